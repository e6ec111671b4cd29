"""DeepSeek-V4 attention in ONE Pallas TPU kernel (the default path of
``pallas_kernels.v4_attention.v4_attention``, ``fused=True``): each query row walks its window
tokens, then its compressed entries, in one online softmax.

Math: ``reference.v4_attention`` (the union of the window ``max(0, p - W + 1) .. p`` and the
visible compressed entries, K = V = the 512-dim row; the sink applied at the end of the row,
in the kernel, on its sink-free LSE by ``reference.sinks``' rule).

Shapes: ``q bf16|f32[T, H, 512]``; both caches packed bf16 words ``u32[P, ps, 256]``
(``reference.packed_cache``: word ``j`` holds features ``j`` (low half) and ``j + 256`` (high
half)), both ``f32[P, ps, 512]``, or both fp8 MODEL1 ``Fp8V4Cache`` (``reference.v4_cache``:
``nope u32[P, ps, 128]``, ``rope u32[P, ceil(ps / 4), 128]``), stacked ``[L, ...]`` read in place
at ``layer``; mixed formats raise NotImplementedError (the reference serves them);
``entries i32[T, k]`` the ratio-4 row lists (ratio 128 walks an implicit iota, no list).
Out ``q.dtype[T, H, 512]`` and ``f32[T, H, 1]`` LSE (natural log, ``-inf`` for an empty row).

Walk (scalar core, per query row = grid step): a stream of ``nw + nc`` positions, the window's
``nw`` tokens (``w_first .. w_end - 1``: contiguous, from ``row_info``) then the compressed
list's first ``nc`` positions (the walk end: one past its last entry that can be valid). Each
position is checked (``0 <= e < limit``, page slot inside the table, page id in ``[0, P)``:
``reference.batch.lookup_page``) and each valid one is DMA'd, one 1 KB row, into the next free
row of a block of ``block`` rows (fp8: two DMAs, below); a full block (or the stream's end) is
waited on and attended:
``logits = sm_scale * (q[:, :256] . low^T + q[:, 256:] . high^T)``, rows past the filled count
selected to zero and their logits ``-inf`` (a select: a NaN in VMEM cannot leak). Two gather
buffers: block b+1 is issued before block b is attended, and a row's last block issues the next
row's first block (after loading that row's list), so DMA round trips overlap compute across
blocks and rows (grid steps run in order). Not measured on a TPU (none here): one descriptor
per row means ``W + k`` DMA issues per query row on the scalar core, as in the MLA kernel.

fp8 caches: per token two whole-row DMAs, its 512 B nope record (row ``off`` of its page) and
the 512 B rope row it shares with 3 tokens (row ``off // 4``), plus its quarter ``off % 4``
stored in a VMEM side buffer by one ``(1, 128)`` vector store. Decoded in VMEM exactly
(``_decode_fp8``): byte plane ``j`` of the record is q's features ``128 j ..`` (e4m3 upcast,
times the tile's power-of-two ue8m0 scale: exact in bf16 and f32), the rope quarter is selected
by lanes (a select over 4 static rolls) and its bf16 halves land on plane 3's lanes 64..127, so
one ``[block, 512]`` operand in q's feature order feeds both matmuls. The values equal
``reference.v4_cache.dequantize_v4_rows``'; the logits then equal the reference's on the
dequantized cache up to f32 summation order.

Traffic per decode row: the ``W`` window rows and the selected entries (packed: 1024 B each,
the minimum; fp8: 1024 B moved by the 2 DMAs against 640 B stored, 1.6x on those bytes), q
read once, out written once, ``4 k`` bytes of the row's list into SMEM, the tables once.
Versus the two-pass path (``two_pass``, ``fused=False``): q is not read twice, and no partial
outputs are written, read back and merged.

Precision: the matmul operands are in ``cdt``, bf16 for a bf16 q (f32 cache rows are rounded to
bf16 in VMEM; packed and fp8 rows are bf16-exact) and f32 for an f32 q; ``P`` is cast to ``cdt``
before ``P @ V`` (rounded for a bf16 q) while ``l`` sums the f32 ``P``; the output is written in
q's dtype. ``precision="bf16"`` (the official ``sparse_attn`` regime, ``reference.v4_attention``)
runs the kernel on ``q`` cast to bf16, so the operands are bf16 and ``P`` is rounded whatever the
cache, and casts the bf16 output back to q's dtype: the kernel itself has no precision switch.
``P`` is rounded relative to the running max of each gathered block (as the official kernel's
blocks of 64), the reference relative to each part's max: 1 bf16 ulp apart at most per ``P``.
``"f32"`` leaves the call as it was (with a bf16 q it is the same bf16 computation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, tpu
from pallas_kernels.v4_attention.blocks import DEFAULT_BLOCK
from reference import v4_attention as v4
from reference.core import batch
from reference.formats import model1 as v4_cache
from reference.formats import packed_cache, stacked
from reference.quant import fp8

WORDS = packed_cache.packed_words(v4.HEAD_DIM)  # 256
HALF = v4.HEAD_DIM // 2  # features per word half
LANES = v4_cache.LANES  # 128: an fp8 token's nope record, and one rope row of 4 tokens
FP8_ROW_BYTES = 2 * 4 * LANES  # what the 2 DMAs of an fp8 token move: 1024 B
FP8_STORED_BYTES = v4_cache.STORED_BYTES_PER_TOKEN  # 640 B of HBM per fp8 token
# row_info words per query row
_WFIRST, _WN, _WSLOT0, _CN, _CSLOT0, _CLIMIT, INFO_WORDS = range(7)
NEG = -1e30  # finite running-max start: a fully masked block adds exp(-inf) = 0, never NaN


def _kernel_cache(cache):
    """A stacked cache as the kernel reads it: packed u32, f32 or ``Fp8V4Cache`` as given;
    plain bf16 packed (a full copy per call: the documented slow path, as in
    ``pallas_kernels.mla``)."""
    if not isinstance(cache, v4_cache.Fp8V4Cache) and jnp.result_type(cache) == jnp.bfloat16:
        return packed_cache.pack_cache(cache)
    return cache


def _format(cache) -> str:
    """How the kernel reads a cache: ``"fp8 (Fp8V4Cache)"``, or its array dtype (``uint32``:
    packed bf16 words; ``float32``)."""
    if isinstance(cache, v4_cache.Fp8V4Cache):
        return "fp8 (Fp8V4Cache)"
    return f"{jnp.result_type(cache)} ({'packed bf16' if packed_cache.is_packed(cache) else 'f32'})"


def check_fused_args(q, window: v4.PagedKV, kv_lens, cu_q_lens, distribution,
                     compressed: v4.PagedKV | None, compressed_indices, attn_sink, *,
                     block: int, layer, precision: str = "f32", **statics):
    """Validate a fused call (``block`` a positive multiple of 8, ``reference.v4_attention``'s
    argument checks, both caches in one format) and return ``(window read, compressed read or
    None, window kernel cache, compressed kernel cache)`` (``_kernel_cache``; without a
    compressed cache a 1-page slice of the window's stands in, never read)."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8, got block={block!r}")
    w_read = stacked.resolve("window.cache", window.cache, layer)
    c_read = None if compressed is None else stacked.resolve("compressed.cache",
                                                            compressed.cache, layer)
    v4.check_v4_args(q, w_read.one, kv_lens, cu_q_lens, distribution, window, compressed,
                     c_read and c_read.one, compressed_indices, attn_sink, precision=precision,
                     **statics)
    w_cache = _kernel_cache(w_read.stacked)
    c_cache = (jax.tree_util.tree_map(lambda x: x[:, :1], w_cache) if c_read is None
               else _kernel_cache(c_read.stacked))
    w_fmt, c_fmt = _format(w_cache), _format(c_cache)
    if w_fmt != c_fmt:
        raise NotImplementedError(
            f"the fused V4 kernel reads both caches in one format; got window.cache {w_fmt} "
            f"and compressed.cache {c_fmt} (the reference, reference.v4_attention_ref, "
            f"serves mixed formats; store both caches fp8 or both packed bf16)")
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


def _fp8_scales(nope):
    """The 7 tile scales ``f32[rows, 1]`` of gathered fp8 records ``u32[rows, 128]``: byte 3
    of word ``64 + t`` as ``bitcast(byte << 23)`` (NaN for the ue8m0 NaN byte 0xFF)."""
    out = []
    for t in range(v4_cache.V4_TILES):
        byte = nope[:, v4_cache.SCALE_WORD0 + t:v4_cache.SCALE_WORD0 + t + 1] >> 24
        out.append(jnp.where(byte == 0xFF, jnp.nan, pltpu.bitcast(byte << 23, jnp.float32)))
    return out


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


def _decode_fp8(nope, rope, quarter):
    """Gathered fp8 tokens -> their values ``f32[rows, 512]`` in q's feature order, exactly
    ``reference.v4_cache.dequantize_v4_rows``' (e4m3 times a power of two is exact in bf16).
    Byte plane ``j`` of the record is features ``128 j .. 128 j + 127`` (plane 3: 384..447 on
    lanes 0..63), tile ``t`` = plane ``t // 2``, lanes ``64 (t % 2)`` up; the rope fills plane
    3's lanes 64..127 (``_fp8_rope``)."""
    scales = _fp8_scales(nope)
    lane = jax.lax.broadcasted_iota(jnp.int32, nope.shape, 1)
    chunks = []
    for j in range(4):
        codes = ((nope >> (8 * j)) & 0xFF).astype(jnp.uint8)
        vals = jax.lax.bitcast_convert_type(codes, fp8.FP8_DTYPE).astype(jnp.float32)
        if j < 3:
            chunks.append(vals * jnp.where(lane < 64, scales[2 * j], scales[2 * j + 1]))
        else:
            chunks.append(jnp.where(lane < 64, vals * scales[6], _fp8_rope(rope, quarter)))
    return jnp.concatenate(chunks, axis=1)


def _operands(bufs, b, fmt: str, live, cdt):
    """Gathered block ``b`` -> ``[(first q feature, operand cdt[block, width])]`` covering the
    512 features, rows past the live count selected to zero (a select: NaN cannot leak)."""
    if fmt == "fp8":
        nbuf, rbuf, qbuf = bufs
        x = _decode_fp8(nbuf[b], rbuf[b], qbuf[b][:, :1])
        return [(0, jnp.where(live, x, 0.0).astype(cdt))]
    low, high = _unpack(bufs[0][b], fmt == "packed")
    return [(0, jnp.where(live, low, 0.0).astype(cdt)),
            (HALF, jnp.where(live, high, 0.0).astype(cdt))]


def _walk(refs, row, lslot, b, cur, *, listed, block, w_page, c_page, w_pages, c_pages,
          layer, layer_ok):
    """Issue the DMAs of query row ``row``'s next ``block`` valid stream positions from
    ``cur`` into gather buffer ``b`` (densely; its list is in SMEM slot ``lslot``). Returns
    ``(cursor, rows issued)``; a row's stream is its ``w_n`` window tokens then ``c_n`` list
    positions (module docstring)."""
    info_ref, wtab_ref, ctab_ref, w_src, c_src, bufs, ent_smem, sems = refs
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
        for src, pid, here in ((w_src, w_pid, in_window), (c_src, c_pid, ~in_window)):
            @pl.when(ok & here)
            def _(src=src, pid=pid):
                _issue(src, bufs, sems, layer, pid, unit % psize, b, n)

        return pos + 1, n + ok.astype(jnp.int32)

    return jax.lax.while_loop(lambda c: (c[1] < block) & (c[0] < w_n + c_n), body,
                              (cur, jnp.int32(0)))


def _row_copy(src, buf, sems, part, layer, pid, row, b, n):
    """One whole cache row ``src[layer, pid, row]`` -> row ``n`` of gather buffer ``b`` of
    ``buf``, on semaphore ``sems[part, b]`` (whole rows: Mosaic refuses part-row slices)."""
    return pltpu.make_async_copy(src.at[layer, pid, pl.ds(row, 1)], buf.at[b, pl.ds(n, 1)],
                                 sems.at[part, b])


def _issue(src, bufs, sems, layer, pid, off, b, n):
    """Start the DMAs of the token at in-page row ``off`` of page ``pid``: packed / f32 one
    row; fp8 its nope record row and the rope row holding its quarter (row ``off // 4``), the
    quarter ``off % 4`` stored beside it in VMEM (one ``(1, 128)`` vector store)."""
    _row_copy(src[0], bufs[0], sems, 0, layer, pid, off, b, n).start()
    if len(src) == 2:
        quarters = v4_cache.ROPE_TOKENS_PER_ROW
        _row_copy(src[1], bufs[1], sems, 1, layer, pid, off // quarters, b, n).start()
        bufs[2][b, pl.ds(n, 1), :] = jnp.full((1, LANES), off % quarters, jnp.int32)


def _wait_rows(copy, n):
    """Wait for ``n`` row DMAs shaped like ``copy`` (one semaphore counts them all)."""
    def body(i, c):
        copy.wait()
        return c

    jax.lax.fori_loop(0, n, body, 0)


def _attend(q, ops, n, m, l_sum, acc_ref, *, sm_scale):
    """One online-softmax step over a gathered block, given as ``ops`` (``_operands``: q's
    feature offset, operand ``[block, width]``, rows past ``n`` already zero); their logits
    are ``-inf``. Returns ``(m, l)``."""
    nt = (((1,), (1,)), ((), ()))
    s = sum(jax.lax.dot_general(q[:, lo:lo + x.shape[1]], x, nt,
                                preferred_element_type=jnp.float32) for lo, x in ops)
    col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(col < n, s * sm_scale, -jnp.inf)
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


def _kernel(info_ref, wtab_ref, ctab_ref, layer_ref, q_ref, sink_ref, ent_hbm, *refs, fmt,
            listed, cdt, sm_scale, **walk_statics):
    """One grid step = one query row (module docstring). Refs: prefetch ``info`` (SMEM
    i32[T * 7]), ``wtab`` / ``ctab`` (SMEM page tables), ``layer`` (SMEM i32[1]); inputs ``q``
    block [1, H, 512], ``sink`` f32[H, 1] (``-inf``: none), ``ent`` (HBM i32[T, k]), then each
    cache's HBM parts (packed / f32: ``[L, P, ps, Wc]``; fp8: ``nope [L, P, ps, 128]``, ``rope
    [L, P, ceil(ps / 4), 128]``), window first; outputs ``out`` [1, H, 512], ``lse`` [1, H, 1];
    scratch: the gather buffers ``[2, block, Wc]`` (fp8: nope, rope and quarter buffers ``[2,
    block, 128]``), their DMA semaphores ``[part, buffer]``, the lists of 2 rows (SMEM i32[2,
    k]) and their semaphore, ``state`` (SMEM i32[4]: this row's cursor, rows in flight, their
    buffer, whether the next row's first block was issued), the f32 accumulator [H, 512].

    Pipeline: a row's block b+1 is issued before block b is attended; its last block issues the
    next row's first block (and loads that row's list), so the DMA round trip is hidden across
    blocks and rows alike (grid steps run in order: ``dimension_semantics`` arbitrary)."""
    nparts = 2 if fmt == "fp8" else 1
    w_src, c_src = refs[:nparts], refs[nparts:2 * nparts]
    out_ref, lse_ref = refs[2 * nparts:2 * nparts + 2]
    bufs = refs[2 * nparts + 2:2 * nparts + 2 + (3 if fmt == "fp8" else 1)]
    ent_smem, sems, esem, state, acc_ref = refs[2 * nparts + 2 + len(bufs):]
    t, num_rows = pl.program_id(0), pl.num_programs(0)
    layer, num_layers = layer_ref[0], walk_statics.pop("layers")
    walk_statics.update(listed=listed, layer=jnp.clip(layer, 0, num_layers - 1),
                        layer_ok=(layer >= 0) & (layer < num_layers))  # else: read nothing
    walk_refs = (info_ref, wtab_ref, ctab_ref, w_src, c_src, bufs, ent_smem, sems)

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
            return _walk(walk_refs, t, t % 2, 1 - b, cur, **walk_statics)

        def last():
            prefetch_next(1 - b)
            return cur, jnp.int32(0)

        cur2, n2 = jax.lax.cond(cur < total, more, last)
        for part in range(nparts):  # each token's DMAs: one whole 128k-word row per part
            _wait_rows(_row_copy(w_src[part], bufs[part], sems, part, 0, 0, 0, b, 0), n)
        live = jax.lax.broadcasted_iota(jnp.int32, (bufs[0].shape[1], 1), 0) < n
        m, l_sum = _attend(q_ref[0], _operands(bufs, b, fmt, live, cdt), n, m, l_sum, acc_ref,
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
                  min_row_bytes: int = 2 * v4.HEAD_DIM, fp8: bool = False) -> aot.Traffic:
    """Modelled HBM traffic of one fused call where every query row gathers ``gathered_rows``
    rows (window + selected entries) of ``row_bytes`` each (packed: 1024 B, one DMA; fp8:
    ``FP8_ROW_BYTES`` = 1024 B in 2 DMAs, the 512 B record and the 512 B rope row it shares
    with 3 tokens): those rows, q read once, out written once (plus its f32 LSE), the rows'
    lists (``meta_words``) and ``row_info`` into SMEM, the page tables once. The minimum moves
    each row once at ``min_row_bytes`` (512 bf16 features: 1024 B; fp8: the 640 B stored per
    token) plus q and out. VMEM: the gather blocks (fp8: nope, rope and quarter buffers), the
    f32 accumulator, q and out blocks double-buffered."""
    q_out = rows * heads * (2 * v4.HEAD_DIM * q_itemsize + 4)
    smem = 4 * (rows * (meta_words + INFO_WORDS) + table_words)
    moved = rows * gathered_rows * row_bytes + q_out + smem
    bytes_min = rows * gathered_rows * min_row_bytes + q_out
    flops = 2 * rows * heads * gathered_rows * 2 * v4.HEAD_DIM
    buf_bytes = 3 * 4 * LANES if fp8 else row_bytes
    vmem = 2 * block * buf_bytes + 4 * heads * v4.HEAD_DIM + 4 * heads * v4.HEAD_DIM * q_itemsize
    return aot.Traffic(int(moved), int(bytes_min), int(flops), int(vmem))


def _scratch(fmt: str, block: int, w_parts, heads: int, dim: int, k: int) -> list:
    """The kernel's scratch (``_kernel``'s docstring)."""
    if fmt == "fp8":
        bufs = [pltpu.VMEM((2, block, LANES), jnp.uint32), pltpu.VMEM((2, block, LANES),
                                                                      jnp.uint32),
                pltpu.VMEM((2, block, LANES), jnp.int32)]  # nope, rope rows, quarters
    else:
        bufs = [pltpu.VMEM((2, block, w_parts[0].shape[-1]), w_parts[0].dtype)]
    return bufs + [pltpu.SMEM((2, k), jnp.int32),  # the compressed lists of 2 rows
                   pltpu.SemaphoreType.DMA((2, 2)), pltpu.SemaphoreType.DMA((1,)),
                   pltpu.SMEM((4,), jnp.int32),  # the walk's state across rows
                   pltpu.VMEM((heads, dim), jnp.float32)]  # accumulator


def _parts(cache) -> tuple:
    """A stacked kernel cache's HBM arrays: ``(nope, rope)`` of an ``Fp8V4Cache``, else the
    array alone."""
    if isinstance(cache, v4_cache.Fp8V4Cache):
        return cache.nope, cache.rope
    return (cache,)


def fused_call(q, w_cache, c_cache, layer, entries, info, w_table, c_table, attn_sink, *,
               gathered_rows: int, block: int, sm_scale: float, vmem_limit_bytes: int | None,
               interpret):
    """The ``pallas_call`` (see ``_kernel``): caches stacked ``[L, P, ps, Wc]`` (packed u32 or
    f32) or stacked ``Fp8V4Cache`` (parts ``[L, P, ps | ceil(ps / 4), 128]``), both caches in
    one format, read at ``layer`` (i32). Returns (``q.dtype[T, H, 512]``, ``f32[T, H, 1]``)."""
    num_rows, heads, dim = q.shape
    listed = entries is not None
    ent = entries.astype(jnp.int32) if listed else jnp.zeros((num_rows, 1), jnp.int32)
    k = ent.shape[1]
    fmt = ("fp8" if isinstance(w_cache, v4_cache.Fp8V4Cache)
           else "packed" if packed_cache.is_packed(w_cache) else "plain")
    w_parts, c_parts = _parts(w_cache), _parts(c_cache)
    kernel = functools.partial(
        _kernel, fmt=fmt, listed=listed, block=block, w_page=w_parts[0].shape[2],
        c_page=c_parts[0].shape[2], w_pages=w_parts[0].shape[1], c_pages=c_parts[0].shape[1],
        layers=w_parts[0].shape[0], sm_scale=float(sm_scale),
        cdt=jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16)
    sink = (jnp.full((heads, 1), -jnp.inf, jnp.float32) if attn_sink is None
            else attn_sink.astype(jnp.float32).reshape(heads, 1))
    row_block = lambda t, *_: (t, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(num_rows,),
        in_specs=[pl.BlockSpec((1, heads, dim), row_block),
                  pl.BlockSpec((heads, 1), lambda t, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)]
        + [pl.BlockSpec(memory_space=pl.ANY)] * (len(w_parts) + len(c_parts)),
        out_specs=[pl.BlockSpec((1, heads, dim), row_block),
                   pl.BlockSpec((1, heads, 1), row_block)],
        scratch_shapes=_scratch(fmt, block, w_parts, heads, dim, k))
    fp8_fmt = fmt == "fp8"
    t = fused_traffic(rows=num_rows, heads=heads, gathered_rows=gathered_rows, meta_words=k,
                      table_words=w_table.shape[0] + c_table.shape[0], block=block,
                      q_itemsize=q.dtype.itemsize,
                      row_bytes=FP8_ROW_BYTES if fp8_fmt else 4 * w_parts[0].shape[-1],
                      min_row_bytes=FP8_STORED_BYTES if fp8_fmt else 2 * v4.HEAD_DIM,
                      fp8=fp8_fmt)
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
                tpu.in_hbm(q), sink, ent, *map(tpu.in_hbm, w_parts + c_parts))


@v4.checks_layers
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
    "compressed_pages_per_seq", "return_lse", "block", "vmem_limit_bytes", "interpret",
    "precision"))
