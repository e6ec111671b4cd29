"""The Pallas TPU lightning-indexer score kernel shared by token and page top-k.

Module map: ``work_list`` (the XLA work list), ``blocks`` (block table, resolution, VMEM
estimate), ``scoring`` (row chunks and the selection hand-off), ``traffic`` (traffic model),
``compile_cases`` (AOT gate shapes), ``fp4`` (``index_quant="fp4_sim"`` on a key tile),
``token`` / ``page`` (the entries). This file: the static config, the kernel body, the call.

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
- q and weights are read straight from ``q [T, H, D]`` and ``weights [T, 1, H]`` by ``pl.Element``
  blocks ``[L, H, D]`` at row ``q row`` (the leading, untiled dim: any offset): no per-item
  gather in XLA. ``q row = clip(first row, 0, T - L)``; ``shift = first row - q row`` says which
  block rows are the item's (only a remainder block at the end of ``q`` is shifted).
- Scalar prefetch: the work list ``i32[W_L * 10]`` (each item carries its sequence's first
  page-table slot) and the page table ``page_indices`` as it is. The kernel looks each page up
  in SMEM on the scalar core and skips a slot outside the table or a page id outside
  ``[0, num_pages)`` (``reference.batch.lookup_page``): XLA does no per-page gather (a
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
  Compressed keys (``compression_ratio = r > 1``, ``reference.batch``): the pages hold entries,
  ``kv_len`` counts entries (the work list converts), positions stay tokens, and the causal
  mask is the entry rule ``j < (p + 1) // r``, written ``(j + 1) * r <= p + 1`` (no division).
- Token mode: the stage's scores go to a ``[L, capacity]`` VMEM row buffer (double-buffered
  across items); stages past the item's last needed block are filled with ``-inf``; then the
  item's rows are DMAed to the HBM output, one DMA per row. Page mode: per-page maxima go into
  a ``[L, page_cols]`` VMEM row buffer (``-inf`` where no page was reached), DMAed out per row
  the same way: XLA maps no slot to a row (a per-element gather there before).

- fp8 index cache (``reference.fp8_cache.Fp8IndexCache``): each page is two DMAs on the same
  semaphore, its e4m3 keys ``[page, 128]`` (whole (32, 128) tiles) and its f32 scale row
  (``scale_lanes`` lanes); keys are upcast in VMEM (exact in bf16), or stay e4m3 for an fp8
  ``q`` on tpu7x (``compute_dtypes``); the stage's scores are scaled per key after the head sum.
- Stored formats (``stored``), one DMA per page as stored, decoded in VMEM: tokamax's 256-byte
  records (``records``; ``causal_rule="tpu_inference"``, its ``j <= p // r``, beside it), the
  fp8 index pages (``fp8_pages``), V4.1's fp4 index pages (``v41_pages``: keys ``[D, nb]``).
- ``index_quant="fp4_sim"`` (DeepSeek-V4's simulation, ``reference.index_scores.fp4_sim``): q
  is rotated and FP4-simulated in the glue (``scoring``: ``[T, H, 128]``, small); each stage's
  key tile, after its DMA, is rotated by the Hadamard matrix (one ``[P*page, 128] x [128, 128]``
  MXU matmul; the matrix is built from iotas once per grid step) and FP4-rounded in VMEM
  (``fp4``). The keys stay as stored (no pass over the cache); HBM bytes are those of plain
  keys. The simulated values are exact in bf16, so the score matmul runs in bf16 with exact
  products (``compute_dtypes``).
- ``precision="bf16"`` (DeepSeek-V4's official scoring, ``reference.indexer.scores``): q is cast
  to bf16 and the weights rounded to bf16 in the glue (``scoring``), each key tile is cast to
  bf16 in VMEM (a no-op for a bf16 cache), the bf16 matmul accumulates in f32; the stage then
  rounds each dot to bf16, each ``relu(dot) * w`` to bf16, and the f32 head sum once. Same
  bytes and MXU work as the plain bf16 path; a few VPU converts per score.

Traffic (``traffic``): keys ``sum over items of pages_needed * page_size * D * itemsize`` (each
sequence's causal keys ``ceil(n / R_max)`` times; decode once); q and the lane-padded weight
column once per q block fetched; scores written once. MXU flops ``2 * L * H * D`` a key an item.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import chips, tpu
from pallas_kernels.indexer import fp4, fp8_pages, records, stored, v41_pages
from pallas_kernels.indexer import work_list as wl
from pallas_kernels.indexer.blocks import IndexerBlocks, vmem_estimate
from pallas_kernels.indexer.work_list import level_bound, row_ladder
from pallas_kernels.tpu import LANES
from reference.core import batch
from reference.formats import fp8_cache, stacked
from reference.quant import fp8

NEG_INF = float("-inf")


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
    chip: str | None = None  # the VMEM cap's chip (``tpu.vmem_limit``)
    scale_lanes: int = 0  # fp8 index cache: lanes of a page's scale row (0: no key scales)
    num_layers: int = 1  # L of the stacked cache the kernel reads in place
    compression_ratio: int = 1  # r: keys are entries of r tokens (``reference.batch``)
    index_quant: str | None = None  # "fp4_sim": keys rotated and FP4-rounded in VMEM (``fp4``)
    precision: str = "f32"  # "bf16": the official rounding of dots, products and head sums
    cache_format: str | None = None  # stored.FORMATS: a cache read as its bytes (records...)
    causal_rule: str = "official"  # "tpu_inference": entry j visible iff j <= p // r

    @property
    def records(self) -> bool:
        """Read as stored, decoded in VMEM (``stored``: tokamax's records, fp8 pages)."""
        return self.cache_format is not None

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
    def key_scales(self) -> bool:
        """Keys come with per-token f32 scales (an ``Fp8IndexCache``)."""
        return self.scale_lanes > 0

    @property
    def page_cols(self) -> int:
        """Page-score columns in VMEM/HBM: whole 128-lane groups."""
        return -(-self.num_blocks * self.block_pages // LANES) * LANES


# ----------------------------------------------------------------------------- static config


def make_configs(q, cache_kv, *, rows: int, num_seqs: int, pages_per_seq: int,
                 blocks: IndexerBlocks, page_mode: bool, one_token_per_seq: bool,
                 chip: str | None = None, compression_ratio: int = 1,
                 index_quant: str | None = None, precision: str = "f32",
                 causal_rule: str = "official") -> list[ScoreConfig]:
    """Static configs of one chunk of ``rows`` query rows: one per ladder level, ascending.
    ``cache_kv``: the stacked cache ``[L, P, ps, D]`` (``reference.stacked``) or one layer;
    ``precision``: ``"f32"`` or ``"bf16"`` (checked by the entries; module docstring);
    ``causal_rule``: ``"official"`` or ``"tpu_inference"`` (``records``' entry checks it).
    """
    total_rows, heads, dim = q.shape
    *lead, num_pages, page_size, _ = cache_kv.shape
    num_layers = lead[0] if lead else 1
    compute, key_dtype, lanes = compute_dtypes(q, cache_kv, chip, index_quant, precision)
    ladder = row_ladder(blocks.block_rows, rows, one_token_per_seq)
    return [ScoreConfig(page_mode=page_mode, rows=rows, total_rows=total_rows, block_rows=size,
                        block_pages=blocks.block_pages,
                        num_items=level_bound(ladder, i, rows, num_seqs), heads=heads, dim=dim,
                        page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages,
                        compute_dtype=compute, key_dtype=key_dtype, chip=chip,
                        scale_lanes=lanes, num_layers=num_layers,
                        compression_ratio=compression_ratio, index_quant=index_quant,
                        precision=precision, causal_rule=causal_rule,
                        cache_format=stored.cache_format(cache_kv))
            for i, size in enumerate(ladder)]


def compute_dtypes(q, cache_kv, chip: str | None, index_quant: str | None = None,
                   precision: str = "f32") -> tuple[jnp.dtype, jnp.dtype, int]:
    """``(compute dtype, key dtype, scale lanes)`` of a call. Plain keys: the promotion of q's
    and the keys' dtypes (f32 or bf16). An ``Fp8IndexCache``: e4m3 keys upcast in VMEM to bf16
    (f32 for an f32 query): every e4m3 value is exact in bf16, so products are exact; an fp8
    query stays fp8 on tpu7x (the fp8 MXU path, twice the bf16 rate) and is upcast to bf16
    elsewhere (v5e has no fp8 MXU; v6e runs fp8 at the bf16 rate). ``index_quant="fp4_sim"``:
    bf16, whatever q's and the keys' dtypes (q and keys are then e2m1 values times powers of
    two, exact in bf16: the products are exact and accumulate in f32). ``precision="bf16"``
    (f32/bf16 keys only: the entries refuse an fp8 cache): bf16, q and the key tiles cast to
    it (the official operands)."""
    if isinstance(cache_kv, records.RecordCache):  # exact e4m3 codes; f32 q stays f32
        return _records_compute(q), jnp.dtype(jnp.uint8), 0
    if isinstance(cache_kv, fp8_pages.PagesCache):  # the Fp8IndexCache's codes, as bytes
        return compute_dtypes(q, fp8_pages.stand_in(cache_kv), chip)[0], jnp.uint8, 0
    if isinstance(cache_kv, v41_pages.PagesCache):  # fp4 values x 2^e: exact in bf16
        return _records_compute(q, precision), jnp.dtype(jnp.uint8), 0
    if isinstance(cache_kv, fp8_cache.Fp8IndexCache):
        if q.dtype == fp8.FP8_DTYPE:
            fp8_mxu = chip is not None and chips.get(chip).fp8_mxu
            compute = fp8.FP8_DTYPE if fp8_mxu else jnp.dtype(jnp.bfloat16)
        else:
            compute = jnp.dtype(jnp.promote_types(q.dtype, jnp.bfloat16))
        return jnp.dtype(compute), fp8.FP8_DTYPE, fp8_cache.scale_lanes(cache_kv.page_size)
    if index_quant is not None or precision == "bf16":
        return jnp.dtype(jnp.bfloat16), jnp.dtype(cache_kv.dtype), 0
    compute = jnp.promote_types(q.dtype, cache_kv.dtype)
    if compute not in (jnp.float32, jnp.bfloat16):
        compute = jnp.dtype(jnp.float32)
    return jnp.dtype(compute), jnp.dtype(cache_kv.dtype), 0


def _records_compute(q, precision: str = "f32") -> jnp.dtype:
    """Stored codes exact in bf16: bf16, f32 for an f32 query at ``precision="f32"``."""
    return jnp.dtype(jnp.bfloat16 if precision == "bf16" else
                     jnp.promote_types(q.dtype, jnp.bfloat16))


def check_config(cfg: ScoreConfig, *, mosaic: bool) -> None:
    """Refuse a config Mosaic cannot compile (``ValueError`` with the numbers). Measured by
    ``scripts/cost/compile_grid.py`` over page sizes 8..256, heads 1..64, both key dtypes, decode
    and mixed batches on v5e, v6e and tpu7x: the one failing class was a token-mode stage that
    is not whole 128-lane groups, which ``blocks.resolve_blocks`` widens away; this is the
    guard that a config built another way cannot reach Mosaic."""
    if cfg.block_pages > LANES:
        raise ValueError(f"block_pages={cfg.block_pages} must be <= {LANES}")
    if mosaic and not cfg.page_mode and cfg.block_tokens % LANES:
        raise ValueError(f"a token-mode stage of block_pages * page_size = {cfg.block_pages} * "
                         f"{cfg.page_size} = {cfg.block_tokens} tokens is not a multiple of "
                         f"{LANES} lanes; Mosaic cannot store it (use blocks.resolve_blocks)")


# ----------------------------------------------------------------------------- kernel body


def _field(items_ref, w, f):
    return items_ref[w * wl.NF + f]


def _page_copies(cfg: ScoreConfig, items_ref, table_ref, layer_ref, cache_hbm, kbuf, ksem, w,
                 blk, slot):
    """``[(fetch?, descriptor)]`` for the ``P`` pages of stage ``blk`` of item ``w``;
    ``cache_hbm`` / ``kbuf`` are ``(keys, scales)`` pairs for an fp8 cache (each page's scale
    row is a second DMA on the same semaphore, started and waited under the same condition).

    Page ``j`` of the item's sequence is ``table[slot0 + j]`` (the page table in SMEM, read on
    the scalar core): fetched only if ``j`` is a page the item needs, the slot lies inside the
    table and the page id inside ``[0, num_pages)`` (``reference.batch.lookup_page``, the rule
    every op uses), from layer ``layer_ref[0]`` of the stacked cache, read in place; a layer
    outside ``[0, L)`` fetches nothing (``reference.stacked``)."""
    npages, slot0 = _field(items_ref, w, wl.NPAGES), _field(items_ref, w, wl.SLOT0)
    layer = layer_ref[0]
    layer_ok = stacked.layer_ok(layer, cfg.num_layers)
    layer = jnp.clip(layer, 0, cfg.num_layers - 1)
    out = []
    for p in range(cfg.block_pages):
        j = blk * cfg.block_pages + p
        pid, ok = batch.lookup_page(table_ref, slot0 + j, cfg.num_pages)
        ok &= (j < npages) & layer_ok
        pid = jnp.clip(pid, 0, cfg.num_pages - 1)
        if cfg.key_scales:
            (keys, scales), (kb, sb) = cache_hbm, kbuf
            out.append((ok, pltpu.make_async_copy(keys.at[layer, pid], kb.at[slot, p],
                                                  ksem.at[slot])))
            out.append((ok, pltpu.make_async_copy(scales.at[layer, pl.ds(pid, 1)],
                                                  sb.at[slot, pl.ds(p, 1)], ksem.at[slot])))
        else:
            out.append((ok, pltpu.make_async_copy(cache_hbm.at[layer, pid], kbuf.at[slot, p],
                                                  ksem.at[slot])))
    return out


def _start(copies):
    for ok, desc in copies:
        pl.when(ok)(desc.start)


def _wait(copies):
    for ok, desc in copies:
        pl.when(ok)(desc.wait)


def _stage_scores(cfg: ScoreConfig, q, wcol, keys, scales, blk, pos0, kv_eff, page_ok,
                  hadamard=None):
    """Masked scores ``f32[R, P*page]`` of one stage (``page_ok``: P traced bools); with an fp8
    cache ``scales f32[P, scale_lanes]`` scale each key's column after the head sum (the
    reference's order, ``reference.index_scores.scaled_scores``); with ``index_quant`` the key
    tile is first rotated by ``hadamard [D, D]`` and FP4-rounded (``fp4.rotate_and_round``;
    q arrives simulated). ``precision="bf16"``: ``wcol`` arrives bf16-valued; each dot, each
    ``relu(dot) * w`` and each head sum is rounded to bf16 (``tpu.round_bf16``)."""
    nb = cfg.block_tokens
    if cfg.records:  # tokamax's records: codes and the scale row decoded in VMEM
        k, scale_row = stored.decode_stage(cfg.cache_format, keys, cfg.page_size,
                                           cfg.compute_dtype, cfg.dim)
    else:
        k, scale_row = keys.reshape(nb, cfg.dim), None
    if cfg.index_quant is not None:
        k = fp4.rotate_and_round(k, hadamard)
    k = k.astype(cfg.compute_dtype)
    prec = (jax.lax.Precision.HIGHEST if cfg.compute_dtype == jnp.float32
            else jax.lax.Precision.DEFAULT)
    axis = stored.feature_axis(cfg.cache_format)  # V4.1 pages: k [D, nb]
    s = jax.lax.dot_general(q, k, (((1,), (axis,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)  # [R*H, nb]
    if cfg.precision == "bf16":
        s = tpu.round_bf16(jnp.maximum(tpu.round_bf16(s), 0.0) * wcol)
        s = tpu.round_bf16(s.reshape(cfg.block_rows, cfg.heads, nb).sum(axis=1))  # [R, nb]
    else:
        s = jnp.maximum(s, 0.0) * wcol
        s = s.reshape(cfg.block_rows, cfg.heads, nb).sum(axis=1)  # [R, nb]
    if scales is not None:  # page p's scales are lanes [0, page) of its row -> lanes of s
        s = s * jnp.concatenate([scales[p:p + 1, :cfg.page_size]
                                 for p in range(cfg.block_pages)], axis=1)
    if scale_row is not None:
        s = s * scale_row
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, nb), 1)
    fetched = jnp.zeros((1, nb), jnp.bool_)
    for p in range(cfg.block_pages):
        fetched = fetched | ((lane // cfg.page_size == p) & page_ok[p])
    tok = blk * nb + lane
    pos = pos0 + jax.lax.broadcasted_iota(jnp.int32, (cfg.block_rows, 1), 0)
    r = cfg.compression_ratio  # entry j visible iff j < (p + 1) // r, division-free:
    visible = (tok <= pos) if r == 1 else ((tok + 1) * r <= pos + 1)
    if cfg.causal_rule == "tpu_inference":  # tokamax's j <= p // r
        visible = tok * r <= pos
    ok = fetched & (tok < kv_eff) & visible
    return jnp.where(ok, s, NEG_INF)


def _put_page_max(cfg: ScoreConfig, out_ref, s, blk):
    """Max-pool ``s f32[R, P*page]`` per page into columns ``[blk*P, blk*P + P)`` of the row
    buffer ``out_ref [R, page_cols]``."""
    nb = cfg.block_tokens
    first = blk * cfg.block_pages
    g0 = pl.multiple_of((first // LANES) * LANES, LANES)
    lane_page = jax.lax.broadcasted_iota(jnp.int32, (1, nb), 1) // cfg.page_size
    col = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1) + g0
    grp = out_ref[:, pl.ds(g0, LANES)]
    for p in range(cfg.block_pages):
        m = jnp.max(jnp.where(lane_page == p, s, NEG_INF), axis=1, keepdims=True)  # [R, 1]
        grp = jnp.where(col == first + p, m, grp)
    out_ref[:, pl.ds(g0, LANES)] = grp


def _row_copies(cfg: ScoreConfig, items_ref, obuf, out_hbm, osem, w, slot):
    """One DMA per item row: block row ``j`` in ``[shift, shift + n)`` of the row buffer ->
    HBM output row ``row - shift + j``.

    Single rows because an item's first row is anywhere: Mosaic refuses a multi-row HBM slice
    at an offset it cannot prove a multiple of 8 (measured), and accepts a single row. The
    source row ``j`` is static (no dynamic sublane offset in VMEM)."""
    n, row = _field(items_ref, w, wl.NROWS), _field(items_ref, w, wl.ROW)
    shift = _field(items_ref, w, wl.SHIFT)
    out = []
    width = cfg.page_cols if cfg.page_mode else cfg.capacity
    for j in range(cfg.block_rows):
        src = obuf.at[slot, pl.ds(j, 1), pl.ds(0, width)]
        dst = out_hbm.at[pl.ds(jnp.maximum(row - shift + j, 0), 1)]
        out.append(((j >= shift) & (j < shift + n),
                    pltpu.make_async_copy(src, dst, osem.at[slot])))
    return out


def _score_kernel(cfg: ScoreConfig, aliased: bool,
                  # scalar prefetch
                  items_ref, table_ref, layer_ref,
                  # inputs (q [L, H, D], weights [L, 1, H], keys in HBM, [earlier scores])
                  q_ref, w_ref, cache_hbm, *refs):
    if cfg.key_scales:  # fp8 cache: the scale rows follow the keys (inputs and scratch)
        cache_hbm, refs = (cache_hbm, refs[0]), refs[1:]
    if aliased:  # the earlier levels' scores: the same HBM buffer as out_ref, never read here
        refs = refs[1:]
    out_ref, kbuf, ksem, base_ref, *row_scratch = refs
    if cfg.key_scales:
        kbuf, row_scratch = (kbuf, row_scratch[0]), row_scratch[1:]
    w = pl.program_id(0)
    n_items = pl.num_programs(0)
    nblk = _field(items_ref, w, wl.NBLK)
    pos0, kv_eff = _field(items_ref, w, wl.POS0), _field(items_ref, w, wl.KVLEN)
    copies = functools.partial(_page_copies, cfg, items_ref, table_ref, layer_ref, cache_hbm,
                               kbuf, ksem)

    @pl.when(w == 0)
    def _():
        base_ref[0] = 0
        _start(copies(0, 0, 0))

    base = base_ref[0]
    oslot = w % 2
    obuf, osem = row_scratch
    rows = functools.partial(_row_copies, cfg, items_ref, obuf, out_ref, osem)

    @pl.when(w >= 2)
    def _():
        _wait(rows(w - 2, oslot))  # that slot's previous rows have left VMEM

    if cfg.page_mode:  # page maxima are written per stage; pages never reached stay -inf
        obuf[oslot] = jnp.full(obuf.shape[1:], NEG_INF, jnp.float32)

    rh = cfg.block_rows * cfg.heads
    q = q_ref[...].reshape(rh, cfg.dim)
    wcol = tpu.lanes_to_column(w_ref[...])  # weights [L, 1, H] -> [L * H, 1]
    hadamard = (fp4.hadamard(cfg.dim, cfg.key_dtype) if cfg.index_quant is not None
                else None)

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
        keys, scales = (kbuf[0][slot], kbuf[1][slot]) if cfg.key_scales else (kbuf[slot], None)
        s = _stage_scores(cfg, q, wcol, keys, scales, blk, pos0, kv_eff,
                          [ok for ok, _ in mine[::2 if cfg.key_scales else 1]], hadamard)
        if cfg.page_mode:
            _put_page_max(cfg, obuf.at[oslot], s, blk)
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


# ----------------------------------------------------------------------------- pallas_call


def score_call(cfg: ScoreConfig, q, wcol, cache_kv, layer, items, page_table, prev, *,
               vmem_limit_bytes: int | None, interpret):
    """One level's kernel call for the chunk's rows.

    ``q: [T, H, D]`` in the compute dtype, ``wcol: f32[T, 1, H]``, ``cache_kv`` the stacked
    cache ``[L, P, ps, D]`` (or fp8 pytree) read in place at ``layer`` (an i32 scalar,
    scalar-prefetched: one compiled kernel serves every layer). ``prev`` is the earlier
    levels' ``f32[C, width]`` (``None`` for the first level; width: token mode ``capacity``,
    page mode ``page_cols``) and the result is it with this level's rows written, one DMA per
    row (rows outside sequences undefined): no slot-to-row map in XLA."""
    check_config(cfg, mosaic=interpret is False)
    r, h, d = cfg.block_rows, cfg.heads, cfg.dim
    aliased = prev is not None
    kernel = functools.partial(_score_kernel, cfg, aliased)
    page_shape = stored.page_shape(cfg.cache_format, cfg.page_size, d)
    scratch = [pltpu.VMEM((2, cfg.block_pages, *page_shape), cfg.key_dtype),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((1,), jnp.int32)]
    if cfg.key_scales:  # the stage's scale rows, double-buffered like the keys
        scratch.append(pltpu.VMEM((2, cfg.block_pages, cfg.scale_lanes), jnp.float32))
    width = cfg.page_cols if cfg.page_mode else cfg.num_blocks * cfg.block_tokens
    out_shape = jax.ShapeDtypeStruct(
        (cfg.rows, cfg.page_cols if cfg.page_mode else cfg.capacity), jnp.float32)
    out_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    scratch += [pltpu.VMEM((2, r, width), jnp.float32), pltpu.SemaphoreType.DMA((2,))]
    est = vmem_estimate(block_rows=r, block_pages=cfg.block_pages, num_heads=h, dim=d,
                        page_size=cfg.page_size, pages_per_seq=cfg.pages_per_seq,
                        key_itemsize=max(1, _key_bytes(cfg) // d),  # V4.1: half a byte
                        q_itemsize=cfg.compute_dtype.itemsize, page_mode=cfg.page_mode,
                        scale_lanes=_scale_lanes(cfg), index_quant=cfg.index_quant)
    limit = tpu.vmem_limit(est, cfg.chip, vmem_limit_bytes)

    def q_rows(w, items_ref, _pages, _layer):  # element offset of the item's q block
        return items_ref[w * wl.NF + wl.QROW], 0, 0

    in_specs = [pl.BlockSpec((pl.Element(r), pl.Element(h), pl.Element(d)), q_rows),
                pl.BlockSpec((pl.Element(r), pl.Element(1), pl.Element(h)), q_rows),
                pl.BlockSpec(memory_space=pltpu.HBM)]
    operands = [items.reshape(-1), page_table, jnp.reshape(layer, (1,)).astype(jnp.int32),
                tpu.in_hbm(q), wcol]  # pinned: no XLA prefetch copy (tpu7x)
    if cfg.key_scales:  # the fp8 cache's two arrays, read by the kernel as they are stored
        in_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
        operands += [tpu.in_hbm(cache_kv.keys), tpu.in_hbm(cache_kv.scales)]
    else:
        operands.append(tpu.in_hbm(stored.array(cfg.cache_format, cache_kv)))
    if aliased:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
        operands.append(prev)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(cfg.num_items,), in_specs=in_specs, out_specs=out_spec,
        scratch_shapes=scratch)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid_spec=grid_spec,
        input_output_aliases={len(operands) - 1: 0} if aliased else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=limit),
        cost_estimate=_cost_estimate(cfg),
        interpret=tpu.interpret_params(interpret),
    )(*operands)
    return out


def _key_bytes(cfg: ScoreConfig) -> int:
    """HBM/VMEM bytes of one key: ``dim * itemsize``, ``stored.key_bytes`` when stored."""
    return (stored.key_bytes(cfg.cache_format, cfg.page_size, cfg.dim)[0] if cfg.records
            else cfg.dim * cfg.key_dtype.itemsize)


def _scale_lanes(cfg: ScoreConfig) -> int:
    """f32 scale lanes a page moves beside its keys (``Fp8IndexCache``, fp8 index pages)."""
    return (stored.key_bytes(cfg.cache_format, cfg.page_size, cfg.dim)[1] if cfg.records
            else cfg.scale_lanes)


def _cost_estimate(cfg: ScoreConfig) -> pl.CostEstimate:
    """Upper bound: every item reads its whole capacity (the real kernel reads causal pages)."""
    toks = cfg.num_items * cfg.capacity
    flops = 2 * toks * cfg.block_rows * cfg.heads * cfg.dim
    if cfg.index_quant is not None:  # the key tile's Hadamard rotation, once per item
        flops += 2 * toks * cfg.dim * cfg.dim
    key_bytes = toks * _key_bytes(cfg)
    key_bytes += cfg.num_items * cfg.pages_per_seq * _scale_lanes(cfg) * 4
    row = cfg.heads * cfg.dim * cfg.compute_dtype.itemsize + -(-cfg.heads // LANES) * LANES * 4
    io = cfg.num_items * cfg.block_rows * row  # q rows and lane-padded weight rows [1, H]
    width = cfg.page_cols if cfg.page_mode else cfg.capacity
    io += min(cfg.rows, cfg.num_items * cfg.block_rows) * width * 4  # rows written once
    return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=key_bytes + io)

