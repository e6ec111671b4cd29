"""The sparse absorbed MLA gather kernel on TPU (Pallas), shared by token and page sparse MLA:
each query row attends the cache rows (token mode) or whole pages (page mode) its top-k selects.

Module map: ``blocks`` (block table, VMEM estimate), ``common`` (``row_info`` and the entries'
shared tail), ``token`` / ``page`` (the entries), ``layers`` (every layer of a step in one
call), ``traffic`` (traffic model),
``compile_cases`` (AOT gate shapes). This file: the static validator, the kernel body and its
``pallas_call``. Page mode specifics are in ``page``'s docstring.

Math (``reference.sparse_mla.sparse_mla_ref`` is the definition)::

    logits[t, h, j] = sm_scale * q[t, h, :] . c[j, :]        j in topk_indices[t] (valid only)
    out[t, h, :]    = softmax_j(logits) @ c[j, :v_dim]        f32 online softmax over blocks

Shapes: ``q: f32|bf16[T, H, D]`` (D a multiple of 128, e.g. 576 padded to 640), cache
``f32[P, page_size, D]``, or ``u32[P, page_size, packed_words(D)]`` (the packed bf16 cache of
``reference.packed_cache``), or ``bf16[P, page_size, D]`` (slow path, below);
``topk_indices: i32[T, k]`` sequence-local token offsets. Out ``q.dtype[T, H, v_dim]``, optional
LSE ``f32[T, H]`` (natural log, ``-inf`` for an empty row).

Gather design (why): Mosaic DMAs move whole 32-bit words. An f32 row is its own words, so one
DMA per selected token row compiles; a plain bf16 array packs two *rows* per word ((16, 128)
tiles), so a single bf16 row cannot be DMA'd (measured: it fails to compile on v5e, v6e and
tpu7x). The kernel therefore gathers 32-bit rows: f32 rows as they are, and bf16 rows from the
packed cache ``u32[..., W]``, ``W = packed_words(D)`` (640 -> 384): word j holds features j and
j + W of one token (``reference.packed_cache`` gives the measured reasons for W and the
pairing). In VMEM ``bitcast(w << 16, f32)`` / ``bitcast(w & 0xFFFF0000, f32)`` give features
``[0, W)`` / ``[W, 2W)`` exactly, so ``q . c = q[:, :W] . low + q[:, W:D] . high[:, :D-W]`` and
the output columns are ``[0, W)`` from ``low`` and ``[W, v_dim)`` from ``high``: every slice
starts on a 128-lane boundary, q needs no split copy and out no interleave. A plain bf16 cache
is packed per call (a full copy of the cache: a documented slow path for tests and notebooks;
serving stores the cache packed).

fp8 latent cache (``reference.fp8_cache.Fp8LatentCache``, 256 u32 words per token: why in that
module): rows are gathered exactly like packed rows (one DMA per token, 1024 B), then decoded in
VMEM: byte plane ``j`` of words ``[0, 128)`` is nope tile ``j`` (bitcast to e4m3, upcast, times
its power-of-two scale from word ``160 + j``: exact in bf16), words ``[128, 160)`` the rope
halves, the high halves rotated 32 lanes up in VMEM so the 64 rope values sit on lanes 0..63
as in q's features ``[512, 576)``: q is read as given (576 or 640 wide, no XLA relayout) and
all five segments start lane aligned.

Pipeline: the grid walks query rows in order; inside a row a loop walks blocks of
``tokens_per_block`` gathered rows. The row's raw top-k entries (``i32[k]``, as the caller gave
them) are DMA'd HBM -> SMEM one row ahead; the page table (``page_indices``) and per-row facts
(``row_info``: limit, first page slot, count and end of the entries that can be valid) are
scalar-prefetched into SMEM. Filling a block is a walk on the scalar core: from a cursor, each
entry is checked (``0 <= e < min(kv_len, capacity)``, page slot inside the table, page id in ``[0,
P)``: ``reference.batch.lookup_page``, the rule every op uses), and each valid one is DMA'd into
the next free row of the block, so a block's live rows are always its first ``n``; invalid entries
cost a scalar check and no DMA. The gathers of block b+1 (possibly the next row's first block) are
issued before block b is computed (double buffer). Rows of a block past ``n`` are zeroed in VMEM (a
select, never a multiply, so a NaN there cannot leak) and their logits are -inf. A row with no
valid entry computes one fully masked block (no DMA) and writes zeros, LSE -inf.

Index preparation in XLA is ``row_info`` only: elementwise over the entries plus two row
reductions and per-row metadata. There is no per-entry page-table gather and no compaction
scatter (XLA's TPU cost model priced that preparation at ~4.5 KB per entry, 3x the kernel's own
gathered bytes at 64 x 8192, H=128, k=2048: issue 13).

Traffic per query row (full k): k rows x 4W bytes gathered (1536 B at D=640; the minimum
counts 2D = 1280 B, so 1.2x: Mosaic moves a packed row whole, see ``reference.packed_cache``),
q read and out written once, 4 bytes per entry into SMEM and 4 bytes per entry of XLA
preparation, and the page table once per call. At 64 decode rows x 8192, k=2048, D=640: 1.20x
the minimum (H=128) and 1.22x (H=16) (``mla_traffic``, asserted in
``tests/test_compile_mla.py``).

Not measured (no TPU here): one descriptor per token row means k DMA issues per query row on
the scalar core; the issue rate, not HBM bandwidth, may bound decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import pool as mla_pool
from pallas_kernels.mla.blocks import _COUNT, _END, _LIMIT, _SLOT0, ROW_INFO_WORDS
from pallas_kernels.mla.traffic import mla_traffic
from reference.core import batch
from reference.formats import fp8_cache, packed_cache, stacked
from reference.formats.cache_format import CacheFormat, check_packed_width
from reference.mla.args import check_mla_args
from reference.quant import fp8

# ----------------------------------------------------------------------------- static checks


def check_kernel_args(q, cache_kv, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens,
                      distribution, *, sm_scale, pages_per_seq, v_dim,
                      selected_name) -> tuple[CacheFormat, batch.RaggedBatch]:
    """The reference's checks (a packed cache is checked as the bf16 cache it holds) plus the
    kernel's: D a multiple of 128 (the fp8 latent cache takes D = 576 or 640: the kernel reads
    that query as given, ``segments``). Returns the cache's ``CacheFormat`` and the batch."""
    if isinstance(cache_kv, mla_pool.TokenPackedCache):  # checked as the [P, ps, D] it holds
        cache_kv = cache_kv.logical()
    if isinstance(cache_kv, fp8_cache.Fp8LatentCache):  # q: 576 or 640 (reference checks)
        check_mla_args(q, cache_kv, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens,
                       distribution, sm_scale=sm_scale, pages_per_seq=pages_per_seq,
                       v_dim=v_dim, selected_name=selected_name)
        return CacheFormat.FP8, batch.RaggedBatch.of(cache_kv, kv_lens, page_indices,
                                                     cu_q_lens, cu_kv_lens, distribution,
                                                     pages_per_seq=pages_per_seq)
    plain = cache_kv
    fmt = CacheFormat.of(cache_kv, "cache_kv")  # refuses an Fp8IndexCache by name
    if np.ndim(cache_kv) != 3:
        raise ValueError(f"cache_kv must have rank 3, got shape {tuple(np.shape(cache_kv))}")
    dim = np.shape(q)[-1]
    if fmt.packed:
        check_packed_width("cache_kv", cache_kv, dim)
        plain = jax.ShapeDtypeStruct((*np.shape(cache_kv)[:2], dim), fmt.value_dtype)
    check_mla_args(q, plain, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens,
                   distribution, sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                   selected_name=selected_name)
    if dim % tpu.LANES:
        raise ValueError(f"the latent dim q.shape[2] must be a multiple of {tpu.LANES} "
                         f"(pad 576 -> 640 with zeros), got {dim}")
    return fmt, batch.RaggedBatch.of(cache_kv, kv_lens, page_indices, cu_q_lens, cu_kv_lens,
                                     distribution, pages_per_seq=pages_per_seq)


