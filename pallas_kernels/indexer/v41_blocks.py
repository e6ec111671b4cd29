"""A V4.1 candidate consumer's index scores reading ONLY its candidate blocks (issue 31, Deliver
4): each query row's candidate blocks of 8 entries gathered from the fp4 index keys in the block
layout (``reference.v41.index_blocks``: a block is one 512-byte row), decoded in VMEM, scored
against the row's query; the scores come back compact, ``8 C`` a row, not ``f32[T, N]``.

Math (``reference.indexer.scores.index_scores``, ``precision="bf16"`` the official regime):
``s = sum_h rb(relu(rb(q_h . k)) * rb(w_h))`` rounded to bf16 once (``rb`` the bf16 rounding;
the identity and f32 operands at highest precision under ``"f32"``), ``k`` the decoded key
``e2m1(nibble) * 2^(scale byte - 127)`` (exact in f32 and bf16).

Shapes: ``q f32|bf16[T, H, 128]``, ``w f32[T, 1, H]`` (lane-dense, bf16-valued under
``"bf16"``), ``meta i32[T, 2 + C]`` per row (its first page-table slot, ``-1`` none; its visible
entries; its candidate block ids, row-local, ``-1`` none), the flat page table ``i32[N]`` and the
stack row ``layer i32[1]`` (both scalar-prefetched: pages are looked up on the scalar core, as
the package's other kernels do, not by an XLA gather an id), the pages ``u32[L, P * R, 128]`` in
HBM. Out ``f32[T, 8, C]``: entry ``j`` of candidate ``c`` at ``[t, j, c]``; ``-inf`` where the
candidate reads nothing (``_candidate``'s rule).

Walk (grid: one step per query row, in order; each row's meta and gathered rows in one of two
slots, ``t % 2``, so the next row's reads fly while this row computes):

- step 0 fetches row 0 into slot 0; step ``t`` fetches row ``t + 1`` into the other slot before
  it waits for its own: the row's meta into SMEM (one DMA, waited), then per candidate that
  reads (``_candidate``) ONE DMA of its block row and ONE of the scale row it uses unless the
  candidate before it (the list is sorted: ``entry``) uses the same one; its slot in that scale
  row (``b % 16``, ``-1`` for none) goes to a lane-wide VMEM row (the decode needs it on
  sublanes);
- after the waits a candidate sharing its predecessor's scale row copies it (``_share``); then
  per chunk of ``n = CHUNK`` candidates (sublanes; a list shorter than a chunk is padded to 8
  and its chunk's other rows marked unread, so every dot has ``CHUNK`` rows: XLA:CPU's f32 dot
  order, and so the interpreter's bits, depend on that count):
  each block's 8 scale words moved to lanes 0..7 (``tpu.align_slot``), per entry ``j`` of the
  blocks nibble plane ``j`` decoded with word ``j``'s byte ``f // 32`` on lane ``f`` -> keys
  ``[n, 128]``, ``q [H, 128] x keys^T`` on the MXU, the regime's rounding, the head sum ->
  ``[1, n]`` lanes of the output, ``-inf`` where the candidate reads nothing (a select: a stale
  or NaN buffer cannot leak).

Not measured on a TPU: a candidate moves 512 B of codes (544 B of its own, codes and scales)
and its scale row's 512 B unless shared (``entry.traffic``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from reference.v41 import index_blocks as ib
from reference.v41.formats import BYTE_BITS, INDEX_BLOCK, NIBBLE_BITS, e2m1_values, ue8m0_values

CHUNK = tpu.LANES  # candidate blocks decoded and scored at once
SLOTS = 2  # rows in flight: this row's reads and the next row's
META_HEAD = 2  # a row's meta: its first page-table slot and visible entries, then its ids


@dataclass(frozen=True)
class BlocksConfig:
    """Static facts of one call."""

    heads: int
    page_size: int
    blocks: int  # C: candidate blocks a row (``padded_blocks``)
    precision: str  # "bf16" | "f32"
    num_pages: int  # P: pages of the stack
    num_layers: int  # L: stack rows
    pages_per_seq: int  # table slots a row may use from its first
    table_len: int  # N: the flat page table's slots

    @property
    def rows(self) -> int:
        """Rows of the gathered buffers: ``blocks`` rounded up to ``CHUNK``."""
        return tpu.round_up(self.blocks, CHUNK)

    @property
    def meta_words(self) -> int:
        """``[first slot, visible entries, C block ids]``."""
        return META_HEAD + self.blocks


def padded_blocks(blocks: int) -> int:
    """A row's list of ``blocks`` candidates as the kernel takes it: rounded up to 8 (a sublane
    tile) if within one chunk, else to a multiple of ``CHUNK``."""
    b = max(blocks, 1)
    return tpu.round_up(b, tpu.SUBLANES if b <= CHUNK else CHUNK)


def vmem_estimate(cfg: BlocksConfig) -> int:
    """Bytes of VMEM: the gathered block and scale rows and the slot rows (``SLOTS`` rows'
    worth), one chunk's decode temporaries (aligned words, codes, keys in f32 and the compute
    dtype, the scores), q, the weights and the output block (double-buffered)."""
    row = tpu.LANES * 4
    gathered = SLOTS * 3 * cfg.rows * row
    chunk = CHUNK * row * 6 + tpu.round_up(cfg.heads, tpu.SUBLANES) * tpu.LANES * 4 * 2
    blocks = 2 * (cfg.heads * row + tpu.SUBLANES * row
                  + ib.BLOCK * tpu.round_up(cfg.blocks, tpu.LANES) * 4)
    return gathered + chunk + blocks


def cost_estimate(cfg: BlocksConfig, rows: int, q_itemsize: int) -> pl.CostEstimate:
    """Upper bound for ``rows`` rows (XLA's view of the call; ``entry.traffic`` is the exact
    count): a row's ids are distinct and ascending (the entry's), so it reads at most one block
    row a candidate and one scale row each, neither more than its pages hold
    (``pages_per_seq`` pages of ``ib.block_rows`` and ``ib.scale_rows``); the meta, q, the
    weights and the output once."""
    block_rows = min(cfg.blocks, cfg.pages_per_seq * ib.block_rows(cfg.page_size))
    scale_rows = min(cfg.blocks, cfg.pages_per_seq * ib.scale_rows(cfg.page_size))
    per_row = (4 * cfg.meta_words + (block_rows + scale_rows) * ib.ROW_BYTES
               + cfg.heads * ib.DIM * q_itemsize + 4 * cfg.heads + 4 * ib.BLOCK * cfg.blocks)
    entries = rows * cfg.blocks * ib.BLOCK
    return pl.CostEstimate(flops=2 * entries * cfg.heads * ib.DIM, transcendentals=0,
                           bytes_accessed=rows * per_row)


def _locate(cfg: BlocksConfig, meta, table, layer, i):
    """Candidate ``i``'s ``(page id, block row)``: it reads iff its id is a block of the row's
    pages (``0 <= id < pages_per_seq * ps / 8``), it holds a visible entry (``8 id < lens``), the
    row has a first slot, the slot is in the table, the page id in ``[0, P)`` and ``layer`` in
    ``[0, L)``; page ``-1`` otherwise."""
    per = ib.block_rows(cfg.page_size)
    first, lens, bid = meta[0], meta[1], meta[META_HEAD + i]
    local = jnp.maximum(bid, 0) // per
    slot = first + local
    ok = ((bid >= 0) & (first >= 0) & (local < cfg.pages_per_seq) & (bid * ib.BLOCK < lens)
          & (slot < cfg.table_len) & (layer >= 0) & (layer < cfg.num_layers))
    page = table[jnp.clip(slot, 0, cfg.table_len - 1)]
    ok = ok & (page >= 0) & (page < cfg.num_pages)
    return jnp.where(ok, page, -1), jnp.maximum(bid, 0) % per


def _candidate(cfg: BlocksConfig, meta, table, layer, i):
    """Candidate ``i``'s ``(page id, block row, new scale row)`` (``_locate``): the scale row is
    new unless candidate ``i - 1`` is on the same page and uses the same scale row (16 blocks a
    row)."""
    page, brow = _locate(cfg, meta, table, layer, i)
    prev, prow = _locate(cfg, meta, table, layer, jnp.maximum(i - 1, 0))
    per = ib.BLOCKS_PER_SCALE_ROW
    shares = (i > 0) & (prev == page) & (prow // per == brow // per)
    return page, brow, (page >= 0) & jnp.logical_not(shares)


def _issue(cfg: BlocksConfig, layer, table, meta, cache_hbm, kbuf, sbuf, info, sem,
           wait: bool):
    """Start (``wait=False``) or wait for (``True``) every DMA of the row: a candidate that
    reads its block row and, when new, its scale row. Its scale slot is written on start."""
    first_scale, rows = ib.block_rows(cfg.page_size), ib.page_rows(cfg.page_size)

    if not wait and cfg.rows > cfg.blocks:  # the last chunk's rows past the list: unread
        info[pl.ds(cfg.blocks, cfg.rows - cfg.blocks), :] = jnp.full(
            (cfg.rows - cfg.blocks, tpu.LANES), -1, jnp.int32)

    def one(i, carry):
        page, brow, new_scale = _candidate(cfg, meta, table, layer, i)
        base = page * rows
        if not wait:
            slot = jnp.where(page >= 0, brow % ib.BLOCKS_PER_SCALE_ROW, -1)
            info[pl.ds(i, 1), :] = jnp.full((1, tpu.LANES), slot)
        tpu.dmas(page >= 0, ((cache_hbm.at[layer, pl.ds(base + brow, 1)],
                              kbuf.at[pl.ds(i, 1)]),), sem, wait)
        scale_row = first_scale + brow // ib.BLOCKS_PER_SCALE_ROW
        tpu.dmas(new_scale, ((cache_hbm.at[layer, pl.ds(base + scale_row, 1)],
                              sbuf.at[pl.ds(i, 1)]),), sem, wait)
        return carry

    jax.lax.fori_loop(0, cfg.blocks, one, 0)


def _share(cfg: BlocksConfig, layer, table, meta, sbuf) -> None:
    """After the waits: a candidate sharing its predecessor's scale row copies it (in order, so
    a run of sharers copies down the run)."""
    def one(i, carry):
        page, _, new_scale = _candidate(cfg, meta, table, layer, i)

        @pl.when(jnp.logical_and(page >= 0, jnp.logical_not(new_scale)))
        def _():
            sbuf[pl.ds(i, 1), :] = sbuf[pl.ds(i - 1, 1), :]
        return carry

    jax.lax.fori_loop(1, cfg.blocks, one, 0)


def _chunk_scores(cfg: BlocksConfig, q, wcol, codes, scale_rows, slot):
    """A chunk's scores: ``codes / scale_rows u32[n, 128]``, ``slot i32[n, 1]`` -> ``f32[8, n]``
    (row ``j``: each candidate's entry ``j``; ``n = CHUNK``)."""
    cdt = jnp.bfloat16 if cfg.precision == "bf16" else jnp.float32
    hi = None if cfg.precision == "bf16" else jax.lax.Precision.HIGHEST
    rb = tpu.rounding(cfg.precision)
    reads = tpu.sublanes_to_lanes(jnp.broadcast_to(jnp.where(slot >= 0, 1, 0),
                                                   codes.shape))  # bool[1, n]
    words = tpu.align_slot(scale_rows, slot, ib.BLOCK)
    lane = jax.lax.broadcasted_iota(jnp.int32, codes.shape, 1)
    shift = (lane // INDEX_BLOCK * BYTE_BITS).astype(jnp.uint32)
    out = []
    for j in range(ib.BLOCK):
        nib = ((codes >> (NIBBLE_BITS * j)) & jnp.uint32(0xF)).astype(jnp.int32)
        word = jnp.broadcast_to(words[:, j:j + 1], codes.shape)
        scale = ue8m0_values(((word >> shift) & jnp.uint32(0xFF)).astype(jnp.int32))
        keys = (e2m1_values(nib) * scale).astype(cdt)
        s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=hi,
                                preferred_element_type=jnp.float32)  # [H, n]
        s = rb(jnp.maximum(rb(s), 0.0) * wcol)
        out.append(rb(jnp.sum(s, axis=0, keepdims=True)))
    return jnp.where(reads, jnp.concatenate(out, axis=0), -jnp.inf)


def _kernel(cfg: BlocksConfig, layer, table, q_ref, w_ref, meta_hbm, cache_hbm, o_ref, meta,
            kbuf, sbuf, info, sems):
    """One query row (module docstring): fetch the next row into the other slot, wait for this
    row's reads, score its candidates a chunk at a time."""
    def issue(slot, wait: bool):
        _issue(cfg, layer[0], table, meta.at[slot], cache_hbm, kbuf.at[slot], sbuf.at[slot],
               info.at[slot], sems.at[1 + slot], wait)

    slot = tpu.overlap_rows(meta_hbm, meta, sems.at[0], issue, SLOTS)
    _share(cfg, layer[0], table, meta.at[slot], sbuf.at[slot])
    cdt = jnp.bfloat16 if cfg.precision == "bf16" else jnp.float32
    q = q_ref[0].astype(cdt)
    wcol = tpu.lanes_to_column(w_ref[...])  # [H, 1]

    def scores(rows):
        return _chunk_scores(cfg, q, wcol, kbuf[slot, rows, :], sbuf[slot, rows, :],
                             info[slot, rows, 0:1])

    if cfg.blocks < CHUNK:  # one chunk, its rows past the list unread
        o_ref[0] = scores(pl.ds(0, CHUNK))[:, :cfg.blocks]
        return

    def chunk(c, carry):
        rows = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        o_ref[0, :, rows] = scores(rows)
        return carry

    jax.lax.fori_loop(0, cfg.blocks // CHUNK, chunk, 0)


@functools.partial(jax.jit, static_argnames=("cfg", "vmem_limit_bytes", "interpret"))
def blocks_call(q, w, meta, pages, layer, table, *, cfg: BlocksConfig,
                vmem_limit_bytes: int | None = None, interpret=False):
    """The ``pallas_call`` (module docstring's shapes). Returns ``f32[T, 8, C]``."""
    t = q.shape[0]
    any_ = pl.BlockSpec(memory_space=pltpu.HBM)
    lanes = tpu.LANES
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(t,),
        in_specs=[pl.BlockSpec((1, cfg.heads, ib.DIM), lambda i, lay, tab: (i, 0, 0)),
                  pl.BlockSpec((1, 1, cfg.heads), lambda i, lay, tab: (i, 0, 0)), any_, any_],
        out_specs=pl.BlockSpec((1, ib.BLOCK, cfg.blocks), lambda i, lay, tab: (i, 0, 0)),
        scratch_shapes=[pltpu.SMEM((SLOTS, cfg.meta_words), jnp.int32),
                        pltpu.VMEM((SLOTS, cfg.rows, lanes), jnp.uint32),
                        pltpu.VMEM((SLOTS, cfg.rows, lanes), jnp.uint32),
                        pltpu.VMEM((SLOTS, cfg.rows, lanes), jnp.int32),
                        pltpu.SemaphoreType.DMA((1 + SLOTS,))])
    return pl.pallas_call(
        functools.partial(_kernel, cfg), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t, ib.BLOCK, cfg.blocks), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=cost_estimate(cfg, t, q.dtype.itemsize),
        interpret=tpu.interpret_params(interpret),
    )(layer, table, q, w, meta, pages)
