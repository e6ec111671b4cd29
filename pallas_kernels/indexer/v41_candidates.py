"""The entry of the candidate-block kernel (``v41_blocks``; issue 31, Deliver 4): a V4.1 candidate
consumer's index scores and top-k reading only its candidate blocks from the fp4 index keys in
the block layout (``reference.v41.index_blocks``), and the kernel's traffic model.

    scores, entries = candidate_scores_v41(q, weights, blocks, candidates, row_pages, lens,
                                           page_size=128, layer=l)
    top = candidate_topk_v41(q, weights, blocks, candidates, row_pages, lens, k=512,
                             page_size=128, layer=l)

Per row ``t``: ``candidates[t]`` its block ids (row-local, ``candidate_block_size = 8`` entries
each, any order; ``-1``, ids past the row's pages and repeats add nothing), ``row_pages[t]`` its
page table (row-local page -> page id, ``-1`` none), ``lens[t]`` its visible entries (entry
``j`` visible iff ``j < lens[t]``: the caller's causal count). The compact scores list each
row's distinct candidate blocks ascending (``reference.v41.candidates.unique_blocks``), 8
entries each: ``-inf`` (entry ``-1``) where the slot is void, the entry not visible or its page
not readable; the top-``k`` is ``reference.v41.candidates.compact_topk`` of them, the declared
tie rule (NaN first, value descending, lower index), the same as ``restricted_topk`` over the
whole row's scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import aot, tpu
from pallas_kernels.indexer.v41_blocks import BlocksConfig, blocks_call, chunk_of, vmem_estimate
from reference.core import checks
from reference.quant.bf16 import round_bf16
from reference.v41 import index_blocks as ib
from reference.v41.candidates import compact_topk, unique_blocks
from reference.v41.formats import index_fp4_bytes

_WHERE = "candidate_scores_v41"


def _check(q, weights, cache, candidates, row_pages, lens, page_size, layer, precision):
    """Static shape and dtype checks, each naming the argument and both numbers."""
    checks.floating("q", q)
    checks.rank("q", q, 3)
    ib.check_geometry(page_size, q.shape[2], ib.BLOCK, _WHERE)
    t, h, _ = q.shape
    checks.floating("weights", weights)
    checks.rank("weights", weights, 2)
    checks.dim("weights", weights, 0, t, "q.shape[0] (rows)")
    checks.dim("weights", weights, 1, h, "q.shape[1] (heads)")
    ib.check_pages(cache, page_size, "cache_kv", _WHERE)  # P: cache.shape[1] // R
    for name, x, r in (("candidates", candidates, 2), ("row_pages", row_pages, 2),
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


def candidate_meta(candidates, row_pages, lens, *, page_size: int, num_pages: int,
                   layer=0, num_layers: int = 1):
    """Each row's distinct candidate blocks ascending and where they live: ``(ids, page, row)``
    each ``i32[T, C]`` (``ids`` ``-1`` void; ``page`` the page id, ``-1`` where nothing is read:
    a void slot, a page not in ``[0, num_pages)``, a block wholly past ``lens``, a ``layer``
    outside the stack; ``row`` the block row in the page)."""
    nb = row_pages.shape[1] * ib.block_rows(page_size)
    ids = unique_blocks(candidates, nb)
    ids = jnp.where(ids < nb, ids, -1)
    page, row = ib.locate(ids, row_pages, page_size=page_size)
    layer = jnp.asarray(layer, jnp.int32)
    live = ((ids >= 0) & (ids * ib.BLOCK < lens.astype(jnp.int32)[:, None]) & (page >= 0)
            & (page < num_pages) & (layer >= 0) & (layer < num_layers))
    return ids, jnp.where(live, page, -1), row


def candidate_scores_v41(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                         candidates: jax.Array, row_pages: jax.Array, lens: jax.Array, *,
                         page_size: int, layer=0, precision: str = "bf16",
                         chip: str | None = None, vmem_limit_bytes: int | None = None,
                         interpret=False) -> tuple[jax.Array, jax.Array]:
    """Index scores of ``q f32|bf16[T, H, 128]`` (head weights ``weights f32[T, H]``) on each
    row's candidate entries only, read from ``cache_kv u32[L, P * R, 128]`` (the block layout)
    at stack row ``layer`` (module docstring for ``candidates i32[T, C]``, ``row_pages i32[T,
    pages]``, ``lens i32[T]``).

    Returns ``(scores f32[T, 8 C], entries i32[T, 8 C])``: compact, each row's distinct blocks
    ascending, ``-inf`` / ``-1`` where nothing counts. Bad values: a Python-int ``layer``
    outside the stack is a ``ValueError``; a traced one, page ids outside ``[0, P)`` and block
    ids outside the row's pages read nothing (``-inf``)."""
    _check(q, weights, cache_kv, candidates, row_pages, lens, page_size, layer, precision)
    return _scores(q, weights, cache_kv, candidates, row_pages, lens, layer,
                   page_size=page_size, precision=precision, chip=chip,
                   vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("page_size", "precision", "chip",
                                             "vmem_limit_bytes", "interpret"))
