"""How the fused V4 attention kernel (``kernel``) reads each cache format: the HBM parts of a
cache, the gather buffers, the DMAs of one token, and the decode of a gathered block into
matmul operands in q's feature order. Five formats (``kernel_format``):

- ``"packed"``: ``u32[L, P, ps, 256]`` (``reference.formats.packed_cache``: word ``j`` holds
  features ``j`` (low half) and ``j + 256``); one 1 KB row DMA per token.
- ``"plain"``: ``f32[L, P, ps, 512]``; one 2 KB row DMA per token.
- ``"fp8"``: MODEL1 ``Fp8V4Cache`` (``reference.formats.model1``: ``nope u32[L, P, ps, 128]``,
  ``rope u32[L, P, ceil(ps / 4), 128]``); per token its 512 B nope record and the 512 B rope row
  it shares with 3 tokens (two DMAs), plus its quarter ``off % 4`` in a VMEM side buffer;
  listed entries fewer (``issue_listed``: record runs, shared rope rows).
- ``"csa"``: tokamax's ``CsaCache`` (``reference.formats.tokamax_v4``: ``nope i32[L, P, ps,
  128]``, ``rope i32[L, P, ps // 4, 128]``): MODEL1's DMAs and byte placement, read as i32 and
  bitcast to u32 in VMEM; only the scales differ: 64 lane-periodic ue8m0 scales, byte 3 of
  words 64..127, scale ``j`` for every feature ``d < 448`` with ``d % 64 == j``, so byte plane
  ``p``'s lane ``w`` takes plane 3's byte at lane ``64 + w % 64`` (``_csa_scales``).
- ``"plane"``: tokamax's ``PlaneCache`` (window / HCA rows, ``words i32[L, P, rows, 128]``,
  ``logical_page_size`` tokens used per page): token ``k`` of a page is rows ``2k, 2k + 1``
  (row ``2k`` word ``w`` = bf16 ``f_w | f_{128 + w} << 16``, row ``2k + 1`` word ``w`` =
  ``f_{256 + w} | f_{384 + w} << 16``); one DMA of the two contiguous rows (1 KB) per token
  into rows ``2n, 2n + 1`` of a ``[2 * block, 128]`` buffer, decoded by two stride-2 sublane
  loads into four 128-lane operands in q's natural feature order (no permutation of q).

Page runs (``traffic.segment_plan``): ``issue_run`` of a segment's wanted tokens
``lo .. hi - 1`` is one DMA of their contiguous rows, a dynamic number (plane: ``2 (hi - lo)``
rows), into the rows a whole segment would fill; fp8 / CSA: their records and their rope rows
``lo // 4 .. (hi - 1) // 4`` into a run rope buffer, expanded per token at decode
(``_run_rope``). Packed / f32 rows (256 / 512 lanes): Mosaic moves several of them only at rows
and sizes that are multiples of the 8-row tile (``tests/test_dma_probe.py``), so by
``run_grain`` (``RUN_GRAINS``): ``"tiles"`` widens the wanted rows to whole 8-row tiles (one
DMA, up to 7 unwanted rows at each end); ``"exact"`` moves the wanted rows only, the segment's
tile-aligned middle as one DMA and its ragged head and tail rows (< 8 each) one DMA a row.
``wait`` re-derives each segment's DMAs from its slot's ``lo, hi``.

Every decode is exact (bf16 halves, e4m3 times a power-of-two scale) and selects unwanted rows
to zero (a select: a NaN in VMEM cannot leak).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import SUBLANES
from reference import v4_attention as v4
from reference.core import checks
from reference.formats import model1 as v4_cache
from reference.formats import packed_cache, tokamax_v4
from reference.quant import fp8

WORDS = packed_cache.packed_words(v4.HEAD_DIM)  # 256
HALF = v4.HEAD_DIM // 2  # features per word half
LANES = v4_cache.LANES  # 128: an fp8 token's nope record, and one rope row of 4 tokens
FP8_ROW_BYTES = 2 * 4 * LANES  # what the 2 DMAs of an fp8 / CSA token move: 1024 B
FP8_STORED_BYTES = v4_cache.STORED_BYTES_PER_TOKEN  # 640 B of HBM per fp8 / CSA token
PLANE_ROWS = tokamax_v4.ROWS_PER_TOKEN  # 2 rows of 128 words per PlaneCache token
PLANE_ROW_BYTES = PLANE_ROWS * tokamax_v4.SLAB_ROWS * LANES  # one DMA per token: 1024 B, all stored
FORMATS = ("packed", "plain", "fp8", "csa", "plane")
FP8_FORMATS = ("fp8", "csa")  # the MODEL1 byte layouts: a record and a shared rope row
QUARTERS = v4_cache.ROPE_TOKENS_PER_ROW  # 4 tokens' rope in one fp8 / CSA rope row
_HIGH = -65536  # 0xFFFF0000 as an i32: a word's high bf16 half
RUN_GRAINS = ("tiles", "exact")  # how a page run moves packed / f32 rows (module docstring)


def kernel_cache(cache):
    """A stacked cache as the kernel reads it: packed u32, f32, ``Fp8V4Cache``, ``CsaCache`` or
    ``PlaneCache`` as given; plain bf16 packed (a full copy per call: the documented slow path,
    as in ``pallas_kernels.mla``)."""
    if is_array(cache) and jnp.result_type(cache) == jnp.bfloat16:
        return packed_cache.pack_cache(cache)
    return cache


def is_array(cache) -> bool:
    """Whether ``cache`` is a plain array (f32 / bf16 rows or packed words), not a format
    pytree."""
    return not isinstance(cache, (v4_cache.Fp8V4Cache, tokamax_v4.CsaCache,
                                  tokamax_v4.PlaneCache))


def kernel_format(cache) -> str:
    """The kernel's name for how it reads ``cache`` (``FORMATS``)."""
    if isinstance(cache, v4_cache.Fp8V4Cache):
        return "fp8"
    if isinstance(cache, tokamax_v4.CsaCache):
        return "csa"
    if isinstance(cache, tokamax_v4.PlaneCache):
        return "plane"
    return "packed" if packed_cache.is_packed(cache) else "plain"


