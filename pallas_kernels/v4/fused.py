"""DeepSeek-V4 attention in ONE Pallas TPU kernel (milestone 2): each query row walks its
window tokens, then its compressed entries, in one online softmax.

Math: ``reference.v4_attention`` (the union of the window ``max(0, p - W + 1) .. p`` and the
visible compressed entries, K = V = the 512-dim row; the sink applied at the end of the row,
in the kernel, on its sink-free LSE by ``reference.sinks``' rule).

Shapes: ``q bf16|f32[T, H, 512]``; both caches packed bf16 words ``u32[P, ps, 256]``
(``reference.packed_cache``: word ``j`` holds features ``j`` (low half) and ``j + 256`` (high
half)) or both ``f32[P, ps, 512]``, stacked ``[L, ...]`` read in place at ``layer``;
``entries i32[T, k]`` the ratio-4 row lists (ratio 128 walks an implicit iota, no list).
Out ``q.dtype[T, H, 512]`` and ``f32[T, H, 1]`` LSE (natural log, ``-inf`` for an empty row).

Walk (scalar core, per query row = grid step): a stream of ``nw + nc`` positions, the window's
``nw`` tokens (``w_first .. w_end - 1``: contiguous, from ``row_info``) then the compressed
list's first ``nc`` positions (the walk end: one past its last entry that can be valid). Each
position is checked (``0 <= e < limit``, page slot inside the table, page id in ``[0, P)``:
``reference.batch.lookup_page``) and each valid one is DMA'd, one 1 KB row, into the next free
row of a block of ``block`` rows; a full block (or the stream's end) is waited on and attended:
``logits = sm_scale * (q[:, :256] . low^T + q[:, 256:] . high^T)``, rows past the filled count
selected to zero and their logits ``-inf`` (a select: a NaN in VMEM cannot leak). Two gather
buffers: block b+1 is issued before block b is attended, and a row's last block issues the next
row's first block (after loading that row's list), so DMA round trips overlap compute across
blocks and rows (grid steps run in order). Not measured on a TPU (none here): one descriptor
per row means ``W + k`` DMA issues per query row on the scalar core, as in the MLA kernel.

Traffic per decode row: the ``W`` window rows and the selected entries (1024 B each: the
minimum), q read once, out written once, ``4 k`` bytes of the row's list into SMEM, the tables
once. Versus milestone 1 (``attention``): q is not read twice, and no partial outputs are
written, read back and merged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, tpu
from reference import batch, packed_cache, stacked
from reference import v4_attention as v4

WORDS = packed_cache.packed_words(v4.HEAD_DIM)  # 256
HALF = v4.HEAD_DIM // 2  # features per word half
DEFAULT_BLOCK = 256  # rows per gathered block: 256 KB of packed rows in VMEM
# row_info words per query row
_WFIRST, _WN, _WSLOT0, _CN, _CSLOT0, _CLIMIT, INFO_WORDS = range(7)
NEG = -1e30  # finite running-max start: a fully masked block adds exp(-inf) = 0, never NaN


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
        if compress_ratio == 4:
            k = entries.shape[1]
            ok = (entries >= 0) & (entries < c_limit[:, None])
            c_n = jnp.max(jnp.where(ok, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=-1,
                          initial=0)
        else:
            c_n = c_limit
    fields = (w_first, w_n, wb.first_slot(rows.seq), c_n, c_slot0, c_limit)
    return jnp.stack([jnp.asarray(f, jnp.int32) for f in fields], axis=-1).reshape(-1)


def _unpack(words, packed: bool):
    """A block of gathered rows -> (features [0, 256), features [256, 512)), exact f32/bf16."""
    if not packed:
        return words[:, :HALF], words[:, HALF:]
    low = pltpu.bitcast(words << 16, jnp.float32)
    return low, pltpu.bitcast(words & jnp.uint32(packed_cache.HIGH_MASK), jnp.float32)


def _walk(refs, row, lslot, b, cur, *, listed, block, w_page, c_page, w_pages, c_pages,
          layer, layer_ok):
    """Issue the DMAs of query row ``row``'s next ``block`` valid stream positions from
    ``cur`` into gather buffer ``b`` (densely; its list is in SMEM slot ``lslot``). Returns
    ``(cursor, rows issued)``; a row's stream is its ``w_n`` window tokens then ``c_n`` list
    positions (module docstring)."""
    info_ref, wtab_ref, ctab_ref, wc_hbm, cc_hbm, buf, ent_smem, sem = refs
    at = row * INFO_WORDS
    w_first, w_n, w_slot0 = info_ref[at + _WFIRST], info_ref[at + _WN], info_ref[at + _WSLOT0]
    c_n, c_slot0, c_limit = info_ref[at + _CN], info_ref[at + _CSLOT0], info_ref[at + _CLIMIT]

    def body(c):
        pos, n = c
        in_window = pos < w_n
        j = pos - w_n
        e = ent_smem[lslot, jnp.clip(j, 0, ent_smem.shape[1] - 1)] if listed else j
        e_ok = (e >= 0) & (e < c_limit)
        unit = jnp.where(in_window, w_first + pos, jnp.where(e_ok, e, 0))
        psize = jnp.where(in_window, w_page, c_page)
        slot = jnp.where(in_window, w_slot0, c_slot0) + unit // psize
        w_pid, w_ok = batch.lookup_page(wtab_ref, slot, w_pages)
        c_pid, c_ok = batch.lookup_page(ctab_ref, slot, c_pages)
        ok = jnp.where(in_window, w_ok, e_ok & c_ok) & layer_ok
        for src, pid, here in ((wc_hbm, w_pid, in_window), (cc_hbm, c_pid, ~in_window)):
            @pl.when(ok & here)
            def _(src=src, pid=pid):
                _row_copy(src, buf, sem, layer, pid, unit % psize, b, n).start()

        return pos + 1, n + ok.astype(jnp.int32)

    return jax.lax.while_loop(lambda c: (c[1] < block) & (c[0] < w_n + c_n), body,
                              (cur, jnp.int32(0)))


def _row_copy(src, buf, sem, layer, pid, off, b, n):
    """One cache row ``src[layer, pid, off]`` -> row ``n`` of gather buffer ``b`` (whole rows:
    Mosaic refuses part-row slices)."""
    return pltpu.make_async_copy(src.at[layer, pid, pl.ds(off, 1)], buf.at[b, pl.ds(n, 1)],
                                 sem.at[b])


def _attend(q, words, n, m, l_sum, acc_ref, *, packed, cdt, sm_scale):
    """One online-softmax step over a gathered block ``words [block, Wc]`` whose first ``n``
    rows are live (the rest selected to zero, their logits ``-inf``). Returns ``(m, l)``."""
    live = jax.lax.broadcasted_iota(jnp.int32, (words.shape[0], 1), 0) < n
    low, high = _unpack(words, packed)
    low = jnp.where(live, low, 0.0).astype(cdt)
    high = jnp.where(live, high, 0.0).astype(cdt)
    nt = (((1,), (1,)), ((), ()))
    s = (jax.lax.dot_general(q[:, :HALF], low, nt, preferred_element_type=jnp.float32)
         + jax.lax.dot_general(q[:, HALF:], high, nt, preferred_element_type=jnp.float32))
    col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(col < n, s * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l_sum = alpha * l_sum + jnp.sum(p, axis=1, keepdims=True)
    pc = p.astype(cdt)
    acc_ref[:, :HALF] = alpha * acc_ref[:, :HALF] + jnp.dot(pc, low,
                                                            preferred_element_type=jnp.float32)
    acc_ref[:, HALF:] = alpha * acc_ref[:, HALF:] + jnp.dot(pc, high,
                                                            preferred_element_type=jnp.float32)
    return m_new, l_sum


def _kernel(info_ref, wtab_ref, ctab_ref, layer_ref, q_ref, sink_ref, ent_hbm, wc_hbm, cc_hbm,
            out_ref, lse_ref, buf, ent_smem, sem, esem, state, acc_ref, *, listed, packed, cdt,
            sm_scale, **walk_statics):
    """One grid step = one query row (module docstring). Refs: prefetch ``info`` (SMEM
    i32[T * 7]), ``wtab`` / ``ctab`` (SMEM page tables), ``layer`` (SMEM i32[1]); inputs ``q``
    block [1, H, 512], ``sink`` f32[H, 1] (``-inf``: none), ``ent`` (HBM i32[T, k]), the stacked
    caches (HBM [L, P, ps, Wc]); outputs ``out`` [1, H, 512], ``lse`` [1, H, 1]; scratch: two
    gather buffers [2, block, Wc] and their DMA semaphores, the lists of 2 rows (SMEM i32[2, k])
    and their semaphore, ``state`` (SMEM i32[4]: this row's cursor, rows in flight, their
    buffer, whether the next row's first block was issued), the f32 accumulator [H, 512].

    Pipeline: a row's block b+1 is issued before block b is attended; its last block issues the
    next row's first block (and loads that row's list), so the DMA round trip is hidden across
    blocks and rows alike (grid steps run in order: ``dimension_semantics`` arbitrary)."""
    t, num_rows = pl.program_id(0), pl.num_programs(0)
    layer, num_layers = layer_ref[0], walk_statics.pop("layers")
    walk_statics.update(listed=listed, layer=jnp.clip(layer, 0, num_layers - 1),
                        layer_ok=(layer >= 0) & (layer < num_layers))  # else: read nothing
    refs = (info_ref, wtab_ref, ctab_ref, wc_hbm, cc_hbm, buf, ent_smem, sem)

    def load_list(row):
        if listed:
            cp = pltpu.make_async_copy(ent_hbm.at[pl.ds(row, 1)],
                                       ent_smem.at[pl.ds(row % 2, 1)], esem.at[0])
            cp.start()
            cp.wait()

    def start_row(row, b):
        """Load ``row``'s list and issue its first block into buffer ``b``; record it."""
        load_list(row)
        cur, n = _walk(refs, row, row % 2, b, jnp.int32(0), **walk_statics)
        state[0], state[1], state[2] = cur, n, b

    @pl.when(t == 0)
    def _():
        start_row(0, 0)

    state[3] = 0

    def prefetch_next(b):
        @pl.when(t + 1 < num_rows)
        def _():
            start_row(t + 1, b)
            state[3] = 1

    total = info_ref[t * INFO_WORDS + _WN] + info_ref[t * INFO_WORDS + _CN]

    def step(carry):
        cur, n, b, m, l_sum = carry

        def more():
            return _walk(refs, t, t % 2, 1 - b, cur, **walk_statics)

        def last():
            prefetch_next(1 - b)
            return cur, jnp.int32(0)

        cur2, n2 = jax.lax.cond(cur < total, more, last)

        def wait(i, c):
            _row_copy(wc_hbm, buf, sem, 0, 0, 0, b, 0).wait()
            return c

        jax.lax.fori_loop(0, n, wait, 0)
        m, l_sum = _attend(q_ref[0], buf[b], n, m, l_sum, acc_ref, packed=packed, cdt=cdt,
                           sm_scale=sm_scale)
        return cur2, n2, 1 - b, m, l_sum

    heads = q_ref.shape[1]
    acc_ref[...] = jnp.zeros_like(acc_ref)
    init = (state[0], state[1], state[2], jnp.full((heads, 1), NEG, jnp.float32),
            jnp.zeros((heads, 1), jnp.float32))
    _, _, _, m, l_sum = jax.lax.while_loop(lambda c: c[1] > 0, step, init)

    @pl.when(state[3] == 0)  # an empty row: nothing in flight, buffer 0 is free
    def _():
        prefetch_next(0)

    empty = l_sum <= 0.0
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l_sum)))
    # reference.sinks' rule, 1 / (1 + e^(sink - lse)): e^ overflow gives 0, sink -inf gives 1
    factor = jnp.where(empty, 0.0, 1.0 / (1.0 + jnp.exp(sink_ref[...] - lse)))
    out_ref[0] = (acc_ref[...] * (factor / jnp.where(empty, 1.0, l_sum))).astype(out_ref.dtype)
    lse_ref[0] = lse