def _scores(q, weights, cache, candidates, row_pages, lens, layer, *, page_size, precision,
            chip, vmem_limit_bytes, interpret):
    """``candidate_scores_v41`` after its checks (jitted)."""
    t, h, _ = q.shape
    c = candidates.shape[1]
    ids, page, row = candidate_meta(candidates, row_pages, lens, page_size=page_size,
                                    num_pages=cache.shape[1] // ib.page_rows(page_size),
                                    layer=layer,
                                    num_layers=cache.shape[0])
    m = c * ib.BLOCK  # compact entries a row
    ent = (ids[..., None] * ib.BLOCK + jnp.arange(ib.BLOCK, dtype=jnp.int32)).reshape(t, m)
    ok = ((page >= 0)[..., None].repeat(ib.BLOCK, axis=-1).reshape(t, m)
          & (ent < lens.astype(jnp.int32)[:, None]))
    if t == 0 or c == 0:
        return jnp.full(ent.shape, -jnp.inf, jnp.float32), jnp.where(ok, ent, -1)
    cp = tpu.round_up(c, chunk_of(c))
    pad = ((0, 0), (0, cp - c))
    meta = jnp.concatenate([jnp.pad(page, pad, constant_values=-1), jnp.pad(row, pad)], axis=1)
    w = weights.astype(jnp.float32)
    w = (round_bf16(w) if precision == "bf16" else w)[:, None, :]  # lane-dense [T, 1, H]
    cfg = BlocksConfig(h, page_size, cp, precision)
    limit = tpu.vmem_limit(vmem_estimate(cfg), tpu.resolve_chip(chip), vmem_limit_bytes)
    out = blocks_call(q, w, meta, tpu.in_hbm(cache), jnp.asarray(layer, jnp.int32)[None],
                      cfg=cfg, vmem_limit_bytes=limit, interpret=interpret)
    out = jnp.swapaxes(out, 1, 2).reshape(t, cp * ib.BLOCK)[:, :m]
    return jnp.where(ok, out, -jnp.inf), jnp.where(ok, ent, -1)


def candidate_topk_v41(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                       candidates: jax.Array, row_pages: jax.Array, lens: jax.Array, *, k: int,
                       page_size: int, layer=0, precision: str = "bf16",
                       chip: str | None = None, vmem_limit_bytes: int | None = None,
                       interpret=False) -> jax.Array:
    """A V4.1 candidate consumer's top-``k`` (``index_topk``) among each row's candidate entries,
    reading only those (``candidate_scores_v41``' arguments): ``i32[T, k]`` row-local entries in
    the declared order, ``-1`` tail (``reference.v41.restricted_topk``'s result on the same
    scores)."""
    checks.positive_int("k", k, "candidate_topk_v41")
    scores, entries = candidate_scores_v41(
        q, weights, cache_kv, candidates, row_pages, lens, page_size=page_size, layer=layer,
        precision=precision, chip=chip, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    return compact_topk(scores, entries, entries >= 0, k)


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
    ``page``, ``row`` ``i32[T, C]``) and ``lens``: per row its meta (one DMA of ``2 C'`` words,
    ``C'`` = ``C`` rounded up to ``v41_blocks.chunk_of(C)``), per candidate with a page its
    512-byte block row (one DMA), per scale row fetched (``_scale_rows``) 512 bytes (one DMA),
    q, the weights (a lane-padded row) and the output block ``f32[8, C']`` (lane-padded: a
    short list's block moves 128 lanes) (three block copies). Minimum: each read candidate's
    visible entries at the format's 68 B and a score each, q and the weights once."""
    ids, page, row = np.asarray(ids), np.asarray(page), np.asarray(row)
    lens = np.asarray(lens)
    t, c = page.shape
    cp = tpu.round_up(max(c, 1), chunk_of(c))
    blocks = int((page >= 0).sum())
    scales = _scale_rows(page, row)
    per_row = (4 * 2 * cp + heads * ib.DIM * q_itemsize + tpu.LANES * 4
               + 4 * ib.BLOCK * tpu.round_up(cp, tpu.LANES))
    moved = t * per_row + (blocks + scales) * ib.ROW_BYTES
    seen = np.clip(lens[:, None] - ids * ib.BLOCK, 0, ib.BLOCK)
    entries = int(np.where(page >= 0, seen, 0).sum())
    bytes_min = (entries * (index_fp4_bytes(ib.DIM) + 4)
                 + t * heads * (ib.DIM * q_itemsize + 4))
    cfg = BlocksConfig(heads, ib.BLOCK, cp, "bf16")
    return aot.Traffic(bytes_moved=moved, bytes_min=bytes_min,
                       flops=2 * t * cp * ib.BLOCK * heads * ib.DIM,
                       vmem_bytes=vmem_estimate(cfg), dmas=t * 4 + blocks + scales)
