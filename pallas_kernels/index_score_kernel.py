"""The Pallas TPU lightning-indexer score kernel shared by token and page top-k.

    score[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k[s, :])        (f32 accumulate)

Shapes: q ``[T, H, D]`` (bf16/f32), weights ``[T, H]``, cache ``[num_pages, page_size, D]``
(bf16/f32); ragged metadata as in ``reference.batch``. Output per call of ``C`` rows
``[row0, row0 + C)``: token mode ``f32[C, pages_per_seq * page_size]``, page mode
``f32[C, pages_per_seq]`` (per-page max fused in the kernel); ``-inf`` for every token/page that
is not a causal, existing candidate, and for rows outside every sequence.

Design.

- Work list (XLA, scalars): each active sequence's rows inside the call's row range are cut into
  blocks of ``R`` (``block_rows``) consecutive rows. One grid step = one work item = one row
  block of one sequence: ``(seq, first row, rows n <= R, abs position of the first row,
  kv_len, pages needed, key blocks)``. Items are in row order; empty items (``n = 0``) fill the
  static grid ``W = floor((C + min(S, C) * (R - 1)) / R)`` at the tail and do nothing.
- Scalar prefetch: the work list ``i32[W * 7]`` and a clean page table ``i32[S * pages_per_seq]``
  (``reference.batch.seq_pages``: ``num_pages`` marks a page that must not be read: past the
  sequence's used pages, a slot past ``page_indices``, an id out of range). ``page_indices`` itself
  is never read inside the kernel.
- Keys stay in HBM (``pltpu.HBM``). An item needs ``ceil(min(last row's abs pos + 1, kv_len) /
  page_size)`` pages (causal: pages after the item's last row are never fetched); they are read
  in stages of ``P`` (``block_pages``) pages, one DMA per page, double-buffered, and the first
  stage of the next item is started during the last stage of the current one, so the pipeline
  does not drain between sequences. Each fetched page is used by all ``R`` rows x ``H`` heads:
  decode reads each key page once per sequence.
- Compute per stage: ``[R*H, D] x [P*page, D]^T -> f32`` on the MXU (bf16 x bf16 with f32
  accumulation, or f32 at HIGHEST precision), relu, times the weight column, sum over heads
  (sublane reduction) -> ``[R, P*page]``; mask ``token <= abs_pos(row)``, ``token < kv_len``,
  page fetched; non-candidates become ``-inf`` (a masked key may hold anything, NaN included:
  ``where`` drops it; every score column depends only on its own key).
- Token mode: the stage's scores go to a ``[R, capacity]`` VMEM row buffer (double-buffered
  across items); stages past the item's last needed block are filled with ``-inf``; then the
  item's ``n`` rows are DMAed to the HBM output, one DMA per row (only the item's own rows).
  Page mode: per-page maxima go into a ``[R, pages]`` output block written back by the Pallas
  pipeline; XLA maps items back to rows (small: pages, not tokens).

Traffic (``traffic``): keys ``sum over items of pages_needed * page_size * D * itemsize``; for
decode this is each needed key once. q and weights once (decode) or once more for the per-item
gather (general path); scores written once (token: ``n`` rows x capacity; page: ``R`` rows x
pages per item).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot
from pallas_kernels.indexer_blocks import LANES, IndexerBlocks, default_blocks, vmem_estimate
from reference import batch

NEG_INF = float("-inf")
# Work-list fields (one i32 row of _NF per item).
_SEQ, _ROW, _NROWS, _POS0, _KVLEN, _NPAGES, _NBLK, _NF = range(8)


@dataclass(frozen=True)
class ScoreConfig:
    """Static facts of one score-kernel call (validated by ``make_config``)."""

    page_mode: bool
    rows: int  # C: query rows per call
    block_rows: int  # R
    block_pages: int  # P
    num_items: int  # W
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


def _pow2(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {name}={value!r}")
    return value


def resolve_blocks(blocks: IndexerBlocks | None, *, block_rows: int | None,
                   block_pages: int | None, chip: str | None, one_token_per_seq: bool,
                   pages_per_seq: int) -> IndexerBlocks:
    """Table defaults overridden by explicit knobs, clamped to the problem, validated."""
    base = blocks or default_blocks(chip, one_token_per_seq=one_token_per_seq)
    r = _pow2("block_rows", base.block_rows if block_rows is None else block_rows)
    p = _pow2("block_pages", base.block_pages if block_pages is None else block_pages)
    if p > LANES:
        raise ValueError(f"block_pages={p} must be <= {LANES} (page scores fill one lane group)")
    p = min(p, 1 << (pages_per_seq - 1).bit_length())  # no stage wider than the sequence
    return IndexerBlocks(r, p)


def num_items(rows: int, num_seqs: int, block_rows: int, one_token_per_seq: bool) -> int:
    """Static grid size: an upper bound on the row blocks of ``rows`` rows over the sequences."""
    if one_token_per_seq:
        return rows
    n = min(num_seqs, rows)
    return max(1, (rows + n * (block_rows - 1)) // block_rows)


def work_list(kv_lens, cu_q_lens, distribution, *, total_rows: int, row0, cfg: ScoreConfig,
              one_token_per_seq: bool):
    """Items ``i32[W, _NF]`` plus per-row facts of the call's rows.

    Returns ``(items, row_item i32[C], abs_pos i32[C], kv_eff i32[C])``: ``row_item`` is the
    row's flat slot ``item * R + j`` (``-1`` for a row outside every sequence).
    """
    num_seqs = kv_lens.shape[0]
    r_blk, c = cfg.block_rows, cfg.rows
    if one_token_per_seq:
        q_start = jnp.arange(num_seqs, dtype=jnp.int32)
        q_end = q_start + 1
    else:
        q_start = jnp.clip(cu_q_lens[:-1], 0, total_rows).astype(jnp.int32)
        q_end = jnp.clip(cu_q_lens[1:], q_start, total_rows).astype(jnp.int32)
    q_len = q_end - q_start
    active = jnp.arange(num_seqs) < batch.num_active_seqs(distribution, num_seqs)
    lo = jnp.clip(q_start, row0, row0 + c)
    hi = jnp.where(active, jnp.clip(q_end, lo, row0 + c), lo)
    nb = (hi - lo + r_blk - 1) // r_blk
    cum = jnp.cumsum(nb)
    w = jnp.arange(cfg.num_items, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum, w, side="right"), 0, num_seqs - 1).astype(jnp.int32)
    row = lo[seq] + (w - (cum[seq] - nb[seq])) * r_blk
    n = jnp.where(w < cum[-1], jnp.clip(hi[seq] - row, 0, r_blk), 0)
    pos0 = kv_lens[seq] - q_len[seq] + (row - q_start[seq])
    kv_eff = jnp.clip(kv_lens[seq], 0, cfg.capacity)
    tokens = jnp.clip(jnp.minimum(pos0 + n, kv_eff), 0, cfg.capacity)
    # An empty item (n == 0) needs no pages: else the previous step's cross-item prefetch would
    # start DMAs for it that nobody waits on (found by scripts/hbm_traffic.py's count).
    npages = jnp.where(n > 0, (tokens + cfg.page_size - 1) // cfg.page_size, 0)
    nblk = jnp.where(n > 0, jnp.maximum((npages + cfg.block_pages - 1) // cfg.block_pages, 1), 0)
    items = jnp.stack([seq, row - row0, n, pos0, kv_eff, npages, nblk], 1)
    # rows of the call -> (item, slot)
    j = jnp.arange(r_blk, dtype=jnp.int32)
    dest = jnp.where(j[None, :] < n[:, None], (row - row0)[:, None] + j[None, :], c)
    flat = (w[:, None] * r_blk + j[None, :])
    row_item = jnp.full((c,), -1, jnp.int32).at[dest.reshape(-1)].set(
        flat.reshape(-1), mode="drop")
    item_of_row = jnp.clip(row_item // r_blk, 0, cfg.num_items - 1)
    row_pos = pos0[item_of_row] + jnp.clip(row_item, 0, None) % r_blk
    return items.astype(jnp.int32), row_item, row_pos, kv_eff[item_of_row]

# ----------------------------------------------------------------------------- kernel body


def _field(items_ref, w, f):
    return items_ref[w * _NF + f]


def _page_copies(cfg: ScoreConfig, items_ref, pages_ref, cache_hbm, kbuf, ksem, w, blk, slot):
    """``[(fetch?, descriptor)]`` for the ``P`` pages of stage ``blk`` of item ``w``."""
    seq, npages = _field(items_ref, w, _SEQ), _field(items_ref, w, _NPAGES)
    out = []
    for p in range(cfg.block_pages):
        j = blk * cfg.block_pages + p
        pid = pages_ref[seq * cfg.pages_per_seq + jnp.minimum(j, cfg.pages_per_seq - 1)]
        ok = (j < npages) & (pid < cfg.num_pages)
        src = cache_hbm.at[jnp.minimum(pid, cfg.num_pages - 1)]
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
    """One DMA per row ``i < n`` of item ``w`` (row buffer -> HBM output row ``row + i``).

    Single rows because an item's first row is anywhere: Mosaic refuses a multi-row HBM slice
    at an offset it cannot prove a multiple of 8 (measured), and accepts a single row."""
    n, row = _field(items_ref, w, _NROWS), _field(items_ref, w, _ROW)
    out = []
    for i in range(cfg.block_rows):
        src = obuf.at[slot, pl.ds(i, 1), pl.ds(0, cfg.capacity)]
        out.append((i < n, pltpu.make_async_copy(src, out_hbm.at[pl.ds(row + i, 1)],
                                                 osem.at[slot])))
    return out


def _score_kernel(cfg: ScoreConfig,
                  # scalar prefetch
                  items_ref, pages_ref,
                  # inputs
                  q_ref, w_ref, cache_hbm,
                  # output
                  out_ref,
                  # scratch
                  kbuf, ksem, base_ref, *row_scratch):
    w = pl.program_id(0)
    n_items = pl.num_programs(0)
    nblk = _field(items_ref, w, _NBLK)
    pos0, kv_eff = _field(items_ref, w, _POS0), _field(items_ref, w, _KVLEN)
    copies = functools.partial(_page_copies, cfg, items_ref, pages_ref, cache_hbm, kbuf, ksem)

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

    q = q_ref[0]
    wcol = w_ref[0]

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


def make_config(q, cache_kv, *, rows: int, num_seqs: int, pages_per_seq: int,
                blocks: IndexerBlocks, page_mode: bool, one_token_per_seq: bool) -> ScoreConfig:
    """Static config of one call of ``rows`` query rows."""
    _, heads, dim = q.shape
    num_pages, page_size, _ = cache_kv.shape
    r = min(blocks.block_rows, 1 << (rows - 1).bit_length())
    compute = jnp.promote_types(q.dtype, cache_kv.dtype)
    if compute not in (jnp.float32, jnp.bfloat16):
        compute = jnp.dtype(jnp.float32)
    return ScoreConfig(page_mode=page_mode, rows=rows, block_rows=r,
                       block_pages=blocks.block_pages,
                       num_items=num_items(rows, num_seqs, r, one_token_per_seq), heads=heads,
                       dim=dim, page_size=page_size, pages_per_seq=pages_per_seq,
                       num_pages=num_pages, compute_dtype=jnp.dtype(compute),
                       key_dtype=jnp.dtype(cache_kv.dtype))


def clean_page_table(kv_lens, page_indices, cu_kv_lens, *, page_size: int, pages_per_seq: int,
                     num_pages: int) -> jax.Array:
    """``i32[S * pages_per_seq]``: each sequence's page ids, ``num_pages`` where not readable
    (``reference.batch.seq_pages``' rules)."""
    def one(i):
        return batch.seq_pages(i, kv_lens, page_indices, cu_kv_lens, page_size=page_size,
                               pages_per_seq=pages_per_seq, num_pages=num_pages).page_ids

    return jax.vmap(one)(jnp.arange(kv_lens.shape[0], dtype=jnp.int32)).reshape(-1)


def _interpret_arg(interpret):
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


def score_call(cfg: ScoreConfig, q, weights, cache_kv, items, page_table, row_item, *,
               row0, one_token_per_seq: bool, vmem_limit_bytes: int | None, interpret):
    """Run the kernel for rows ``[row0, row0 + C)``; returns un-masked-row output
    (token: ``f32[C, capacity]``, rows outside sequences undefined; page: ``f32[C, pages]``)."""
    r, h, d = cfg.block_rows, cfg.heads, cfg.dim
    total_rows = q.shape[0]
    if one_token_per_seq:  # item i is row i: no gather
        q_items = q.astype(cfg.compute_dtype).reshape(cfg.num_items, h, d)
        w_items = weights.astype(jnp.float32).reshape(cfg.num_items, h, 1)
    else:
        rows = row0 + items[:, _ROW:_ROW + 1] + jnp.arange(r, dtype=jnp.int32)[None, :]
        rows = jnp.clip(rows, 0, total_rows - 1).reshape(-1)
        q_items = q[rows].astype(cfg.compute_dtype).reshape(cfg.num_items, r * h, d)
        w_items = weights[rows].astype(jnp.float32).reshape(cfg.num_items, r * h, 1)
    kernel = functools.partial(_score_kernel, cfg)
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
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(cfg.num_items,),
        in_specs=[pl.BlockSpec((1, r * h, d), lambda w, *_: (w, 0, 0)),
                  pl.BlockSpec((1, r * h, 1), lambda w, *_: (w, 0, 0)),
                  pl.BlockSpec(memory_space=pltpu.HBM)],
        out_specs=out_spec, scratch_shapes=scratch)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=limit),
        cost_estimate=_cost_estimate(cfg, q_items, w_items, out_shape),
        interpret=_interpret_arg(interpret),
    )(items.reshape(-1), page_table, q_items, w_items, cache_kv)
    if cfg.page_mode:
        flat = out.reshape(cfg.num_items * r, cfg.page_cols)[:, :cfg.pages_per_seq]
        return flat[jnp.clip(row_item, 0, None)]
    return out


