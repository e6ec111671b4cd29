"""DeepSeek-V4.1 per-row candidate selection (issue 31, Deliver 4), reference side: pure jnp,
the flag-off path and the oracle the kernels are held to.

Two levels over one index-score row per query (``T`` rows, ``N`` compressed entries):

1. ``candidate_blocks``: at the candidate source, the row's scores max-pooled into blocks of
   ``block`` entries, the newest block ``(len - 1) // block`` forced in, the top ``num_blocks``
   blocks kept, per query row.
2. ``restricted_topk``: at an index source after it (``REINDEX``), the top ``k`` entries among
   those whose block is a candidate of the same row.

Official rule (DeepSeek-V4.1-Flash ``inference/model.py``, ``select_candidate_blocks`` about
l.583-610 and ``Indexer.forward`` about l.563-578). The release file itself was not found in the
code index; read instead: public restatements there (one citing ``model.py:583-610``, an HF-style
port ``modeling_deepseek_v41.py``, a harness re-running ``Indexer.forward`` with its line comments,
sglang-style ``dsv41`` indexers), all agreeing on this rule: scores past the row's visible length
``compress_lens`` are ``-inf``; blocks are padded with ``-inf`` to a multiple of ``block`` and
max-pooled (``amax``: NaN propagates); the block ``(compress_lens - 1) // block`` is filled with
``+inf`` (a row with length 0 has block -1: nothing forced); ``topk(min(blocks, num_blocks))`` and
a block is kept iff its top-k value ``> -inf``. Consumers mask non-candidate entries to ``-inf``
and take ``topk(min(index_topk, len))``.

Rules this module fixes (``docs/v41.md``, "Candidate selection"):

- **Order** (the declared tie rule): NaN first, then value descending, then lower index; -0.0
  equals +0.0. Torch orders NaN above ``+inf`` in ``sort``/``topk`` (understood, not run here).
- **NaN blocks** rank first and take budget slots, but are *not kept*: the official keep test
  ``value > -inf`` is false for NaN. So a NaN can only shrink a row's candidate set; a NaN in
  the newest block is overwritten by ``+inf`` (kept). With ``num_blocks`` or more NaN blocks
  the newest block itself falls out, as in the official code.
- **-1** marks an empty slot: blocks not kept, entries scored ``-inf`` (masked, outside the
  candidates, or past the length). The official consumer attends masked entries where fewer
  than ``k`` are finite; ``num_blocks * block - (block - 1) >= k`` (``V41Config`` validates it)
  makes that impossible for rows with at least ``k`` visible entries, and the two agree.
- **NaN entries** of a consumer (visible, in a candidate block) rank first and are selected,
  as the official top-k selects and attends them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from reference.core import checks as _checks
from reference.indexer.page_topk import page_max

KEY_NAN = 2 ** 31 - 1  # every NaN: above every number
KEY_POS_INF = 0x7F800000  # the key of +inf (the forced newest block)
KEY_NEG_INF = -1 - 0x7F800000  # the key of -inf (masked): never selected


def sort_key(scores: jax.Array) -> jax.Array:
    """The declared order as an integer key, ``f32|bf16[...] -> i32[...]``: a larger key ranks
    first; equal keys tie (then the lower index wins, ``jax.lax.top_k``'s rule). NaN (any sign
    or payload) -> ``KEY_NAN``; -0.0 and +0.0 -> 0; otherwise strictly increasing in the value,
    subnormals included, ``-inf`` -> ``KEY_NEG_INF``, ``+inf`` -> ``KEY_POS_INF``."""
    # integer ops only: no float compare, so a platform flushing subnormals cannot merge them
    bits = jax.lax.bitcast_convert_type(jnp.asarray(scores).astype(jnp.float32), jnp.int32)
    magnitude = bits & jnp.int32(0x7FFFFFFF)
    key = jnp.where(bits < 0, -1 - magnitude, magnitude)  # -0.0 -> -1, fixed below
    key = jnp.where(magnitude == 0, jnp.int32(0), key)
    return jnp.where(magnitude > KEY_POS_INF, jnp.int32(KEY_NAN), key)


def _check_rows(scores, lens) -> tuple[int, int]:
    _checks.floating("scores", scores)
    _checks.rank("scores", scores, 2)
    _checks.integer("lens", lens)
    _checks.rank("lens", lens, 1)
    _checks.dim("lens", lens, 0, scores.shape[0], "scores.shape[0] (rows)")
    rows, n = scores.shape
    if n < 1:
        raise ValueError(f"scores must have at least 1 entry per row, got scores.shape[1]={n}")
    return rows, n


def _visible(lens: jax.Array, n: int) -> jax.Array:
    """bool[T, n]: entry j of row t is visible iff ``j < lens[t]``."""
    return jnp.arange(n, dtype=jnp.int32)[None, :] < lens.astype(jnp.int32)[:, None]


def _top_keys(key: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` over ``i32[T, M]`` keys with ``k`` possibly above ``M``: the extra
    slots get ``KEY_NEG_INF`` and index -1. Returns (keys, indices), each ``i32[T, k]``."""
    kk = min(k, key.shape[-1])
    vals, idx = jax.lax.top_k(key, kk)
    pad = ((0, 0), (0, k - kk))
    return (jnp.pad(vals, pad, constant_values=KEY_NEG_INF),
            jnp.pad(idx.astype(jnp.int32), pad, constant_values=-1))


