"""V4.1 per-row candidate selection (reference/v41/candidates.py) against a float64 NumPy oracle
written from the definition (docs/v41.md, "Candidate selection"): Python sorts with explicit
rank tuples, no integer keys, no top_k."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from reference.v41 import (
    candidate_blocks,
    candidate_mask,
    candidate_pages,
    restricted_topk,
    sort_key,
)

NAN = float("nan")
INF = float("inf")


def _rank(value: float, index: int) -> tuple:
    """The declared order: NaN first, then value descending (-0.0 == +0.0), then lower index."""
    return (0, 0.0, index) if math.isnan(value) else (1, -value, index)


def oracle_blocks(scores, lens, num_blocks, block):
    """Kept block ids per row (ascending), from the definition."""
    out = []
    for row, length in zip(np.asarray(scores, np.float64), lens, strict=True):
        nb = -(-len(row) // block)
        pooled = []
        for b in range(nb):
            vis = [float(row[j]) for j in range(b * block, min((b + 1) * block, len(row)))
                   if j < length]
            if not vis:
                pooled.append(-INF)
            elif any(math.isnan(v) for v in vis):
                pooled.append(NAN)
            else:
                pooled.append(max(vis))
        if length > 0:
            pooled[(length - 1) // block] = INF  # the newest block, forced in
        ranked = sorted(range(nb), key=lambda b: _rank(pooled[b], b))[:num_blocks]
        kept = sorted(b for b in ranked if not math.isnan(pooled[b]) and pooled[b] > -INF)
        out.append(kept + [-1] * (num_blocks - len(kept)))
    return np.array(out, np.int64).reshape(len(lens), num_blocks)


def oracle_topk(scores, lens, cands, k, block):
    """Top-k entries per row among visible entries in the row's candidate blocks."""
    out = []
    for t, (row, length) in enumerate(zip(np.asarray(scores, np.float64), lens, strict=True)):
        allowed = None if cands is None else {int(b) for b in cands[t] if b >= 0}
        pool = [j for j in range(len(row)) if j < length and float(row[j]) != -INF
                and (allowed is None or j // block in allowed)]
        chosen = sorted(pool, key=lambda j: _rank(float(row[j]), j))[:k]
        out.append(chosen + [-1] * (k - len(chosen)))
    return np.array(out, np.int64).reshape(len(lens), k)


def _blocks(scores, lens, num_blocks, block, dtype=jnp.float32):
    got = candidate_blocks(jnp.asarray(scores, dtype), jnp.asarray(lens, jnp.int32),
                           num_blocks=num_blocks, block=block)
    return np.asarray(got)


def test_sort_key_is_the_declared_order():
    vals = np.array([-INF, -3e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 2.0, 3e38, INF, NAN, -NAN],
                    np.float32)
    key = np.asarray(sort_key(jnp.asarray(vals)))
    assert (np.diff(key[:4]) > 0).all() and key[4] == key[5] == 0
    assert (np.diff(key[5:11]) > 0).all() and key[10] == key[11]
    bf = jnp.asarray(vals, jnp.bfloat16)
    assert (np.asarray(sort_key(bf)) == np.asarray(sort_key(bf.astype(jnp.float32)))).all()


def test_hand_cases_blocks():
    # newest block kept though its max is the lowest; blocks of 2, budget 2
    s = [[5, 4, 9, 1, 7, 0, -3, NAN]]  # entry 7 past the length: never read
    assert _blocks(s, [7], 2, 2).tolist() == [[1, 3]]
    # ties: equal block maxima go to the lower block; -0.0 ties +0.0
    assert _blocks([[0.0, 1, 1, 0, -0.0, 1, 0.5, 0]], [8], 2, 2).tolist() == [[0, 3]]
    assert _blocks([[-0.0, -1, 0.0, -1, -2, -2]], [6], 2, 2).tolist() == [[0, 2]]
    # a NaN block ranks first and takes a slot, but is not kept (official value > -inf)
    assert _blocks([[1, NAN, 9, 9, 2, 2, 3, 3]], [8], 2, 2).tolist() == [[3, -1]]
    assert _blocks([[1, NAN, 9, 9, 2, 2, 3, 3]], [8], 3, 2).tolist() == [[1, 3, -1]]
    # a NaN in the newest block is overwritten by +inf: kept
    assert _blocks([[1, 1, 9, 9, 2, NAN]], [6], 2, 2).tolist() == [[1, 2]]
    # budget at least the NaN blocks: the newest block falls out too (as in the official code)
    assert _blocks([[NAN, 1, NAN, 1, 2, 2]], [6], 2, 2).tolist() == [[-1, -1]]


@pytest.mark.parametrize("length,want", [(0, []), (1, [0]), (3, [0]), (4, [0]), (5, [0, 1]),
                                         (8, [0, 1]), (9, [0, 2]), (12, [0, 2])])
def test_lengths_at_block_boundaries(length, want):
    # block 4, budget 2; scores fall with the index so block 0 wins, the newest is forced
    s = np.where(np.arange(12) < length, 100.0 - np.arange(12), NAN)[None]
    got = _blocks(s, [length], 2, 4)
    assert got.tolist() == [want + [-1] * (2 - len(want))]
    assert (got == oracle_blocks(s, [length], 2, 4)).all()


def test_prefill_rows_have_their_own_sets():
    rng = np.random.default_rng(7)
    t, n = 24, 24
    s = np.full((t, n), NAN, np.float32)
    for i in range(t):  # row i sees entries < i (a ratio-1 prefill); different winners
        s[i, :i] = rng.permutation(i)
    lens = np.arange(t)
    got = _blocks(s, lens, 2, 3)
    assert (got == oracle_blocks(s, lens, 2, 3)).all()
    assert len({tuple(r) for r in got.tolist()}) > t // 2
    assert got[0].tolist() == [-1, -1]


def _random_rows(rng, t, n, nan_rate=0.03):
    """bf16-valued scores with many ties (small integers, signed zeros), a few NaN, random
    lengths in [0, n], NaN past every length."""
    s = rng.integers(-3, 4, (t, n)).astype(np.float32) * rng.choice([1.0, 0.5], (t, n))
    s[rng.random((t, n)) < 0.1] = -0.0
    s[rng.random((t, n)) < nan_rate] = NAN
    lens = rng.integers(0, n + 1, t)
    lens[:3] = [0, n, min(n, 1)]
    s[np.arange(n)[None, :] >= lens[:, None]] = NAN
    return s, lens


@pytest.mark.parametrize("n,num_blocks,block", [(37, 3, 4), (64, 5, 8), (10, 20, 1)])
def test_random_blocks_and_restricted_topk(n, num_blocks, block):
    rng = np.random.default_rng(n)
    for dtype in (jnp.float32, jnp.bfloat16):
        s, lens = _random_rows(rng, 16, n)
        got = _blocks(s, lens, num_blocks, block, dtype)
        assert (got == oracle_blocks(s, lens, num_blocks, block)).all()
        for cands in (got, None):
            k = 6
            top = np.asarray(restricted_topk(jnp.asarray(s, dtype), jnp.asarray(lens, jnp.int32),
                                             None if cands is None else jnp.asarray(cands),
                                             k=k, block=block))
            assert (top == oracle_topk(s, lens, cands, k, block)).all()
            if cands is not None:  # never outside the candidates, -1 only in the tail
                for t in range(len(lens)):
                    sel = top[t][top[t] >= 0]
                    assert set((sel // block).tolist()) <= set(cands[t].tolist())
                    assert (top[t][len(sel):] == -1).all()


def test_budget_constraint_fills_k():
    # num_blocks * block - (block - 1) = 3 * 4 - 3 = 9 >= k = 9: every row with lens >= k has
    # k finite candidates (even when its newest block holds one entry) and fills all k slots
    rng = np.random.default_rng(3)
    n, block, num_blocks, k = 41, 4, 3, 9
    s = rng.standard_normal((n + 1, n)).astype(np.float32)
    lens = np.arange(n + 1)
    s[np.arange(n)[None, :] >= lens[:, None]] = NAN
    cands = _blocks(s, lens, num_blocks, block)
    top = np.asarray(restricted_topk(jnp.asarray(s), jnp.asarray(lens, jnp.int32),
                                     jnp.asarray(cands), k=k, block=block))
    assert (top == oracle_topk(s, lens, cands, k, block)).all()
    filled = (top >= 0).sum(1)
    assert (filled == np.minimum(lens, k)).all()
    # one block short of the constraint: a row whose newest block holds one entry falls short
    short = np.asarray(restricted_topk(jnp.asarray(s), jnp.asarray(lens, jnp.int32),
                                       jnp.asarray(_blocks(s, lens, 2, block)), k=k, block=block))
    # 2 * 4 - 3 = 5 < 9: rows with lens >= 9 fall short; lens 37's newest block holds 1 entry
    assert ((short[k:] >= 0).sum(1) < k).all() and (short[37] >= 0).sum() == 5


def test_candidate_mask_and_k_past_n():
    ids = jnp.asarray([[2, 0, -1], [-1, -1, -1], [1, 7, 99]], jnp.int32)
    m = np.asarray(candidate_mask(ids, n=7, block=3))
    assert m.tolist() == [[1, 1, 1, 0, 0, 0, 1], [0] * 7, [0, 0, 0, 1, 1, 1, 0]]
    top = restricted_topk(jnp.asarray([[1.0, NAN, 3.0, -INF, 2.0]]), jnp.asarray([5]), None,
                          k=7, block=2)
    assert np.asarray(top).tolist() == [[1, 2, 4, 0, -1, -1, -1]]


@pytest.mark.parametrize("page_size,block", [(16, 8), (4, 8), (16, 24), (8, 8)])
def test_candidate_pages_are_the_pages_holding_a_candidate_entry(page_size, block):
    """``candidate_pages`` against the definition (slot ``first_slot + j`` is set iff some row of
    that sequence has a block with an entry on page ``j < pages_per_seq``): blocks straddling
    pages, ``-1`` slots, ids past the capacity, rows outside every sequence (negative slot)."""
    rng = np.random.default_rng()
    pps, seqs, rows = 6, 3, 9
    first = rng.choice([0, 1, 2, -1], rows) * pps
    nblk = pps * page_size // block + 2  # a few ids past the capacity
    cands = rng.integers(-1, nblk, (rows, 4)).astype(np.int32)
    got = np.asarray(candidate_pages(jnp.asarray(cands), jnp.asarray(first, np.int32),
                                     table_len=seqs * pps + 1, page_size=page_size,
                                     pages_per_seq=pps, block=block))
    want = np.zeros(seqs * pps + 1, bool)
    for r in range(rows):
        for c in cands[r]:
            for e in range(c * block, c * block + block):
                if c >= 0 and first[r] >= 0 and e // page_size < pps:
                    want[first[r] + e // page_size] = True
    np.testing.assert_array_equal(got, want)


def test_bad_static_input_names_the_argument():
    s, lens = jnp.zeros((2, 8)), jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="num_blocks"):
        candidate_blocks(s, lens, num_blocks=0, block=4)
    with pytest.raises(TypeError, match="block"):
        candidate_blocks(s, lens, num_blocks=2, block=2.0)
    with pytest.raises(ValueError, match=r"lens.shape\[0\].*2, got 3"):
        candidate_blocks(s, jnp.zeros(3, jnp.int32), num_blocks=2, block=4)
    with pytest.raises(TypeError, match="lens"):
        restricted_topk(s, jnp.zeros(2), None, k=2, block=4)
    with pytest.raises(ValueError, match="candidates"):
        restricted_topk(s, lens, jnp.zeros((3, 2), jnp.int32), k=2, block=4)


@pytest.mark.parametrize("n,block,c", [(50, 4, 5), (50, 4, 13), (33, 1, 7)])
def test_restricted_topk_takes_candidates_in_any_order(n, block, c):
    """Unsorted ids, repeats, ``-1`` anywhere and ids past the row: the set they name, on both
    of ``restricted_topk``'s paths (``c * block < n``: only the candidate entries gathered and
    ranked; otherwise the whole row masked), against the oracle; bf16 ties included."""
    rng = np.random.default_rng()
    s, lens = _random_rows(rng, 12, n)
    s = np.round(s * 2) / 2  # coarse values: ties across blocks
    nb = -(-n // block)
    cands = rng.integers(-1, nb + 3, (12, c)).astype(np.int32)
    cands[:, -1] = cands[:, 0]  # a repeat in every row
    for dtype in (jnp.float32, jnp.bfloat16):
        top = np.asarray(restricted_topk(jnp.asarray(s, dtype), jnp.asarray(lens, jnp.int32),
                                         jnp.asarray(cands), k=9, block=block))
        sv = np.asarray(jnp.asarray(s, dtype).astype(jnp.float32))
        assert (top == oracle_topk(sv, lens, cands, 9, block)).all()


def test_ranked_entries_is_the_declared_order_whatever_the_positions():
    """``ranked_entries`` over each row's (score, entry) pairs shuffled (a kernel's lane-dense
    compact order is not entry order), coarse values (ties), NaN, ``-inf`` and masked pairs, ``k``
    past the pairs: the oracle's top-``k`` of the row in entry order."""
    from reference.v41.candidates import ranked_entries

    rng = np.random.default_rng()
    s, lens = _random_rows(rng, 10, 40)
    s = np.round(s * 2) / 2
    s[rng.random(s.shape) < 0.05] = -INF
    ok = np.arange(40)[None] < np.asarray(lens)[:, None]
    want = oracle_topk(s, lens, None, 45, 1)
    perm = np.stack([rng.permutation(40) for _ in range(10)])
    ent = np.broadcast_to(np.arange(40), (10, 40))
    got = ranked_entries(jnp.asarray(np.take_along_axis(s, perm, 1), jnp.float32),
                         jnp.asarray(np.take_along_axis(ent, perm, 1), jnp.int32),
                         jnp.asarray(np.take_along_axis(ok, perm, 1)), 45)
    np.testing.assert_array_equal(np.asarray(got), want)