def fused_traffic(*, rows: int, heads: int, gathered_rows: int, meta_words: int,
                  table_words: int, block: int, q_itemsize: int, row_bytes: int,
                  min_row_bytes: int = 2 * v4.HEAD_DIM) -> aot.Traffic:
    """Modelled HBM traffic of one fused call where every query row gathers ``gathered_rows``
    rows (window + selected entries) of ``row_bytes`` each: those rows, q read once, out
    written once (plus its f32 LSE), the rows' lists (``meta_words``) and ``row_info`` into
    SMEM, the page tables once. The minimum moves each row once at ``min_row_bytes`` (512 bf16
    features: 1024 B) plus q and out. VMEM: the two gather blocks, the f32 accumulator, q and
    out blocks double-buffered."""
    q_out = rows * heads * (2 * v4.HEAD_DIM * q_itemsize + 4)
    smem = 4 * (rows * (meta_words + INFO_WORDS) + table_words)
    moved = rows * gathered_rows * row_bytes + q_out + smem
    bytes_min = rows * gathered_rows * min_row_bytes + q_out
    flops = 2 * rows * heads * gathered_rows * 2 * v4.HEAD_DIM
    vmem = 2 * block * row_bytes + 4 * heads * v4.HEAD_DIM + 4 * heads * v4.HEAD_DIM * q_itemsize
    return aot.Traffic(int(moved), int(bytes_min), int(flops), int(vmem))


