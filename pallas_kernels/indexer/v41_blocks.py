"""A V4.1 candidate consumer's index scores reading ONLY its candidate blocks (issue 31, Deliver
4): each query row's candidate blocks of 8 entries gathered from the fp4 index keys in the block
layout (``reference.v41.index_blocks``: a block is one 512-byte row), decoded in VMEM, scored
against the row's query; the scores come back compact, ``C * 8`` a row, not ``f32[T, N]``.

Math (``reference.indexer.scores.index_scores``, ``precision="bf16"`` the official regime):
``s = sum_h rb(relu(rb(q_h . k)) * rb(w_h))`` rounded to bf16 once (``rb`` the bf16 rounding;
the identity and f32 operands at highest precision under ``"f32"``), ``k`` the decoded key
``e2m1(nibble) * 2^(scale byte - 127)`` (exact in f32 and bf16).

Shapes: ``q f32|bf16[T, H, 128]``, ``w f32[T, 1, H]`` (lane-dense, bf16-valued under
``"bf16"``), ``meta i32[T, 2 C]`` per row (the page id of each candidate block, ``-1`` none, then
its block row in the page), the pages ``u32[L, P * R, 128]`` in HBM at stack row ``layer
i32[1]`` (scalar-prefetched). Out ``f32[T, 8, C]``: entry ``j`` of candidate ``c`` at ``[t, j,
c]`` (an unread candidate's lanes hold junk: the entry masks them).

Walk (grid: one step per query row, in order; each row's meta and gathered rows in one of two
slots, ``t % 2``, so the next row's reads fly while this row computes):

- step 0 fetches row 0 into slot 0; step ``t`` fetches row ``t + 1`` into the other slot before
  it waits for its own: the row's meta into SMEM (one DMA, waited), then per candidate with a
  page ONE DMA of its block row and ONE of the scale row it uses unless the candidate before it
  (the list is sorted: ``entry``) uses the same one; its slot in that scale row (``b % 16``)
  goes to a lane-wide VMEM row (the decode needs it on sublanes);
- after the waits a candidate sharing its predecessor's scale row copies it (``_share``); then
  per chunk of ``n = CHUNK`` candidates (sublanes; a shorter list: itself rounded up to 8):
  each block's 8 scale words moved to lanes 0..7 (``tpu.align_slot``), per entry ``j`` of the
  blocks nibble plane ``j`` decoded with word ``j``'s byte ``f // 32`` on lane ``f`` -> keys
  ``[n, 128]``, ``q [H, 128] x keys^T`` on the MXU, the regime's rounding, the head sum ->
  ``[1, n]`` lanes of the output.

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
from reference.v41.formats import INDEX_BLOCK, e2m1_values, ue8m0_values

CHUNK = tpu.LANES  # candidate blocks decoded and scored at once (fewer for a shorter list)
SLOTS = 2  # rows in flight: this row's reads and the next row's
_NIBBLE, _BYTE = 4, 8


@dataclass(frozen=True)
class BlocksConfig:
    """Static facts of one call."""

    heads: int
    page_size: int
    blocks: int  # C: candidate blocks a row, a multiple of ``chunk``
    precision: str  # "bf16" | "f32"

    @property
    def chunk(self) -> int:
        """Candidates decoded at once: ``CHUNK``, or the list rounded up to 8 sublanes if
        shorter (``chunk_of``)."""
        return chunk_of(self.blocks)

    @property
    def meta_words(self) -> int:
        """``[C page ids, C block rows]``."""
        return 2 * self.blocks


def chunk_of(blocks: int) -> int:
    """Candidates a chunk for a list of ``blocks``: ``CHUNK``, or ``blocks`` rounded up to a
    multiple of 8 (a sublane tile) if that is fewer; pad the list to a multiple of it."""
    return min(CHUNK, tpu.round_up(max(blocks, 1), tpu.SUBLANES))


def vmem_estimate(cfg: BlocksConfig) -> int:
    """Bytes of VMEM: the gathered block and scale rows and the slot rows (``SLOTS`` rows'
    worth), one chunk's decode temporaries (aligned words, codes, keys in f32 and the compute
    dtype, the scores), q, the weights and the output block (double-buffered)."""
    row = tpu.LANES * 4
    gathered = SLOTS * 3 * cfg.blocks * row
    chunk = cfg.chunk * row * 6 + tpu.round_up(cfg.heads, tpu.SUBLANES) * tpu.LANES * 4 * 2
    blocks = 2 * (cfg.heads * row + tpu.SUBLANES * row
                  + ib.BLOCK * tpu.round_up(cfg.blocks, tpu.LANES) * 4)
    return gathered + chunk + blocks


def cost_estimate(cfg: BlocksConfig, rows: int, q_itemsize: int) -> pl.CostEstimate:
    """Upper bound for ``rows`` rows (XLA's view of the call): every candidate's block row and a
    scale row each (``entry.traffic`` counts the ones with a page, shared scale rows once), the
    meta, q, the weights and the output once."""
    per_row = (4 * cfg.meta_words + 2 * cfg.blocks * ib.ROW_BYTES
               + cfg.heads * ib.DIM * q_itemsize + 4 * cfg.heads + 4 * ib.BLOCK * cfg.blocks)
    entries = rows * cfg.blocks * ib.BLOCK
    return pl.CostEstimate(flops=2 * entries * cfg.heads * ib.DIM, transcendentals=0,
                           bytes_accessed=rows * per_row)


def _candidate(cfg: BlocksConfig, meta, i):
    """Candidate ``i``'s ``(page id, block row, new scale row)``: the scale row is new unless
    candidate ``i - 1`` is on the same page and uses the same scale row (16 blocks a row)."""
    c, per = cfg.blocks, ib.BLOCKS_PER_SCALE_ROW
    page, brow = meta[i], meta[c + i]
    j = jnp.maximum(i - 1, 0)
    same = jnp.logical_and(i > 0, meta[j] == page)
    shares = jnp.logical_and(same, meta[c + j] // per == brow // per)
    return page, brow, jnp.logical_and(page >= 0, jnp.logical_not(shares))


def _issue(cfg: BlocksConfig, layer, meta, cache_hbm, kbuf, sbuf, info, sem, wait: bool):
    """Start (``wait=False``) or wait for (``True``) every DMA of the row: a candidate with a
    page its block row and, when new, its scale row. Its scale slot is written on start."""
    first_scale, rows = ib.block_rows(cfg.page_size), ib.page_rows(cfg.page_size)

    def one(i, carry):
        page, brow, new_scale = _candidate(cfg, meta, i)
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


def _share(cfg: BlocksConfig, meta, sbuf) -> None:
    """After the waits: a candidate sharing its predecessor's scale row copies it (in order, so
    a run of sharers copies down the run)."""
    def one(i, carry):
        page, _, new_scale = _candidate(cfg, meta, i)

        @pl.when(jnp.logical_and(page >= 0, jnp.logical_not(new_scale)))
        def _():
            sbuf[pl.ds(i, 1), :] = sbuf[pl.ds(i - 1, 1), :]
        return carry

    jax.lax.fori_loop(1, cfg.blocks, one, 0)


def _chunk_scores(cfg: BlocksConfig, q, wcol, codes, scale_rows, slot):
    """A chunk's scores: ``codes / scale_rows u32[n, 128]``, ``slot i32[n, 1]`` -> ``f32[8, n]``
    (row ``j``: each candidate's entry ``j``; ``n = cfg.chunk``)."""
    cdt = jnp.bfloat16 if cfg.precision == "bf16" else jnp.float32
    hi = None if cfg.precision == "bf16" else jax.lax.Precision.HIGHEST
    rb = tpu.rounding(cfg.precision)
    words = tpu.align_slot(scale_rows, slot, ib.BLOCK)
    lane = jax.lax.broadcasted_iota(jnp.int32, codes.shape, 1)
    shift = (lane // INDEX_BLOCK * _BYTE).astype(jnp.uint32)
    out = []
    for j in range(ib.BLOCK):
        nib = ((codes >> (_NIBBLE * j)) & jnp.uint32(0xF)).astype(jnp.int32)
        word = jnp.broadcast_to(words[:, j:j + 1], codes.shape)
        scale = ue8m0_values(((word >> shift) & jnp.uint32(0xFF)).astype(jnp.int32))
        keys = (e2m1_values(nib) * scale).astype(cdt)
        s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=hi,
                                preferred_element_type=jnp.float32)  # [H, n]
        s = rb(jnp.maximum(rb(s), 0.0) * wcol)
        out.append(rb(jnp.sum(s, axis=0, keepdims=True)))
    return jnp.concatenate(out, axis=0)


def _kernel(cfg: BlocksConfig, layer, q_ref, w_ref, meta_hbm, cache_hbm, o_ref, meta, kbuf,
            sbuf, info, sems):
    """One query row (module docstring): fetch the next row into the other slot, wait for this
    row's reads, score its candidates a chunk at a time."""
    t, n = pl.program_id(0), pl.num_programs(0)

    def issue(slot, wait: bool):
        _issue(cfg, layer[0], meta.at[slot], cache_hbm, kbuf.at[slot], sbuf.at[slot],
               info.at[slot], sems.at[1 + slot], wait)

    def fetch(row, slot):
        load = pltpu.make_async_copy(meta_hbm.at[row], meta.at[slot], sems.at[0])
        load.start()
        load.wait()
        issue(slot, wait=False)

    slot = t % SLOTS
    pl.when(t == 0)(lambda: fetch(0, 0))
    pl.when(t + 1 < n)(lambda: fetch(t + 1, (t + 1) % SLOTS))
    issue(slot, wait=True)
    _share(cfg, meta.at[slot], sbuf.at[slot])
    cdt = jnp.bfloat16 if cfg.precision == "bf16" else jnp.float32
    q = q_ref[0].astype(cdt)
    wcol = tpu.lanes_to_column(w_ref[...])  # [H, 1]

    def chunk(c, carry):
        c0 = pl.multiple_of(c * cfg.chunk, cfg.chunk)
        rows = pl.ds(c0, cfg.chunk)
        o_ref[0, :, rows] = _chunk_scores(cfg, q, wcol, kbuf[slot, rows, :],
                                          sbuf[slot, rows, :], info[slot, rows, 0:1])
        return carry

    jax.lax.fori_loop(0, cfg.blocks // cfg.chunk, chunk, 0)


@functools.partial(jax.jit, static_argnames=("cfg", "vmem_limit_bytes", "interpret"))
def blocks_call(q, w, meta, pages, layer, *, cfg: BlocksConfig,
                vmem_limit_bytes: int | None = None, interpret=False):
    """The ``pallas_call`` (module docstring's shapes). Returns ``f32[T, 8, C]``."""
    t = q.shape[0]
    any_ = pl.BlockSpec(memory_space=pltpu.HBM)
    lanes = tpu.LANES
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(t,),
        in_specs=[pl.BlockSpec((1, cfg.heads, ib.DIM), lambda i, lay: (i, 0, 0)),
                  pl.BlockSpec((1, 1, cfg.heads), lambda i, lay: (i, 0, 0)), any_, any_],
        out_specs=pl.BlockSpec((1, ib.BLOCK, cfg.blocks), lambda i, lay: (i, 0, 0)),
        scratch_shapes=[pltpu.SMEM((SLOTS, cfg.meta_words), jnp.int32),
                        pltpu.VMEM((SLOTS, cfg.blocks, lanes), jnp.uint32),
                        pltpu.VMEM((SLOTS, cfg.blocks, lanes), jnp.uint32),
                        pltpu.VMEM((SLOTS, cfg.blocks, lanes), jnp.int32),
                        pltpu.SemaphoreType.DMA((1 + SLOTS,))])
    return pl.pallas_call(
        functools.partial(_kernel, cfg), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t, ib.BLOCK, cfg.blocks), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=cost_estimate(cfg, t, q.dtype.itemsize),
        interpret=tpu.interpret_params(interpret),
    )(layer, q, w, meta, pages)
