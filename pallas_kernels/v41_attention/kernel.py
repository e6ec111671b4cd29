"""DeepSeek-V4.1 attention over its own TPU cache pages in one Pallas kernel (issue 31, Deliver 3:
the attention part): each query row's window tokens (fp8 e4m3, ue8m0 scales per 32:
``reference.v41.window_pages``) and its top-k pool entries (fp4 e2m1, e4m3 scales per 16:
``reference.v41.pool_pages``) read in place from the stacked pages, decoded in VMEM, one
softmax with the sink.

Math (``reference.statements.deepseek_v41_layer.attend``, the official bf16 regime): ``logits
= scale * q . k`` over the row's keys (K = V = the decoded 512-dim row), ``m`` their max, ``e =
exp(logits - m)``, ``den = sum(e) + exp(sink - m)``, ``out = rb(rb(e) @ V / den)`` (``rb`` the
bf16 rounding under ``precision="bf16"``, the identity under ``"f32"``). A row with no key (a
row outside every sequence) gets zeros.

Shapes: ``q bf16|f32[T, H, D]`` in the lane order (``reference.v41.pool_pages.lane_order``: the
order both caches' records decode to; ``entry`` permutes q there and the output back), ``sink
f32[H, 1]``, ``meta i32[T, M]`` per row (``meta_words``: its position, its window's first
token, per window segment the page id and first token position, per pool entry the page id and
offset in the page; page id -1 = none), window pages ``u32[L, P, Rw, W]`` and pool pages ``u32[K,
P, Rp, W]`` in HBM at stack rows ``layers i32[2]`` (scalar-prefetched). Out ``f32[T, H, D]``
(lane order).

Walk (grid: one step per query row, in order; every row's meta and gathered rows in one of
two slots, ``t % 2``, so the next row's reads fly while this row computes):

- step 0 fetches row 0 (below) into slot 0; step ``t`` fetches row ``t + 1`` into the other
  slot before it waits for its own: the row's ``meta`` into SMEM (one DMA, waited), then its
  DMAs started;
- the window: ``S`` segments of ``seg = gcd(page_size, W / S_words)`` tokens (aligned in the
  page, so a segment's scale words share one scale row): per segment with a page, ONE DMA of
  its ``seg`` record rows and ONE of its scale row; a row's window ``max(0, p - window + 1) ..
  p`` spans at most ``S = (window - 2) // seg + 2`` segments (5 at V4.1-Flash: 160 tokens read
  for 128);
- the pool: the listed entries sorted by page and offset (``entry``); per entry with a page,
  ONE DMA of the record row holding it (two entries a row) unless its predecessor's is the
  same row, and ONE of its scale row (sixteen entries a row) likewise; its offset is kept in a
  VMEM column (its half, scale slot and validity); after the waits an entry sharing a row
  copies it from its predecessor (``_share``);
- this row's DMAs waited, the keys decoded (``decode``), exact; tokens outside the window and
  unlisted entries selected to zero (a select: a stale or NaN buffer cannot leak) and their
  logits ``-inf``; the key mask moved from sublanes to lanes by a one-hot matmul (exact);
- ``q [H, D] x keys [N, D]^T`` on the MXU (bf16 operands under ``"bf16"``, f32 at highest
  precision under ``"f32"``), the softmax, ``rb(e) @ keys``.

Not measured on a TPU: the pool reads a whole record row (512 B at ``D = 512``) for an entry of
288 B unless it shares one, and a whole scale row likewise (``traffic``); the window reads
whole segments. The grid is sequential (``"arbitrary"``): the slots carry from one step to
the next.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from pallas_kernels.v41_attention import decode
from reference.v41 import pool_pages, window_pages

INFO_LANES = tpu.LANES  # the pool entries' offset column, one lane-wide row an entry
SLOTS = 2  # rows in flight: this row's reads and the next row's


@dataclass(frozen=True)
class AttnConfig:
    """Static facts of one call."""

    heads: int
    dim: int
    window: int  # window_size (tokens)
    page_size: int
    topk: int  # pool entries a row (0: a window-only layer)
    precision: str  # "bf16" | "f32"

    @property
    def width(self) -> int:
        """W: words a page row."""
        return window_pages.record_words(self.dim)

    @property
    def seg(self) -> int:
        """Window tokens a segment: divides the page and the tokens of a scale row."""
        return math.gcd(self.page_size, window_pages.tokens_per_scale_row(self.dim))

    @property
    def segments(self) -> int:
        """S: segments a row's window can span."""
        return (self.window - 2) // self.seg + 2

    @property
    def window_rows(self) -> int:
        return self.segments * self.seg

    @property
    def meta_words(self) -> int:
        """M: ``[pos, first, S page ids, S first positions, k page ids, k offsets]``."""
        return 2 + 2 * self.segments + 2 * self.topk


