"""DeepSeek-V4 attention in ONE Pallas TPU kernel (the default path of
``pallas_kernels.v4_attention.v4_attention``, ``fused=True``): each query row walks its window
tokens, then its compressed entries, in one online softmax.

Math: ``reference.v4_attention`` (the union of the window ``max(0, p - W + 1) .. p`` and the
visible compressed entries, K = V = the 512-dim row; the sink applied at the end of the row,
in the kernel, on its sink-free LSE by ``reference.sinks``' rule).

Shapes: ``q bf16|f32[T, H, 512]``; both caches in one format (``formats``): packed bf16 words
``u32[P, ps, 256]`` (``reference.packed_cache``: word ``j`` holds features ``j`` and ``j + 256``
in its low / high half), ``f32[P, ps, 512]``, fp8 MODEL1 ``Fp8V4Cache`` (``reference.v4_cache``:
``nope u32[P, ps, 128]``, ``rope u32[P, ceil(ps / 4), 128]``), tokamax's ``CsaCache`` /
``PlaneCache`` (``reference.formats.tokamax_v4``), stacked ``[L, ...]`` read in place at
``layer`` (mixed formats: NotImplementedError); ``entries i32[T, k]`` the ratio-4 lists. Out
``q.dtype[T, H, 512]``, ``f32[T, H, 1]`` LSE (natural log, ``-inf`` for an empty row).
The flash-state protocol (``state``, tokamax's ``mla_swa`` / ``sparse_mla``): a row may start
from an external state and return its state instead of its output (module ``state``); a call
may first write this step's rows into its window cache in place (``writes``).

Walk (scalar core, per query row = grid step; ``walk``): a stream of window units then
compressed units. The window's tokens ``w_first .. w_end - 1`` (contiguous, from ``row_info``)
and an HCA walk's entries ``0 .. c_limit - 1`` are page runs (``traffic.segment_plan``): units
of ``seg`` aligned rows of one page (``seg = gcd(block, page sizes)``, a multiple of 8; fp8 /
CSA: of 32), one DMA per cache part each, of the unit's wanted rows ``lo .. hi - 1`` only (a
dynamic number: ``formats.issue_run``), into the rows they take in the next ``seg``-row slot
of a block of ``block`` rows; ``lo, hi`` are kept in SMEM (the waits re-derive the DMAs' sizes
from them) and the slot's other rows (stale, maybe NaN) are selected away; packed / f32 rows
move whole 8-row tiles (``run_grain="tiles"``) or exactly, ragged ends a row a DMA
(``"exact"``: ``formats.RUN_GRAINS``). A CSA walk's units are the list's first ``nc``
positions (the walk end: one past its last entry that can be valid), one row each, packed
densely after the runs. Each unit is checked (``0 <= e < limit``, page slot inside the table,
page id in ``[0, P)``: ``reference.batch.lookup_page``; a released page is never read) and each
valid one is DMA'd; a full block (or the stream's end) is waited on and attended:
``logits = sm_scale * (q[:, :256] . low^T + q[:, 256:] . high^T)``, unwanted rows selected to
zero and their logits ``-inf`` (a select: a NaN in VMEM cannot leak). Two gather buffers:
block b+1 is issued before block b is attended, and a row's last block issues the next row's
first block (after loading that row's list), so DMA round trips overlap compute across blocks
and rows (grid steps run in order). Not measured on a TPU (none here): per decode row at
V4-Flash (window 128, pages of 64) the window is 2 or 3 DMAs instead of 128, the 64 HCA
entries 1 instead of 64, a CSA list one per entry packed (fp8 / CSA: fewer, below).

fp8 caches: a run segment is two DMAs, its wanted tokens' nope records and the rope rows they
touch (rows ``lo // 4 .. (hi - 1) // 4``), the rope rows expanded to one per token by 4 stride-4
sublane stores (quarter ``r % 4``). A listed entry (lists in entry order, ``walk_order``):
its 512 B record (row ``off``), the 512 B rope row it shares with 3 tokens (row ``off // 4``)
and its quarter ``off % 4`` (one vector store); adjacent slots of a page are ONE records DMA,
a rope row the previous row fetched is copied in VMEM (``walk._listed``; packed: one DMA per
entry, Mosaic moves 256-word rows singly or in aligned 8-row tiles, ``measure.dma_probe``).
Random top-512 of 2048: ~1.44 DMAs, ~863 B per entry (``traffic.listed_reads``; at worst 2,
1024 B: the static bound). Decoded in VMEM
exactly (``formats._decode_fp8``): byte plane ``j`` of the record is q's features ``128 j ..``
(e4m3 upcast, times the power-of-two ue8m0 scale: exact in bf16 and f32), the rope quarter is
selected by lanes and its bf16 halves land on plane 3's lanes 64..127, so one ``[block, 512]``
operand in q's feature order feeds both matmuls. The values equal
``reference.v4_cache.dequantize_v4_rows``'; the logits then equal the reference's on the
dequantized cache up to f32 summation order.

Traffic per decode row (``fused_traffic``, ``traffic.run_bound``): the window and HCA runs'
wanted tokens (at most ``ceil((W - 1) / seg) + 1`` window segments, 3 DMAs per part for 128
tokens at pages of 64, each of its wanted rows only: packed / f32 widened to 8-row tiles, at
most 136 rows for 128 tokens; 1024 B per packed / plane row, fp8 / CSA a 512 B record and the
rope rows the run touches: at most 33 for 128 tokens, <= 644 B per token,
``traffic.run_rope_bound``), the selected CSA entries (1024 B each; fp8 / CSA: by 2 DMAs
against 640 B stored, at most), q read once, out written once,
``4 k`` bytes of the row's list into SMEM, the tables once (a state read and written: its acc,
l and m, ``state``). Versus the two-pass path (``two_pass``, ``fused=False``): q is not read
twice, and no partial outputs are written, read back and merged.

Precision: the matmul operands are in ``cdt``, bf16 for a bf16 q (f32 cache rows are rounded to
bf16 in VMEM; packed, plane and fp8 rows are bf16-exact) and f32 for an f32 q; ``P`` is cast to
``cdt`` before ``P @ V`` (rounded for a bf16 q) while ``l`` sums the f32 ``P``; the output is
written in q's dtype. ``precision="bf16"`` (the official ``sparse_attn`` regime,
``reference.v4_attention``) runs the kernel on ``q`` cast to bf16, so the operands are bf16 and
``P`` is rounded whatever the cache, and casts the bf16 output back to q's dtype: the kernel
itself has no precision switch. ``P`` is rounded relative to the running max of each gathered
block (as the official kernel's blocks of 64), the reference relative to each part's max: 1 bf16
ulp apart at most per ``P``. ``"f32"`` leaves the call as it was (with a bf16 q it is the same
bf16 computation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from pallas_kernels.v4_attention import formats, traffic
from pallas_kernels.v4_attention import writes as row_writes
from pallas_kernels.v4_attention.blocks import DEFAULT_BLOCK, DEFAULT_RUN_GRAIN
from pallas_kernels.v4_attention.formats import (  # noqa: F401 (old names of this module)
    FP8_ROW_BYTES,
    FP8_STORED_BYTES,
    HALF,
    LANES,
    WORDS,
    _decode_fp8,
)
from pallas_kernels.v4_attention.traffic import INFO_WORDS, fused_traffic
from pallas_kernels.v4_attention.walk import (  # noqa: F401 (the row_info fields: old names)
    _CLIMIT,
    _CN,
    _CSLOT0,
    _WFIRST,
    _WN,
    _WSLOT0,
    _live,
    _units,
    _walk,
    walk_order,
)
from reference import v4_attention as v4
from reference.core import batch
from reference.formats import stacked

NEG = -1e30  # finite running-max start: a fully masked block adds exp(-inf) = 0, never NaN
_kernel_cache = formats.kernel_cache  # old names (pallas_kernels.v4.fused re-exports them)
_format = formats.describe


def check_fused_args(q, window: v4.PagedKV, kv_lens, cu_q_lens, distribution,
                     compressed: v4.PagedKV | None, compressed_indices, attn_sink, *,
                     block: int, layer, precision: str = "f32", **statics):
    """Validate a fused call (``block`` a positive multiple of 8, ``reference.v4_attention``'s
    argument checks, tokamax caches by ``formats.check_tokamax_cache``, both caches in one
    format) and return ``(window read, compressed read or None, window kernel cache, compressed
    kernel cache)`` (``formats.kernel_cache``; without a compressed cache a 1-page slice of the
    window's stands in, never read)."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8, got block={block!r}")
    w_read = stacked.resolve("window.cache", window.cache, layer)
    c_read = None if compressed is None else stacked.resolve("compressed.cache",
                                                            compressed.cache, layer)
    w_one = formats.check_tokamax_cache("window.cache", w_read.one)
    c_one = c_read and formats.check_tokamax_cache("compressed.cache", c_read.one)
    v4.check_v4_args(q, w_one, kv_lens, cu_q_lens, distribution, window, compressed, c_one,
                     compressed_indices, attn_sink, precision=precision, **statics)
    w_cache = formats.kernel_cache(w_read.stacked)
    c_cache = (jax.tree_util.tree_map(lambda x: x[:, :1], w_cache) if c_read is None
               else formats.kernel_cache(c_read.stacked))
    w_fmt, c_fmt = formats.describe(w_cache), formats.describe(c_cache)
    if w_fmt != c_fmt:
        raise NotImplementedError(
            f"the fused V4 kernel reads both caches in one format; got window.cache {w_fmt} "
            f"and compressed.cache {c_fmt} (the reference, reference.v4_attention_ref, "
            f"serves mixed formats; store both caches fp8 or both packed bf16, or run the "
            f"window and the compressed cache as two calls through a flash state: "
            f"pallas_kernels.v4_attention.state)")
    return w_read, c_read, w_cache, c_cache


def row_info(rows: batch.RowFacts, wb: batch.RaggedBatch, cb: batch.RaggedBatch | None,
             entries, *, window_size: int, compress_ratio: int) -> jax.Array:
    """``i32[T * INFO_WORDS]`` per row: window first token and count, window first page slot,
    compressed walk length, compressed first page slot, compressed entry limit. Elementwise
    plus row reductions (no per-entry page lookup: the kernel reads the tables in SMEM)."""
    in_seq = rows.in_seq
    w_end = jnp.minimum(rows.abs_pos + 1, wb.kv_eff(rows.seq))
    w_first = jnp.maximum(rows.abs_pos - window_size + 1, 0)
    w_n = jnp.where(in_seq, jnp.maximum(w_end - w_first, 0), 0)
    zeros = jnp.zeros_like(w_n)
    c_n, c_slot0, c_limit = zeros, zeros, zeros
    if compress_ratio:
        c_limit = jnp.minimum(v4.visible_entries(rows.abs_pos, compress_ratio),
                              cb.kv_eff(rows.seq))
        c_limit = jnp.where(in_seq, c_limit, 0)
        c_slot0 = cb.first_slot(rows.seq)
        c_n = list_walk_end(entries, c_limit) if compress_ratio == 4 else c_limit
    fields = (w_first, w_n, wb.first_slot(rows.seq), c_n, c_slot0, c_limit)
    return pack_info(fields)


def list_walk_end(entries, c_limit):
    """``i32[T]``: one past each row's last listed entry ``e`` with ``0 <= e < c_limit`` (0:
    none), the compressed walk's length."""
    k = entries.shape[1]
    ok = (entries >= 0) & (entries < c_limit[:, None])
    return jnp.max(jnp.where(ok, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=-1,
                   initial=0)


def pack_info(fields) -> jax.Array:
    """The ``INFO_WORDS`` per-row fields (``row_info``'s order) as the flat ``i32`` SMEM
    array."""
    return jnp.stack([jnp.asarray(f, jnp.int32) for f in fields], axis=-1).reshape(-1)


def _attend(q, ops, live, m, l_sum, acc_ref, *, sm_scale):
    """One online-softmax step over a gathered block, given as ``ops`` (``formats.operands``:
    q's feature offset, operand ``[block, width]``, unwanted rows already zero); the logits of
    columns where ``live`` (``bool[H, block]``) is false are ``-inf``. Returns ``(m, l)``."""
    nt = (((1,), (1,)), ((), ()))
    s = sum(jax.lax.dot_general(q[:, lo:lo + x.shape[1]], x, nt,
                                preferred_element_type=jnp.float32) for lo, x in ops)
    s = jnp.where(live, s * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l_sum = alpha * l_sum + jnp.sum(p, axis=1, keepdims=True)
    pc = p.astype(ops[0][1].dtype)
    for lo, x in ops:
        hi = lo + x.shape[1]
        acc_ref[:, lo:hi] = alpha * acc_ref[:, lo:hi] + jnp.dot(
            pc, x, preferred_element_type=jnp.float32)
    return m_new, l_sum


def _start_state(state_in, acc_ref, heads: int):
    """The row's starting ``(m, l)`` (and ``acc_ref``): empty (``NEG``, 0, zeros), or the
    external state ``(acc [1, H, 512], l [1, H, 1], m [1, H, 1])`` refs; a state with ``l <= 0``
    (or NaN) holds nothing and starts empty (its ``m`` and ``acc`` are not read)."""
    if not state_in:
        acc_ref[...] = jnp.zeros_like(acc_ref)
        return jnp.full((heads, 1), NEG, jnp.float32), jnp.zeros((heads, 1), jnp.float32)
    acc_in, l_in, m_in = state_in
    l0 = l_in[0]
    has = l0 > 0.0
    acc_ref[...] = jnp.where(has, acc_in[0].astype(jnp.float32), 0.0)
    return jnp.where(has, m_in[0], NEG), jnp.where(has, l0, 0.0)


def _finish(outs, sink_ref, acc_ref, m, l_sum, *, state_out: bool):
    """Write the row: normalized ``out`` and sink-free ``lse`` (the sink applied once, here),
    or (``state_out``) the unnormalized state ``acc``, ``l``, ``m`` (``m = 0`` where empty)."""
    empty = l_sum <= 0.0
    if state_out:
        acc_out, l_out, m_out = outs
        acc_out[0] = acc_ref[...].astype(acc_out.dtype)
        l_out[0] = l_sum
        m_out[0] = jnp.where(empty, 0.0, m)
        return
    out_ref, lse_ref = outs
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l_sum)))
    # reference.sinks' rule, 1 / (1 + e^(sink - lse)): e^ overflow gives 0, sink -inf gives 1
    factor = jnp.where(empty, 0.0, 1.0 / (1.0 + jnp.exp(sink_ref[...] - lse)))
    out_ref[0] = (acc_ref[...] * (factor / jnp.where(empty, 1.0, l_sum))).astype(out_ref.dtype)
    lse_ref[0] = lse


