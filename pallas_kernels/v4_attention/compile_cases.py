"""AOT compile-gate cases of DeepSeek-V4 attention (``pallas_kernels.v4_attention``) at
V4-Flash and V4-Pro decode shapes, with the traffic model of one call (``v4_traffic``).

Shapes: 64 decode rows, one per sequence of 8192 tokens, window 128 (pages of 64 tokens),
compressed pages of 64 entries; V4-Flash H=64 with the ratio-4 top-512 (CSA) and the ratio-128
layer (HCA: every visible entry, 64 at 8192); V4-Pro H=128 with top-1024. Cache formats
(``FORMATS``): packed bf16 (``u32[P, 64, 256]``, both paths) and fp8 MODEL1 (``Fp8V4Cache``:
``nope u32[P, 64, 128]``, ``rope u32[P, 16, 128]``; the fused kernel only, the two-pass path
refuses it). The bf16 regime (``precision="bf16"``, ``bf16_regime_cases``): the fused kernel at
the V4-Flash CSA decode shape on packed caches (the serving format) and on f32 caches
(``f32[P, 64, 512]``: the one bf16-mode kernel program the cases above do not compile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import aot
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import kernel as mla_kernel
from pallas_kernels.mla.traffic import PREP_BYTES_PER_ENTRY, mla_traffic
from pallas_kernels.v4_attention import blocks as v4_blocks
from pallas_kernels.v4_attention import formats, traffic
from pallas_kernels.v4_attention.entry import v4_attention
from pallas_kernels.v4_attention.kernel import (  # noqa: F401 (FP8_*: pallas_kernels.v4's names)
    FP8_ROW_BYTES,
    FP8_STORED_BYTES,
    INFO_WORDS,
    fused_traffic,
)
from reference.formats import model1 as v4_cache
from reference.formats import packed_cache, tokamax_v4
from reference.formats.cache_format import CacheFormat
from reference.v4_attention import HEAD_DIM, PagedKV

WINDOW, PAGE, SCALE = 128, 64, HEAD_DIM ** -0.5
WORDS = packed_cache.packed_words(HEAD_DIM)  # 256 u32 words: one bf16 row, no padding
# (name, rows = seqs, context tokens, heads, ratio, k): k = entries each row selects
SHAPES = (("flash_csa_decode64x8192_h64_k512", 64, 8192, 64, 4, 512),
          ("flash_hca_decode64x8192_h64", 64, 8192, 64, 128, None),
          ("pro_csa_decode64x8192_h128_k1024", 64, 8192, 128, 4, 1024))
FORMATS = ("packed", "fp8")
BF16_REGIME_FORMATS = ("packed", "f32")  # bf16_regime_cases: the serving format, f32 rows


def _cache_spec(pages: int, fmt: str):
    """A window / compressed cache struct of ``pages`` pages of ``PAGE`` rows in ``fmt``
    (``FORMATS``, ``"f32"``, or tokamax's ``"plane"`` / ``"csa"``)."""
    sd = jax.ShapeDtypeStruct
    if fmt == "plane":
        return tokamax_v4.PlaneCache(sd((pages, formats.PLANE_ROWS * PAGE, formats.LANES),
                                        jnp.int32), logical_page_size=PAGE)
    if fmt == "csa":
        return tokamax_v4.CsaCache(sd((pages, PAGE, formats.LANES), jnp.int32),
                                   sd((pages, v4_cache.rope_rows(PAGE), formats.LANES),
                                      jnp.int32))
    if fmt == "f32":
        return sd((pages, PAGE, HEAD_DIM), jnp.float32)
    if fmt == "fp8":
        return v4_cache.Fp8V4Cache(sd((pages, PAGE, v4_cache.LANES), jnp.uint32),
                                   sd((pages, v4_cache.rope_rows(PAGE), v4_cache.LANES),
                                      jnp.uint32))
    return sd((pages, PAGE, WORDS), jnp.uint32)


def specs(*, rows: int, context: int, heads: int, ratio: int, k: int | None,
          fmt: str = "packed"):
    """ShapeDtypeStructs of ``(q, window, kv_lens, cu_q_lens, distribution, compressed,
    compressed_indices)`` (the last two ``None`` where the ratio takes none); both caches in
    ``fmt`` (``FORMATS``, or ``"f32"``); q bf16."""
    sd = jax.ShapeDtypeStruct
    w_pages = rows * (context // PAGE)
    window = PagedKV(_cache_spec(w_pages, fmt), sd((w_pages,), jnp.int32),
                     sd((rows + 1,), jnp.int32))
    comp = idx = None
    if ratio:
        c_pages = rows * -(-(context // ratio) // PAGE)
        comp = PagedKV(_cache_spec(c_pages, fmt), sd((c_pages,), jnp.int32),
                       sd((rows + 1,), jnp.int32))
    if ratio == 4:
        idx = sd((rows, k), jnp.int32)
    return [sd((rows, heads, HEAD_DIM), jnp.bfloat16), window, sd((rows,), jnp.int32),
            sd((rows + 1,), jnp.int32), sd((3,), jnp.int32), comp, idx]


def v4_traffic(chip: str, *, rows: int, context: int, heads: int, ratio: int,
               k: int | None) -> aot.Traffic:
    """Modelled HBM bytes of one decode call (every row at the end of a full ``context``):
    the two MLA kernel calls (``mla_traffic``: window ``WINDOW`` rows; compressed ``k`` rows,
    or ``context // 128`` for ratio 128 whose meta row is the whole entry capacity), the XLA
    index building (window iota written, compressed list read and written) and the merge (two
    bf16 partial outputs and two f32 LSEs read, the bf16 output written). The minimum reads
    each window row and selected entry once (1024 B: 512 bf16), q once, writes out once."""
    fmt = CacheFormat.PACKED_BF16
    entries = 0 if not ratio else (k if ratio == 4 else context // ratio)
    meta = {"window": WINDOW, "compressed": entries if ratio == 4 else context // ratio}
    moved = flops = vmem = dmas = 0
    for part, selected, table in (("window", WINDOW, rows * context // PAGE),
                                  ("compressed", entries,
                                   rows * -(-(context // max(ratio, 1)) // PAGE))):
        if not selected:
            continue
        units = mla_blocks.token_block(meta[part], chip)
        shape = mla_kernel.block_shape("token", heads=heads, dim=HEAD_DIM, v_dim=HEAD_DIM,
                                       page_size=PAGE, units=units, meta_len=meta[part],
                                       q_dtype=jnp.bfloat16, fmt="packed")
        t = mla_traffic(rows=rows, heads=heads, dim=HEAD_DIM, v_dim=HEAD_DIM,
                        selected_rows=selected, fmt=fmt, q_itemsize=2, meta_words=meta[part],
                        prep_bytes=rows * meta[part] * PREP_BYTES_PER_ENTRY, table_words=table,
                        shape=shape)
        moved, flops, vmem = moved + t.bytes_moved, flops + t.flops, max(vmem, t.vmem_bytes)
        dmas += t.dmas + rows  # + each row's LSE block (return_lse)
    index_xla = 4 * rows * (WINDOW + (2 if ratio == 4 else 1) * meta["compressed"] * bool(ratio))
    parts = 2 if ratio else 1
    merge = rows * heads * (parts * (2 * HEAD_DIM + 4) + 2 * HEAD_DIM)
    bytes_min = (rows * (WINDOW + entries) * fmt.plain_row_bytes(HEAD_DIM)
                 + rows * heads * 2 * HEAD_DIM * 2)
    return aot.Traffic(int(moved + index_xla + merge), int(bytes_min), int(flops), int(vmem),
                       dmas=dmas)


def fused_v4_traffic(chip: str, *, rows: int, context: int, heads: int, ratio: int,
                     k: int | None, fmt: str = "packed",
                     run_grain: str = "tiles") -> aot.Traffic:
    """``kernel.fused_traffic`` at a compile shape (every row gathers its whole window and
    every selected / visible entry); fp8: 1024 B moved per gathered token (2 DMAs) against a
    minimum of the 640 B stored per token; f32: 2048 B rows against the 1024 B of their bf16
    values (as the kernel's own call); the block is the table's for ``chip``; ``run_grain``:
    the page runs' (``formats.RUN_GRAINS``)."""
    entries = 0 if not ratio else (k if ratio == 4 else context // ratio)
    pages = rows * (context // PAGE) + (rows * -(-(context // ratio) // PAGE) if ratio else 1)
    return _fused_model(chip, fmt, rows=rows, heads=heads, gathered=WINDOW + entries,
                        meta=k or 0, tables=pages, run_grain=run_grain)


def _fused_model(chip: str, fmt: str, *, rows: int, heads: int, gathered: int, meta: int,
                 tables: int, window: int = WINDOW, run_grain: str = "tiles",
                 **state) -> aot.Traffic:
    """``fused_traffic`` of one call in ``fmt`` (``formats``' bytes per token) with a bf16 q,
    plus the ``row_info`` XLA writes; ``state``: its ``acc_in_itemsize`` / ``acc_out_itemsize``.
    ``gathered``: ``window`` tokens then entries (listed when ``meta``), read as the kernel's
    page runs at their bound (``traffic.run_bound``: a window anywhere, pages of ``PAGE``;
    ``run_grain``: ``formats.RUN_GRAINS``)."""
    kfmt = "plain" if fmt == "f32" else fmt
    width = HEAD_DIM if fmt == "f32" else WORDS
    block = v4_blocks.block(chip, v4_blocks.table_format(kfmt), heads)
    seg, w_runs, c_runs = traffic.segment_plan(kfmt, block, PAGE, PAGE, listed=bool(meta))
    single, runs, dmas = traffic.run_bound(window=window, entries=gathered - window, seg=seg,
                                   window_runs=w_runs, compressed_runs=c_runs,
                                   dmas_per_read=2 if kfmt in formats.FP8_FORMATS else 1,
                                   align=formats.run_align(kfmt, width),
                                   exact=run_grain == "exact")
    rope = traffic.run_rope_bound(window=window, entries=gathered - window,
                                  window_runs=w_runs, compressed_runs=c_runs)
    t = fused_traffic(rows=rows, heads=heads, gathered_rows=gathered, meta_words=meta,
                      table_words=tables, block=block,
                      q_itemsize=2, row_bytes=formats.row_bytes(kfmt, width),
                      min_row_bytes=formats.stored_bytes(kfmt), fp8=kfmt in formats.FP8_FORMATS,
                      read_rows=rows * single, gather_dmas=rows * dmas, run_rows=rows * runs,
                      run_row_bytes=formats.run_row_bytes(kfmt, width),
                      run_rope_rows=rows * rope if kfmt in formats.FP8_FORMATS else 0, **state)
    return aot.Traffic(t.bytes_moved + rows * INFO_WORDS * 4, t.bytes_min, t.flops,
                       t.vmem_bytes, t.dmas)  # + row_info written by XLA


def _case(kernel: str, name: str, dims: dict, *, fused: bool, fmt: str,
          precision: str = "f32", run_grain: str = "tiles") -> aot.CompileCase:
    """One ``CompileCase`` of ``v4_attention(..., fused=fused, precision=precision,
    run_grain=run_grain)`` at ``dims`` (a ``SHAPES`` row) with both caches in ``fmt``."""
    ratio, context = dims["ratio"], dims["context"]
    c_pages = -(-(context // ratio) // PAGE) if ratio else 0

    def fn_for_chip(chip):
        f = functools.partial(v4_attention, sm_scale=SCALE, window_size=WINDOW,
                              compress_ratio=ratio, window_pages_per_seq=context // PAGE,
                              compressed_pages_per_seq=c_pages, fused=fused,
                              precision=precision, run_grain=run_grain)
        return lambda q, w, kv, cu, d, c, i: f(q, w, kv, cu, d, compressed=c,
                                               compressed_indices=i)

    traffic = (functools.partial(fused_v4_traffic, fmt=fmt, run_grain=run_grain) if fused
               else v4_traffic)
    return aot.CompileCase(kernel, name, fn_for_chip, specs(**dims, fmt=fmt),
                           functools.partial(traffic, **dims), tags=("decode",))


def compile_cases(fused: bool = False, fmt: str = "packed") -> list[aot.CompileCase]:
    """One case per ``SHAPES`` entry (the chip picks the MLA blocks); ``fused``: the
    one-kernel path (``v4_attention(..., fused=True)``); ``fmt``: both caches' format
    (``FORMATS``; fp8 needs ``fused``)."""
    if fmt not in FORMATS or (fmt == "fp8" and not fused):
        raise ValueError(f"fmt must be one of {FORMATS} (fp8 only with fused=True), got "
                         f"fmt={fmt!r}, fused={fused}")
    kernel = ("v4_attention_fused" if fused else "v4_attention") + ("_fp8" if fmt == "fp8"
                                                                    else "")
    return [_case(kernel, name, dict(rows=rows, context=context, heads=heads, ratio=ratio, k=k),
                  fused=fused, fmt=fmt)
            for name, rows, context, heads, ratio, k in SHAPES]


def exact_run_cases() -> list[aot.CompileCase]:
    """The fused kernel on packed caches with ``run_grain="exact"`` (page runs move the wanted
    rows only: ``formats.RUN_GRAINS``) at every ``SHAPES`` row, kernel
    ``"v4_attention_fused_exact"``."""
    return [_case("v4_attention_fused_exact", name,
                  dict(rows=rows, context=context, heads=heads, ratio=ratio, k=k), fused=True,
                  fmt="packed", run_grain="exact")
            for name, rows, context, heads, ratio, k in SHAPES]


def plane_run_cases() -> list[aot.CompileCase]:
    """The fused kernel on bf16 rows stored as two 128-word rows per token (tokamax's
    ``PlaneCache``, both caches) at every ``SHAPES`` row, kernel ``"v4_attention_fused_plane"``:
    128-lane rows, so each page run moves exactly its wanted rows in ONE DMA (Mosaic takes any
    dynamic row and length of 128-lane rows; 256-word rows only at 8-row tiles:
    ``tests/test_dma_probe.py``): the exact run's bytes at the tiles' descriptor count."""
    return [_case("v4_attention_fused_plane", name,
                  dict(rows=rows, context=context, heads=heads, ratio=ratio, k=k), fused=True,
                  fmt="plane")
            for name, rows, context, heads, ratio, k in SHAPES]


def bf16_regime_cases() -> list[aot.CompileCase]:
    """The fused kernel with ``precision="bf16"`` (the official ``sparse_attn`` rounding) at the
    V4-Flash CSA decode shape (``SHAPES[0]``, bf16 q), one case per ``BF16_REGIME_FORMATS``:
    packed caches (how the official code stores its bf16 ``kv_cache``: the serving case; with
    a bf16 q its kernel is the f32-precision one, and the case keeps it compiling should that
    change) and f32 caches (f32 rows gathered and rounded to bf16 operands in VMEM: the
    bf16-mode program no ``compile_cases`` case compiles)."""
    name, rows, context, heads, ratio, k = SHAPES[0]
    dims = dict(rows=rows, context=context, heads=heads, ratio=ratio, k=k)
    return [_case(f"v4_attention_fused_{fmt}_precision_bf16", name, dims, fused=True, fmt=fmt,
                  precision="bf16") for fmt in BF16_REGIME_FORMATS]


# ----------------------------------------------------------------------------- tokamax's split

TOKAMAX_PARTS = ("window_writes_state_plane", "entries_from_state_csa", "hca_plane")
LONG_CONTEXT = 65536  # the engines' long-context decode shape (tokamax_shapes)


def tokamax_traffic(chip: str, part: str, *, rows: int, context: int, heads: int, ratio: int,
                    k: int | None) -> aot.Traffic:
    """The model of one ``tokamax_cases`` call (``TOKAMAX_PARTS``) at a ``SHAPES`` row: the
    window pass (this step's rows written in place first, ``WINDOW`` plane rows, no list, the
    window table and a 1-slot stand-in, the bf16 state written), the CSA pass (``k`` CSA
    entries in 2 DMAs each, the list, a 1-slot window table and the compressed one, the bf16
    state read, the output written), or the HCA layer in one call (window and every visible
    entry, plane rows)."""
    w_pages = rows * (context // PAGE)
    c_pages = rows * -(-(context // max(ratio, 1)) // PAGE)
    dims = dict(rows=rows, heads=heads)
    if part == "window_writes_state_plane":
        return _fused_model(chip, "plane", **dims, gathered=WINDOW, meta=0, tables=w_pages + 1,
                            acc_out_itemsize=2, written_rows=rows)
    if part == "entries_from_state_csa":
        return _fused_model(chip, "csa", **dims, gathered=k, meta=k, tables=1 + c_pages,
                            window=0, acc_in_itemsize=2)
    return fused_v4_traffic(chip, rows=rows, context=context, heads=heads, ratio=ratio, k=k,
                            fmt="plane")


def _tokamax_fn(part: str, ratio: int, context: int, c_pages: int):
    """The call of one ``TOKAMAX_PARTS`` case, a function of ``specs``' arguments plus the
    state."""
    from pallas_kernels.v4_attention.state import v4_attention_state, v4_entries_from_state

    if part == "window_writes_state_plane":  # the window's words apart: argument 1, to donate
        return lambda q, words, table, w_cu, kv, cu, d, new_kv: v4_attention_state(
            q, PagedKV(tokamax_v4.PlaneCache(words, PAGE), table, w_cu), kv, cu, d,
            sm_scale=SCALE, window_size=WINDOW, compress_ratio=0,
            window_pages_per_seq=context // PAGE, return_state=True, new_kv=new_kv)
    if part == "entries_from_state_csa":
        return lambda q, c, cu, d, i, st, sink: v4_entries_from_state(
            q, c, cu, d, i, st, sm_scale=SCALE, compressed_pages_per_seq=c_pages,
            attn_sink=sink)
    return lambda q, w, kv, cu, d, c: v4_attention(
        q, w, kv, cu, d, sm_scale=SCALE, window_size=WINDOW, compress_ratio=ratio,
        window_pages_per_seq=context // PAGE, compressed_pages_per_seq=c_pages, compressed=c)


def _long(row: tuple, context: int) -> tuple:
    """A ``SHAPES`` row at another context length (its name says the new length)."""
    name, rows, old, heads, ratio, k = row
    return (name.replace(f"x{old}", f"x{context}"), rows, context, heads, ratio, k)


def tokamax_shapes() -> list[tuple[str, tuple]]:
    """``(TOKAMAX_PARTS entry, SHAPES-style row)`` of each ``tokamax_cases`` case: the two CSA
    passes at V4-Flash (8K and 64K contexts) and V4-Pro (8K), the HCA call at V4-Flash (8K and
    64K); decode, 64 rows."""
    flash_csa, flash_hca, pro_csa = SHAPES
    csa_rows = (flash_csa, _long(flash_csa, LONG_CONTEXT), pro_csa)
    return ([(part, row) for row in csa_rows for part in TOKAMAX_PARTS[:2]]
            + [(TOKAMAX_PARTS[2], row) for row in (flash_hca, _long(flash_hca, LONG_CONTEXT))])


def tokamax_cases() -> list[aot.CompileCase]:
    """tokamax's V4 split on tokamax's cache formats (``TOKAMAX_PARTS``) at ``tokamax_shapes``:
    at each CSA decode shape the window pass on a ``PlaneCache`` writing this step's rows
    in place, then returning the bf16 flash state (``mla_swa(unnormalized_output=True)``; the
    cache's words are argument 1, to donate) and the CSA entries from that state on a
    ``CsaCache``, normalized with the sink (``sparse_mla``); at each HCA shape the whole layer
    in one fused call on ``PlaneCache`` window and compressed caches."""
    from pallas_kernels.v4_attention.state import FlashState

    sd = jax.ShapeDtypeStruct
    cases = []
    for part, (name, rows, context, heads, ratio, k) in tokamax_shapes():
        dims = dict(rows=rows, context=context, heads=heads, ratio=ratio, k=k)
        c_pages = -(-(context // ratio) // PAGE)
        q, w, kv, cu, d, c, i = specs(**dims, fmt="csa" if ratio == 4 else "plane")
        if part == "window_writes_state_plane":
            plane = specs(**dims, fmt="plane")[1]
            args = [q, plane.cache.words, *plane[1:], kv, cu, d, sd((rows, HEAD_DIM), q.dtype)]
        elif part == "entries_from_state_csa":
            state = FlashState(sd(q.shape, jnp.bfloat16), sd(q.shape[:2], jnp.float32),
                               sd(q.shape[:2], jnp.float32))
            args = [q, c, cu, d, i, state, sd((heads,), jnp.float32)]
        else:
            args = [q, w, kv, cu, d, c]
        fn = _tokamax_fn(part, ratio, context, c_pages)
        cases.append(aot.CompileCase(f"v4_tokamax_{part}", name, lambda chip, fn=fn: fn, args,
                                     functools.partial(tokamax_traffic, part=part, **dims),
                                     tags=("decode",)))
    return cases