def vmem_estimate(cfg: AttnConfig) -> int:
    """Bytes of VMEM: the gathered rows and the offsets column (``SLOTS`` rows' worth), the
    decoded keys (f32 and the compute copy), the logits and probabilities, q and the output
    block (double-buffered)."""
    n = cfg.window_rows + cfg.topk
    w = tpu.round_up(cfg.width, tpu.LANES) * 4
    rows = SLOTS * ((cfg.window_rows + cfg.segments + 2 * cfg.topk) * w
                    + cfg.topk * INFO_LANES * 4)
    keys = n * cfg.dim * (4 + 4)
    logits = 3 * cfg.heads * tpu.round_up(n, tpu.LANES) * 4
    blocks = 2 * 2 * cfg.heads * cfg.dim * 4
    return rows + keys + logits + blocks


def cost_estimate(cfg: AttnConfig, rows: int, q_itemsize: int) -> pl.CostEstimate:
    """Upper bound for ``rows`` rows (XLA's view of the call): every segment and listed entry
    read (``entry.traffic`` counts the ones with a page), q and the f32 output once."""
    row = 4 * cfg.width
    per_row = (4 * cfg.meta_words + cfg.segments * (cfg.seg + 1) * row + 2 * cfg.topk * row
               + cfg.heads * cfg.dim * (q_itemsize + 4))
    keys = cfg.window_rows + cfg.topk
    return pl.CostEstimate(flops=4 * rows * cfg.heads * cfg.dim * keys,
                           transcendentals=rows * cfg.heads * keys, bytes_accessed=rows * per_row)


def _window_keys(cfg: AttnConfig, meta, wbuf, wsbuf):
    """The window's decoded rows ``f32[S * seg, D]`` (zero where not attended) and their
    validity ``i32[S * seg, 128]`` (0 / 1; Mosaic selects no i1 vectors) from the row's meta
    (SMEM) and the gathered rows."""
    s_n, seg, ps = cfg.segments, cfg.seg, cfg.page_size
    shape = (cfg.window_rows, INFO_LANES)
    r = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    which, i = r // seg, r % seg
    base = jnp.zeros(shape, jnp.int32)
    has = jnp.zeros(shape, jnp.int32)
    for s in range(s_n):
        base = jnp.where(which == s, meta[2 + s_n + s], base)
        has = jnp.where(which == s, jnp.where(meta[2 + s] >= 0, 1, 0), has)
    tok = base + i
    ok = jnp.where((has > 0) & (tok >= meta[1]) & (tok <= meta[0]), 1, 0)
    per = window_pages.tokens_per_scale_row(cfg.dim)
    slot = ((base % ps) + i) % per
    scales = jnp.concatenate([jnp.broadcast_to(wsbuf[s:s + 1], (seg, cfg.width))
                              for s in range(s_n)], axis=0)
    vals = decode.window_values(wbuf[...], scales, slot[:, :1], cfg.dim)
    return jnp.where(ok[:, :1] > 0, vals, 0.0), ok


def _pool_keys(cfg: AttnConfig, pinfo, pbuf, psbuf):
    """The listed entries' decoded rows ``f32[k, D]`` and validity ``i32[k, 128]`` (0 / 1)."""
    off = pinfo[...]
    ok = jnp.where(off >= 0, 1, 0)
    lay = pool_pages.layout(cfg.dim)
    col = off[:, :1]
    vals = decode.pool_values(pbuf[...], col % lay.per_row, psbuf[...],
                              col % lay.per_scale_row, cfg.dim)
    return jnp.where(ok[:, :1] > 0, vals, 0.0), ok


_to_lanes = tpu.sublanes_to_lanes  # the key mask from sublanes onto lanes
_dmas = tpu.dmas  # start or wait a row's copies where a condition holds