# ----------------------------------------------------------------------------- kernel body


def _dot_nt(a, b, f32: bool):
    """a[M, K] . b[N, K]^T -> f32[M, N]."""
    prec = jax.lax.Precision.HIGHEST if f32 else None
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def _dot(a, b, f32: bool):
    """a[M, K] . b[K, N] -> f32[M, N]."""
    prec = jax.lax.Precision.HIGHEST if f32 else None
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def segments(dim: int, v_dim: int, fmt: CacheFormat, words: int):
    """Static plan of the feature segments: ``(part, q_lo, q_hi, v_lo, v_hi)`` per segment.

    ``part`` indexes the unpacked operands (``_unpack``): plain: the row itself; packed: 0 = low
    halves = features ``[0, W)``, 1 = high halves = features ``[W, 2W)``; fp8: 0..3 = the nope
    tiles (features ``[128 j, 128 j + 128)``), 4 = the 64 rope values on lanes 0..63 (q read
    as given: its features ``[512, dim)``, dim 576 or 640). ``q_lo:q_hi`` are the query (and
    logit) features of the segment, ``v_lo:v_hi`` its output columns (empty: no accumulator).
    All starts are multiples of 128, so every slice is lane aligned.
    """
    if fmt.fp8:
        tile = fp8.LATENT_TILE
        segs = [(j, j * tile, (j + 1) * tile, min(j * tile, v_dim), min((j + 1) * tile, v_dim))
                for j in range(fp8.LATENT_TILES)]
        return tuple(segs) + ((fp8.LATENT_TILES, fp8.LATENT_NOPE, dim, v_dim, v_dim),)
    if not fmt.packed:
        return ((0, 0, dim, 0, v_dim),)
    segs = [(0, 0, min(dim, words), 0, min(v_dim, words))]
    if dim > words:
        segs.append((1, words, dim, words, max(v_dim, words)))  # empty v range: no acc
    return tuple(segs)


