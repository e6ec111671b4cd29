"""Tests for reference/witnesses.py: the segment-witness policy (seed 000, vllm#47942).

The first fifteen tests carry the seed's names and hand examples. The oracle below restates
the definition in plain Python ints (exact, no overflow); it is not a copy of the jnp code,
which works in int32 with a float estimate and edge correction.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.witnesses import (
    MAX_TOPOLOGY_SEGMENTS,
    LearnedKeepOutOfRange,
    RowsMismatch,
    SegmentsOutOfRange,
    WitnessError,
    apply_topology_witnesses,
    attention_mass_recall,
    local_selector,
    locality_null,
    merge_topology_witnesses,
    random_null,
    random_selector,
    scatter_topology_witnesses,
    segment_coverage,
    segment_of,
    topology_witness_indices,
)

I32_MAX = 2**31 - 1
PROPERTY = settings(max_examples=60, deadline=None)

# --------------------------------------------------------------------------------------------
# Oracle: the definition, in Python ints
# --------------------------------------------------------------------------------------------


def oracle_segment(x: int, L: int, S: int) -> int:
    lp = max(L, 1)
    s_eff = min(S, lp)
    return min(x * s_eff // lp, S - 1)


def oracle_edge(s: int, L: int, S: int) -> int:
    s_eff = min(S, max(L, 1))
    return -(-s * L // s_eff)  # ceil(s * L / S_eff)


def oracle_witnesses(row: list[int], L: int, S: int) -> list[int]:
    if L <= 0:
        return [-1] * S
    s_eff = min(S, L)
    occupied = {oracle_segment(x, L, S) for x in row if x >= 0}
    return [oracle_edge(s, L, S) if s < s_eff and s not in occupied else -1 for s in range(S)]


def oracle_merge(row: list[int], wit: list[int], keep: int, max_rep: int) -> list[int]:
    budget = min(max_rep, len(row) - keep)
    placed = [w for w in wit if w >= 0][:budget]
    return row[:keep] + placed + row[keep + len(placed) :]


def oracle_apply(row, L, keep, S, max_rep):
    return oracle_merge(row, oracle_witnesses(row, L, S), keep, max_rep)


def as_rows(arr) -> list[list[int]]:
    return np.asarray(arr).tolist()


def valid_set(row, L) -> set[int]:
    return {x for x in row if 0 <= x < L}


# --------------------------------------------------------------------------------------------
# Random cases (NumPy-generated from a hypothesis-drawn seed, so a batch costs one call)
# --------------------------------------------------------------------------------------------


def random_context(rng: np.random.Generator) -> int:
    kind = rng.integers(0, 8)
    if kind == 0:
        return int(rng.integers(-3, 1))  # empty / negative: the fallback
    if kind <= 3:
        return int(rng.integers(1, 80))  # around and below S
    if kind <= 6:
        return int(rng.integers(80, 20_000))
    return int(rng.integers(I32_MAX - 5_000, I32_MAX + 1))  # int32 edge


def random_learned_row(rng, L: int, topk: int, tail_padding: int = 0, junk: bool = False):
    """Distinct causal tokens (clustered or uniform) then padding; ``tail_padding`` slots at
    the end are forced to ``-1``; ``junk`` sprinkles out-of-range, negative and duplicate
    entries."""
    room = topk - tail_padding
    n = int(rng.integers(0, min(room, max(L, 0)) + 1))
    if n and rng.random() < 0.5 and L > 4 * n:
        width = int(rng.integers(n, 4 * n + 1))
        start = int(rng.integers(0, L - width + 1))
        tokens = start + rng.choice(width, size=n, replace=False)
    elif n:
        tokens = rng.choice(L, size=n, replace=False)
    else:
        tokens = np.zeros(0, np.int64)
    row = [int(t) for t in tokens] + [-1] * (topk - n)
    head = row[:room]
    if rng.random() < 0.5:
        rng.shuffle(head)  # padding anywhere in the learned part
    row = head + row[room:]
    if junk:
        for j in range(topk):
            u = rng.random()
            if u < 0.1:
                row[j] = min(I32_MAX, max(L, 0) + int(rng.integers(0, 100)))
                if rng.random() < 0.3:
                    row[j] = I32_MAX
            elif u < 0.15:
                row[j] = int(rng.integers(-9, 0))
            elif u < 0.2 and j:
                row[j] = row[int(rng.integers(0, j))]
    return row


def random_batch(seed: int, rows: int, topk: int, tail_padding: int = 0, junk: bool = False):
    rng = np.random.default_rng(seed)
    lens = [random_context(rng) for _ in range(rows)]
    learned = [random_learned_row(rng, L, topk, tail_padding, junk) for L in lens]
    return learned, lens


# Few distinct shapes: eager JAX compiles each op once per shape, and these are shared by every
# property test (S < topk, S > topk, S = 1, S = 64; topk = 1).
TOPKS = st.sampled_from([1, 8, 24])
SEGMENTS = st.sampled_from([1, 3, 8, 64])
SEEDS = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------------------------
# The seed's fifteen tests
# --------------------------------------------------------------------------------------------


def test_a_witness_fills_only_the_segment_the_learned_row_misses():
    # L=16, S=4: segments [0,4) [4,8) [8,12) [12,16); the row meets 0, 1, 2.
    out = topology_witness_indices(jnp.array([[0, 5, 9, -1]], jnp.int32), jnp.array([16]), 4)
    assert out.dtype == jnp.int32 and out.shape == (1, 4)
    assert as_rows(out) == [[-1, -1, -1, 12]]


def test_the_merge_keeps_the_prefix_and_writes_witnesses_into_the_tail():
    learned = jnp.array([[0, 5, 9, -1]], jnp.int32)
    out = apply_topology_witnesses(learned, jnp.array([16]), 2, 4, 2)
    assert as_rows(out) == [[0, 5, 12, -1]]
    wit = topology_witness_indices(learned, jnp.array([16]), 4)
    assert as_rows(merge_topology_witnesses(learned, wit, 2, 2)) == [[0, 5, 12, -1]]


def test_a_disabled_policy_is_the_identity():
    learned, lens = random_batch(7, 6, 8)
    x, ctx = jnp.array(learned, jnp.int32), jnp.array(lens, jnp.int32)
    assert as_rows(scatter_topology_witnesses(x, ctx, 0)) == learned  # S = 0
    assert as_rows(apply_topology_witnesses(x, ctx, 3, 4, 0)) == learned  # max_replacements 0
    assert as_rows(apply_topology_witnesses(x, ctx, 8, 4, 5)) == learned  # keep = topk
    empty = jnp.zeros((0, 8), jnp.int32)
    assert scatter_topology_witnesses(empty, jnp.zeros((0,), jnp.int32), 4).shape == (0, 8)
    assert topology_witness_indices(empty, jnp.zeros((0,), jnp.int32), 4).shape == (0, 4)


def test_short_and_empty_rows_follow_the_source_fallback():
    pad = [[-1] * 6] * 3
    lens = jnp.array([0, -1, -(2**31)], jnp.int32)
    assert as_rows(scatter_topology_witnesses(jnp.array(pad), lens, 4)) == pad
    assert as_rows(topology_witness_indices(jnp.array(pad), lens, 4)) == [[-1] * 4] * 3
    # A zero-length row holding junk gets no witness either; the junk passes through.
    junk = [[3, -1, 7, -1]]
    assert as_rows(scatter_topology_witnesses(jnp.array(junk), jnp.array([0]), 2)) == junk
    # L < S: S_eff = L, one token per segment, every token the row lacks becomes a witness.
    out = topology_witness_indices(jnp.array([[1, -1, -1]]), jnp.array([3]), 8)
    assert as_rows(out) == [[0, -1, 2, -1, -1, -1, -1, -1]]
    merged = scatter_topology_witnesses(jnp.array([[1] + [-1] * 9]), jnp.array([3]), 8)
    assert as_rows(merged) == [[1, -1, 0, 2, -1, -1, -1, -1, -1, -1]]


def test_an_out_of_range_learned_index_is_clamped_rather_than_refused():
    # L=4, S=8: S_eff = 4; 20 marks min(floor(20*4/4), 7) = 7, outside the partition [0, 4).
    assert segment_of(20, 4, 8) == 7
    assert as_rows(segment_of(jnp.array([20, 5, 4, 3]), 4, 8)) == [7, 5, 4, 3]
    out = topology_witness_indices(jnp.array([[20, -1]]), jnp.array([4]), 8)
    assert as_rows(out) == [[0, 1, 2, 3, -1, -1, -1, -1]]  # marks nothing inside
    merged = apply_topology_witnesses(jnp.array([[20, 2, -1, -1]]), jnp.array([4]), 1, 8, 8)
    assert as_rows(merged) == [[20, 0, 1, 3]]  # 20 passes through; 2 marked segment 2


MALFORMED = [
    (
        "learned 1-D",
        lambda: topology_witness_indices(jnp.array([0, 1]), jnp.array([4, 4]), 4),
        RowsMismatch,
        r"learned must be 2-D.*\(2,\)",
        {"learned_shape": (2,), "rows": None, "argument": "learned"},
    ),
    (
        "learned 3-D",
        lambda: scatter_topology_witnesses(
            jnp.zeros((2, 2, 2), jnp.int32), jnp.ones(2, jnp.int32), 4
        ),
        RowsMismatch,
        r"learned must be 2-D.*\(2, 2, 2\)",
        {"learned_shape": (2, 2, 2)},
    ),
    (
        "context_lens short",
        lambda: apply_topology_witnesses(jnp.zeros((3, 4), jnp.int32), jnp.array([5, 5]), 2, 4, 2),
        RowsMismatch,
        r"context_lens\.shape=\(2,\).*learned\.shape=\(3, 4\).*rows=3",
        {"rows": 3, "argument": "context_lens", "argument_shape": (2,)},
    ),
    (
        "context_lens 2-D",
        lambda: topology_witness_indices(
            jnp.zeros((3, 4), jnp.int32), jnp.ones((3, 1), jnp.int32), 4
        ),
        RowsMismatch,
        r"context_lens must be 1-D",
        {"rows": 3, "argument_shape": (3, 1)},
    ),
    (
        "witnesses rows",
        lambda: merge_topology_witnesses(
            jnp.zeros((3, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32), 2, 2
        ),
        RowsMismatch,
        r"witnesses\.shape=\(2, 4\).*rows=3",
        {"rows": 3, "argument": "witnesses"},
    ),
    (
        "zero segments",
        lambda: topology_witness_indices(jnp.zeros((1, 4), jnp.int32), jnp.array([8]), 0),
        SegmentsOutOfRange,
        r"s=0 \(num_segments\).*\[1, 64\]",
        {"num_segments": 0},
    ),
    (
        "65 segments at apply",
        lambda: apply_topology_witnesses(jnp.zeros((1, 4), jnp.int32), jnp.array([8]), 0, 65, 4),
        SegmentsOutOfRange,
        r"s=65 \(num_segments\)",
        {"num_segments": 65},
    ),
    (
        "65 segments at scatter",
        lambda: scatter_topology_witnesses(jnp.zeros((1, 4), jnp.int32), jnp.array([8]), 65),
        SegmentsOutOfRange,
        r"s=65",
        {"num_segments": 65},
    ),
    (
        "negative segments at scatter",
        lambda: scatter_topology_witnesses(jnp.zeros((1, 4), jnp.int32), jnp.array([8]), -1),
        SegmentsOutOfRange,
        r"s=-1",
        {"num_segments": -1},
    ),
    (
        "witness width 65 at merge",
        lambda: merge_topology_witnesses(
            jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 65), jnp.int32), 0, 4
        ),
        SegmentsOutOfRange,
        r"s=65",
        {"num_segments": 65},
    ),
    (
        "keep above topk",
        lambda: apply_topology_witnesses(jnp.zeros((1, 4), jnp.int32), jnp.array([8]), 5, 4, 4),
        LearnedKeepOutOfRange,
        r"learned_keep=5 .*topk=4",
        {"learned_keep": 5, "topk": 4},
    ),
    (
        "negative keep",
        lambda: merge_topology_witnesses(
            jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), -1, 4
        ),
        LearnedKeepOutOfRange,
        r"learned_keep=-1 .*topk=4",
        {"learned_keep": -1, "topk": 4},
    ),
    (
        "negative max_replacements",
        lambda: apply_topology_witnesses(jnp.zeros((1, 4), jnp.int32), jnp.array([8]), 0, 4, -2),
        WitnessError,
        r"max_replacements=-2 must be >= 0",
        {"max_replacements": -2},
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "pattern", "attrs"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_calls_are_refused(call, error, pattern, attrs):
    with pytest.raises(error, match=pattern) as info:
        call()
    assert isinstance(info.value, WitnessError) and isinstance(info.value, ValueError)
    if error is WitnessError:  # the max_replacements refusal is the base class itself
        assert type(info.value) is WitnessError
    for name, value in attrs.items():
        assert getattr(info.value, name) == value


def test_every_witness_lands_in_its_own_segment():
    # Rounding the edge down does not round-trip: floor(1 * 10 / 4) = 2 lies in segment 0.
    assert segment_of(2, 10, 4) == 0
    assert segment_of(math.ceil(10 / 4), 10, 4) == 1
    lengths = [1, 2, 3, 10, 63, 64, 65, 100, 1000, 4097, 131_071, I32_MAX - 1, I32_MAX]
    empty = jnp.full((len(lengths), 1), -1, jnp.int32)
    top = MAX_TOPOLOGY_SEGMENTS
    for S in range(1, top + 1):
        # Every edge of every length, padded by repetition to 64 columns: one array shape.
        edges = [[oracle_edge(min(s, min(S, L) - 1), L, S) for s in range(top)] for L in lengths]
        segs = [[min(s, min(S, L) - 1) for s in range(top)] for L in lengths]
        assert [
            [segment_of(e, L, S) for e in row] for row, L in zip(edges, lengths, strict=True)
        ] == segs
        got = segment_of(jnp.array(edges, jnp.int32), jnp.array(lengths)[:, None], S)
        assert as_rows(got) == segs, S  # the int32 array path agrees
        if S in (1, 2, 3, 4, 7, 8, 16, 33, 63, 64):  # what the policy emits on an empty row
            wit = as_rows(topology_witness_indices(empty, jnp.array(lengths), S))
            for row, L, e in zip(wit, lengths, edges, strict=True):
                assert row == e[: min(S, L)] + [-1] * (S - min(S, L))


@PROPERTY
@given(seed=SEEDS, topk=TOPKS, S=SEGMENTS)
def test_witnesses_are_causal_distinct_disjoint_and_complete(seed, topk, S):
    learned, lens = random_batch(seed, 16, topk)
    out = as_rows(topology_witness_indices(jnp.array(learned), jnp.array(lens), S))
    for row, L, wit in zip(learned, lens, out, strict=True):
        ws = [w for w in wit if w >= 0]
        assert all(0 <= w < L for w in ws)  # causal
        assert len(set(ws)) == len(ws)  # distinct
        assert not set(ws) & set(row)  # disjoint
        if L > 0:  # complete: K u W(K) meets every segment
            covered = {oracle_segment(x, L, S) for x in list(row) + ws if 0 <= x < L}
            assert covered == set(range(min(S, L)))
        assert wit == oracle_witnesses(row, L, S)


@settings(max_examples=50, deadline=None)
@given(seed=SEEDS, topk=TOPKS, S=SEGMENTS)
def test_the_serving_row_is_causal_distinct_ordered_and_within_budget(seed, topk, S):
    learned, lens = random_batch(seed, 16, topk)  # 50 x 16 = 800 rows
    out = as_rows(scatter_topology_witnesses(jnp.array(learned), jnp.array(lens), S))
    keep, budget = max(topk - S, 0), min(S, topk)
    for row, L, new in zip(learned, lens, out, strict=True):
        assert len(new) == topk
        assert new[:keep] == row[:keep]  # prefix bit-identical
        changed = [j for j in range(topk) if new[j] != row[j]]
        assert all(keep <= j < keep + budget for j in changed)  # budget respected
        wit = [w for w in oracle_witnesses(row, L, S) if w >= 0][:budget]
        assert new[keep : keep + len(wit)] == wit  # one ascending run starting at keep
        assert wit == sorted(wit)
        assert new[keep + len(wit) :] == row[keep + len(wit) :]
        valid = [x for x in new if x >= 0]
        assert all(x < L for x in valid)  # causal (the generated learned rows are)
        assert len(set(valid)) == len(valid)  # distinct


@settings(max_examples=50, deadline=None)
@given(seed=SEEDS, topk=TOPKS, S=SEGMENTS)
def test_every_segment_is_covered_when_the_reserved_tail_is_padding(seed, topk, S):
    learned, lens = random_batch(seed, 16, topk, tail_padding=min(S, topk))
    out = as_rows(scatter_topology_witnesses(jnp.array(learned), jnp.array(lens), S))
    for row, L, new in zip(learned, lens, out, strict=True):
        witness_count = sum(w >= 0 for w in oracle_witnesses(row, L, S))
        if witness_count <= min(S, topk):  # every witness fits the reserved tail
            assert segment_coverage(new, L, S) == 1.0


def test_overwriting_a_sole_tail_occupant_uncovers_its_segment():
    # L=16, S=4, topk=8: keep = 4, max_replacements = 4. Slot 4 holds 12, segment 3's sole
    # occupant; segments 1 and 2 are missing, so witnesses 4 and 8 overwrite slots 4 and 5,
    # and 12 goes with them. This is the source's behaviour, pinned on purpose.
    learned = jnp.array([[0, 1, 2, 3, 12, -1, -1, -1]], jnp.int32)
    merged = as_rows(scatter_topology_witnesses(learned, jnp.array([16]), 4))[0]
    assert merged == [0, 1, 2, 3, 4, 8, -1, -1]
    assert segment_coverage(merged, 16, 4) == 0.75
    # The same row with 12 moved into the retained prefix is fully covered.
    safe = as_rows(
        scatter_topology_witnesses(jnp.array([[0, 1, 2, 12, 3, -1, -1, -1]]), jnp.array([16]), 4)
    )[0]
    assert safe == [0, 1, 2, 12, 4, 8, -1, -1] and segment_coverage(safe, 16, 4) == 1.0


def test_permuting_the_learned_row_leaves_the_witness_set_unchanged():
    ctx = jnp.array([16])
    rows = [[0, 5, 9, -1], [9, -1, 5, 0], [5, 0, 9, -1], [5, 9, 0, -1], [-1, 9, 0, 5]]
    wits = [as_rows(topology_witness_indices(jnp.array([r]), ctx, 4))[0] for r in rows]
    assert all(w == [-1, -1, -1, 12] for w in wits)  # a set function of the row
    merged = {
        tuple(r): as_rows(apply_topology_witnesses(jnp.array([r]), ctx, 2, 4, 2))[0] for r in rows
    }
    # Permuting the retained prefix leaves the output set alone ...
    assert set(merged[(0, 5, 9, -1)]) - {-1} == {0, 5, 12}
    assert set(merged[(5, 0, 9, -1)]) - {-1} == {0, 5, 12}
    # ... moving a token across the keep boundary does not: the merge is positional.
    assert set(merged[(5, 9, 0, -1)]) - {-1} == {5, 9, 12}


def test_the_nulls_spend_exactly_the_policy_budget():
    learned, lens = random_batch(11, 24, 16, tail_padding=4)
    out = as_rows(scatter_topology_witnesses(jnp.array(learned), jnp.array(lens), 4))
    for L, new in zip(lens, out, strict=True):
        k = len(valid_set(new, L))
        for null in (random_null(L, k, seed=L % 1000), locality_null(L, k)):
            assert null.dtype == np.int32 and null.shape == (k,)
            assert len(valid_set(null.tolist(), L)) == k == int((null >= 0).sum())
        if L > 0:
            assert locality_null(L, k).tolist() == list(range(L - k, L))
    assert locality_null(3, 5).tolist() == [0, 1, 2, -1, -1]  # clipped at 0
    assert locality_null(0, 2).tolist() == [-1, -1] and random_null(-4, 2, 0).tolist() == [-1, -1]


def test_the_nulls_are_the_last_row_of_the_attention_selectors():
    for L, k, seed in [(1, 1, 0), (9, 4, 3), (64, 8, 12345), (40, 64, 7)]:
        rand, local = random_selector(L, k, seed), local_selector(L, k)
        assert rand.shape == local.shape == (L, k)
        np.testing.assert_array_equal(random_null(L, k, seed), rand[L - 1])
        np.testing.assert_array_equal(locality_null(L, k), local[L - 1])
        for t in range(L):  # every selector row is causal, distinct, -1 padded
            for sel in (rand[t], local[t]):
                got = sel[sel >= 0]
                assert len(got) == min(k, t + 1) == len(set(got.tolist()))
                assert got.max() <= t and (sel[len(got) :] == -1).all()
            assert local[t][local[t] >= 0].tolist() == list(range(max(t + 1 - k, 0), t + 1))
    # the seed matters (a selector compared with itself could not fail; seeded reproducibility
    # is checked above through random_null, which draws its own selector)
    assert not np.array_equal(random_selector(30, 5, 1), random_selector(30, 5, 2))
    assert not np.array_equal(random_null(1000, 5, 1), random_null(1000, 5, 2))


def test_coverage_and_recall_match_a_hand_computed_example():
    # L=8, S=4: segments [0,2) [2,4) [4,6) [6,8). Dyadic weights, total 1 exactly:
    #   a = [1/2, 0, 1/4, 0, 1/8, 1/32, 1/16, 1/32].
    # The learned top-2 is {0, 2} (weights 1/2, 1/4) with a padded tail of 2 reserved slots;
    # segments 2 and 3 are missing, so witnesses e_2 = 4 and e_3 = 6 fill the tail. Budget 4.
    # Policy {0, 2, 4, 6}: coverage 4/4, recall 1/2 + 1/4 + 1/8 + 1/16 = 15/16 = 0.9375.
    # Locality null [4, 8): segments {2, 3}, coverage 0.5; recall 1/8+1/32+1/16+1/32 = 1/4.
    a = np.array([1 / 2, 0, 1 / 4, 0, 1 / 8, 1 / 32, 1 / 16, 1 / 32])
    assert a.sum() == 1.0
    policy = as_rows(
        apply_topology_witnesses(jnp.array([[0, 2, -1, -1]]), jnp.array([8]), 2, 4, 2)
    )[0]
    assert policy == [0, 2, 4, 6]
    assert segment_coverage(policy, 8, 4) == 1.0
    assert attention_mass_recall(policy, a) == 0.9375
    null = locality_null(8, len(policy))
    assert null.tolist() == [4, 5, 6, 7]
    assert segment_coverage(null, 8, 4) == 0.5
    assert attention_mass_recall(null, a) == 0.25
    # Padding, duplicates and out-of-range entries count for nothing.
    noisy = policy + [-1, 0, 6, 8, 100, -7]
    assert segment_coverage(noisy, 8, 4) == 1.0
    assert attention_mass_recall(noisy, a) == 0.9375
    assert segment_coverage([-1, 8, 9], 8, 4) == 0.0
    assert attention_mass_recall([-1, 8, 9], a) == 0.0


# --------------------------------------------------------------------------------------------
# Oracle agreement, edge arithmetic, metric edge cases
# --------------------------------------------------------------------------------------------


@PROPERTY
@given(seed=SEEDS, topk=TOPKS, S=SEGMENTS, keep_frac=st.floats(0, 1), max_rep=st.integers(0, 70))
def test_apply_and_witnesses_match_the_oracle_with_junk_entries(seed, topk, S, keep_frac, max_rep):
    learned, lens = random_batch(seed, 16, topk, junk=True)
    keep = round(keep_frac * topk)
    x, ctx = jnp.array(learned, jnp.int32), jnp.array(lens, jnp.int32)
    wit = as_rows(topology_witness_indices(x, ctx, S))
    assert wit == [oracle_witnesses(r, L, S) for r, L in zip(learned, lens, strict=True)]
    got = as_rows(apply_topology_witnesses(x, ctx, keep, S, max_rep))
    want = [oracle_apply(r, L, keep, S, max_rep) for r, L in zip(learned, lens, strict=True)]
    assert got == want


@PROPERTY
@given(
    seed=SEEDS,
    topk=TOPKS,
    width=st.sampled_from([1, 3, 8]),
    keep_frac=st.floats(0, 1),
    max_rep=st.integers(0, 10),
)
def test_merge_places_arbitrary_witness_columns_in_column_order(
    seed, topk, width, keep_frac, max_rep
):
    rng = np.random.default_rng(seed)
    learned = rng.integers(-2, 50, size=(5, topk)).tolist()
    wit = np.where(rng.random((5, width)) < 0.5, -1, rng.integers(0, 99, (5, width))).tolist()
    keep = round(keep_frac * topk)
    got = as_rows(merge_topology_witnesses(jnp.array(learned), jnp.array(wit), keep, max_rep))
    assert got == [oracle_merge(r, w, keep, max_rep) for r, w in zip(learned, wit, strict=True)]


def test_segment_of_arrays_broadcast_and_match_python_ints():
    rng = np.random.default_rng(0)
    for S in (1, 3, 7, 64):
        lens = np.concatenate(
            [
                rng.integers(1, 100, 50),
                rng.integers(1, I32_MAX, 200),
                [I32_MAX, I32_MAX - 1, 2**30, 2**24 + 1],
            ]
        ).astype(np.int64)
        xs = np.concatenate(
            [
                np.minimum(rng.integers(0, lens), I32_MAX),
                lens - 1,
                lens,
                np.full(len(lens), I32_MAX),
                np.full(len(lens), -1),
            ]
        )
        ctx = np.tile(lens, 5)
        got = np.asarray(segment_of(jnp.array(xs, jnp.int32), jnp.array(ctx, jnp.int32), S))
        want = [
            oracle_segment(int(x), int(L), S) if x >= 0 else -1
            for x, L in zip(xs, ctx, strict=True)
        ]
        assert got.tolist() == want
    grid = segment_of(jnp.arange(10)[:, None], jnp.array([[4, 10, 16]]), 4)  # broadcasting
    assert grid.shape == (10, 3)
    assert np.asarray(grid).tolist() == [
        [oracle_segment(x, L, 4) for L in (4, 10, 16)] for x in range(10)
    ]
    assert segment_of(-1, 10, 4) == -1 and segment_of(5, 0, 4) == 3  # L = 0 read as 1


def test_int32_edge_matches_python_ints():
    # x * S_eff and s * L both overflow int32 here; every edge, its neighbours and the largest
    # entries must still land exactly where Python ints put them.
    for L in (I32_MAX, I32_MAX - 1, I32_MAX - 63, 2**31 - 64 * 7):
        for S in (64, 63, 7):
            edges = [oracle_edge(s, L, S) for s in range(S)] + [L]
            probes = sorted({e + d for e in edges for d in (-1, 0, 1) if 0 <= e + d <= I32_MAX})
            probes += [I32_MAX] * (200 - len(probes))  # one array shape for every case
            got = segment_of(jnp.array(probes, jnp.int32), L, S)
            assert as_rows(got) == [oracle_segment(x, L, S) for x in probes]
            learned = [[I32_MAX, I32_MAX - 1, edges[S // 2], -1, -1, -1]]
            wit = as_rows(topology_witness_indices(jnp.array(learned), jnp.array([L]), S))
            assert wit == [oracle_witnesses(learned[0], L, S)]
            out = as_rows(apply_topology_witnesses(jnp.array(learned), jnp.array([L]), 3, S, 3))
            assert out == [oracle_apply(learned[0], L, 3, S, 3)]
            assert all(0 <= w < L for w in out[0][3:])


def test_metrics_without_segments_or_mass():
    assert segment_coverage([0, 1], 10, 0) == 1.0  # S = 0: no segments
    assert segment_coverage([0, 1], 0, 4) == 1.0  # L = 0: no segments
    assert segment_coverage([], 10, 4) == 0.0
    assert segment_coverage(np.array([0, 2, 9]), 3, 100) == 2 / 3  # S_eff = L, no upper bound
    assert math.isnan(attention_mass_recall([0, 1], np.zeros(4)))
    assert math.isnan(attention_mass_recall([0], []))
    assert attention_mass_recall(jnp.array([3, 3, 3]), [1.0, 1.0, 1.0, 1.0]) == 0.25


# --------------------------------------------------------------------------------------------
# Transformations: jit, vmap, donation; static shapes and cost
# --------------------------------------------------------------------------------------------


def test_jit_and_vmap_equal_eager():
    batches = [random_batch(s, 12, 16, junk=True) for s in range(3)]
    x = jnp.array([b[0] for b in batches], jnp.int32)  # [3, 12, 16]
    ctx = jnp.array([b[1] for b in batches], jnp.int32)  # [3, 12]
    for keep, S, max_rep in [(10, 8, 6), (5, 64, 64), (16, 4, 4), (0, 3, 20)]:
        eager = [apply_topology_witnesses(x[i], ctx[i], keep, S, max_rep) for i in range(3)]
        jitted = jax.jit(apply_topology_witnesses, static_argnums=(2, 3, 4))
        for i in range(3):
            np.testing.assert_array_equal(jitted(x[i], ctx[i], keep, S, max_rep), eager[i])
        vmapped = jax.vmap(
            partial(
                apply_topology_witnesses,
                learned_keep=keep,
                num_segments=S,
                max_replacements=max_rep,
            )
        )(x, ctx)
        np.testing.assert_array_equal(vmapped, jnp.stack(eager))
        w_eager = jnp.stack([topology_witness_indices(x[i], ctx[i], S) for i in range(3)])
        w_vmap = jax.vmap(partial(topology_witness_indices, num_segments=S))(x, ctx)
        np.testing.assert_array_equal(w_vmap, w_eager)
    serve = jax.jit(scatter_topology_witnesses, static_argnums=2)
    np.testing.assert_array_equal(
        serve(x[0], ctx[0], 8), scatter_topology_witnesses(x[0], ctx[0], 8)
    )
    seg = jax.jit(segment_of, static_argnums=2)
    np.testing.assert_array_equal(seg(x, ctx[..., None], 7), segment_of(x, ctx[..., None], 7))


def test_scatter_works_on_a_donated_buffer_under_jit():
    learned, lens = random_batch(3, 32, 64, tail_padding=8)
    expected = [oracle_apply(r, L, 56, 8, 8) for r, L in zip(learned, lens, strict=True)]
    serve = jax.jit(scatter_topology_witnesses, static_argnums=2, donate_argnums=0)
    buf = jnp.array(learned, jnp.int32)
    out = serve(buf, jnp.array(lens, jnp.int32), 8)
    assert as_rows(out) == expected
    assert buf.is_deleted()  # the buffer was donated and reused
    out2 = serve(out, jnp.array(lens, jnp.int32), 8)  # chaining a donated result works too
    assert as_rows(out2) == [
        oracle_apply(r, L, 56, 8, 8) for r, L in zip(expected, lens, strict=True)
    ]


def test_a_refused_donated_call_leaves_the_buffer_untouched():
    serve = jax.jit(scatter_topology_witnesses, static_argnums=2, donate_argnums=0)
    buf = jnp.array([[0, 5, 9, -1]], jnp.int32)
    with pytest.raises(SegmentsOutOfRange):
        serve(buf, jnp.array([16]), 65)
    with pytest.raises(RowsMismatch):
        serve(buf, jnp.array([16, 16]), 4)
    assert not buf.is_deleted() and as_rows(buf) == [[0, 5, 9, -1]]


def test_refusals_run_before_the_identity_shortcut():
    x, ctx = jnp.zeros((2, 4), jnp.int32), jnp.array([8, 8])
    with pytest.raises(LearnedKeepOutOfRange):  # B would be 0 either way
        apply_topology_witnesses(x, ctx, 9, 4, 0)
    with pytest.raises(LearnedKeepOutOfRange):
        merge_topology_witnesses(x, jnp.zeros((2, 4), jnp.int32), 9, 0)
    with pytest.raises(SegmentsOutOfRange):  # zero rows
        apply_topology_witnesses(jnp.zeros((0, 4), jnp.int32), jnp.zeros((0,), jnp.int32), 0, 65, 4)
    with pytest.raises(SegmentsOutOfRange):
        topology_witness_indices(jnp.zeros((0, 4), jnp.int32), jnp.zeros((0,), jnp.int32), 0)
    with pytest.raises(WitnessError, match="max_replacements=-1"):  # keep = topk: B = 0
        apply_topology_witnesses(x, ctx, 4, 4, -1)
    with pytest.raises(RowsMismatch):  # S = 0 is the off switch, not a licence for bad shapes
        scatter_topology_witnesses(x, jnp.array([8]), 0)
    with pytest.raises(RowsMismatch):
        apply_topology_witnesses(jnp.zeros((0, 4), jnp.int32), jnp.zeros((1,), jnp.int32), 0, 4, 0)


def test_dtypes_and_statics_are_type_checked():
    x, ctx = jnp.zeros((2, 4), jnp.int32), jnp.array([8, 8])
    with pytest.raises(TypeError, match="learned must have an integer dtype"):
        topology_witness_indices(x.astype(jnp.float32), ctx, 4)
    with pytest.raises(TypeError, match="context_lens must have an integer dtype"):
        apply_topology_witnesses(x, ctx.astype(jnp.float32), 0, 4, 4)
    with pytest.raises(TypeError, match="witnesses must have an integer dtype"):
        merge_topology_witnesses(x, jnp.zeros((2, 4), jnp.float32), 0, 4)
    with pytest.raises(TypeError, match="learned_keep must be a static Python int"):
        apply_topology_witnesses(x, ctx, 1.0, 4, 4)
    with pytest.raises(TypeError, match="num_segments must be a static Python int"):
        jax.jit(scatter_topology_witnesses)(x, ctx, 4)  # traced, not static
    with pytest.raises(TypeError, match="context_lens must have an integer dtype"):
        scatter_topology_witnesses(x, jnp.array([True, False]), 4)
    out = apply_topology_witnesses(np.zeros((2, 4), np.int64) - 1, np.array([8, 8]), 0, 4, 4)
    assert out.dtype == jnp.int32 and as_rows(out) == [[0, 2, 4, 6]] * 2


@pytest.mark.parametrize("fill", ["tail", "lowest"])
def test_cost_is_linear_in_topk_plus_segments_squared_with_no_scatter_gather_or_callback(fill):
    rows, topk, S = 8, 256, 64
    jaxpr = jax.make_jaxpr(lambda a, c: scatter_topology_witnesses(a, c, S, fill=fill))(
        jnp.zeros((rows, topk), jnp.int32), jnp.ones((rows,), jnp.int32)
    )
    biggest, prims = 0, set()

    def walk(jx):
        nonlocal biggest
        for eqn in jx.eqns:
            prims.add(eqn.primitive.name)
            for v in eqn.outvars:
                biggest = max(biggest, math.prod(getattr(v.aval, "shape", ())))
            for param in eqn.params.values():  # pjit / cond bodies
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    # No [rows, topk, S] intermediate: the largest is the merge window's [rows, S, min(S, topk)]
    # compare-select (or a [rows, topk] array).
    assert biggest <= rows * max(topk, S * min(S, topk)) < rows * topk * S
    assert "dynamic_update_slice" in prims  # the walk reached the jitted merge body
    # Per-element scatters and gathers model at tens of times their data on TPU (issue 13).
    assert not {p for p in prims if "scatter" in p or "gather" in p or "callback" in p}


@jax.jit
def _scatter_merge(learned, witnesses, keep, budget):
    """The merge as it was written before issue 13 (a per-element scatter): kept here only to
    show that the scatter-free merge is bitwise the same function. Jitted with ``keep`` and
    ``budget`` traced, as ``_merge`` is: one program per shape, not an eager compile of each op."""
    rows, topk = learned.shape
    valid = witnesses >= 0
    rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1
    slot = jnp.where(valid & (rank < budget), keep + rank, topk)
    row_ids = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], slot.shape)
    return learned.at[row_ids, slot].set(witnesses, mode="drop")


@PROPERTY
@given(seed=SEEDS, topk=st.sampled_from([1, 2, 5, 16, 63, 64, 65, 200]),
       S=st.sampled_from([1, 2, 7, 32, 33, 64]), keep_frac=st.floats(0, 1),
       max_rep=st.integers(0, 80))
def test_the_scatter_free_merge_is_bitwise_the_old_scatter_merge(seed, topk, S, keep_frac,
                                                                  max_rep):
    rng = np.random.default_rng(seed)
    learned = jnp.asarray(rng.integers(-3, 300, size=(9, topk)), jnp.int32)
    wit = np.where(rng.random((9, S)) < 0.4, -1, rng.integers(0, 300, (9, S)))
    keep = round(keep_frac * topk)
    budget = min(max_rep, topk - keep)
    got = merge_topology_witnesses(learned, jnp.asarray(wit, jnp.int32), keep, max_rep)
    want = learned if budget == 0 else _scatter_merge(learned, jnp.asarray(wit, jnp.int32),
                                                      keep, budget)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --------------------------------------------------------------------------------------------
# fill="lowest" and the opt-in S >= topk guard (issue 12 item 4)
# --------------------------------------------------------------------------------------------


def oracle_lowest(row: list[int], L: int, S: int) -> list[int]:
    """The definition: a row's ``w`` valid witnesses (ascending segment order, at most
    ``topk``) overwrite its last ``w`` slots; everything before them is kept."""
    placed = [w for w in oracle_witnesses(row, L, S) if w >= 0][: len(row)]
    return row[: len(row) - len(placed)] + placed


def test_the_lowest_fill_writes_the_row_end_and_the_tail_fill_the_reserved_slots():
    # L = 16, S = 4 (the seed's geometry); segment 3 is missing from both rows.
    rows = jnp.array([[5, 9, 2, 3, -1, -1, -1, -1], [5, 9, 2, 3, 6, 7, 1, 0]], jnp.int32)
    ctx = jnp.array([16, 16])
    low = as_rows(scatter_topology_witnesses(rows, ctx, 4, fill="lowest"))
    tail = as_rows(scatter_topology_witnesses(rows, ctx, 4, fill="tail"))
    assert low == [[5, 9, 2, 3, -1, -1, -1, 12], [5, 9, 2, 3, 6, 7, 1, 12]]
    assert tail == [[5, 9, 2, 3, 12, -1, -1, -1], [5, 9, 2, 3, 12, 7, 1, 0]]
    assert as_rows(scatter_topology_witnesses(rows, ctx, 4)) == tail  # "tail" is the default


@settings(max_examples=50, deadline=None)
@given(seed=SEEDS, topk=TOPKS, S=SEGMENTS, padding=st.booleans())
def test_the_lowest_fill_matches_its_definition(seed, topk, S, padding):
    learned, lens = random_batch(seed, 16, topk, tail_padding=min(S, topk) if padding else 0,
                                 junk=not padding)
    out = as_rows(scatter_topology_witnesses(jnp.array(learned), jnp.array(lens), S,
                                             fill="lowest"))
    tail = as_rows(scatter_topology_witnesses(jnp.array(learned), jnp.array(lens), S))
    for row, L, new, old in zip(learned, lens, out, tail, strict=True):
        assert new == oracle_lowest(row, L, S)
        w = sum(x >= 0 for x in oracle_witnesses(row, L, S))
        if w == S:  # every segment missing: the two fills write the same slots
            assert new == old
        if padding and L > 0 and w <= min(S, topk):
            assert segment_coverage(new, L, S) == 1.0  # witnesses landed on padding only


def test_the_lowest_fill_under_jit_with_a_donated_buffer():
    learned, lens = random_batch(5, 32, 24)
    serve = jax.jit(scatter_topology_witnesses, static_argnames=("num_segments", "fill"),
                    donate_argnums=0)
    buf = jnp.array(learned, jnp.int32)
    out = serve(buf, jnp.array(lens, jnp.int32), num_segments=8, fill="lowest")
    assert as_rows(out) == [oracle_lowest(r, L, 8) for r, L in zip(learned, lens, strict=True)]
    assert buf.is_deleted()


def test_the_full_overwrite_guard_is_opt_in_and_names_both_numbers():
    x, ctx = jnp.array([[0, 5, 9, 3]], jnp.int32), jnp.array([16])
    for fill in ("tail", "lowest"):
        for s in (4, 5, 64):  # S >= topk: allowed by default (upstream behaviour) ...
            assert np.asarray(scatter_topology_witnesses(x, ctx, s, fill=fill)).shape == (1, 4)
            with pytest.raises(ValueError, match=rf"num_segments={s} >= topk=4"):  # ... or refused
                scatter_topology_witnesses(x, ctx, s, fill=fill, refuse_full_overwrite=True)
        got = scatter_topology_witnesses(x, ctx, 3, fill=fill, refuse_full_overwrite=True)
        assert as_rows(got) == as_rows(scatter_topology_witnesses(x, ctx, 3, fill=fill))
        assert as_rows(scatter_topology_witnesses(x, ctx, 0, refuse_full_overwrite=True)) == [
            [0, 5, 9, 3]]  # S = 0 is off, never refused


def test_bad_fill_and_guard_arguments_are_refused_by_name():
    x, ctx = jnp.array([[0, 5, 9, -1]], jnp.int32), jnp.array([16])
    with pytest.raises(ValueError, match=r"fill must be one of \('tail', 'lowest'\), got "
                                         r"fill='highest'"):
        scatter_topology_witnesses(x, ctx, 4, fill="highest")
    with pytest.raises(ValueError, match="fill must be one of"):  # also when S = 0
        scatter_topology_witnesses(x, ctx, 0, fill=None)
    with pytest.raises(TypeError, match="refuse_full_overwrite must be a bool, got int"):
        scatter_topology_witnesses(x, ctx, 4, refuse_full_overwrite=1)
    with pytest.raises(SegmentsOutOfRange):
        scatter_topology_witnesses(x, ctx, 65, fill="lowest")
    with pytest.raises(RowsMismatch):
        scatter_topology_witnesses(x, jnp.array([8, 8]), 4, fill="lowest")
