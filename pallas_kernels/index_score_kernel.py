"""The Pallas TPU lightning-indexer score kernel shared by token and page top-k.

    score[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k[s, :])        (f32 accumulate)

Shapes: q ``[T, H, D]`` (bf16/f32), weights ``[T, H]``, cache ``[num_pages, page_size, D]``
(bf16/f32); ragged metadata as in ``reference.batch``. Output per chunk of ``C`` rows
``[row0, row0 + C)``: token mode ``f32[C, pages_per_seq * page_size]``, page mode
``f32[C, pages_per_seq]`` (per-page max fused in the kernel); ``-inf`` for every token/page that
is not a causal, existing candidate, and for rows outside every sequence.

Design.

- Row-block ladder (static): ``block_rows, block_rows/4, ..., 1`` (``(1, 4, 16)`` for R=16;
  ``(1,)`` for ``one_token_per_seq``), each level capped at ``C``. Each sequence's rows inside the
  chunk are cut into ``floor(n / R_max)`` full blocks of ``R_max`` rows plus, for a remainder
  ``0 < m < R_max``, ONE block of the smallest level ``>= m``. So a sequence still has
  ``ceil(n / R_max)`` blocks (its causal keys are read as often as with one block size), but a
  decode row (``n = 1``) is a 1-row block, an MTP sequence of 3 rows a 4-row block: the MXU
  work ``[L*H, D] x [D, keys]`` follows the rows that exist, not ``R_max``.
- One ``pallas_call`` per ladder level ``L`` (the MXU shape is static per call), each with its
  own static grid bound ``W_L`` (``level_bound``) and work list; token mode: the level calls
  write disjoint rows of the same HBM score array (``input_output_aliases``).
- Work list (XLA, scalars): one grid step = one row block of one sequence: ``(seq, first row,
  rows n <= L, abs position of block row 0, kv_len, pages needed, key stages, shift, q row)``.
  Empty items (``n = 0``) fill the grid at the tail, do nothing, and point at the last real
  item's q rows (the pipeline does not refetch an unchanged block).
- q and weights are read straight from ``q [T, H, D]`` and ``weights [T, H, 1]`` by ``pl.Element``
  blocks ``[L, H, D]`` at row ``q row`` (the leading, untiled dim: any offset): no per-item
  gather in XLA. ``q row = clip(first row, 0, T - L)``; ``shift = first row - q row`` says which
  block rows are the item's (only a remainder block at the end of ``q`` is shifted).
- Scalar prefetch: the work list ``i32[W_L * 10]`` (each item carries its sequence's first
  page-table slot) and the page table ``page_indices`` as it is. The kernel looks each page up
  in SMEM on the scalar core and skips a slot outside the table or a page id outside
  ``[0, num_pages)`` (``reference.batch.seq_pages``' rules): XLA does no per-page gather (a
  clean ``[S, pages_per_seq]`` table gathered in XLA modelled at 35 MB on v6e at 64 x 4096,
  half the kernel's key bytes: issue 13).
- Keys stay in HBM (``pltpu.HBM``). An item needs ``ceil(min(last row's abs pos + 1, kv_len) /
  page_size)`` pages (causal); they are read in stages of ``P`` (``block_pages``) pages, one DMA
  per page, double-buffered, and the first stage of the next item is started during the last
  stage of the current one. Each fetched page is used by all ``L`` rows x ``H`` heads of the
  item: each key page is read once per item (decode: once per sequence).
- Compute per stage: ``[L*H, D] x [P*page, D]^T -> f32`` on the MXU, relu, times the weight
  column, sum over heads -> ``[L, P*page]``; mask ``token <= abs_pos(row)``, ``token <
  kv_len``, page fetched; non-candidates become ``-inf`` (``where`` drops NaN keys).
- Token mode: the stage's scores go to a ``[L, capacity]`` VMEM row buffer (double-buffered
  across items); stages past the item's last needed block are filled with ``-inf``; then the
  item's rows are DMAed to the HBM output, one DMA per row. Page mode: per-page maxima go into
  a ``[L, pages]`` output block written back by the Pallas pipeline; XLA maps slots to rows.

Traffic (``traffic``): keys ``sum over items of pages_needed * page_size * D * itemsize`` (each
sequence's causal keys ``ceil(n / R_max)`` times; decode once); q and the lane-padded weight
column once per q block fetched (``L`` rows per item: decode rows once); scores written once
(token: the item's rows x capacity; page: ``L`` rows x pages per item). MXU flops ``2 * L * H *
D`` per key token per item.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, tpu
from pallas_kernels.indexer_blocks import LANES, IndexerBlocks, default_blocks, vmem_estimate
from reference import batch, index_scores

NEG_INF = float("-inf")
# Work-list fields (one i32 row of _NF per item).
_SEQ, _ROW, _NROWS, _POS0, _KVLEN, _NPAGES, _NBLK, _SHIFT, _QROW, _SLOT0, _NF = range(11)


@dataclass(frozen=True)
class ScoreConfig:
    """Static facts of one score-kernel call (one ladder level; built by ``make_configs``)."""

    page_mode: bool
    rows: int  # C: query rows per chunk
    total_rows: int  # T: rows of q
    block_rows: int  # L: this level's rows per item
    block_pages: int  # P
    num_items: int  # W_L
    heads: int
    dim: int
    page_size: int
    pages_per_seq: int
    num_pages: int
    compute_dtype: jnp.dtype
    key_dtype: jnp.dtype

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_size

    @property
    def block_tokens(self) -> int:
        return self.block_pages * self.page_size

    @property
    def num_blocks(self) -> int:
        return -(-self.pages_per_seq // self.block_pages)

    @property
    def page_cols(self) -> int:
        """Page-score columns in VMEM/HBM: whole 128-lane groups."""
        return -(-self.num_blocks * self.block_pages // LANES) * LANES


def resolve_blocks(blocks: IndexerBlocks | None, *, block_rows: int | None,
                   block_pages: int | None, chip: str | None, one_token_per_seq: bool,
                   pages_per_seq: int, page_size: int | None = None, page_mode: bool = False,
                   mosaic: bool = False) -> IndexerBlocks:
    """``blocks``, then the explicit knobs, over the table defaults; clamped to the problem.

    ``mosaic`` (compiling for a TPU, not interpreting): in token mode a stage's scores are
    stored at lane offset ``stage * P * page_size`` of the row buffer, which Mosaic compiles
    only when ``P * page_size`` is a multiple of 128 (measured over 300 AOT compiles on v5e,
    v6e and tpu7x by ``scripts/compile_grid.py``: every narrower stage failed with
    "cannot statically prove that index in dimension 2 is a multiple of 128", every whole-lane
    stage compiled). So ``P`` is doubled until it is: pages past an item's need are never
    fetched (their scores are ``-inf``), so a wider stage costs MXU work on at most 127
    tokens per item and no HBM traffic. Page mode stores per-page maxima into aligned 128-lane
    groups and needs no widening."""
    if blocks is not None and not isinstance(blocks, IndexerBlocks):
        raise TypeError(f"blocks must be an IndexerBlocks, got {type(blocks).__name__}")
    base = default_blocks(chip, one_token_per_seq=one_token_per_seq)
    picked = IndexerBlocks(block_rows, block_pages).over((blocks or IndexerBlocks()).over(base))
    p = min(picked.block_pages, 1 << (pages_per_seq - 1).bit_length())  # no stage past the seq
    if mosaic and not page_mode:
        if page_size is None:
            raise ValueError("resolve_blocks(mosaic=True) needs page_size")
        while (p * page_size) % LANES and p < LANES:  # p = 128 always works
            p *= 2
    return IndexerBlocks(picked.block_rows, p)


def row_ladder(block_rows: int, rows: int, one_token_per_seq: bool) -> tuple[int, ...]:
    """Ascending row-block sizes ``1, ..., block_rows/4, block_rows``, each capped at ``rows``
    (``(1,)`` for ``one_token_per_seq``)."""
    if one_token_per_seq:
        return (1,)
    levels, r = {1}, block_rows
    while r > 1:
        levels.add(min(r, rows))
        r //= 4
    return tuple(sorted(levels))


def level_bound(ladder: tuple[int, ...], i: int, rows: int, num_seqs: int) -> int:
    """Static grid size of level ``i``: an upper bound on its items over ``rows`` rows.

    Every item of level ``i`` holds more rows than level ``i - 1`` (a full block, or a remainder
    too big for the level below), so ``<= rows // (ladder[i-1] + 1)``. Below the top there is at
    most one (remainder) item per sequence; the top has ``<= ceil(n / R)`` per sequence."""
    below = ladder[i - 1] if i > 0 else 0
    bound = rows // (below + 1)
    if i == len(ladder) - 1:
        r, n = ladder[i], min(num_seqs, rows)
        bound = min(bound, (rows + n * (r - 1)) // r)
    else:
        bound = min(bound, num_seqs)
    return max(1, bound)


def _seq_rows(kv_lens, cu_q_lens, distribution, *, total_rows: int, row0, rows: int,
              one_token_per_seq: bool):
    """Per sequence ``(q_start, q_len, lo, hi)``: its rows and their part in ``[row0, row0+C)``."""
    num_seqs = kv_lens.shape[0]
    if one_token_per_seq:
        q_start = jnp.arange(num_seqs, dtype=jnp.int32)
        q_end = q_start + 1
    else:
        q_start = jnp.clip(cu_q_lens[:-1], 0, total_rows).astype(jnp.int32)
        q_end = jnp.clip(cu_q_lens[1:], q_start, total_rows).astype(jnp.int32)
    active = jnp.arange(num_seqs) < batch.num_active_seqs(distribution, num_seqs)
    lo = jnp.clip(q_start, row0, row0 + rows)
    hi = jnp.where(active, jnp.clip(q_end, lo, row0 + rows), lo)
    return q_start, q_end - q_start, lo, hi


def _level_items(cfg: ScoreConfig, i: int, top: int, ladder, seq_rows, kv_lens, slot0, row0):
    """Items ``i32[W_L, _NF]`` of ladder level ``i`` (see the module docstring)."""
    q_start, q_len, lo, hi = seq_rows
    num_seqs, size = kv_lens.shape[0], cfg.block_rows
    n_rows = hi - lo
    full = n_rows // top
    rem = n_rows - full * top
    rem_level = sum((rem > lvl).astype(jnp.int32) for lvl in ladder)  # smallest level >= rem
    has_rem = ((rem > 0) & (rem_level == i)).astype(jnp.int32)
    if i == len(ladder) - 1:
        count, base = full + has_rem, lo
    else:
        count, base = has_rem, lo + full * top
    cum = jnp.cumsum(count)
    w = jnp.arange(cfg.num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(cum, w, side="right", method="compare_all")  # loop-free
    seq = jnp.clip(seq, 0, num_seqs - 1).astype(jnp.int32)
    real = w < cum[-1]
    row = base[seq] + (w - (cum[seq] - count[seq])) * size
    n = jnp.where(real, jnp.clip(hi[seq] - row, 0, size), 0)
    qrow = jnp.clip(row, 0, cfg.total_rows - size)
    last = jnp.where(cum[-1] > 0, qrow[jnp.clip(cum[-1] - 1, 0, cfg.num_items - 1)], 0)
    qrow = jnp.where(real, qrow, last)  # empty items: no new q block
    shift = jnp.where(real, row - qrow, 0)
    pos = kv_lens[seq] - q_len[seq] + (row - q_start[seq])  # abs pos of the first row
    kv_eff = jnp.clip(kv_lens[seq], 0, cfg.capacity)
    tokens = jnp.clip(jnp.minimum(pos + n, kv_eff), 0, cfg.capacity)
    # An empty item (n == 0) needs no pages: else the previous step's cross-item prefetch would
    # start DMAs for it that nobody waits on (found by scripts/hbm_traffic.py's count).
    npages = jnp.where(n > 0, (tokens + cfg.page_size - 1) // cfg.page_size, 0)
    nblk = jnp.where(n > 0, jnp.maximum((npages + cfg.block_pages - 1) // cfg.block_pages, 1), 0)
    return jnp.stack([seq, row - row0, n, pos - shift, kv_eff, npages, nblk, shift, qrow,
                      slot0[seq]], 1).astype(jnp.int32)


def work_list(kv_lens, cu_q_lens, distribution, *, cu_kv_lens, row0, cfgs: list[ScoreConfig],
              one_token_per_seq: bool):
    """Items of every level plus per-row facts of the chunk's rows.

    Returns ``(items [i32[W_L, _NF] per level], row_slot i32[C], abs_pos i32[C], kv_eff
    i32[C])``: ``row_slot`` is the row's flat slot in the levels' concatenated ``[W_L * L]``
    block rows (``-1`` for a row outside every sequence)."""
    c, ladder = cfgs[0].rows, tuple(cfg.block_rows for cfg in cfgs)
    seq_rows = _seq_rows(kv_lens, cu_q_lens, distribution, total_rows=cfgs[0].total_rows,
                         row0=row0, rows=c, one_token_per_seq=one_token_per_seq)
    slot0 = cu_kv_lens[:-1] // cfgs[0].page_size  # each sequence's first page-table slot
    all_items, slot_rows, slot_pos, slot_kv = [], [], [], []
    for i, cfg in enumerate(cfgs):
        items = _level_items(cfg, i, ladder[-1], ladder, seq_rows, kv_lens, slot0, row0)
        all_items.append(items)
        j = jnp.arange(cfg.block_rows, dtype=jnp.int32)[None, :]
        shift, n = items[:, _SHIFT:_SHIFT + 1], items[:, _NROWS:_NROWS + 1]
        mine = (j >= shift) & (j < shift + n)
        slot_rows.append(jnp.where(mine, items[:, _ROW:_ROW + 1] - shift + j, c).reshape(-1))
        slot_pos.append((items[:, _POS0:_POS0 + 1] + j).reshape(-1))
        slot_kv.append(jnp.broadcast_to(items[:, _KVLEN:_KVLEN + 1], mine.shape).reshape(-1))
    dest = jnp.concatenate(slot_rows)
    row_slot = jnp.full((c,), -1, jnp.int32).at[dest].set(
        jnp.arange(dest.shape[0], dtype=jnp.int32), mode="drop")
    at = jnp.clip(row_slot, 0, None)
    return all_items, row_slot, jnp.concatenate(slot_pos)[at], jnp.concatenate(slot_kv)[at]

# ----------------------------------------------------------------------------- kernel body


def _field(items_ref, w, f):
    return items_ref[w * _NF + f]


def _page_copies(cfg: ScoreConfig, items_ref, table_ref, cache_hbm, kbuf, ksem, w, blk, slot):
    """``[(fetch?, descriptor)]`` for the ``P`` pages of stage ``blk`` of item ``w``.

    Page ``j`` of the item's sequence is ``table[slot0 + j]`` (the page table in SMEM, read on
    the scalar core): fetched only if ``j`` is a page the item needs, the slot lies inside the
    table and the page id inside ``[0, num_pages)`` (``reference.batch.seq_pages``' rules)."""
    npages, slot0 = _field(items_ref, w, _NPAGES), _field(items_ref, w, _SLOT0)
    num_slots = table_ref.shape[0]
    out = []
    for p in range(cfg.block_pages):
        j = blk * cfg.block_pages + p
        tslot = slot0 + j
        ok = (j < npages) & (tslot >= 0) & (tslot < num_slots)
        pid = table_ref[jnp.clip(tslot, 0, num_slots - 1)]
        ok &= (pid >= 0) & (pid < cfg.num_pages)
        src = cache_hbm.at[jnp.clip(pid, 0, cfg.num_pages - 1)]
        out.append((ok, pltpu.make_async_copy(src, kbuf.at[slot, p], ksem.at[slot])))
    return out


def _start(copies):
    for ok, desc in copies:
        pl.when(ok)(desc.start)


def _wait(copies):
    for ok, desc in copies:
        pl.when(ok)(desc.wait)


def _stage_scores(cfg: ScoreConfig, q, wcol, keys, blk, pos0, kv_eff, page_ok):
    """Masked scores ``f32[R, P*page]`` of one stage (``page_ok``: P traced bools)."""
    nb = cfg.block_tokens
    k = keys.reshape(nb, cfg.dim).astype(cfg.compute_dtype)
    prec = (jax.lax.Precision.HIGHEST if cfg.compute_dtype == jnp.float32
            else jax.lax.Precision.DEFAULT)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)  # [R*H, nb]
    s = jnp.maximum(s, 0.0) * wcol
    s = s.reshape(cfg.block_rows, cfg.heads, nb).sum(axis=1)  # [R, nb]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, nb), 1)
    fetched = jnp.zeros((1, nb), jnp.bool_)
    for p in range(cfg.block_pages):
        fetched = fetched | ((lane // cfg.page_size == p) & page_ok[p])
    tok = blk * nb + lane
    pos = pos0 + jax.lax.broadcasted_iota(jnp.int32, (cfg.block_rows, 1), 0)
    ok = fetched & (tok < kv_eff) & (tok <= pos)
    return jnp.where(ok, s, NEG_INF)


def _put_page_max(cfg: ScoreConfig, out_ref, s, blk):
    """Max-pool ``s f32[R, P*page]`` per page into columns ``[blk*P, blk*P + P)``."""
    nb = cfg.block_tokens
    first = blk * cfg.block_pages
    g0 = pl.multiple_of((first // LANES) * LANES, LANES)
    lane_page = jax.lax.broadcasted_iota(jnp.int32, (1, nb), 1) // cfg.page_size
    col = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1) + g0
    grp = out_ref[0, :, pl.ds(g0, LANES)]
    for p in range(cfg.block_pages):
        m = jnp.max(jnp.where(lane_page == p, s, NEG_INF), axis=1, keepdims=True)  # [R, 1]
        grp = jnp.where(col == first + p, m, grp)
    out_ref[0, :, pl.ds(g0, LANES)] = grp


def _row_copies(cfg: ScoreConfig, items_ref, obuf, out_hbm, osem, w, slot):
    """One DMA per item row: block row ``j`` in ``[shift, shift + n)`` of the row buffer ->
    HBM output row ``row - shift + j``.

    Single rows because an item's first row is anywhere: Mosaic refuses a multi-row HBM slice
    at an offset it cannot prove a multiple of 8 (measured), and accepts a single row. The
    source row ``j`` is static (no dynamic sublane offset in VMEM)."""
    n, row = _field(items_ref, w, _NROWS), _field(items_ref, w, _ROW)
    shift = _field(items_ref, w, _SHIFT)
    out = []
    for j in range(cfg.block_rows):
        src = obuf.at[slot, pl.ds(j, 1), pl.ds(0, cfg.capacity)]
        dst = out_hbm.at[pl.ds(jnp.maximum(row - shift + j, 0), 1)]
        out.append(((j >= shift) & (j < shift + n),
                    pltpu.make_async_copy(src, dst, osem.at[slot])))
    return out


def _score_kernel(cfg: ScoreConfig, aliased: bool,
                  # scalar prefetch
                  items_ref, table_ref,
                  # inputs (q [L, H, D], weights [L, H, 1], keys in HBM, [earlier scores])
                  q_ref, w_ref, cache_hbm, *refs):
    if aliased:  # the earlier levels' scores: the same HBM buffer as out_ref, never read here
        refs = refs[1:]
    out_ref, kbuf, ksem, base_ref, *row_scratch = refs
    w = pl.program_id(0)
    n_items = pl.num_programs(0)
    nblk = _field(items_ref, w, _NBLK)
    pos0, kv_eff = _field(items_ref, w, _POS0), _field(items_ref, w, _KVLEN)
    copies = functools.partial(_page_copies, cfg, items_ref, table_ref, cache_hbm, kbuf, ksem)

    @pl.when(w == 0)
    def _():
        base_ref[0] = 0
        _start(copies(0, 0, 0))

    base = base_ref[0]
    oslot = w % 2
    if cfg.page_mode:
        out_ref[...] = jnp.full(out_ref.shape, NEG_INF, jnp.float32)
    else:
        obuf, osem = row_scratch
        rows = functools.partial(_row_copies, cfg, items_ref, obuf, out_ref, osem)

        @pl.when(w >= 2)
        def _():
            _wait(rows(w - 2, oslot))  # that slot's previous rows have left VMEM

    rh = cfg.block_rows * cfg.heads
    q = q_ref[...].reshape(rh, cfg.dim)
    wcol = w_ref[...].reshape(rh, 1)

    def stage(blk, carry):
        slot = (base + blk) % 2
        nxt = 1 - slot

        @pl.when(blk + 1 < nblk)
        def _():
            _start(copies(w, blk + 1, nxt))

        @pl.when((blk + 1 == nblk) & (w + 1 < n_items))
        def _():
            _start(copies(w + 1, 0, nxt))  # next item's first stage overlaps this one

        mine = copies(w, blk, slot)
        _wait(mine)
        s = _stage_scores(cfg, q, wcol, kbuf[slot], blk, pos0, kv_eff, [ok for ok, _ in mine])
        if cfg.page_mode:
            _put_page_max(cfg, out_ref, s, blk)
        else:
            start = pl.multiple_of(blk * cfg.block_tokens, cfg.block_tokens)
            obuf[oslot, :, pl.ds(start, cfg.block_tokens)] = s
        return carry

    jax.lax.fori_loop(0, nblk, stage, 0)
    base_ref[0] = (base + nblk) % 2
    if not cfg.page_mode:
        def fill(blk, carry):
            start = pl.multiple_of(blk * cfg.block_tokens, cfg.block_tokens)
            obuf[oslot, :, pl.ds(start, cfg.block_tokens)] = jnp.full(
                (cfg.block_rows, cfg.block_tokens), NEG_INF, jnp.float32)
            return carry

        jax.lax.fori_loop(nblk, cfg.num_blocks, fill, 0)
        _start(rows(w, oslot))

        @pl.when(w == n_items - 1)
        def _():
            @pl.when(w >= 1)
            def _():
                _wait(rows(w - 1, 1 - oslot))

            _wait(rows(w, oslot))


# ----------------------------------------------------------------------------- wrapper


def make_configs(q, cache_kv, *, rows: int, num_seqs: int, pages_per_seq: int,
                 blocks: IndexerBlocks, page_mode: bool,
                 one_token_per_seq: bool) -> list[ScoreConfig]:
    """Static configs of one chunk of ``rows`` query rows: one per ladder level, ascending."""
    total_rows, heads, dim = q.shape
    num_pages, page_size, _ = cache_kv.shape
    compute = jnp.promote_types(q.dtype, cache_kv.dtype)
    if compute not in (jnp.float32, jnp.bfloat16):
        compute = jnp.dtype(jnp.float32)
    ladder = row_ladder(blocks.block_rows, rows, one_token_per_seq)
    return [ScoreConfig(page_mode=page_mode, rows=rows, total_rows=total_rows, block_rows=size,
                        block_pages=blocks.block_pages,
                        num_items=level_bound(ladder, i, rows, num_seqs), heads=heads, dim=dim,
                        page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages,
                        compute_dtype=jnp.dtype(compute), key_dtype=jnp.dtype(cache_kv.dtype))
            for i, size in enumerate(ladder)]


def _interpret_arg(interpret):
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


def score_call(cfg: ScoreConfig, q, wcol, cache_kv, items, page_table, prev, *,
               vmem_limit_bytes: int | None, interpret):
    """One level's kernel call for the chunk's rows.

    ``q: [T, H, D]`` in the compute dtype, ``wcol: f32[T, H, 1]``. Token mode: ``prev`` is the
    earlier levels' ``f32[C, capacity]`` (``None`` for the first level) and the result is it
    with this level's rows written (rows outside sequences undefined). Page mode: ``f32[W_L *
    L, page_cols]``, one row per item slot."""
    r, h, d = cfg.block_rows, cfg.heads, cfg.dim
    aliased = prev is not None
    kernel = functools.partial(_score_kernel, cfg, aliased)
    scratch = [pltpu.VMEM((2, cfg.block_pages, cfg.page_size, d), cfg.key_dtype),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1,), jnp.int32)]
    if cfg.page_mode:
        out_shape = jax.ShapeDtypeStruct((cfg.num_items, r, cfg.page_cols), jnp.float32)
        out_spec = pl.BlockSpec((1, r, cfg.page_cols), lambda w, *_: (w, 0, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.rows, cfg.capacity), jnp.float32)
        out_spec = pl.BlockSpec(memory_space=pltpu.HBM)
        scratch += [pltpu.VMEM((2, r, cfg.num_blocks * cfg.block_tokens), jnp.float32),
                    pltpu.SemaphoreType.DMA((2,))]
    est = vmem_estimate(block_rows=r, block_pages=cfg.block_pages, num_heads=h, dim=d,
                        page_size=cfg.page_size, pages_per_seq=cfg.pages_per_seq,
                        key_itemsize=cfg.key_dtype.itemsize,
                        q_itemsize=cfg.compute_dtype.itemsize, page_mode=cfg.page_mode)
    limit = vmem_limit_bytes or max(32 * 1024 * 1024, 2 * est)

    def q_rows(w, items_ref, _pages):  # element offset of the item's q block
        return items_ref[w * _NF + _QROW], 0, 0

    in_specs = [pl.BlockSpec((pl.Element(r), pl.Element(h), pl.Element(d)), q_rows),
                pl.BlockSpec((pl.Element(r), pl.Element(h), pl.Element(1)), q_rows),
                pl.BlockSpec(memory_space=pltpu.HBM)]
    operands = [items.reshape(-1), page_table, q, wcol, cache_kv]
    if aliased:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
        operands.append(prev)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(cfg.num_items,), in_specs=in_specs, out_specs=out_spec,
        scratch_shapes=scratch)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid_spec=grid_spec,
        input_output_aliases={5: 0} if aliased else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=limit),
        cost_estimate=_cost_estimate(cfg, out_shape),
        interpret=_interpret_arg(interpret),
    )(*operands)
    if cfg.page_mode:
        return out.reshape(cfg.num_items * r, cfg.page_cols)
    return out