def _issue(cfg: AttnConfig, layers, meta, win_hbm, pool_hbm, wbuf, wsbuf, pbuf, psbuf, pinfo,
           sem, wait: bool):
    """Start (``wait=False``) or wait for (``True``) every DMA of the row: two a window segment
    with a page, two a listed entry with a page. The pool offsets column is written on start."""
    s_n, seg, ps = cfg.segments, cfg.seg, cfg.page_size
    wlay = window_pages.layout(cfg.dim)
    per_w, w_rec = wlay.per_scale_row, wlay.record_rows(ps)
    for s in range(s_n):
        pid, off = meta[2 + s], meta[2 + s_n + s] % ps
        _dmas(pid >= 0, ((win_hbm.at[layers[0], pid, pl.ds(off, seg)],
                          wbuf.at[pl.ds(s * seg, seg)]),
                         (win_hbm.at[layers[0], pid, pl.ds(w_rec + off // per_w, 1)],
                          wsbuf.at[pl.ds(s, 1)])), sem, wait)

    if not cfg.topk:
        return
    lay = pool_pages.layout(cfg.dim)
    rec_rows = lay.record_rows(ps)

    def entry(i, carry):
        pid, off, new_rec, new_scale = _entry(cfg, meta, i)
        if not wait:
            pinfo[pl.ds(i, 1), :] = jnp.full((1, INFO_LANES), jnp.where(pid >= 0, off, -1))
        _dmas(new_rec, ((pool_hbm.at[layers[1], pid, pl.ds(off // lay.per_row, 1)],
                         pbuf.at[pl.ds(i, 1)]),), sem, wait)
        _dmas(new_scale, ((pool_hbm.at[layers[1], pid,
                                       pl.ds(rec_rows + off // lay.per_scale_row, 1)],
                           psbuf.at[pl.ds(i, 1)]),), sem, wait)
        return carry

    jax.lax.fori_loop(0, cfg.topk, entry, 0)


def _entry(cfg: AttnConfig, meta, i):
    """Listed entry ``i``'s ``(page id, offset, new record row, new scale row)``: a row is new
    unless entry ``i - 1`` (the list is sorted by page and offset: ``entry``) is on the same
    page in the same record row (two entries a row) or scale row (sixteen a row); only a new
    row is fetched, an entry sharing one copies it from its predecessor (``_share``)."""
    lay, base = pool_pages.layout(cfg.dim), 2 + 2 * cfg.segments
    pid, off = meta[base + i], meta[base + cfg.topk + i]
    j = jnp.maximum(i - 1, 0)
    same = jnp.logical_and(i > 0, meta[base + j] == pid)
    prev = meta[base + cfg.topk + j]
    shares_rec = jnp.logical_and(same, prev // lay.per_row == off // lay.per_row)
    shares_scale = jnp.logical_and(same, prev // lay.per_scale_row == off // lay.per_scale_row)
    return (pid, off, jnp.logical_and(pid >= 0, jnp.logical_not(shares_rec)),
            jnp.logical_and(pid >= 0, jnp.logical_not(shares_scale)))


def _share(cfg: AttnConfig, meta, pbuf, psbuf) -> None:
    """After the waits: each listed entry that shares its record or scale row with its
    predecessor copies that row from the predecessor's slot (in order, so a run of sharers
    copies down the run)."""
    def entry(i, carry):
        pid, _, new_rec, new_scale = _entry(cfg, meta, i)
        for buf, new in ((pbuf, new_rec), (psbuf, new_scale)):
            @pl.when(jnp.logical_and(pid >= 0, jnp.logical_not(new)))
            def _(buf=buf):
                buf[pl.ds(i, 1), :] = buf[pl.ds(i - 1, 1), :]
        return carry

    jax.lax.fori_loop(1, cfg.topk, entry, 0)


def _kernel(cfg: AttnConfig, layers, q_ref, sink_ref, meta_hbm, win_hbm, *rest):
    """One query row (module docstring): fetch the next row into the other slot, wait for this
    row's reads, attend."""
    if cfg.topk:
        pool_hbm, o_ref, meta, wbuf, wsbuf, pbuf, psbuf, pinfo, sems = rest
    else:
        (o_ref, meta, wbuf, wsbuf, sems), pool_hbm = rest, None
        pbuf = psbuf = pinfo = None
    def issue(slot, wait: bool):
        at = [None if b is None else b.at[slot] for b in (wbuf, wsbuf, pbuf, psbuf, pinfo)]
        _issue(cfg, layers, meta.at[slot], win_hbm, pool_hbm, *at, sems.at[1 + slot], wait)

    slot = tpu.overlap_rows(meta_hbm, meta, sems.at[0], issue, SLOTS)
    if cfg.topk:
        _share(cfg, meta.at[slot], pbuf.at[slot], psbuf.at[slot])
    _attend(cfg, meta.at[slot], q_ref, sink_ref, o_ref, wbuf.at[slot], wsbuf.at[slot],
            *((pinfo.at[slot], pbuf.at[slot], psbuf.at[slot]) if cfg.topk else ()))


def _attend(cfg: AttnConfig, meta, q_ref, sink_ref, o_ref, wbuf, wsbuf, *pool):
    """The row's keys decoded from its slot's gathered rows (``pool``: the offsets column and
    the record and scale rows of its entries), one softmax with the sink, the output block
    written."""
    keys, ok = _window_keys(cfg, meta, wbuf, wsbuf)
    if cfg.topk:
        pkeys, pok = _pool_keys(cfg, *pool)
        keys, ok = jnp.concatenate([keys, pkeys], axis=0), jnp.concatenate([ok, pok], axis=0)
    cdt = jnp.bfloat16 if cfg.precision == "bf16" else jnp.float32
    hi = None if cfg.precision == "bf16" else jax.lax.Precision.HIGHEST
    keys = keys.astype(cdt)
    logits = jax.lax.dot_general(q_ref[0].astype(cdt), keys, (((1,), (1,)), ((), ())),
                                 precision=hi, preferred_element_type=jnp.float32)
    logits = jnp.where(_to_lanes(ok), logits * jnp.float32(cfg.dim ** -0.5), -jnp.inf)
    m = jnp.max(logits, axis=1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # no key: e = 0, out = 0
    e = jnp.exp(logits - m)
    den = jnp.sum(e, axis=1, keepdims=True) + jnp.exp(sink_ref[...] - m)
    rb = tpu.rounding(cfg.precision)
    acc = jax.lax.dot_general(rb(e).astype(cdt), keys, (((1,), (0,)), ((), ())), precision=hi,
                              preferred_element_type=jnp.float32)
    o_ref[0] = rb(acc / den)


@functools.partial(jax.jit, static_argnames=("cfg", "vmem_limit_bytes", "interpret"))
def attention_call(q, sink, meta, window_pages_, pool_pages_, layers, *, cfg: AttnConfig,
                   vmem_limit_bytes: int | None = None, interpret=False):
    """The ``pallas_call`` (module docstring's shapes; ``pool_pages_`` None when ``cfg.topk ==
    0``). Returns ``f32[T, H, D]`` in the lane order."""
    t = q.shape[0]
    w = cfg.width
    any_ = pl.BlockSpec(memory_space=pltpu.HBM)
    in_specs = [pl.BlockSpec((1, cfg.heads, cfg.dim), lambda i, lay: (i, 0, 0)),
                pl.BlockSpec((cfg.heads, 1), lambda i, lay: (0, 0)), any_, any_]
    scratch = [pltpu.SMEM((SLOTS, cfg.meta_words), jnp.int32),
               pltpu.VMEM((SLOTS, cfg.window_rows, w), jnp.uint32),
               pltpu.VMEM((SLOTS, cfg.segments, w), jnp.uint32)]
    operands = [q, sink, meta, window_pages_]
    if cfg.topk:
        in_specs.append(any_)
        operands.append(pool_pages_)
        scratch += [pltpu.VMEM((SLOTS, cfg.topk, w), jnp.uint32),
                    pltpu.VMEM((SLOTS, cfg.topk, w), jnp.uint32),
                    pltpu.VMEM((SLOTS, cfg.topk, INFO_LANES), jnp.int32)]
    scratch.append(pltpu.SemaphoreType.DMA((1 + SLOTS,)))  # the meta loads, each slot's reads
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(t,), in_specs=in_specs,
        out_specs=pl.BlockSpec((1, cfg.heads, cfg.dim), lambda i, lay: (i, 0, 0)),
        scratch_shapes=scratch)
    return pl.pallas_call(
        functools.partial(_kernel, cfg), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t, cfg.heads, cfg.dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=cost_estimate(cfg, t, q.dtype.itemsize),
        interpret=tpu.interpret_params(interpret),
    )(layers, *operands)
