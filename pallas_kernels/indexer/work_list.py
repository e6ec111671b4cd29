"""The indexer kernel's work list, built in XLA from the ragged batch (scalars only).

One grid step of a ladder level is one item: a row block of one sequence (the kernel module's
docstring has the design). ``work_list`` builds every level's items for one chunk of rows plus
each row's slot among them; ``row_ladder`` / ``level_bound`` give the static level sizes and
grid bounds.
"""

from __future__ import annotations

import jax.numpy as jnp

from reference.core import batch

# Work-list fields (one i32 row of NF per item; the kernel reads them as ``wl.FIELD``).
SEQ, ROW, NROWS, POS0, KVLEN, NPAGES, NBLK, SHIFT, QROW, SLOT0, NF = range(11)


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


def _seq_rows(b: batch.RaggedBatch, *, total_rows: int, row0, rows: int,
              one_token_per_seq: bool):
    """Per sequence ``(q_start, q_len, lo, hi)``: its rows and their part in ``[row0, row0+C)``."""
    num_seqs, cu_q_lens = b.num_seqs, b.cu_q_lens
    if one_token_per_seq:
        q_start = jnp.arange(num_seqs, dtype=jnp.int32)
        q_end = q_start + 1
    else:
        q_start = jnp.clip(cu_q_lens[:-1], 0, total_rows).astype(jnp.int32)
        q_end = jnp.clip(cu_q_lens[1:], q_start, total_rows).astype(jnp.int32)
    active = b.active()
    lo = jnp.clip(q_start, row0, row0 + rows)
    hi = jnp.where(active, jnp.clip(q_end, lo, row0 + rows), lo)
    return q_start, q_end - q_start, lo, hi


# A one-hot read ``x[idx]`` (``take``) up to this many compare elements; beyond, a gather.
ONE_HOT_MAX = 1 << 20


def take(x, idx):
    """``x[idx]`` for an integer vector ``x`` and in-range ``idx``: a masked sum over the one-hot
    ``idx == arange(len(x))`` (exact) while it has at most ``ONE_HOT_MAX`` elements, else a
    gather. XLA's TPU model prices a scalar gather at kilobytes per index (the work list's
    dozen of them were ~3 MB of a decode call's glue); the compare costs ``4 len(idx) len(x)``
    bytes."""
    if idx.shape[0] * x.shape[0] > ONE_HOT_MAX:
        return x[idx]
    hit = idx[:, None] == jnp.arange(x.shape[0], dtype=idx.dtype)[None, :]
    return jnp.sum(jnp.where(hit, x[None, :], 0), axis=1, dtype=x.dtype)