def _cost_estimate(cfg: ScoreConfig, out_shape) -> pl.CostEstimate:
    """Upper bound: every item reads its whole capacity (the real kernel reads causal pages)."""
    toks = cfg.num_items * cfg.capacity
    flops = 2 * toks * cfg.block_rows * cfg.heads * cfg.dim
    key_bytes = toks * cfg.dim * cfg.key_dtype.itemsize
    rows = cfg.num_items * cfg.block_rows * cfg.heads
    io = rows * (cfg.dim * cfg.compute_dtype.itemsize + LANES * 4)
    io += math.prod(out_shape.shape) * 4
    return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=key_bytes + io)


def device_chip() -> str | None:
    """The chip Pallas will compile for: the default device if it is a known TPU."""
    dev = jax.config.jax_default_device
    if dev is not None and getattr(dev, "platform", "") == "tpu":
        kind = dev.device_kind.lower()
        for chip, tag in (("v5e", "v5 lite"), ("v6e", "v6 lite"), ("tpu7x", "7x")):
            if tag in kind:
                return chip
    return aot.detect_chip()


# ----------------------------------------------------------------------------- row chunks

# Long-prefill bound: one call's f32 token scores [C, capacity] stay <= this many bytes (the
# reference's 64 MiB window), so a 2048-row prefill at 32K runs as 4 calls of 512 rows.
SCORE_CHUNK_BYTES = index_scores.SCORE_BLOCK_BYTES  # the reference's documented bound


