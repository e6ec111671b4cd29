"""The entry of the candidate-block kernel (``v41_blocks``; issue 31, Deliver 4): a V4.1 candidate
consumer's index scores and top-k reading only its candidate blocks from the fp4 index keys in
the block layout (``reference.v41.index_blocks``), and the kernel's traffic model.

    scores, entries = candidate_scores_v41(q, weights, blocks, candidates, page_indices,
                                           first_slot, lens, pages_per_seq=n, page_size=128,
                                           layer=l)
    top = candidate_topk_v41(q, weights, blocks, candidates, page_indices, first_slot, lens,
                             k=512, pages_per_seq=n, page_size=128, layer=l)

Per row ``t``: ``candidates[t]`` its block ids (row-local, ``candidate_block_size = 8`` entries
each, any order; ``-1``, ids past the row's pages and repeats add nothing); its row-local page
``j`` is ``page_indices[first_slot[t] + j]`` for ``j < pages_per_seq`` (the package's slot
rule; ``first_slot`` ``-1``: none); ``lens[t]`` its visible entries (entry ``j`` visible iff ``j
< lens[t]``: the caller's causal count). The compact scores hold, for each row's distinct
candidate blocks ascending (``reference.v41.candidates.unique_blocks``, ``C'`` slots), entry
``j`` of slot ``c`` at position ``j C + c`` (the kernel's lane-dense order: an entry-order
``[T, C, 8]`` would pad 8 lanes to 128 on TPU), ``-inf`` / entry ``-1`` where the slot is void,
the entry not visible or its page not readable; the top-``k`` is
``reference.v41.candidates.ranked_entries`` of them (one sort by score then entry: the declared
tie rule, NaN first, value descending, lower index, whatever the positions), the same as
``restricted_topk`` over the whole row's scores. Pages are looked up in the kernel (the page
table scalar-prefetched), not by an XLA gather an id (XLA's TPU model prices such a gather at
~5 KB an index: 153 MB for 16 rows of 2048 candidates, measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import aot, tpu
from pallas_kernels.indexer.v41_blocks import (
    META_HEAD,
    BlocksConfig,
    blocks_call,
    padded_blocks,
    vmem_estimate,
)
from reference.core import checks
from reference.quant.bf16 import round_bf16
from reference.v41 import index_blocks as ib
from reference.v41.candidates import ranked_entries, unique_blocks
from reference.v41.formats import index_fp4_bytes

_WHERE = "candidate_scores_v41"


def _check(q, weights, cache, candidates, page_indices, first_slot, lens, pages_per_seq,
           page_size, layer, precision):
    """Static shape and dtype checks, each naming the argument and both numbers."""
    checks.floating("q", q)
    checks.rank("q", q, 3)
    ib.check_geometry(page_size, q.shape[2], ib.BLOCK, _WHERE)
    checks.positive_int("pages_per_seq", pages_per_seq, _WHERE)
    t, h, _ = q.shape
    checks.floating("weights", weights)
    checks.rank("weights", weights, 2)
    checks.dim("weights", weights, 0, t, "q.shape[0] (rows)")
    checks.dim("weights", weights, 1, h, "q.shape[1] (heads)")
    ib.check_pages(cache, page_size, "cache_kv", _WHERE)
    checks.integer("page_indices", page_indices)
    checks.rank("page_indices", page_indices, 1)
    for name, x, r in (("candidates", candidates, 2), ("first_slot", first_slot, 1),
                       ("lens", lens, 1)):
        checks.integer(name, x)
        checks.rank(name, x, r)
        checks.dim(name, x, 0, t, "q.shape[0] (rows)")
    if precision not in ("bf16", "f32"):
        raise ValueError(f"{_WHERE}: precision must be 'bf16' or 'f32', got {precision!r}")
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) \
            and not 0 <= int(layer) < cache.shape[0]:
        raise ValueError(f"{_WHERE}: layer={int(layer)} is outside [0, {cache.shape[0]}) (the "
                         f"stack's rows)")


def _distinct(candidates, pages_per_seq: int, page_size: int):
    """``i32[T, C]``: each row's distinct ids of blocks of its pages, ascending, ``-1`` void."""
    nb = pages_per_seq * ib.block_rows(page_size)
    ids = unique_blocks(candidates, nb)
    return jnp.where(ids < nb, ids, -1)