def _level_items(cfg, i: int, top: int, ladder, seq_rows, b: batch.RaggedBatch, slot0, row0):
    """Items ``i32[W_L, NF]`` of ladder level ``i`` (see the module docstring). ``POS0`` is a
    token position; ``KVLEN`` and ``NPAGES`` count keys (entries when ``b.compression_ratio >
    1``: a block's last row at token ``pos + n - 1`` sees ``entries_of_tokens(pos + n)``)."""
    q_start, q_len, lo, hi = seq_rows
    kv_lens = b.kv_lens
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
    row = take(base, seq) + (w - (take(cum, seq) - take(count, seq))) * size
    n = jnp.where(real, jnp.clip(take(hi, seq) - row, 0, size), 0)
    qrow = jnp.clip(row, 0, cfg.total_rows - size)
    last = jnp.where(cum[-1] > 0, qrow[jnp.clip(cum[-1] - 1, 0, cfg.num_items - 1)], 0)
    qrow = jnp.where(real, qrow, last)  # empty items: no new q block
    shift = jnp.where(real, row - qrow, 0)
    pos = take(kv_lens, seq) - take(q_len, seq) + (row - take(q_start, seq))  # first row's
    # keys: min(entries_of_tokens(kv_len), capacity)
    kv_eff = take(b.kv_eff(slice(None)), seq)  # (a slice: no gather)
    seen = batch.entries_of_tokens(pos + n, b.compression_ratio)  # keys the last row may see
    if cfg.causal_rule == "tpu_inference":  # j <= p // r
        seen = (pos + n - 1) // b.compression_ratio + 1
    tokens = jnp.clip(jnp.minimum(seen, kv_eff), 0, cfg.capacity)
    # An empty item (n == 0) needs no pages: else the previous step's cross-item prefetch would
    # start DMAs for it that nobody waits on (found by scripts/cost/hbm_traffic.py's count).
    npages = jnp.where(n > 0, (tokens + cfg.page_size - 1) // cfg.page_size, 0)
    nblk = jnp.where(n > 0, jnp.maximum((npages + cfg.block_pages - 1) // cfg.block_pages, 1), 0)
    return jnp.stack([seq, row - row0, n, pos - shift, kv_eff, npages, nblk, shift, qrow,
                      take(slot0, seq)], 1).astype(jnp.int32)


def work_list(b: batch.RaggedBatch, *, row0, cfgs, one_token_per_seq: bool):
    """Items of every level plus per-row facts of the chunk's rows.

    Returns ``(items [i32[W_L, NF] per level], row_slot i32[C], key_pos i32[C], kv_eff
    i32[C])``: ``row_slot`` is the row's flat slot in the levels' concatenated ``[W_L * L]``
    block rows (``-1`` for a row outside every sequence); ``key_pos`` the row's last visible key
    (``reference.batch.last_visible_key``: its absolute position for tokens), ``kv_eff`` its
    sequence's keys (``RaggedBatch.kv_eff``)."""
    c, ladder = cfgs[0].rows, tuple(cfg.block_rows for cfg in cfgs)
    seq_rows = _seq_rows(b, total_rows=cfgs[0].total_rows, row0=row0, rows=c,
                         one_token_per_seq=one_token_per_seq)
    slot0 = b.first_slot(slice(0, b.num_seqs))  # each sequence's first page-table slot
    all_items, slot_rows, slot_pos, slot_kv = [], [], [], []
    for i, cfg in enumerate(cfgs):
        items = _level_items(cfg, i, ladder[-1], ladder, seq_rows, b, slot0, row0)
        all_items.append(items)
        j = jnp.arange(cfg.block_rows, dtype=jnp.int32)[None, :]
        shift, n = items[:, SHIFT:SHIFT + 1], items[:, NROWS:NROWS + 1]
        mine = (j >= shift) & (j < shift + n)
        slot_rows.append(jnp.where(mine, items[:, ROW:ROW + 1] - shift + j, c).reshape(-1))
        slot_pos.append((items[:, POS0:POS0 + 1] + j).reshape(-1))
        slot_kv.append(jnp.broadcast_to(items[:, KVLEN:KVLEN + 1], mine.shape).reshape(-1))
    dest = jnp.concatenate(slot_rows)
    slot_pos, slot_kv = jnp.concatenate(slot_pos), jnp.concatenate(slot_kv)
    if c * dest.shape[0] > ONE_HOT_MAX:  # (``take``'s rule)
        row_slot = jnp.full((c,), -1, jnp.int32).at[dest].set(
            jnp.arange(dest.shape[0], dtype=jnp.int32), mode="drop")
        at = jnp.clip(row_slot, 0, None)
        return all_items, row_slot, b.key_pos(slot_pos[at]), slot_kv[at]
    # one-hot: row r's slot is the one whose dest is r (at most one), else -1 (read as slot 0)
    m = jnp.arange(dest.shape[0], dtype=jnp.int32)[None, :]
    hit = dest[None, :] == jnp.arange(c, dtype=jnp.int32)[:, None]
    found = jnp.any(hit, axis=1)
    hit = hit | (~found[:, None] & (m == 0))

    def pick(x):
        return jnp.sum(jnp.where(hit, x[None, :], 0), axis=1, dtype=jnp.int32)

    row_slot = jnp.where(found, pick(m[0]), -1)
    return all_items, row_slot, b.key_pos(pick(slot_pos)), pick(slot_kv)