def _cost_estimate(cfg: ScoreConfig, q_items, w_items, out_shape) -> pl.CostEstimate:
    """Upper bound: every item reads its whole capacity (the real kernel reads causal pages)."""
    toks = cfg.num_items * cfg.capacity
    flops = 2 * toks * cfg.block_rows * cfg.heads * cfg.dim
    key_bytes = toks * cfg.dim * cfg.key_dtype.itemsize
    io = (q_items.size * q_items.dtype.itemsize + w_items.size * 4
          + math.prod(out_shape.shape) * 4)
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
SCORE_CHUNK_BYTES = 64 * 1024 * 1024


def chunk_rows(total_rows: int, width: int, block_rows: int, chunk_bytes: int) -> int:
    """Rows per kernel call: ``f32[C, width] <= chunk_bytes``, at least one row block."""
    return max(1, min(total_rows, max(block_rows, chunk_bytes // (4 * width))))


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
    cfg = make_config(q, cache_kv, rows=c, num_seqs=num_seqs, pages_per_seq=pages_per_seq,
                      blocks=blocks, page_mode=page_mode, one_token_per_seq=one_token_per_seq)
    table = clean_page_table(seq_lens, page_indices, cu_kv_lens, page_size=page_size,
                             pages_per_seq=pages_per_seq, num_pages=num_pages)

    def one_chunk(row0):
        items, row_item, abs_pos, kv_eff = work_list(
            seq_lens, cu_q_lens, distribution, total_rows=total_rows, row0=row0, cfg=cfg,
            one_token_per_seq=one_token_per_seq)
        scores = score_call(cfg, q, weights, cache_kv, items, table, row_item, row0=row0,
                            one_token_per_seq=one_token_per_seq and c == total_rows,
                            vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
        row_ok = row_item >= 0
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


def traffic(q_lens, kv_lens, *, heads: int, dim: int, page_size: int, pages_per_seq: int,
            key_itemsize: int, q_itemsize: int, blocks: IndexerBlocks, page_mode: bool,
            one_token_per_seq: bool, chunk_bytes: int = SCORE_CHUNK_BYTES) -> aot.Traffic:
    """HBM bytes, MXU flops and VMEM of the score kernel (and its q/weight gathers and page-score
    row map) for a batch of sequences ``(q_lens[i], kv_lens[i])``, replaying the work list.

    Minimum: q and weights read once, each sequence's ``kv_len`` keys read once, scores written
    once (token ``f32[T, capacity]``, page ``f32[T, pages_per_seq]``)."""
    total = sum(q_lens)
    cap = pages_per_seq * page_size
    width = pages_per_seq if page_mode else cap
    c = chunk_rows(total, width, blocks.block_rows, chunk_bytes)
    r = min(blocks.block_rows, 1 << (c - 1).bit_length())
    w_items = num_items(c, len(q_lens), r, one_token_per_seq)
    p_blk = blocks.block_pages
    n_blocks = -(-pages_per_seq // p_blk)
    page_cols = -(-(n_blocks * p_blk) // LANES) * LANES
    key_row = dim * key_itemsize
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    chunks = sorted({min(i * c, total - c) for i in range(-(-total // c))})
    keys = flops = rows_out = 0
    for row0 in chunks:
        for q0, ql, kl in zip(starts, q_lens, kv_lens, strict=True):
            lo, hi = max(q0, row0), min(q0 + ql, row0 + c)
            for a in range(lo, hi, r):
                n = min(r, hi - a)
                last = min(kl, cap) and min(kl - ql + (a - q0) + n, min(kl, cap))
                pages = -(-max(last, 0) // page_size)
                keys += pages * page_size * key_row
                flops += 2 * r * heads * dim * pages * page_size
                rows_out += n
    n_calls = len(chunks)
    q_bytes = total * heads * dim * q_itemsize
    w_bytes = total * heads * 4
    w_col = LANES * 4 * heads  # a weight column [R*H, 1] f32 occupies whole 128-lane tiles
    if one_token_per_seq and c == total:
        moved_q = q_bytes + total * w_col
    else:
        gathered = n_calls * w_items * r * (heads * dim * q_itemsize + w_col)
        moved_q = q_bytes + w_bytes + 2 * gathered  # gather writes it, the kernel reads it
    if page_mode:
        out = n_calls * w_items * r * page_cols * 4  # out blocks
        out += 2 * total * pages_per_seq * 4  # XLA row map: read + write
    else:
        out = rows_out * cap * 4
    bytes_min = q_bytes + w_bytes + sum(kl * key_row for kl in kv_lens) + total * width * 4
    vmem = vmem_estimate(block_rows=r, block_pages=p_blk, num_heads=heads, dim=dim,
                         page_size=page_size, pages_per_seq=pages_per_seq,
                         key_itemsize=key_itemsize, q_itemsize=q_itemsize, page_mode=page_mode)
    return aot.Traffic(bytes_moved=keys + moved_q + out, bytes_min=bytes_min, flops=flops,
                       vmem_bytes=vmem)


# ----------------------------------------------------------------------------- compile gate

# name -> (q_lens, kv_lens, one_token_per_seq); DeepSeek-V3.2 indexer: H=64, D=128, page 64.
GATE_SHAPES = {
    "decode 64x4096": ([1] * 64, [4096] * 64, True),
    "decode 8x131072": ([1] * 8, [131072] * 8, True),
    "prefill 2048@32768": ([2048], [32768], False),
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
                                                 pages_per_seq=pps),
                           page_mode=page_mode, one_token_per_seq=otp)

        tags = ("decode",) if otp else ("prefill",)
        cases.append(aot.CompileCase(kernel, name, fn_for_chip, specs, model, tags))
    return cases