def describe(cache) -> str:
    """A cache's format in words, for messages: ``"fp8 (Fp8V4Cache)"``, ``"csa (tokamax
    CsaCache)"``, ``"plane (tokamax PlaneCache)"``, or its array dtype (``uint32``: packed bf16
    words; ``float32``)."""
    fmt = kernel_format(cache)
    if fmt == "fp8":
        return "fp8 (Fp8V4Cache)"
    if fmt in ("csa", "plane"):
        return f"{fmt} (tokamax {type(cache).__name__})"
    return f"{jnp.result_type(cache)} ({'packed bf16' if fmt == 'packed' else 'f32'})"


def _int32(name: str, x) -> None:
    if jnp.result_type(x) != jnp.int32:
        raise TypeError(f"{name} must be int32 (tokamax's 32-bit words), got dtype "
                        f"{jnp.result_type(x)}")


def check_tokamax_cache(name: str, one):
    """Static checks of one layer of a tokamax cache (``CsaCache``: ``nope i32[P, ps, 128]``,
    ``rope i32[P, ps // 4, 128]``, ``ps % 4 == 0``; ``PlaneCache``: ``words i32[P, rows, 128]``,
    ``0 < logical_page_size <= rows // 2``). Returns the ``f32[P, ps, 512]`` struct of its
    logical rows, what ``reference.v4_attention``'s checks read; any other cache as given."""
    if isinstance(one, tokamax_v4.CsaCache):
        for part, x in (("nope", one.nope), ("rope", one.rope)):
            checks.rank(f"{name}.{part}", x, 3)
            _int32(f"{name}.{part}", x)
            checks.dim(f"{name}.{part}", x, 2, LANES, "128 lanes")
        pages, ps = np.shape(one.nope)[:2]
        if ps % v4_cache.ROPE_TOKENS_PER_ROW:
            raise ValueError(f"{name}.nope page size {ps} must be a multiple of 4 (a rope row "
                             f"holds 4 entries; tokamax binds ps == 4 * rope rows)")
        checks.dim(f"{name}.rope", one.rope, 0, pages, f"{name}.nope.shape[0] (pages)")
        checks.dim(f"{name}.rope", one.rope, 1, ps // v4_cache.ROPE_TOKENS_PER_ROW,
                   f"{name}.nope.shape[1] // 4")
    elif isinstance(one, tokamax_v4.PlaneCache):
        checks.rank(f"{name}.words", one.words, 3)
        _int32(f"{name}.words", one.words)
        checks.dim(f"{name}.words", one.words, 2, LANES, "128 lanes")
        rows, lps = np.shape(one.words)[1], one.logical_page_size
        checks.positive_int(f"{name}.logical_page_size", lps)
        if lps * PLANE_ROWS > rows:
            raise ValueError(f"{name}.logical_page_size={lps} needs {PLANE_ROWS * lps} rows "
                             f"per page ({PLANE_ROWS} per token), but {name}.words has {rows}")
    else:
        return one
    return jax.ShapeDtypeStruct(tuple(one.shape), jnp.float32)