def fused_call(q, w_cache, c_cache, layer, entries, info, w_table, c_table, attn_sink, *,
               gathered_rows: int, block: int, sm_scale: float, vmem_limit_bytes: int | None,
               interpret):
    """The ``pallas_call`` (see ``_kernel``): caches stacked ``[L, P, ps, Wc]`` (packed u32 or
    f32, both the same), read at ``layer`` (i32). Returns (``q.dtype[T, H, 512]``, ``f32[T, H,
    1]``)."""
    num_rows, heads, dim = q.shape
    listed = entries is not None
    ent = entries.astype(jnp.int32) if listed else jnp.zeros((num_rows, 1), jnp.int32)
    k = ent.shape[1]
    packed = packed_cache.is_packed(w_cache)
    kernel = functools.partial(
        _kernel, listed=listed, block=block, w_page=w_cache.shape[2], c_page=c_cache.shape[2],
        w_pages=w_cache.shape[1], c_pages=c_cache.shape[1], layers=w_cache.shape[0],
        sm_scale=float(sm_scale), cdt=jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16,
        packed=packed)
    sink = (jnp.full((heads, 1), -jnp.inf, jnp.float32) if attn_sink is None
            else attn_sink.astype(jnp.float32).reshape(heads, 1))
    row_block = lambda t, *_: (t, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(num_rows,),
        in_specs=[pl.BlockSpec((1, heads, dim), row_block),
                  pl.BlockSpec((heads, 1), lambda t, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((1, heads, dim), row_block),
                   pl.BlockSpec((1, heads, 1), row_block)],
        scratch_shapes=[pltpu.VMEM((2, block, w_cache.shape[-1]), w_cache.dtype),  # blocks
                        pltpu.SMEM((2, k), jnp.int32),  # the compressed lists of 2 rows
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((1,)),
                        pltpu.SMEM((4,), jnp.int32),  # the walk's state across rows
                        pltpu.VMEM((heads, dim), jnp.float32)])  # accumulator
    t = fused_traffic(rows=num_rows, heads=heads, gathered_rows=gathered_rows, meta_words=k,
                      table_words=w_table.shape[0] + c_table.shape[0], block=block,
                      q_itemsize=q.dtype.itemsize, row_bytes=4 * w_cache.shape[-1])
    call = pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_rows, heads, dim), q.dtype),
                   jax.ShapeDtypeStruct((num_rows, heads, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=tpu.vmem_limit(t.vmem_bytes, tpu.device_chip(), vmem_limit_bytes)),
        cost_estimate=pl.CostEstimate(flops=t.flops, transcendentals=0,
                                      bytes_accessed=t.bytes_moved),
        interpret=tpu.interpret_params(interpret), name="v4_fused_attention")
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return call(info, tpu.smem_page_table(w_table), tpu.smem_page_table(c_table), layer,
                tpu.in_hbm(q), sink, ent, tpu.in_hbm(w_cache), tpu.in_hbm(c_cache))