def _kernel(info_ref, wtab_ref, ctab_ref, layer_ref, q_ref, sink_ref, ent_hbm, *refs, fmt,
            listed, cdt, sm_scale, state_in=False, state_out=False, writes=False,
            **walk_statics):
    """One grid step = one query row (module docstring). Refs: prefetch ``info`` (SMEM i32[T *
    INFO_WORDS]), ``wtab`` / ``ctab`` (SMEM page tables), ``layer`` (SMEM i32[1]); inputs ``q``
    block [1, H, 512], ``sink`` f32[H, 1] (``-inf``: none), ``ent`` (HBM i32[T, k]), with
    ``state_in`` the state blocks ``acc`` [1, H, 512], ``l``, ``m`` [1, H, 1], then each cache's
    HBM parts (``formats.parts``), window first; outputs ``out`` [1, H, 512], ``lse`` [1, H, 1]
    (``state_out``: ``acc``, ``l``, ``m``); with ``writes`` the new rows (HBM i32[2 T, 128])
    after the caches and the window cache aliased as the last output (``writes``: info then
    holds each row's write position after its ``T * INFO_WORDS``); scratch: the gather buffers
    ``[2, block, ...]`` (``formats.buffers``), their DMA semaphores ``[part, buffer]``, the
    lists of 2 rows (SMEM i32[2, k]) and their semaphore, ``state`` (SMEM i32[4]: this row's
    cursor, rows in flight, their buffer, whether the next row's first block was issued), the
    f32 accumulator [H, 512].

    Pipeline: a row's block b+1 is issued before block b is attended; its last block issues the
    next row's first block (and loads that row's list), so the DMA round trip is hidden across
    blocks and rows alike (grid steps run in order: ``dimension_semantics`` arbitrary)."""
    runs_on = walk_statics["window_runs"] or walk_statics["compressed_runs"]
    nparts, nbufs = (2, 3 + 2 * runs_on) if fmt in formats.FP8_FORMATS else (1, 1)
    n_state = 3 if state_in else 0
    state_refs, refs = refs[:n_state], refs[n_state:]
    w_src, c_src = refs[:nparts], refs[nparts:2 * nparts]
    n_new = nparts if writes else 0  # writes: this step's rows per part, the parts as outputs
    new_hbm, refs = refs[2 * nparts:2 * nparts + n_new], refs[2 * nparts + n_new:]
    n_out = 3 if state_out else 2
    outs, cache_out = refs[:n_out], refs[n_out:n_out + n_new]
    refs = refs[n_out + n_new:]
    bufs, (ent_smem, sems, esem, state, acc_ref, runs) = refs[:nbufs], refs[nbufs:]
    t, num_rows = pl.program_id(0), pl.num_programs(0)
    layer, num_layers = layer_ref[0], walk_statics.pop("layers")
    walk_statics.update(fmt=fmt, listed=listed, layer=jnp.clip(layer, 0, num_layers - 1),
                        layer_ok=(layer >= 0) & (layer < num_layers))  # else: read nothing
    walk_refs = (info_ref, wtab_ref, ctab_ref, w_src, c_src, bufs, ent_smem, sems, runs)
    seg, block = walk_statics["seg"], walk_statics["block"]

    def start_row(row, b):
        """Load ``row``'s list and issue its first block into buffer ``b``; record it."""
        if listed:
            cp = pltpu.make_async_copy(ent_hbm.at[pl.ds(row, 1)],
                                       ent_smem.at[pl.ds(row % 2, 1)], esem.at[0])
            cp.start()
            cp.wait()
        cur, n = _walk(walk_refs, row, row % 2, b, jnp.int32(0), **walk_statics)
        state[0], state[1], state[2] = cur, n, b

    @pl.when(t == 0)
    def _():
        if writes:  # this step's rows into the window cache, before any read
            row_writes.write_rows(
                info_ref, wtab_ref, new_hbm, cache_out, esem.at[0], base=num_rows * INFO_WORDS,
                info_words=INFO_WORDS, slot_word=_WSLOT0, num_rows=num_rows,
                w_page=walk_statics["w_page"], w_pages=walk_statics["w_pages"],
                layer=walk_statics["layer"], layer_ok=walk_statics["layer_ok"], fmt=fmt)
        start_row(0, 0)

    state[3] = 0

    def prefetch_next(b):
        @pl.when(t + 1 < num_rows)
        def _():
            start_row(t + 1, b)
            state[3] = 1

    total = sum(_units(info_ref, t, seg, walk_statics["window_runs"],
                       walk_statics["compressed_runs"]))

    def step(carry):
        cur, n, b, m, l_sum = carry

        def more():
            return _walk(walk_refs, t, t % 2, 1 - b, cur, **walk_statics)

        def last():
            prefetch_next(1 - b)
            return cur, jnp.int32(0)

        cur2, n2 = jax.lax.cond(cur < total, more, last)
        ns = runs[b, 2 * (block // seg)]  # segments: 0 unless page runs are on
        formats.wait(fmt, w_src, bufs, sems, b, n - ns * seg, ns, seg if runs_on else 1,
                     runs, walk_statics["run_grain"], shared=runs[b, 2 * (block // seg) + 1])
        live = _live(runs, b, (block, 1), 0, seg)
        cols = _live(runs, b, (q_ref.shape[1], block), 1, seg)
        ops = formats.operands(fmt, bufs, b, live, cdt, ns * seg)
        m, l_sum = _attend(q_ref[0], ops, cols, m, l_sum, acc_ref, sm_scale=sm_scale)
        return cur2, n2, 1 - b, m, l_sum

    m0, l0 = _start_state(state_refs, acc_ref, q_ref.shape[1])
    init = (state[0], state[1], state[2], m0, l0)
    _, _, _, m, l_sum = jax.lax.while_loop(lambda c: c[1] > 0, step, init)

    @pl.when(state[3] == 0)  # an empty row: nothing in flight, buffer 0 is free
    def _():
        prefetch_next(0)

    _finish(outs, sink_ref, acc_ref, m, l_sum, state_out=state_out)


def _scratch(fmt: str, block: int, w_parts, heads: int, dim: int, k: int, seg: int,
             runs: bool) -> list:
    """The kernel's scratch (``_kernel``'s docstring)."""
    return formats.buffers(fmt, block, w_parts, runs) + [
        pltpu.SMEM((2, k), jnp.int32),  # the compressed lists of 2 rows
        pltpu.SemaphoreType.DMA((2, 2)), pltpu.SemaphoreType.DMA((1,)),
        pltpu.SMEM((4,), jnp.int32),  # the walk's state across rows
        pltpu.VMEM((heads, dim), jnp.float32),  # accumulator
        pltpu.SMEM((2, 2 * (block // seg) + 2), jnp.int32)]  # slots' lo, hi; runs; shared


def _state_io(state, return_state: bool, acc_dtype, q, row_block):
    """The state's input arrays and block specs (``state``: ``(acc [T, H, 512], l [T, H], m
    [T, H])`` or None) and the outputs' shapes and specs."""
    num_rows, heads, dim = q.shape
    sd = jax.ShapeDtypeStruct
    col = pl.BlockSpec((1, heads, 1), row_block)
    full = pl.BlockSpec((1, heads, dim), row_block)
    ins, in_specs = [], []
    if state is not None:
        acc, l_in, m_in = state
        ins = [tpu.in_hbm(acc), tpu.in_hbm(l_in.astype(jnp.float32)[..., None]),
               tpu.in_hbm(m_in.astype(jnp.float32)[..., None])]
        in_specs = [full, col, col]
    if return_state:
        out_shape = [sd((num_rows, heads, dim), acc_dtype),
                     sd((num_rows, heads, 1), jnp.float32), sd((num_rows, heads, 1), jnp.float32)]
        return ins, in_specs, out_shape, [full, col, col]
    out_shape = [sd((num_rows, heads, dim), q.dtype), sd((num_rows, heads, 1), jnp.float32)]
    return ins, in_specs, out_shape, [full, col]


def fused_call(q, w_cache, c_cache, layer, entries, info, w_table, c_table, attn_sink, *,
               gathered_rows: int, block: int, sm_scale: float, vmem_limit_bytes: int | None,
               interpret, state=None, return_state: bool = False, acc_dtype=None,
               new_rows=None, window_size: int = 0, run_grain: str = DEFAULT_RUN_GRAIN):
    """The ``pallas_call`` (see ``_kernel``): caches stacked ``[L, P, ps, Wc]`` (packed u32 or
    f32) or stacked format pytrees (``formats``), both caches in one format, read at ``layer``
    (i32). ``state``: the rows' starting flash state ``(acc f32|bf16[T, H, 512], l f32[T, H],
    m f32[T, H])`` or None (empty); ``return_state``: return the state ``(acc acc_dtype[T, H,
    512], l, m f32[T, H, 1])`` (``acc_dtype`` default q's) instead of (``q.dtype[T, H, 512]``,
    ``f32[T, H, 1]``). ``new_rows``: this step's rows encoded per window cache part
    (``writes.row_parts``; one part: the array alone, as the plane words once), which the
    kernel writes into the window cache first, ``info`` then ending in their positions; the
    updated stacked window parts are returned last, aliased to the inputs. ``window_size``: the
    window tokens of ``gathered_rows`` (the rest: compressed entries), for the page-run
    traffic bound (``traffic.run_bound``); ``run_grain``: ``formats.RUN_GRAINS``."""
    num_rows, heads, dim = q.shape
    listed = entries is not None
    ent = entries.astype(jnp.int32) if listed else jnp.zeros((num_rows, 1), jnp.int32)
    k = ent.shape[1]
    fmt = formats.kernel_format(w_cache)
    w_parts, c_parts = formats.parts(w_cache), formats.parts(c_cache)
    (layers, w_pages, w_page), (_, c_pages, c_page) = (formats.paging(w_cache),
                                                       formats.paging(c_cache))
    seg, window_runs, compressed_runs = traffic.segment_plan(fmt, block, w_page, c_page,
                                                             listed)
    kernel = functools.partial(
        _kernel, fmt=fmt, listed=listed, block=block, seg=seg, window_runs=window_runs,
        compressed_runs=compressed_runs, w_page=w_page, c_page=c_page,
        run_grain=formats.check_run_grain(run_grain),
        w_pages=w_pages, c_pages=c_pages, layers=layers, sm_scale=float(sm_scale),
        cdt=jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16,
        state_in=state is not None, state_out=return_state, writes=new_rows is not None)
    sink = (jnp.full((heads, 1), -jnp.inf, jnp.float32) if attn_sink is None
            else attn_sink.astype(jnp.float32).reshape(heads, 1))
    row_block = lambda t, *_: (t, 0, 0)  # noqa: E731
    acc_dtype = jnp.dtype(q.dtype if acc_dtype is None else acc_dtype)
    state_ins, state_specs, out_shape, out_specs = _state_io(state, return_state, acc_dtype, q,
                                                             row_block)
    any_spec, extra_ins, aliases = pl.BlockSpec(memory_space=pl.ANY), [], {}
    if new_rows is not None:  # the window parts (inputs 7 + state ..) become the last outputs
        extra_ins = list(new_rows) if isinstance(new_rows, (tuple, list)) else [new_rows]
        aliases = {7 + len(state_ins) + i: len(out_shape) + i for i in range(len(w_parts))}
        out_shape = out_shape + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in w_parts]
        out_specs = out_specs + [any_spec] * len(w_parts)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(num_rows,),
        in_specs=[pl.BlockSpec((1, heads, dim), row_block),
                  pl.BlockSpec((heads, 1), lambda t, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)] + state_specs
        + [any_spec] * (len(w_parts) + len(c_parts) + len(extra_ins)),
        out_specs=out_specs, scratch_shapes=_scratch(fmt, block, w_parts, heads, dim, k, seg,
                                                    window_runs or compressed_runs))
    single_rows, run_rows, gather_dmas = traffic.run_bound(
        window=window_size, entries=gathered_rows - window_size, seg=seg,
        window_runs=window_runs, compressed_runs=compressed_runs,
        dmas_per_read=len(w_parts), align=formats.run_align(fmt, w_parts[0].shape[-1]),
        exact=run_grain == "exact")
    rope_rows = traffic.run_rope_bound(
        window=window_size, entries=gathered_rows - window_size, window_runs=window_runs,
        compressed_runs=compressed_runs) if fmt in formats.FP8_FORMATS else 0
    t = fused_traffic(rows=num_rows, heads=heads, gathered_rows=gathered_rows,
                      meta_words=k if listed else 0,
                      table_words=w_table.shape[0] + c_table.shape[0], block=block,
                      q_itemsize=q.dtype.itemsize,
                      row_bytes=formats.row_bytes(fmt, w_parts[0].shape[-1]),
                      min_row_bytes=formats.stored_bytes(fmt), fp8=fmt in formats.FP8_FORMATS,
                      acc_in_itemsize=0 if state is None else state[0].dtype.itemsize,
                      acc_out_itemsize=acc_dtype.itemsize if return_state else 0,
                      written_rows=0 if new_rows is None else num_rows,
                      read_rows=num_rows * single_rows, gather_dmas=num_rows * gather_dmas,
                      run_rows=num_rows * run_rows,
                      run_row_bytes=formats.run_row_bytes(fmt, w_parts[0].shape[-1]),
                      run_rope_rows=num_rows * rope_rows,
                      write_bytes=row_writes.written_bytes(fmt),
                      write_dmas=row_writes.written_dmas(fmt))
    call = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=tpu.vmem_limit(t.vmem_bytes, tpu.device_chip(), vmem_limit_bytes)),
        cost_estimate=pl.CostEstimate(flops=t.flops, transcendentals=0,
                                      bytes_accessed=t.bytes_moved),
        interpret=tpu.interpret_params(interpret), name="v4_fused_attention")
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return call(info, tpu.smem_page_table(w_table), tpu.smem_page_table(c_table), layer,
                tpu.in_hbm(q), sink, ent, *state_ins, *map(tpu.in_hbm, w_parts + c_parts),
                *extra_ins)


def fused_rows(q, window: v4.PagedKV, kv_lens, cu_q_lens, distribution, *, compressed,
               compressed_indices, attn_sink, block: int, vmem_limit_bytes, interpret, layer,
               precision: str, state=None, return_state: bool = False, acc_dtype=None,
               new_kv=None, **statics):
    """Check and run one fused call (``v4_attention_fused``'s arguments, ``statics`` its static
    ones; ``state`` / ``return_state`` / ``acc_dtype``: ``fused_call``'s; ``new_kv f32|bf16[T,
    512]``: this step's rows, written into the window cache first, ``writes``; a ``run_grain``
    in ``statics``: ``fused_call``'s). Returns
    ``(fused_call's outputs, the updated window cache as given, or None)``, q's precision cast
    applied (``precision="bf16"``: the kernel runs on q cast to bf16; its normalized output is
    cast back to q's dtype)."""
    run_grain = statics.pop("run_grain", DEFAULT_RUN_GRAIN)
    w_read, c_read, w_cache, c_cache = check_fused_args(
        q, window, kv_lens, cu_q_lens, distribution, compressed, compressed_indices, attn_sink,
        block=block, layer=layer, precision=precision, **statics)
    if statics["compress_ratio"] == 4 and formats.kernel_format(w_cache) in formats.FP8_FORMATS:
        compressed_indices = walk_order(compressed_indices)  # shared rope rows, record runs
    rows = batch.row_facts(q.shape[0], kv_lens, cu_q_lens, distribution)
    wb = batch.RaggedBatch.of(w_read.one, kv_lens, window.page_indices, cu_q_lens,
                              window.cu_lens, distribution,
                              pages_per_seq=statics["window_pages_per_seq"])
    cb, c_table, capacity = None, jnp.full((1,), -1, jnp.int32), 0  # ratio 0: walks 0 entries
    ratio = statics["compress_ratio"]
    if c_read is not None:
        cb = batch.RaggedBatch.of(c_read.one, v4.compressed_lens(kv_lens, ratio),
                                  compressed.page_indices, cu_q_lens, compressed.cu_lens,
                                  distribution, pages_per_seq=statics["compressed_pages_per_seq"])
        c_table, capacity = compressed.page_indices, cb.capacity_tokens  # entries
    info = row_info(rows, wb, cb, compressed_indices, window_size=statics["window_size"],
                    compress_ratio=ratio)
    new_rows = None
    if new_kv is not None:
        row_writes.check_new_kv(new_kv, q, w_cache)
        new_rows, positions = row_writes.row_parts(new_kv, w_cache, rows, wb, w_read.layer)
        info = jnp.concatenate([info, positions])
    selected = compressed_indices.shape[1] if ratio == 4 else capacity
    q_in = q.astype(jnp.bfloat16) if precision == "bf16" else q  # f32 q: rounded to bf16
    res = fused_call(q_in, w_cache, c_cache, w_read.layer, compressed_indices, info,
                     window.page_indices, c_table, attn_sink,
                     gathered_rows=statics["window_size"] + selected, block=block,
                     sm_scale=statics["sm_scale"], vmem_limit_bytes=vmem_limit_bytes,
                     interpret=interpret, state=state, return_state=return_state,
                     acc_dtype=q.dtype if acc_dtype is None else acc_dtype,
                     new_rows=new_rows, window_size=statics["window_size"],
                     run_grain=run_grain)
    res, written = list(res), None
    if new_kv is not None:
        n = len(formats.parts(w_cache))
        res, written = res[:-n], row_writes.updated_cache(w_cache, res[-n:], window.cache)
    if not return_state and precision == "bf16":
        res[0] = res[0].astype(q.dtype)
    return res, written


@v4.checks_layers
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
    "compressed_pages_per_seq", "return_lse", "block", "vmem_limit_bytes", "interpret",
    "precision", "run_grain"))
def v4_attention_fused(q: jax.Array, window: v4.PagedKV, kv_lens: jax.Array,
                       cu_q_lens: jax.Array, distribution: jax.Array, *, sm_scale: float,
                       window_size: int, compress_ratio: int, window_pages_per_seq: int,
                       compressed_pages_per_seq: int = 0,
                       compressed: v4.PagedKV | None = None,
                       compressed_indices: jax.Array | None = None,
                       attn_sink: jax.Array | None = None, return_lse: bool = False,
                       block: int = DEFAULT_BLOCK, vmem_limit_bytes: int | None = None,
                       interpret=False, layer=None, precision: str = "f32",
                       run_grain: str = DEFAULT_RUN_GRAIN):
    """``reference.v4_attention_ref``'s semantics in one kernel (module docstring).

    Args as ``pallas_kernels.v4_attention.v4_attention`` (both caches in one format: packed
    u32, f32, ``Fp8V4Cache``, or tokamax's ``CsaCache`` / ``PlaneCache``; a plain bf16 cache is
    packed per call, a full copy: the slow path), plus ``block``: cache rows per gathered block
    (a positive multiple of 8; ``blocks.py`` holds the table), ``precision`` (``"f32"`` |
    ``"bf16"``: module docstring, "Precision") and ``run_grain`` (``"tiles"`` | ``"exact"``:
    how page runs move packed / f32 rows, ``formats.RUN_GRAINS``; ``blocks.DEFAULT_RUN_GRAIN``).
    """
    (out, lse), _ = fused_rows(
        q, window, kv_lens, cu_q_lens, distribution, sm_scale=sm_scale,
        window_size=window_size, compress_ratio=compress_ratio,
        window_pages_per_seq=window_pages_per_seq,
        compressed_pages_per_seq=compressed_pages_per_seq, compressed=compressed,
        compressed_indices=compressed_indices, attn_sink=attn_sink, block=block,
        vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, layer=layer,
        precision=precision, run_grain=run_grain)
    lse = lse[..., 0]
    return (out, lse) if return_lse else out