def parts(cache) -> tuple:
    """A stacked kernel cache's HBM arrays: ``(nope, rope)`` of an ``Fp8V4Cache`` /
    ``CsaCache``, ``(words,)`` of a ``PlaneCache``, else the array alone."""
    if isinstance(cache, (v4_cache.Fp8V4Cache, tokamax_v4.CsaCache)):
        return cache.nope, cache.rope
    if isinstance(cache, tokamax_v4.PlaneCache):
        return (cache.words,)
    return (cache,)


def paging(cache) -> tuple[int, int, int]:
    """``(layers, pages, tokens per page)`` of a stacked kernel cache (its logical shape: a
    ``PlaneCache`` page holds ``logical_page_size`` tokens)."""
    layers, pages, page_size = tuple(cache.shape)[:3]
    return int(layers), int(pages), int(page_size)


def row_bytes(fmt: str, width: int = WORDS) -> int:
    """HBM bytes the DMAs of one gathered token move (packed / plain: ``4 * width``)."""
    return {"fp8": FP8_ROW_BYTES, "csa": FP8_ROW_BYTES, "plane": PLANE_ROW_BYTES}.get(
        fmt, 4 * width)


def run_row_bytes(fmt: str, width: int = WORDS) -> int:
    """HBM bytes per token of a page run but its rope rows: fp8 / CSA its 512 B record (the
    run's rope rows, 4 tokens each, counted apart: ``traffic.run_rope_rows``), else
    ``row_bytes``."""
    return 4 * LANES if fmt in FP8_FORMATS else row_bytes(fmt, width)


def stored_bytes(fmt: str) -> int:
    """The minimum HBM bytes of one token: 640 B stored per fp8 / CSA token, else its 512
    bf16 features (1024 B)."""
    return FP8_STORED_BYTES if fmt in FP8_FORMATS else 2 * v4.HEAD_DIM


def gather_row_vmem(fp8: bool, row_bytes: int, runs: bool = False) -> int:
    """VMEM bytes per block row of ``buffers``' gather buffers, one of the two: fp8 / CSA the
    nope, rope and quarter rows (``3 x 512`` B), with page runs (``runs``) plus the runs' rope
    rows (``2 x block / 4`` rows over both buffers) and their expansion (``block`` rows): ``3 x
    128`` words more; else one row of ``row_bytes``."""
    if not fp8:
        return row_bytes
    run_rows = 4 * LANES * (2 + QUARTERS) // (2 * QUARTERS) if runs else 0
    return 3 * 4 * LANES + run_rows