def _unpack_fp8(w, cdt):
    """Gathered fp8 latent words ``u32[rows, 256]`` -> the five operands of ``segments``: each
    nope tile decoded (byte plane -> e4m3 -> f32, times its scale; exact in bf16), then the
    rope: word ``j < 32`` holds rope values ``j`` (low half) and ``j + 32`` (high half); the
    high halves are rotated 32 lanes up so rope value ``i`` sits on lane ``i`` as in the query
    (lanes past 64 are scales and padding: selected to zero, never multiplied). Done here, per
    gathered block, so the query needs no relayout in XLA (issue: 0.45x the kernel's bytes)."""
    nope, side = w[:, :fp8_cache.NOPE_WORDS], w[:, fp8_cache.ROPE_WORD0:]
    parts = []
    for j in range(fp8.LATENT_TILES):
        codes = ((nope >> (8 * j)) & 0xFF).astype(jnp.uint8)
        vals = jax.lax.bitcast_convert_type(codes, fp8.FP8_DTYPE).astype(jnp.float32)
        at = fp8_cache.SCALE_WORD0 - fp8_cache.ROPE_WORD0 + j
        scale = jax.lax.bitcast_convert_type(side[:, at:at + 1], jnp.float32)
        parts.append((vals * scale).astype(cdt))
    lane = jax.lax.broadcasted_iota(jnp.int32, side.shape, 1)
    low, high = packed_cache.unpack_words(side)
    pairs = fp8_cache.ROPE_PAIRS
    high = pltpu.roll(high, pairs, 1)  # lane i + 32 <- high half of word i
    rope = jnp.where(lane < pairs, low, jnp.where(lane < 2 * pairs, high, 0.0))
    return parts + [rope.astype(cdt)]