def candidate_meta(candidates, page_indices, first_slot, lens, *, pages_per_seq: int,
                   page_size: int, num_pages: int, layer=0, num_layers: int = 1):
    """What the kernel reads, in jnp (its traffic model's and the tests' view; the kernel looks
    pages up itself): ``(ids, page, row)`` each ``i32[T, C]``, each row's distinct candidate
    blocks ascending (``-1`` void), the page id each reads (``-1``: nothing, ``v41_blocks.
    _locate``'s rule) and its block row in the page."""
    ids = _distinct(candidates, pages_per_seq, page_size)
    per = ib.block_rows(page_size)
    first = first_slot.astype(jnp.int32)[:, None]
    local = jnp.maximum(ids, 0) // per
    slot = first + local
    n = page_indices.shape[0]
    layer = jnp.asarray(layer, jnp.int32)
    ok = ((ids >= 0) & (first >= 0) & (local < pages_per_seq) & (slot < n)
          & (ids * ib.BLOCK < lens.astype(jnp.int32)[:, None]) & (layer >= 0)
          & (layer < num_layers))
    page = page_indices.astype(jnp.int32)[jnp.clip(slot, 0, max(n - 1, 0))] if n else slot
    ok = ok & (page >= 0) & (page < num_pages)
    return ids, jnp.where(ok, page, -1), jnp.maximum(ids, 0) % per


def candidate_scores_v41(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                         candidates: jax.Array, page_indices: jax.Array, first_slot: jax.Array,
                         lens: jax.Array, *, pages_per_seq: int, page_size: int, layer=0,
                         precision: str = "bf16", chip: str | None = None,
                         vmem_limit_bytes: int | None = None,
                         interpret=False) -> tuple[jax.Array, jax.Array]:
    """Index scores of ``q f32|bf16[T, H, 128]`` (head weights ``weights f32[T, H]``) on each
    row's candidate entries only, read from ``cache_kv u32[L, P * R, 128]`` (the block layout)
    at stack row ``layer`` (module docstring for ``candidates i32[T, C]``, ``page_indices
    i32[N]``, ``first_slot i32[T]``, ``lens i32[T]``, ``pages_per_seq``).

    Returns ``(scores f32[T, 8 C], entries i32[T, 8 C])``: compact (module docstring's order),
    ``-inf`` / ``-1`` where nothing counts. Bad values: a Python-int ``layer`` outside the stack
    is a ``ValueError``; a traced one, slots past the table, page ids outside ``[0, P)`` and
    block ids outside the row's pages read nothing (``-inf``)."""
    _check(q, weights, cache_kv, candidates, page_indices, first_slot, lens, pages_per_seq,
           page_size, layer, precision)
    return _scores(q, weights, cache_kv, candidates, page_indices, first_slot, lens, layer,
                   pages_per_seq=pages_per_seq, page_size=page_size, precision=precision,
                   chip=chip, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("pages_per_seq", "page_size", "precision", "chip",
                                             "vmem_limit_bytes", "interpret"))
def _scores(q, weights, cache, candidates, page_indices, first_slot, lens, layer, *,
            pages_per_seq, page_size, precision, chip, vmem_limit_bytes, interpret):
    """``candidate_scores_v41`` after its checks (jitted)."""
    t, h, _ = q.shape
    c = candidates.shape[1]
    m = c * ib.BLOCK  # compact entries a row
    if t == 0 or c == 0:
        return jnp.full((t, m), -jnp.inf, jnp.float32), jnp.full((t, m), -1, jnp.int32)
    cp = padded_blocks(c)
    ids = jnp.pad(_distinct(candidates, pages_per_seq, page_size), ((0, 0), (0, cp - c)),
                  constant_values=-1)
    lens = lens.astype(jnp.int32)
    meta = jnp.concatenate([first_slot.astype(jnp.int32)[:, None], lens[:, None], ids], axis=1)
    w = weights.astype(jnp.float32)
    w = (round_bf16(w) if precision == "bf16" else w)[:, None, :]  # lane-dense [T, 1, H]
    table = tpu.smem_page_table(page_indices)
    cfg = BlocksConfig(h, page_size, cp, precision, cache.shape[1] // ib.page_rows(page_size),
                       cache.shape[0], pages_per_seq, table.shape[0])
    limit = tpu.vmem_limit(vmem_estimate(cfg), tpu.resolve_chip(chip), vmem_limit_bytes)
    out = blocks_call(q, w, meta, tpu.in_hbm(cache), jnp.asarray(layer, jnp.int32)[None],
                      table, cfg=cfg, vmem_limit_bytes=limit, interpret=interpret)  # [T, 8, C']
    ent = ids[:, None, :] * ib.BLOCK + jnp.arange(ib.BLOCK, dtype=jnp.int32)[None, :, None]
    ok = (ids >= 0)[:, None, :] & (ent < lens[:, None, None]) & (out != -jnp.inf)
    scores = jnp.where(ok, out, -jnp.inf)[:, :, :c].reshape(t, m)
    return scores, jnp.where(ok, ent, -1)[:, :, :c].reshape(t, m)