def v4_attention_fused(q: jax.Array, window: v4.PagedKV, kv_lens: jax.Array,
                       cu_q_lens: jax.Array, distribution: jax.Array, *, sm_scale: float,
                       window_size: int, compress_ratio: int, window_pages_per_seq: int,
                       compressed_pages_per_seq: int = 0,
                       compressed: v4.PagedKV | None = None,
                       compressed_indices: jax.Array | None = None,
                       attn_sink: jax.Array | None = None, return_lse: bool = False,
                       block: int = DEFAULT_BLOCK, vmem_limit_bytes: int | None = None,
                       interpret=False, layer=None, precision: str = "f32"):
    """``reference.v4_attention_ref``'s semantics in one kernel (module docstring).

    Args as ``pallas_kernels.v4_attention.v4_attention`` (both caches packed u32, or both f32;
    a plain bf16 cache is packed per call, a full copy: the slow path), plus ``block``: cache
    rows per gathered block (a positive multiple of 8; ``blocks.py`` holds the table), and
    ``precision`` (``"f32"`` | ``"bf16"``: module docstring, "Precision").
    """
    statics = dict(sm_scale=sm_scale, window_size=window_size, compress_ratio=compress_ratio,
                   window_pages_per_seq=window_pages_per_seq,
                   compressed_pages_per_seq=compressed_pages_per_seq)
    w_read, c_read, w_cache, c_cache = check_fused_args(
        q, window, kv_lens, cu_q_lens, distribution, compressed, compressed_indices, attn_sink,
        block=block, layer=layer, precision=precision, **statics)
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
    q_in = q.astype(jnp.bfloat16) if precision == "bf16" else q  # f32 q: rounded to bf16
    out, lse = fused_call(q_in, w_cache, c_cache, w_read.layer, compressed_indices, info,
                          window.page_indices, c_table, attn_sink,
                          gathered_rows=window_size + selected, block=block, sm_scale=sm_scale,
                          vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    out, lse = (out.astype(q.dtype) if precision == "bf16" else out), lse[..., 0]
    return (out, lse) if return_lse else out