@v4.checks_layers
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
    "compressed_pages_per_seq", "return_lse", "block", "vmem_limit_bytes", "interpret"))
def v4_attention_fused(q: jax.Array, window: v4.PagedKV, kv_lens: jax.Array,
                       cu_q_lens: jax.Array, distribution: jax.Array, *, sm_scale: float,
                       window_size: int, compress_ratio: int, window_pages_per_seq: int,
                       compressed_pages_per_seq: int = 0,
                       compressed: v4.PagedKV | None = None,
                       compressed_indices: jax.Array | None = None,
                       attn_sink: jax.Array | None = None, return_lse: bool = False,
                       block: int = DEFAULT_BLOCK, vmem_limit_bytes: int | None = None,
                       interpret=False, layer=None):
    """``reference.v4_attention_ref``'s semantics in one kernel (module docstring).

    Args as ``pallas_kernels.v4.v4_attention`` (both caches packed u32, or both f32; a plain
    bf16 cache is packed per call, a full copy: the slow path), plus ``block``: cache rows per
    gathered block (a positive multiple of 8).
    """
    statics = dict(sm_scale=sm_scale, window_size=window_size, compress_ratio=compress_ratio,
                   window_pages_per_seq=window_pages_per_seq,
                   compressed_pages_per_seq=compressed_pages_per_seq)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8, got block={block!r}")
    w_read = stacked.resolve("window.cache", window.cache, layer)
    c_read = None if compressed is None else stacked.resolve("compressed.cache",
                                                            compressed.cache, layer)
    v4.check_v4_args(q, w_read.one, kv_lens, cu_q_lens, distribution, window, compressed,
                     c_read and c_read.one, compressed_indices, attn_sink, **statics)
    w_cache = _kernel_cache(w_read.stacked)
    c_cache = w_cache[:, :1] if c_read is None else _kernel_cache(c_read.stacked)
    if c_cache.dtype != w_cache.dtype:
        raise NotImplementedError(f"the fused V4 kernel reads both caches in one format; got "
                                  f"window {w_cache.dtype} and compressed {c_cache.dtype}")
    rows = batch.row_facts(q.shape[0], kv_lens, cu_q_lens, distribution)
    wb = batch.RaggedBatch.of(w_read.one, kv_lens, window.page_indices, cu_q_lens,
                              window.cu_lens, distribution, pages_per_seq=window_pages_per_seq)
    cb, c_table, capacity = None, jnp.full((1,), -1, jnp.int32), 0  # ratio 0: walks 0 entries
    if c_read is not None:
        cb = batch.RaggedBatch.of(c_read.one, v4.compressed_lens(kv_lens, compress_ratio),
                                  compressed.page_indices, cu_q_lens, compressed.cu_lens,
                                  distribution, pages_per_seq=compressed_pages_per_seq)
        c_table, capacity = compressed.page_indices, cb.capacity_tokens  # entries
    info = row_info(rows, wb, cb, compressed_indices, window_size=window_size,
                    compress_ratio=compress_ratio)
    selected = compressed_indices.shape[1] if compress_ratio == 4 else capacity
    out, lse = fused_call(q, w_cache, c_cache, w_read.layer, compressed_indices, info,
                          window.page_indices, c_table, attn_sink,
                          gathered_rows=window_size + selected, block=block, sm_scale=sm_scale,
                          vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    lse = lse[..., 0]
    return (out, lse) if return_lse else out


def _kernel_cache(cache):
    """A stacked cache as the kernel reads it: packed u32 or f32 as given; plain bf16 packed
    (a full copy per call: the documented slow path, as in ``pallas_kernels.mla``)."""
    if jnp.result_type(cache) == jnp.bfloat16:
        return packed_cache.pack_cache(cache)
    return cache