def buffers(fmt: str, block: int, w_parts, runs: bool = False) -> list:
    """The two gather buffers of ``block`` rows (a leading 2) of each part; fp8 / CSA page
    runs (``runs``) add the runs' rope rows (``block / 4``, a leading 2) and one ``[block,
    128]`` buffer they are expanded into, one row per token."""
    if fmt in FP8_FORMATS:
        dt = w_parts[0].dtype
        run_bufs = [pltpu.VMEM((2, block // QUARTERS, LANES), w_parts[1].dtype),
                    pltpu.VMEM((block, LANES), w_parts[1].dtype)] if runs else []
        return [pltpu.VMEM((2, block, LANES), dt), pltpu.VMEM((2, block, LANES), dt),
                pltpu.VMEM((2, block, LANES), jnp.int32)] + run_bufs  # nope, rope, quarters
    if fmt == "plane":
        return [pltpu.VMEM((2, PLANE_ROWS * block, LANES), jnp.int32)]
    return [pltpu.VMEM((2, block, w_parts[0].shape[-1]), w_parts[0].dtype)]


def _copy(src, buf, sems, part, layer, pid, row, b, n, rows: int = 1):
    """``rows`` whole cache rows ``src[layer, pid, row:row + rows]`` -> rows ``n..`` of gather
    buffer ``b`` of ``buf``, on semaphore ``sems[part, b]`` (whole rows: Mosaic refuses
    part-row slices)."""
    return pltpu.make_async_copy(src.at[layer, pid, pl.ds(row, rows)],
                                 buf.at[b, pl.ds(n, rows)], sems.at[part, b])


def issue(fmt: str, src, bufs, sems, layer, pid, off, b, n, rows: int = 1):
    """Start the DMAs of ``rows`` tokens from in-page slot ``off`` of page ``pid`` into rows
    ``n ..`` of gather buffer ``b`` (module docstring; ``rows > 1``: ``issue_run`` of all its
    rows)."""
    if rows > 1:
        issue_run(fmt, src, bufs, sems, layer, pid, off, b, n, 0, rows, rows)
        return
    if fmt == "plane":
        _copy(src[0], bufs[0], sems, 0, layer, pid, PLANE_ROWS * off, b, PLANE_ROWS * n,
              PLANE_ROWS).start()
        return
    _copy(src[0], bufs[0], sems, 0, layer, pid, off, b, n).start()
    if fmt in FP8_FORMATS:
        quarters = v4_cache.ROPE_TOKENS_PER_ROW
        _copy(src[1], bufs[1], sems, 1, layer, pid, off // quarters, b, n).start()
        bufs[2][b, pl.ds(n, 1), :] = jnp.full((1, LANES), off % quarters, jnp.int32)


def issue_listed(src, bufs, sems, layer, pid, off, b, n, records, shared):
    """fp8 / CSA: a listed (CSA-selected) entry at in-page slot ``off`` of page ``pid`` into row
    ``n`` of gather buffer ``b`` (``walk._listed``): ``records`` > 0 (dynamic) starts ONE DMA of
    the 128-lane nope records of the ``records`` entries at slots ``off ..`` (a coalesced run:
    the next ``records - 1`` listed entries, adjacent slots of this page, take rows ``n + 1 ..``
    and issue no record DMA); ``shared`` (dynamic bool): its rope row is the previous row's
    (same page, same ``off // 4``), so no rope DMA: its quarter word carries ``QUARTERS`` more
    and ``operands`` copies the previous row's rope to it (``_fill_shared``). Mosaic compiles
    a DMA of a dynamic number of 128-lane rows at a dynamic row (``measure.dma_probe``)."""
    @pl.when(records > 0)
    def _():
        _copy(src[0], bufs[0], sems, 0, layer, pid, off, b, n, records).start()

    @pl.when(jnp.logical_not(shared))
    def _():
        _copy(src[1], bufs[1], sems, 1, layer, pid, off // QUARTERS, b, n).start()

    word = off % QUARTERS + QUARTERS * shared.astype(jnp.int32)
    bufs[2][b, pl.ds(n, 1), :] = jnp.full((1, LANES), word, jnp.int32)


def run_align(fmt: str, width: int = WORDS) -> int:
    """The row tile of a page run's DMA: 1 (any rows, one DMA) for rows of 128 lanes (fp8 /
    CSA records and rope rows, plane rows); else (packed 256 words, f32 512) 8, the sublane
    tile: Mosaic refuses a DMA of several wider rows at a row or of a size that is not a
    multiple of it (one row it moves anywhere), so a run's rows are widened to whole tiles
    (``run_grain="tiles"``) or its ragged ends moved one row a DMA (``"exact"``)."""
    return 1 if fmt in (*FP8_FORMATS, "plane") or width == LANES else SUBLANES


def check_run_grain(run_grain) -> str:
    """``run_grain`` if it is one of ``RUN_GRAINS``, else ``ValueError``."""
    if run_grain not in RUN_GRAINS:
        raise ValueError(f"run_grain must be one of {RUN_GRAINS}, got run_grain={run_grain!r}")
    return run_grain


def _run_copies(fmt: str, src, bufs, sems, layer, pid, off, b, n, lo, hi):
    """The DMAs of a page-run segment's wanted tokens ``off + lo .. off + hi - 1`` into rows
    ``n + lo .. n + hi - 1`` of buffer ``b``: one per part, of a dynamic number of rows (plane:
    ``2 (hi - lo)``; fp8 / CSA rope: rows ``lo // 4 .. (hi - 1) // 4`` at run rope row
    ``n / 4 + lo // 4``; packed / f32: ``lo``, ``hi`` widened to ``run_align`` tiles)."""
    grain = run_align(fmt, src[0].shape[-1])
    if grain > 1:
        lo, hi = pl.multiple_of(lo // grain * grain, grain), (hi + grain - 1) // grain * grain
        n, size = pl.multiple_of(n + lo, grain), pl.multiple_of(hi - lo, grain)
        return [pltpu.make_async_copy(src[0].at[layer, pid, pl.ds(off + lo, size)],
                                      bufs[0].at[b, pl.ds(n, size)], sems.at[0, b])]
    if fmt == "plane":
        return [_copy(src[0], bufs[0], sems, 0, layer, pid, PLANE_ROWS * (off + lo), b,
                      PLANE_ROWS * (n + lo), PLANE_ROWS * (hi - lo))]
    copies = [_copy(src[0], bufs[0], sems, 0, layer, pid, off + lo, b, n + lo, hi - lo)]
    if fmt in FP8_FORMATS:
        r0 = lo // QUARTERS
        copies.append(_copy(src[1], bufs[3], sems, 1, layer, pid, off // QUARTERS + r0, b,
                            n // QUARTERS + r0, (hi - 1) // QUARTERS - r0 + 1))
    return copies


def _exact_run(src, buf, sems, layer, pid, off, b, n, lo, hi, grain: int, act) -> None:
    """``act`` (start or wait) on the DMAs of a packed / f32 segment's wanted rows ``lo .. hi -
    1`` exactly (``run_grain="exact"``): its ragged head ``lo .. min(a, hi) - 1`` one row a DMA
    (``a``: ``lo`` rounded up to ``grain``), its whole tiles ``a .. z - 1`` (``z``: ``hi``
    rounded down, at least ``a``) as one DMA when there are any, its ragged tail one row a DMA;
    at most ``2 (grain - 1) + 1`` DMAs (``traffic.run_reads`` counts them)."""
    a = pl.multiple_of((lo + grain - 1) // grain * grain, grain)
    z = pl.multiple_of(jnp.maximum(hi // grain * grain, a), grain)
    head_end = jnp.minimum(a, hi)

    def one_row(r, c):
        act(_copy(src, buf, sems, 0, layer, pid, off + r, b, n + r))
        return c

    jax.lax.fori_loop(lo, head_end, one_row, 0)

    @pl.when(z > a)
    def _():
        size = pl.multiple_of(z - a, grain)
        act(pltpu.make_async_copy(src.at[layer, pid, pl.ds(off + a, size)],
                                  buf.at[b, pl.ds(pl.multiple_of(n + a, grain), size)],
                                  sems.at[0, b]))

    jax.lax.fori_loop(jnp.maximum(z, head_end), hi, one_row, 0)


def _run_dmas(fmt: str, src, bufs, sems, layer, pid, off, b, n, lo, hi, run_grain: str,
              act) -> None:
    """``act`` (start or wait) on each DMA of a page-run segment (``_run_copies``, or
    ``_exact_run`` for packed / f32 rows with ``run_grain="exact"``)."""
    grain = run_align(fmt, src[0].shape[-1])
    if grain > 1 and run_grain == "exact":
        _exact_run(src[0], bufs[0], sems, layer, pid, off, b, n, lo, hi, grain, act)
        return
    for copy in _run_copies(fmt, src, bufs, sems, layer, pid, off, b, n, lo, hi):
        act(copy)


def issue_run(fmt: str, src, bufs, sems, layer, pid, off, b, n, lo, hi, seg: int,
              run_grain: str = "tiles"):
    """Start the DMAs of a page-run segment (``seg`` rows of page ``pid`` from in-page row
    ``off`` into slot rows ``n ..`` of buffer ``b``; ``off``, ``n`` multiples of ``seg``): only
    its wanted rows ``lo .. hi - 1`` (``0 <= lo < hi <= seg``, dynamic), one DMA per part of
    a dynamic number of rows (packed / f32: by ``run_grain``, module docstring), each row where
    a whole-segment DMA would put it (the masks by slot are unchanged)."""
    off, n = pl.multiple_of(off, seg), pl.multiple_of(n, seg)
    _run_dmas(fmt, src, bufs, sems, layer, pid, off, b, n, lo, hi, run_grain,
              lambda copy: copy.start())


def wait(fmt: str, src, bufs, sems, b, n, runs=0, seg: int = 1, slots=None,
         run_grain: str = "tiles", shared=0):
    """Wait for the DMAs into gather buffer ``b``: ``n`` single tokens and ``runs`` segments
    (one semaphore per part counts their bytes; each wait takes one copy's bytes of that part:
    a coalesced run of listed records, ``issue_listed``, is waited row by row; ``shared`` of
    the ``n`` tokens issued no rope DMA). A segment's DMAs move its slot's wanted rows
    (``issue_run`` with ``run_grain``), re-derived from ``slots`` (SMEM ``i32[2, >= 2 runs]``:
    slot ``j``'s ``lo, hi`` at ``[b, 2 j]``, ``[b, 2 j + 1]``); ``slots`` None: every segment
    whole (``seg`` rows)."""
    rows = PLANE_ROWS if fmt == "plane" else 1
    for part in range(len(src)):
        copy = _copy(src[part], bufs[part], sems, part, 0, 0, 0, b, 0, rows)

        def body(i, c, copy=copy):
            copy.wait()
            return c

        jax.lax.fori_loop(0, n - shared if part == 1 else n, body, 0)
    if seg <= 1:
        return

    def run_body(j, c):
        lo, hi = (0, seg) if slots is None else (slots[b, 2 * j], slots[b, 2 * j + 1])
        _run_dmas(fmt, src, bufs, sems, 0, 0, 0, b, 0, lo, hi, run_grain,
                  lambda copy: copy.wait())
        return c

    jax.lax.fori_loop(0, runs, run_body, 0)


def _u32(x):
    return x if x.dtype == jnp.uint32 else jax.lax.bitcast_convert_type(x, jnp.uint32)


def _scale_of_byte(byte):
    """ue8m0 bytes (u32) -> their f32 values ``bitcast(byte << 23)``; NaN for 0xFF."""
    return jnp.where(byte == 0xFF, jnp.nan, pltpu.bitcast(byte << 23, jnp.float32))


def _fp8_scales(nope):
    """The 7 MODEL1 tile scales ``f32[rows, 1]`` of gathered fp8 records ``u32[rows, 128]``:
    byte 3 of word ``64 + t``."""
    return [_scale_of_byte(nope[:, v4_cache.SCALE_WORD0 + t:v4_cache.SCALE_WORD0 + t + 1] >> 24)
            for t in range(v4_cache.V4_TILES)]


def _csa_scales(nope):
    """``f32[rows, 128]``: lane ``w``'s lane-periodic CSA scale, scale ``w % 64`` = byte 3 of
    word ``64 + w % 64`` (lanes below 64 take it by a lane roll of 64)."""
    s = _scale_of_byte(nope >> 24)
    lane = jax.lax.broadcasted_iota(jnp.int32, nope.shape, 1)
    return jnp.where(lane < 64, pltpu.roll(s, 64, 1), s)


def _fp8_rope(rope, quarter):
    """Gathered rope rows ``u32[rows, 128]`` (4 tokens each) and each row's quarter ``i32[rows,
    1]`` -> ``f32[rows, 128]`` whose lanes 64..127 are the token's 64 rope values (features
    448..511; lanes 0..63 junk, overwritten by the caller). The quarter is moved to lanes 0..31
    by a select over 4 static lane rolls (a select: the other tokens' NaN cannot leak), then
    its words are rolled to lanes 64..95 (low halves: rope 0..31) and 96..127 (high: 32..63)."""
    words = rope
    for qt in range(1, v4_cache.ROPE_TOKENS_PER_ROW):
        words = jnp.where(quarter == qt, pltpu.roll(rope, LANES - v4_cache.ROPE_WORDS * qt, 1),
                          words)
    lane = jax.lax.broadcasted_iota(jnp.int32, rope.shape, 1)
    low = pltpu.bitcast(pltpu.roll(words, 64, 1) << 16, jnp.float32)
    high = pltpu.bitcast(pltpu.roll(words, 96, 1) & jnp.uint32(packed_cache.HIGH_MASK),
                         jnp.float32)
    return jnp.where(lane < 96, low, high)


def _decode_fp8(nope, rope, quarter, csa: bool = False):
    """Gathered fp8 tokens -> their values ``f32[rows, 512]`` in q's feature order, exactly
    ``reference.v4_cache.dequantize_v4_rows``' (e4m3 times a power of two is exact in bf16).
    Byte plane ``j`` of the record is features ``128 j .. 128 j + 127`` (plane 3: 384..447 on
    lanes 0..63); MODEL1: tile ``t`` = plane ``t // 2``, lanes ``64 (t % 2)`` up; ``csa``: the
    lane-periodic scales (``_csa_scales``); the rope fills plane 3's lanes 64..127
    (``_fp8_rope``)."""
    nope, rope = _u32(nope), _u32(rope)
    lane = jax.lax.broadcasted_iota(jnp.int32, nope.shape, 1)
    if csa:
        per_lane = _csa_scales(nope)
        scale = [per_lane] * 4
    else:
        tiles = _fp8_scales(nope)
        scale = [jnp.where(lane < 64, tiles[2 * j], tiles[min(2 * j + 1, 6)]) for j in range(4)]
    chunks = []
    for j in range(4):
        codes = ((nope >> (8 * j)) & 0xFF).astype(jnp.uint8)
        vals = jax.lax.bitcast_convert_type(codes, fp8.FP8_DTYPE).astype(jnp.float32)
        vals = vals * scale[j]
        chunks.append(vals if j < 3 else jnp.where(lane < 64, vals, _fp8_rope(rope, quarter)))
    return jnp.concatenate(chunks, axis=1)


def _unpack(words, packed: bool):
    """A block of gathered rows -> (features [0, 256), features [256, 512)), exact f32/bf16."""
    if not packed:
        return words[:, :HALF], words[:, HALF:]
    low = pltpu.bitcast(words << 16, jnp.float32)
    return low, pltpu.bitcast(words & jnp.uint32(packed_cache.HIGH_MASK), jnp.float32)


def _plane_chunks(buf, b):
    """A gathered block of PlaneCache tokens ``i32[2 * block, 128]`` -> ``[(first feature,
    f32[block, 128])]``: rows ``2n`` (features ``w``, ``128 + w``) and ``2n + 1`` (``256 + w``,
    ``384 + w``) by stride-2 sublane loads, each word's low and high bf16 halves."""
    block = buf.shape[1] // PLANE_ROWS
    out = []
    for r in range(PLANE_ROWS):
        words = buf[b, pl.ds(r, block, stride=PLANE_ROWS), :]
        out += [(2 * LANES * r, pltpu.bitcast(words << 16, jnp.float32)),
                (2 * LANES * r + LANES, pltpu.bitcast(words & jnp.int32(_HIGH), jnp.float32))]
    return out


def _run_rope(bufs, b, run_rows):
    """fp8 / CSA: each gathered token's rope row and quarter, ``(u32|i32[block, 128], i32[block,
    1])``: rows below ``run_rows`` (page runs, slot-aligned, first in the block) take run rope
    row ``r // 4`` (expanded by 4 stride-4 sublane stores) and quarter ``r % 4``; the others
    their own row and stored quarter (selects: a stale row cannot leak)."""
    rbuf, qbuf = bufs[1], bufs[2]
    own, quarter = _fill_shared(rbuf[b], qbuf[b][:, :1])
    if len(bufs) == 3:
        return own, quarter
    run_rope, side = bufs[3], bufs[4]
    block = side.shape[0]
    for q in range(QUARTERS):
        side[pl.ds(q, block // QUARTERS, stride=QUARTERS), :] = run_rope[b]
    r = jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    in_run = r < run_rows
    return (jnp.where(in_run, side[...], own), jnp.where(in_run, r % QUARTERS, quarter))


def _fill_shared(rope, word):
    """Per-row rope rows ``[block, 128]`` and quarter words ``i32[block, 1]`` -> the rope rows
    with each shared row (word ``>= QUARTERS``: ``issue_listed`` issued no rope DMA for it)
    replaced by the previous row's, and the quarters ``word % QUARTERS``. A shared group is
    at most ``QUARTERS`` rows (``walk._listed``), so ``QUARTERS - 1`` selects of a one-row
    sublane roll fill it (selects: a stale row cannot leak)."""
    shared = word >= QUARTERS
    for _ in range(QUARTERS - 1):
        rope = jnp.where(shared, pltpu.roll(rope, 1, 0), rope)
    return rope, word % QUARTERS


def operands(fmt: str, bufs, b, live, cdt, run_rows=0):
    """Gathered block ``b`` -> ``[(first q feature, operand cdt[block, width])]`` covering the
    512 features, unwanted rows (``live`` false) selected to zero (a select: NaN cannot leak);
    ``run_rows``: the block's rows read by page runs (fp8 / CSA: their rope rows expand)."""
    if fmt in FP8_FORMATS:
        rope, quarter = _run_rope(bufs, b, run_rows)
        x = _decode_fp8(bufs[0][b], rope, quarter, csa=fmt == "csa")
        chunks = [(0, x)]
    elif fmt == "plane":
        chunks = _plane_chunks(bufs[0], b)
    else:
        low, high = _unpack(bufs[0][b], fmt == "packed")
        chunks = [(0, low), (HALF, high)]
    return [(lo, jnp.where(live, x, 0.0).astype(cdt)) for lo, x in chunks]