def candidate_topk_v41(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                       candidates: jax.Array, page_indices: jax.Array, first_slot: jax.Array,
                       lens: jax.Array, *, k: int, pages_per_seq: int, page_size: int, layer=0,
                       precision: str = "bf16", chip: str | None = None,
                       vmem_limit_bytes: int | None = None, interpret=False) -> jax.Array:
    """A V4.1 candidate consumer's top-``k`` (``index_topk``) among each row's candidate entries,
    reading only those (``candidate_scores_v41``' arguments): ``i32[T, k]`` row-local entries in
    the declared order, ``-1`` tail (``reference.v41.restricted_topk``'s result on the same
    scores)."""
    checks.positive_int("k", k, "candidate_topk_v41")
    scores, entries = candidate_scores_v41(
        q, weights, cache_kv, candidates, page_indices, first_slot, lens,
        pages_per_seq=pages_per_seq, page_size=page_size, layer=layer, precision=precision,
        chip=chip, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    return ranked_entries(scores, entries, entries >= 0, k)


def _scale_rows(page: np.ndarray, row: np.ndarray) -> int:
    """Scale rows the kernel fetches: per row of the call, a candidate with a page counts one
    unless the candidate before it is on the same page in the same scale row (``v41_blocks.
    _candidate``: the list order, not a set)."""
    n = 0
    for p, r in zip(page, row, strict=True):
        srow = r // ib.BLOCKS_PER_SCALE_ROW
        prev_same = np.zeros(p.shape, bool)
        prev_same[1:] = (p[1:] == p[:-1]) & (srow[1:] == srow[:-1])
        n += int(((p >= 0) & ~prev_same).sum())
    return n


def traffic(ids, page, row, lens, *, heads: int, q_itemsize: int = 2) -> aot.Traffic:
    """HBM bytes and DMA descriptors of one call from its ``candidate_meta`` (NumPy ``ids``,
    ``page``, ``row`` ``i32[T, C]``) and ``lens``: per row its meta (one DMA of ``2 + C'`` words,
    ``C'`` = ``v41_blocks.padded_blocks(C)``), per candidate with a page its
    512-byte block row (one DMA), per scale row fetched (``_scale_rows``) 512 bytes (one DMA),
    q, the weights (a lane-padded row) and the output block ``f32[8, C']`` (lane-padded: a
    short list's block moves 128 lanes) (three block copies). Minimum: each read candidate's
    visible entries at the format's 68 B and a score each, q and the weights once."""
    ids, page, row = np.asarray(ids), np.asarray(page), np.asarray(row)
    lens = np.asarray(lens)
    t, c = page.shape
    cp = padded_blocks(c)
    blocks = int((page >= 0).sum())
    scales = _scale_rows(page, row)
    per_row = (4 * (META_HEAD + cp) + heads * ib.DIM * q_itemsize + tpu.LANES * 4
               + 4 * ib.BLOCK * tpu.round_up(cp, tpu.LANES))
    moved = t * per_row + (blocks + scales) * ib.ROW_BYTES
    seen = np.clip(lens[:, None] - ids * ib.BLOCK, 0, ib.BLOCK)
    entries = int(np.where(page >= 0, seen, 0).sum())
    bytes_min = (entries * (index_fp4_bytes(ib.DIM) + 4)
                 + t * heads * (ib.DIM * q_itemsize + 4))
    cfg = BlocksConfig(heads, ib.BLOCK, cp, "bf16", 1, 1, 1, 1)
    return aot.Traffic(bytes_moved=moved, bytes_min=bytes_min,
                       flops=2 * t * cp * ib.BLOCK * heads * ib.DIM,
                       vmem_bytes=vmem_estimate(cfg), dmas=t * 4 + blocks + scales)