@functools.partial(jax.jit, static_argnames=("num_blocks", "block"))
def candidate_blocks(scores: jax.Array, lens: jax.Array, *, num_blocks: int,
                     block: int) -> jax.Array:
    """The candidate source's per-row candidate blocks (official ``select_candidate_blocks``).

    Args:
      scores: f32|bf16[T, N] index scores of each query row over the ``N`` compressed entries;
        entries ``j >= lens[t]`` are masked to ``-inf`` here (any value there, NaN included, is
        never read).
      lens: i32[T] visible entries of each row, in ``[0, N]`` (``(p + 1) // ratio`` for the
        query at position ``p``); a row with length 0 keeps no block.
      num_blocks: the budget ``candidate_topk_blocks`` (may exceed ``ceil(N / block)``).
      block: entries per block, ``candidate_block_size``.

    Returns:
      i32[T, num_blocks]: each row's kept block ids ascending, ``-1`` tail. A block is ranked
      by the max of its visible scores (NaN if any is NaN, ``-inf`` if none is visible), the
      newest block ``(lens - 1) // block`` ranked as ``+inf``, in the module's order; of the
      first ``num_blocks`` those scoring neither NaN nor ``-inf`` are kept.
    """
    _check_rows(scores, lens)
    _checks.positive_int("num_blocks", num_blocks)
    _checks.positive_int("block", block)
    rows, n = scores.shape
    nb = -(-n // block)
    pad = ((0, 0), (0, nb * block - n))
    x = jnp.pad(scores.astype(jnp.float32), pad)
    ok = jnp.pad(_visible(lens, n), pad)
    key = sort_key(page_max(x, ok, block))  # f32[T, nb]: NaN propagates, -inf if none visible
    newest = (lens.astype(jnp.int32) - 1) // block  # floor: -1 for an empty row
    key = jnp.where(jnp.arange(nb, dtype=jnp.int32)[None, :] == newest[:, None],
                    jnp.int32(KEY_POS_INF), key)
    top, idx = _top_keys(key, num_blocks)
    kept = (top > KEY_NEG_INF) & (top != KEY_NAN)
    ids = jnp.sort(jnp.where(kept, idx, nb), axis=-1)  # ascending, not-kept (nb) last
    return jnp.where(ids < nb, ids, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("n", "block"))
def candidate_mask(candidates: jax.Array, *, n: int, block: int) -> jax.Array:
    """Expand block ids to the entry mask the official code publishes.

    Args:
      candidates: i32[T, C] block ids (``candidate_blocks``' output; ``-1`` slots and ids
        outside ``[0, ceil(n / block))`` select nothing).
      n: entries per row; block: entries per block.

    Returns:
      bool[T, n]: entry ``j`` of row ``t`` is set iff ``j // block`` is among row ``t``'s ids.
    """
    _checks.integer("candidates", candidates)
    _checks.rank("candidates", candidates, 2)
    _checks.positive_int("n", n)
    _checks.positive_int("block", block)
    nb = -(-n // block)
    ids = candidates.astype(jnp.int32)
    slot = jnp.where((ids >= 0) & (ids < nb), ids, nb)  # nb: a dump column
    rows = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    blocks = jnp.zeros((ids.shape[0], nb + 1), jnp.bool_).at[rows, slot].set(True)[:, :nb]
    return jnp.repeat(blocks, block, axis=1)[:, :n]


@functools.partial(jax.jit, static_argnames=("table_len", "page_size", "pages_per_seq",
                                             "block"))
def candidate_pages(candidates: jax.Array, first_slot: jax.Array, *, table_len: int,
                    page_size: int, pages_per_seq: int, block: int) -> jax.Array:
    """The page-table slots holding an entry of some row's candidate blocks: what a consumer's
    index scores need read (``pallas_kernels.indexer.v41_scores``: the other pages of the table
    become -1, so the kernel never fetches them).

    Args:
      candidates: i32[T, C] block ids per row (``candidate_blocks``; ``-1`` slots select
        nothing). Block ``c`` covers entries ``c * block .. c * block + block - 1``: the
        sequence-local pages ``c * block // page_size .. (c * block + block - 1) //
        page_size`` (a block may straddle pages), those below ``pages_per_seq``.
      first_slot: i32[T] the page-table slot of each row's sequence's first page
        (``RaggedBatch.first_slot``), negative for a row outside every sequence (nothing).
      table_len: slots in the flat page table; page_size: entries per page.

    Returns:
      bool[table_len]: slot ``s`` is set iff some row's candidate block has an entry on it (the
      union over the rows of each sequence: a prefill's rows share their sequence's pages).
    """
    _checks.integer("candidates", candidates)
    _checks.rank("candidates", candidates, 2)
    _checks.integer("first_slot", first_slot)
    _checks.dim("first_slot", first_slot, 0, candidates.shape[0], "candidates.shape[0] (rows)")
    for name, v in (("page_size", page_size), ("pages_per_seq", pages_per_seq),
                    ("block", block)):
        _checks.positive_int(name, v)
    ids = candidates.astype(jnp.int32)
    lo = ids * block // page_size
    hi = (ids * block + block - 1) // page_size
    slot0 = first_slot.astype(jnp.int32)[:, None, None]
    span = 1 if page_size % block == 0 else -(-block // page_size) + 1  # pages a block touches
    page = lo[..., None] + jnp.arange(span, dtype=jnp.int32)
    ok = (ids[..., None] >= 0) & (page <= hi[..., None]) & (page < pages_per_seq) & (slot0 >= 0)
    slot = jnp.where(ok, slot0 + page, table_len)
    slot = jnp.where(slot < table_len, slot, table_len)  # a dump slot
    return jnp.zeros((table_len + 1,), jnp.bool_).at[slot.reshape(-1)].set(True)[:table_len]


@functools.partial(jax.jit, static_argnames=("k", "block"))
def restricted_topk(scores: jax.Array, lens: jax.Array, candidates: jax.Array | None, *,
                    k: int, block: int) -> jax.Array:
    """Top-``k`` entries of each row among its candidate blocks (a ``REINDEX`` layer after the
    candidate source; ``candidates=None``: unrestricted, the candidate source's own top-k).

    Args:
      scores: f32|bf16[T, N] this layer's index scores; entries ``j >= lens[t]`` never read.
      lens: i32[T] visible entries per row, in ``[0, N]``.
      candidates: i32[T, C] block ids per row (``candidate_blocks``: ascending, ``-1`` tail;
        any order works: ``-1``, ids outside ``[0, ceil(N / block))`` and repeats add nothing);
        or None. Where ``C * block < N`` only the candidate entries are gathered (one index a
        block) and ranked: the same result for ``C * block`` entries' work, not ``N``'s.
      k: ``index_topk`` (may exceed ``N``); block: ``candidate_block_size``.

    Returns:
      i32[T, k]: entry indices in the module's order (NaN first, value descending, lower index
      first), ``-1`` tail where fewer than ``k`` entries are visible, in a candidate block and
      not ``-inf``. With ``num_blocks * block - (block - 1) >= k`` and finite scores a row with
      ``lens >= k`` fills all ``k`` slots (the newest block holds at least one entry).
    """
    rows, n = _check_rows(scores, lens)
    _checks.positive_int("k", k)
    _checks.positive_int("block", block)
    ok = _visible(lens, n)
    if candidates is not None:
        _checks.integer("candidates", candidates)
        _checks.rank("candidates", candidates, 2)
        _checks.dim("candidates", candidates, 0, rows, "scores.shape[0] (rows)")
        if candidates.shape[1] * block < n:  # fewer candidate entries than entries
            return _compact_topk(scores, lens, candidates, k, block)
        ok = ok & candidate_mask(candidates, n=n, block=block)
    key = jnp.where(ok, sort_key(scores), jnp.int32(KEY_NEG_INF))
    top, idx = _top_keys(key, k)
    return jnp.where(top > KEY_NEG_INF, idx, -1).astype(jnp.int32)


def unique_blocks(candidates: jax.Array, num_blocks: int) -> jax.Array:
    """``i32[T, C]`` block ids -> each row's distinct ids in ``[0, num_blocks)`` ascending,
    every other slot (``-1``, out of range, a repeat) ``num_blocks``: one sort, repeats then
    voided in place. The void slots sit among the ids, which stay ascending: what the compact
    order needs (void slots are masked)."""
    ids = candidates.astype(jnp.int32)
    ids = jnp.sort(jnp.where((ids >= 0) & (ids < num_blocks), ids, num_blocks), axis=-1)
    repeat = jnp.pad(ids[:, 1:] == ids[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(repeat, num_blocks, ids)


def _compact_topk(scores, lens, candidates, k, block):
    """``restricted_topk`` over the candidate entries only: each row's distinct blocks' scores
    gathered (blocks ascending: a compact position orders as its entry, so the lower-index tie
    rule carries over), the top-``k`` over ``C * block`` keys,
    mapped back to entries. The same result as masking the whole row, at ``C * block`` entries'
    work instead of ``N``'s (the long rows: 16384 against 10^6 at V4.1-Flash)."""
    rows, n = scores.shape
    nb = -(-n // block)
    ids = unique_blocks(candidates, nb)  # [T, C], nb = none
    ent = (ids[..., None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(rows, -1)
    ok = ((ids < nb)[..., None].repeat(block, axis=-1).reshape(rows, -1)
          & (ent < jnp.minimum(lens.astype(jnp.int32), n)[:, None]))
    # by entry, into a lane-dense [T, C * block]; the row left as it lies (a [nb, block] view,
    # or gathering [T, C, block], would pad ``block`` lanes to 128 on TPU: 16x the bytes)
    got = jnp.take_along_axis(scores, jnp.where(ok, ent, 0), axis=1)
    return compact_topk(got, ent, ok, k)


def compact_topk(scores: jax.Array, entries: jax.Array, ok: jax.Array, k: int) -> jax.Array:
    """The top-``k`` of compact candidate scores in the declared order: ``scores f32[T, M]``
    of the entries ``entries i32[T, M]`` (ascending along each row where ``ok``, so a compact
    position orders as its entry and the lower-index tie rule carries over), ``ok bool[T, M]``
    the ones that count. Returns ``i32[T, k]`` entries, ``-1`` tail (``restricted_topk``'s)."""
    key = jnp.where(ok, sort_key(scores), jnp.int32(KEY_NEG_INF))
    top, pos = _top_keys(key, k)
    idx = jnp.take_along_axis(entries, jnp.maximum(pos, 0), axis=1)
    return jnp.where(top > KEY_NEG_INF, idx, -1).astype(jnp.int32)


def ranked_entries(scores: jax.Array, entries: jax.Array, ok: jax.Array, k: int) -> jax.Array:
    """The top-``k`` of ``(score, entry)`` pairs in the declared order whatever their positions:
    ``scores f32[T, M]``, ``entries i32[T, M]``, ``ok bool[T, M]`` the pairs that count. One
    sort per row by (key descending, entry ascending), the first ``k``: the tie rule needs no
    position order (a kernel's lane-dense compact scores are not in entry order), and no gather
    maps positions back to entries. Returns ``i32[T, k]`` entries, ``-1`` tail (``-inf`` and
    masked pairs never selected: ``restricted_topk``'s)."""
    key = jnp.where(ok, sort_key(scores), jnp.int32(KEY_NEG_INF))
    ent = jnp.where(ok, entries.astype(jnp.int32), jnp.iinfo(jnp.int32).max)
    inv, ent = jax.lax.sort((~key, ent), dimension=1, num_keys=2)  # ~key: descending, no overflow
    kk = min(k, key.shape[-1])
    top = jnp.where(~inv[:, :kk] > KEY_NEG_INF, ent[:, :kk], -1)
    return jnp.pad(top, ((0, 0), (0, k - kk)), constant_values=-1).astype(jnp.int32)