def _unpack(w, fmt: CacheFormat, cdt):
    """Gathered rows -> operand list (plain: the rows; packed: low and high halves; fp8: the
    five ``_unpack_fp8`` operands)."""
    if fmt.fp8:
        return _unpack_fp8(w, cdt)
    if not fmt.packed:
        return [w.astype(cdt)]
    return [x.astype(cdt) for x in packed_cache.unpack_words(w)]


def _masks(mode, live, lim_ref, buf, *, rows, unit, units):
    """Row mask bool[rows, 1] and lane mask bool[1, rows] of one block's live cache rows.

    token: the first ``live`` rows (the walk packs a block's gathered rows densely). page: rows
    ``[i*unit, i*unit + lim_i)`` of the first ``live`` pages, ``lim_i`` (the causal / kv_len
    limit inside page i) written to ``lim_ref[buf, i]`` when its DMA was issued.
    """
    r_iota = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    l_iota = jax.lax.broadcasted_iota(jnp.int32, (1, rows), 1)
    if mode == "token":
        return r_iota < live, l_iota < live
    row_ok = jnp.zeros((rows, 1), jnp.bool_)
    lane_ok = jnp.zeros((1, rows), jnp.bool_)
    for i in range(units):
        lim = jnp.where(i < live, lim_ref[buf, i], 0)
        lo_r, hi_r = i * unit, i * unit + lim
        row_ok |= (r_iota >= lo_r) & (r_iota < hi_r)
        lane_ok |= (l_iota >= lo_r) & (l_iota < hi_r)
    return row_ok, lane_ok


def _entry_source(mode, e, info, table_ref, *, page_size, pages_per_seq, num_pages):
    """Where entry ``e`` of a row lives, on the scalar core: ``(ok, page id, in-page row,
    limit)``. ``info = (slot0, limit)`` of the row. token: ``e`` is a token offset, valid if
    ``0 <= e < limit`` (``limit = min(kv_len, capacity)``); page: ``e`` is a page number,
    valid if some token ``e * page_size + r < limit`` (``limit = min(kv_len, abs_pos + 1)``).
    Both then need the page slot inside ``page_indices`` and the page id in ``[0, P)``."""
    slot0, limit = info
    if mode == "token":
        ok = (e >= 0) & (e < limit)
        page, inner, lim = e // page_size, e % page_size, 0
    else:
        # e >= pages_per_seq leaves no token below limit <= capacity; the clip avoids overflow
        lim = jnp.clip(limit - jnp.clip(e, 0, pages_per_seq) * page_size, 0, page_size)
        ok = (e >= 0) & (lim > 0)
        page, inner = e, 0
    pid, found = batch.lookup_page(table_ref, slot0 + jnp.where(ok, page, 0), num_pages)
    return ok & found, jnp.clip(pid, 0, num_pages - 1), inner, lim


def _split_refs(refs, has_sink: bool, return_lse: bool):
    """The kernel's refs after ``cache``: ``(sink or None, out, lse or None, the 8 scratch
    refs)``; the sink input and the LSE output exist only when asked for."""
    sink_ref, refs = (refs[0], refs[1:]) if has_sink else (None, refs)
    lse_ref = refs[1] if return_lse else None
    return sink_ref, refs[0], lse_ref, refs[-8:]