def chunk_rows(total_rows: int, width: int, block_rows: int, chunk_bytes: int) -> int:
    """Rows per kernel call: ``f32[C, width] <= chunk_bytes``, at least one row block, and
    balanced over the calls (572 rows at a 512-row bound run as 2 x 286, not 512 + 512 with 452
    rows scored twice by the clamped last chunk)."""
    c_max = max(1, min(total_rows, max(block_rows, chunk_bytes // (4 * width))))
    n_chunks = -(-total_rows // c_max)
    return -(-total_rows // n_chunks)


def score_and_select(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution, *, pages_per_seq: int, one_token_per_seq: bool,
                     page_mode: bool, blocks: IndexerBlocks, chunk_bytes: int,
                     vmem_limit_bytes: int | None, interpret, out_width: int, out_dtype,
                     finish) -> jax.Array:
    """Score the rows in chunks of ``C`` rows (one kernel call each, inside a ``fori_loop``) and
    hand each chunk to ``finish(scores f32[C, N], row_ok bool[C], abs_pos i32[C],
    kv_eff i32[C]) -> [C, out_width]``. Rows outside every sequence get ``-inf`` scores."""
    total_rows = q.shape[0]
    num_pages, page_size, _ = cache_kv.shape
    num_seqs = seq_lens.shape[0]
    width = pages_per_seq if page_mode else pages_per_seq * page_size
    c = chunk_rows(total_rows, width, blocks.block_rows, chunk_bytes)
    cfgs = make_configs(q, cache_kv, rows=c, num_seqs=num_seqs, pages_per_seq=pages_per_seq,
                        blocks=blocks, page_mode=page_mode,
                        one_token_per_seq=one_token_per_seq)
    table = tpu.smem_page_table(page_indices)
    q_in = q.astype(cfgs[0].compute_dtype)  # a no-op unless q and keys differ in dtype
    wcol = weights.astype(jnp.float32).reshape(total_rows, q.shape[1], 1)

    def one_chunk(row0):
        items, row_slot, abs_pos, kv_eff = work_list(
            seq_lens, cu_q_lens, distribution, cu_kv_lens=cu_kv_lens, row0=row0, cfgs=cfgs,
            one_token_per_seq=one_token_per_seq)
        scores = None
        per_level = []
        for cfg, its in zip(cfgs, items, strict=True):
            out = score_call(cfg, q_in, wcol, cache_kv, its, table,
                             None if page_mode else scores,
                             vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
            if page_mode:
                per_level.append(out)
            else:
                scores = out
        if page_mode:
            flat = jnp.concatenate(per_level)[:, :pages_per_seq]
            scores = flat[jnp.clip(row_slot, 0, None)]
        row_ok = row_slot >= 0
        scores = jnp.where(row_ok[:, None], scores, NEG_INF)
        return finish(scores, row_ok, abs_pos, kv_eff)

    n_chunks = -(-total_rows // c)
    if n_chunks == 1:
        return one_chunk(jnp.int32(0))

    def body(i, out):
        row0 = jnp.minimum(i * c, total_rows - c).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(out, one_chunk(row0), row0, 0)

    out = jnp.zeros((total_rows, out_width), out_dtype)
    return jax.lax.fori_loop(0, n_chunks, body, out)


def check_kernel_knobs(score_chunk_bytes, vmem_limit_bytes) -> None:
    """Refuse non-positive ``score_chunk_bytes`` / ``vmem_limit_bytes``."""
    for name, v in (("score_chunk_bytes", score_chunk_bytes),
                    ("vmem_limit_bytes", vmem_limit_bytes)):
        if v is None and name == "vmem_limit_bytes":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {name}={v!r}")


# ----------------------------------------------------------------------------- traffic model


def replay_items(q_lens, kv_lens, *, row0: int, rows: int, total_rows: int,
                 ladder: tuple[int, ...], page_size: int, capacity: int):
    """Plain-Python replay of ``work_list`` for one chunk: per level, the real items'
    ``(q row, rows n, pages needed)`` in grid order (the traffic model's and tests' view)."""
    top = ladder[-1]
    levels = [[] for _ in ladder]
    q0 = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        lo, hi = min(max(q0, row0), row0 + rows), min(max(q0 + ql, row0), row0 + rows)
        full, rem = divmod(max(hi - lo, 0), top)
        blocks = [(len(ladder) - 1, lo + i * top) for i in range(full)]
        if rem:
            blocks.append((sum(rem > lvl for lvl in ladder), lo + full * top))
        kv_eff = min(max(kl, 0), capacity)
        for i, a in blocks:
            n = min(ladder[i], hi - a)
            last = min(max(kl - ql + (a - q0) + n, 0), kv_eff)
            levels[i].append((min(max(a, 0), total_rows - ladder[i]), n, -(-last // page_size)))
        q0 += ql
    return levels


def traffic(q_lens, kv_lens, *, heads: int, dim: int, page_size: int, pages_per_seq: int,
            key_itemsize: int, q_itemsize: int, blocks: IndexerBlocks, page_mode: bool,
            one_token_per_seq: bool, chunk_bytes: int = SCORE_CHUNK_BYTES) -> aot.Traffic:
    """HBM bytes, MXU flops and VMEM of the score kernel (and the page-score row map in XLA)
    for a batch of sequences ``(q_lens[i], kv_lens[i])``, replaying the work lists.

    Kernel side: key pages per item; one q block ``[L, H, D]`` plus the lane-padded weight
    column ``f32[L, H, 128]`` per change of q row along the grid (the pipeline skips an
    unchanged block); score rows (token) or out blocks (page). XLA side: page mode's row map
    (read + write ``f32[T, pages_per_seq]``). Minimum: q and weights read once, each
    sequence's ``kv_len`` keys read once, scores written once."""
    total = sum(q_lens)
    cap = pages_per_seq * page_size
    width = pages_per_seq if page_mode else cap
    c = chunk_rows(total, width, blocks.block_rows, chunk_bytes)
    ladder = row_ladder(blocks.block_rows, c, one_token_per_seq)
    p_blk = blocks.block_pages
    page_cols = -(-(-(-pages_per_seq // p_blk) * p_blk) // LANES) * LANES
    key_row = dim * key_itemsize
    q_row = heads * (dim * q_itemsize + LANES * 4)  # q row + lane-padded weight column
    chunks = sorted({min(i * c, total - c) for i in range(-(-total // c))})
    keys = flops = q_moved = out = 0
    for row0 in chunks:
        levels = replay_items(q_lens, kv_lens, row0=row0, rows=c, total_rows=total,
                              ladder=ladder, page_size=page_size, capacity=cap)
        for i, (size, items) in enumerate(zip(ladder, levels, strict=True)):
            qrows = [qr for qr, _, _ in items] or [0]
            fetches = 1 + sum(a != b for a, b in zip(qrows, qrows[1:], strict=False))
            q_moved += fetches * size * q_row
            for _, n, pages in items:
                keys += pages * page_size * key_row
                flops += 2 * size * heads * dim * pages * page_size
                out += 0 if page_mode else n * cap * 4
            if page_mode:
                out += level_bound(ladder, i, c, len(q_lens)) * size * page_cols * 4
    if page_mode:
        out += 2 * total * pages_per_seq * 4  # XLA row map: read + write
    bytes_min = (total * heads * (dim * q_itemsize + 4) + sum(kl * key_row for kl in kv_lens)
                 + total * width * 4)
    vmem = vmem_estimate(block_rows=ladder[-1], block_pages=p_blk, num_heads=heads, dim=dim,
                         page_size=page_size, pages_per_seq=pages_per_seq,
                         key_itemsize=key_itemsize, q_itemsize=q_itemsize, page_mode=page_mode)
    return aot.Traffic(bytes_moved=keys + q_moved + out, bytes_min=bytes_min, flops=flops,
                       vmem_bytes=vmem)


# ----------------------------------------------------------------------------- compile gate

# name -> (q_lens, kv_lens, one_token_per_seq); DeepSeek-V3.2 indexer: H=64, D=128, page 64.
GATE_SHAPES = {
    "decode 64x4096": ([1] * 64, [4096] * 64, True),
    "decode 8x131072": ([1] * 8, [131072] * 8, True),
    "prefill 2048@32768": ([2048], [32768], False),
    # the common serving batch: decode rows beside a chunked prefill (general path)
    "mixed 60x1@4096 + 512@32768": ([1] * 60 + [512], [4096] * 60 + [32768], False),
}
GATE_HEADS, GATE_DIM, GATE_PAGE, GATE_K = 64, 128, 64, 2048


def gate_specs(q_lens, kv_lens, *, key_dtype=jnp.bfloat16, heads=GATE_HEADS, dim=GATE_DIM,
               page_size=GATE_PAGE) -> tuple[list[jax.ShapeDtypeStruct], int]:
    """Argument specs of a batch (each sequence's capacity = its kv_len); ``pages_per_seq``."""
    t, s = sum(q_lens), len(q_lens)
    pps = -(-max(kv_lens) // page_size)
    i32 = jnp.int32
    specs = [jax.ShapeDtypeStruct((t, heads, dim), jnp.bfloat16),
             jax.ShapeDtypeStruct((t, heads), jnp.float32),
             jax.ShapeDtypeStruct((s * pps, page_size, dim), key_dtype),
             jax.ShapeDtypeStruct((s,), i32), jax.ShapeDtypeStruct((s * pps,), i32),
             jax.ShapeDtypeStruct((s + 1,), i32), jax.ShapeDtypeStruct((s + 1,), i32),
             jax.ShapeDtypeStruct((3,), i32)]
    return specs, pps


def gate_cases(kernel: str, entry, k_name: str, *, page_mode: bool,
               quick: bool) -> list[aot.CompileCase]:
    """Compile cases of ``entry`` at the gate shapes (plus an f32-key decode when not quick)."""
    shapes = dict(GATE_SHAPES)
    if not quick:
        shapes["decode 64x4096 f32 keys"] = GATE_SHAPES["decode 64x4096"]
    cases = []
    for name, (q_lens, kv_lens, otp) in shapes.items():
        key_dtype = jnp.float32 if "f32" in name else jnp.bfloat16
        specs, pps = gate_specs(q_lens, kv_lens, key_dtype=key_dtype)
        k = GATE_K if not page_mode else min(GATE_K // GATE_PAGE, pps)

        def fn_for_chip(chip, pps=pps, otp=otp, k=k):
            return functools.partial(entry, **{k_name: k}, pages_per_seq=pps,
                                     one_token_per_seq=otp, chip=chip)

        def model(chip, q_lens=q_lens, kv_lens=kv_lens, otp=otp, pps=pps, key_dtype=key_dtype):
            return traffic(q_lens, kv_lens, heads=GATE_HEADS, dim=GATE_DIM, page_size=GATE_PAGE,
                           pages_per_seq=pps, key_itemsize=jnp.dtype(key_dtype).itemsize,
                           q_itemsize=jnp.dtype(jnp.promote_types(jnp.bfloat16,
                                                                  key_dtype)).itemsize,
                           blocks=resolve_blocks(None, block_rows=None, block_pages=None,
                                                 chip=chip, one_token_per_seq=otp,
                                                 pages_per_seq=pps, page_size=GATE_PAGE,
                                                 page_mode=page_mode, mosaic=True),
                           page_mode=page_mode, one_token_per_seq=otp)

        tags = ("decode",) if otp else ("mixed",) if name.startswith("mixed") else ("prefill",)
        cases.append(aot.CompileCase(kernel, name, fn_for_chip, specs, model, tags))
    return cases