def _kernel(info_ref, table_ref, layer_ref, q_ref, meta_hbm, cache_hbm, *refs, mode,
            fmt, f32, num_rows, page_size, pages_per_seq, num_pages, num_layers, units,
            sm_scale, segs, return_lse, rows_per_layer, has_sink=False):
    """One grid step = one query row; see the module docstring for the pipeline.

    Refs: prefetch ``info`` (SMEM i32[T * 4]: per row valid-entry count, walk end, first page
    slot, limit), ``table`` (SMEM i32[N], the page table) and ``layer`` (SMEM i32[1]: the layer
    of the stacked cache read in place; outside ``[0, L)`` nothing is read,
    ``reference.stacked``); inputs ``q`` block [1, H, D], ``meta`` (HBM i32[T, k], the row's
    raw entries), ``cache`` (HBM ``[L, P, page_size, W]``, or a token-packed pool ``[L, P,
    page_size / k, k, D]``, ``pool``), with ``has_sink`` the row's sink
    logits (VMEM block f32[H, 1] of ``[Ls, H, 1]``); outputs ``out`` block [H / G, G, v_dim]
    (``out_groups``) and ``lse`` [1, H, 1]; scratch: gather buffers, raw rows of 2 query rows,
    DMA semaphores, rows filled per buffer, in-page limits (page), walk cursor, parity.
    """
    sink_ref, out_ref, lse_ref, scratch = _split_refs(refs, has_sink, return_lse)
    gbuf, sbuf, gsem, ssem, fill_ref, lim_ref, cur_ref, parity = scratch
    unit = 1 if mode == "token" else page_size
    rows = units * unit
    cdt = jnp.float32 if f32 else jnp.bfloat16
    t = pl.program_id(0)

    def meta_copy(row):
        b = row % 2
        return pltpu.make_async_copy(meta_hbm.at[pl.ds(row, 1)], sbuf.at[pl.ds(b, 1)],
                                     ssem.at[b])

    def row_layer(row):
        """The stacked cache's layer query row ``row`` reads: the prefetched layer, plus
        ``row // rows_per_layer`` when one call serves several layers' rows (every row of a
        one-layer call reads the prefetched layer); ``(layer clipped, inside the stack?)``."""
        lay = layer_ref[0] + row // rows_per_layer
        return jnp.clip(lay, 0, num_layers - 1), stacked.layer_ok(lay, num_layers)

    def unit_copy(buf, i, pid, inner, layer=0):  # whole rows: Mosaic refuses part-row slices
        if mode == "token":
            return pltpu.make_async_copy(cache_hbm.at[layer, pid, pl.ds(inner, 1)],
                                         gbuf.at[buf, pl.ds(i, 1)], gsem.at[buf])
        return pltpu.make_async_copy(cache_hbm.at[layer, pid], gbuf.at[buf, i], gsem.at[buf])

    def issue(row, buf, first):
        """Walk the row's raw entries from the cursor, DMA the next ``units`` valid ones into
        buffer ``buf`` (densely), stop at the walk end; record how many were issued."""
        at = row * ROW_INFO_WORDS
        info = (info_ref[at + _SLOT0], info_ref[at + _LIMIT])
        end = info_ref[at + _END]
        layer, layer_ok = row_layer(row)

        def body(c):
            cur, n = c
            ok, pid, inner, lim = _entry_source(
                mode, sbuf[row % 2, cur], info, table_ref, page_size=page_size,
                pages_per_seq=pages_per_seq, num_pages=num_pages)
            ok &= layer_ok

            @pl.when(ok)
            def _():
                unit_copy(buf, n, pid, inner, layer).start()
                if mode == "page":
                    lim_ref[buf, n] = lim

            return cur + 1, n + ok.astype(jnp.int32)

        start = 0 if first else cur_ref[0]
        cur, n = jax.lax.while_loop(lambda c: (c[1] < units) & (c[0] < end), body,
                                    (jnp.int32(start), jnp.int32(0)))
        cur_ref[0] = cur
        fill_ref[buf] = n

    def wait(buf):
        def body(i, c):
            unit_copy(buf, 0, 0, 0).wait()  # same byte count as each issued copy
            return c
        jax.lax.fori_loop(0, fill_ref[buf], body, 0)

    @pl.when(t == 0)
    def _():
        meta_copy(0).start()
        meta_copy(0).wait()
        issue(0, 0, True)
        parity[0] = 0

    @pl.when(t + 1 < num_rows)
    def _():
        meta_copy(t + 1).start()

    q = q_ref[0].astype(cdt)  # [H, D]
    qs = [q[:, lo:hi] for _, lo, hi, _, _ in segs]
    vsegs = [(i, vlo, vhi) for i, _, _, vlo, vhi in segs if vhi > vlo]
    heads = q.shape[0]
    num_blocks = jnp.maximum((info_ref[t * ROW_INFO_WORDS + _COUNT] + units - 1) // units, 1)
    base = parity[0]

    def block(j, carry):
        buf = (base + j) % 2

        @pl.when(j + 1 < num_blocks)
        def _():
            issue(t, 1 - buf, False)

        @pl.when((j + 1 == num_blocks) & (t + 1 < num_rows))
        def _():
            meta_copy(t + 1).wait()
            issue(t + 1, 1 - buf, True)

        wait(buf)
        row_ok, lane_ok = _masks(mode, fill_ref[buf], lim_ref, buf, rows=rows, unit=unit,
                                 units=units)
        w = gbuf[buf].reshape(rows, gbuf.shape[-1])
        w = jnp.where(row_ok, w, jnp.zeros_like(w))  # select: stale/NaN rows become 0
        return _softmax_step(carry, _unpack(w, fmt, cdt), lane_ok, qs, segs, vsegs,
                             f32=f32, cdt=cdt, sm_scale=sm_scale)

    init = (jnp.full((heads, 1), -jnp.inf, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
            tuple(jnp.zeros((heads, vhi - vlo), jnp.float32) for _, vlo, vhi in vsegs))
    m, l_sum, accs = jax.lax.fori_loop(0, num_blocks, block, init)
    parity[0] = (base + num_blocks) % 2
    _write_out(out_ref, lse_ref, m, l_sum, accs, vsegs,
               sink=None if sink_ref is None else sink_ref[...])


def _softmax_step(carry, parts, lane_ok, qs, segs, vsegs, *, f32, cdt, sm_scale):
    """One online-softmax update over a gathered block: ``parts`` the block's rows (unpacked,
    zeros where not live), ``lane_ok bool[H, rows]`` the live logits. ``carry = (m f32[H, 1],
    l f32[H, 1], accs)`` with one f32 accumulator per value segment."""
    m_prev, l_prev, accs = carry
    s = sum(_dot_nt(qp, parts[i][:, :hi - lo], f32)
            for qp, (i, lo, hi, _, _) in zip(qs, segs, strict=True)) * sm_scale
    s = jnp.where(lane_ok, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pc = p.astype(cdt)
    accs = tuple(alpha * a + _dot(pc, parts[i][:, :vhi - vlo], f32)
                 for a, (i, vlo, vhi) in zip(accs, vsegs, strict=True))
    return m_new, l_new, accs


def _write_out(out_ref, lse_ref, m, l_sum, accs, vsegs, sink=None):
    """Normalise and store one row: zeros and LSE ``-inf`` for a row with no live entry.

    ``sink f32[H, 1]`` (optional, ``reference.sinks``): the denominator becomes ``l +
    exp(sink - m)`` (``m`` the running max, finite wherever ``l > 0``): ``-inf`` adds 0, a
    huge sink makes it ``inf`` and the row 0 (no NaN). The LSE stays ``m + log(l)``."""
    den = l_sum
    if sink is not None:
        m_safe = jnp.where(l_sum > 0, m, 0.0)
        den = l_sum + jnp.where(l_sum > 0, jnp.exp(sink - m_safe), 0.0)
    inv = jnp.where(l_sum > 0, 1.0 / jnp.where(l_sum > 0, den, 1.0), 0.0)
    for a, (_, vlo, vhi) in zip(accs, vsegs, strict=True):
        _store_heads(out_ref, vlo, vhi, a * inv)
    if lse_ref is not None:
        lse_ref[0] = jnp.where(l_sum > 0, m + jnp.log(jnp.where(l_sum > 0, l_sum, 1.0)),
                               -jnp.inf)


def _store_heads(out_ref, vlo: int, vhi: int, x):
    """Store one row's ``x f32[H, vhi - vlo]`` into columns ``[vlo, vhi)`` of the output block
    ``[H / G, G, v_dim]`` (``out_groups``): head ``h`` at ``[h // G, h % G]``, each group of
    ``G`` heads a sublane-aligned f32 slice cast on its own."""
    group = out_ref.shape[1]
    for g in range(out_ref.shape[0]):
        out_ref[g, :, vlo:vhi] = x[g * group:(g + 1) * group].astype(out_ref.dtype)


# ----------------------------------------------------------------------------- pallas_call


def out_groups(heads: int) -> int:
    """Heads per group ``G`` of the kernel's output ``[T * H / G, G, v_dim]`` (a reshape of
    ``[T, H, v_dim]``): 8 when ``H`` is a multiple of 8, else ``H``. Why: XLA tiles a 16-bit
    array's two minor dims in (16, 128) or (8, 128) tiles, and on tpu7x it may pick (16, 128)
    for the kernel's ``[T, H, v_dim]`` output while the program's result stays (8, 128): a
    relayout copy of the whole output (seen in the fp8 ``dsa_step``: 0.2x its kernels' bytes).
    With 8 as the second-minor dim only the (8, 128) tiling fits, which is byte for byte the
    (8, 128) layout of ``[T, H, v_dim]``, so the reshape back is free on every chip."""
    return 8 if heads % 8 == 0 else heads


def block_shape(mode, *, heads, dim, v_dim, page_size, units, meta_len, q_dtype, fmt):
    """The static sizes the kernel allocates (for ``mla_blocks.vmem_bytes``); ``fmt`` a
    ``CacheFormat`` (or its short name)."""
    fmt = CacheFormat.named(fmt)
    compute = jnp.promote_types(jnp.dtype(q_dtype), fmt.value_dtype)
    return mla_blocks.MlaBlockShape(
        heads=heads, q_words=dim, num_q_parts=1, q_itemsize=jnp.dtype(compute).itemsize,
        block_rows=units * (1 if mode == "token" else page_size),
        cache_words=fmt.row_words(dim), cache_itemsize=fmt.storage_dtype.itemsize,
        out_cols=v_dim, meta_words=meta_len,
        unpacked_parts=4 if fmt.fp8 else 2 if fmt.packed else 1)


def _at_layer(n: int):
    """Index map of the query block ``[None, 1, H, D]`` of a stacked ``q [n, T, H, D]``: the
    prefetched layer (clipped into ``[0, n)``), query row ``t``."""
    def index(t, _info, _table, layer_ref):
        return jnp.clip(layer_ref[0], 0, n - 1), t, 0, 0
    return index


def _sink_row(n: int, rows_per_layer: int):
    """Index map of the sink block ``[None, H, 1]`` of ``[n, H, 1]``: row ``t``'s layer of the
    call (``t // rows_per_layer``, clipped into ``[0, n)``; 0 for a shared sink)."""
    def index(t, *_):
        return (0 if n == 1 else jnp.minimum(t // rows_per_layer, n - 1)), 0, 0
    return index


def gather_attend(q, cache, layer, entries, info, table, *, mode, fmt, units, pages_per_seq,
                  sm_scale, v_dim, return_lse, vmem_limit_bytes, interpret,
                  rows_per_layer=None, sink=None):
    """Run the kernel. ``q: [T, H, D]``, or ``[L, T, H, D]`` read in place at ``layer`` (f32 or
    bf16: the compute dtype); ``cache``: the stacked ``[L, P, page_size, W]`` (f32 / bf16 rows,
    or packed u32 words; page mode also a token-packed pool ``[L, P, page_size / k, k, D]``,
    ``pool``) read in place at ``layer`` (i32 scalar, scalar-prefetched);
    ``entries: i32[T, k]`` the rows' raw top-k entries (token offsets, or page numbers in page
    mode); ``info: i32[T, 4]`` from ``row_info``; ``table: i32[N]`` the page table
    (``page_indices``) as it is. q and the cache are pinned to HBM (``tpu.in_hbm``).
    ``rows_per_layer``: one call for several layers (``layers.sparse_mla_layers``): the rows
    are ``layers x rows_per_layer`` (layer-major) and row ``t`` reads layer ``layer +
    t // rows_per_layer``; ``None``: every row reads ``layer``. ``sink``: optional
    ``f32[Ls, H]`` attention-sink logits applied in the kernel's finalize (``_write_out``;
    ``Ls = 1``: every row's, else row ``t`` takes row ``t // rows_per_layer``); ``None`` adds
    no operand (exactly the kernel without sinks).

    Returns ``q.dtype[T, H, v_dim]`` and ``f32[T, H, 1]`` (or None).
    """
    q_stack = q if q.ndim == 4 else q[None]  # a reshape: the kernel reads layer 0 or `layer`
    _, num_rows, heads, dim = q_stack.shape
    num_layers, num_pages, *unit, words = cache.shape  # unit: (ps,) or (ps / k, k) (mla_pool)
    page_size = int(np.prod(unit))
    if len(unit) > 1 and mode == "token":
        mla_pool.refuse_token_rows(f"{mode}_sparse_mla", mla_pool.TokenPackedCache(cache))
    k = entries.shape[1]
    shape = block_shape(mode, heads=heads, dim=dim, v_dim=v_dim, page_size=page_size,
                        units=units, meta_len=k, q_dtype=q.dtype, fmt=fmt)
    kernel = functools.partial(
        _kernel, mode=mode, fmt=fmt, f32=q.dtype == jnp.float32, num_rows=num_rows,
        page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages,
        num_layers=num_layers, units=units,
        sm_scale=float(sm_scale), segs=segments(dim, v_dim, fmt, words),
        return_lse=return_lse, rows_per_layer=rows_per_layer or num_rows,
        has_sink=sink is not None)
    gbuf = (2, units, words) if mode == "token" else (2, units, *unit, words)
    group = out_groups(heads)
    out_shape = [jax.ShapeDtypeStruct((num_rows * heads // group, group, v_dim), q.dtype)]
    out_specs = [pl.BlockSpec((heads // group, group, v_dim), lambda t, *_: (t, 0, 0))]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, heads, 1), jnp.float32))
        out_specs.append(pl.BlockSpec((1, heads, 1), lambda t, *_: (t, 0, 0)))
    in_specs = [pl.BlockSpec((None, 1, heads, dim), _at_layer(q_stack.shape[0])),
                pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    sink_ops = []
    if sink is not None:  # [Ls, H, 1]: heads on sublanes, as the row's m and l
        sink_ops = [sink.astype(jnp.float32).reshape(-1, heads, 1)]
        in_specs.append(pl.BlockSpec((None, heads, 1),
                                     _sink_row(sink_ops[0].shape[0], rows_per_layer or num_rows)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(num_rows,),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM(gbuf, cache.dtype),  # gathered rows, double buffer
                        pltpu.SMEM((2, k), jnp.int32),  # raw entries of 2 query rows
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SMEM((2,), jnp.int32),  # units issued into each buffer
                        pltpu.SMEM((2, units), jnp.int32),  # page mode: in-page limits
                        pltpu.SMEM((1,), jnp.int32),  # walk cursor in the current row
                        pltpu.SMEM((1,), jnp.int32)])  # gather buffer parity across rows
    traffic = mla_traffic(rows=num_rows, heads=heads, dim=dim, v_dim=v_dim,
                          selected_rows=k * (1 if mode == "token" else page_size), fmt=fmt,
                          q_itemsize=q.dtype.itemsize, meta_words=k, prep_bytes=0,
                          table_words=table.shape[0], shape=shape)
    call = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),  # each row prefetches the next row's rows
            vmem_limit_bytes=tpu.vmem_limit(mla_blocks.vmem_bytes(shape),
                                              tpu.device_chip(), vmem_limit_bytes)),
        cost_estimate=pl.CostEstimate(flops=traffic.flops, transcendentals=0,
                                      bytes_accessed=traffic.bytes_moved),
        interpret=tpu.interpret_params(interpret), name=f"{mode}_sparse_mla")
    operands = [info.reshape(-1), table, jnp.reshape(layer, (1,)).astype(jnp.int32),
                tpu.in_hbm(q_stack), entries, tpu.in_hbm(cache), *sink_ops]
    res = call(*operands)
    return res[0].reshape(num_rows, heads, v_dim), (res[1] if return_lse else None)
