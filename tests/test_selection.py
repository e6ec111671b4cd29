"""The shared selection stage on hand-made score rows."""

from __future__ import annotations

import numpy as np
import pytest

from reference import select_topk

NEG = -np.inf


@pytest.mark.parametrize("exact", [True, False])
def test_guard_pads_minus_one_in_the_tail_and_k_may_exceed_columns(exact):
    scores = np.array([[0.5, NEG, 2.0, 1.0], [NEG, NEG, NEG, NEG], [3.0, 1.0, 2.0, 0.0]],
                      np.float32)
    idx = np.asarray(select_topk(scores, 6, exact=exact))
    np.testing.assert_array_equal(idx, [[2, 3, 0, -1, -1, -1], [-1] * 6, [0, 2, 1, 3, -1, -1]])


@pytest.mark.parametrize("exact", [True, False])
def test_nan_scores_are_never_selected(exact):
    scores = np.array([[np.nan, 1.0, np.nan, -5.0]], np.float32)
    np.testing.assert_array_equal(select_topk(scores, 3, exact=exact), [[1, 3, -1]])


def test_exact_mode_ties_go_to_the_lowest_index():
    scores = np.array([[1.0, 2.0, 1.0, 2.0, 1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(select_topk(scores, 4, exact=True), [[1, 3, 5, 0]])


def test_reruns_are_bitwise_identical():
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((64, 500)).astype(np.float32)
    scores[:, ::7] = scores[:, :1]  # many ties
    first = np.asarray(select_topk(scores, 50, exact=True))
    for _ in range(5):
        np.testing.assert_array_equal(select_topk(scores, 50, exact=True), first)


def _seed_select(scores, k, exact):
    """The selection as written before issue 13 (``aggregate_to_topk=False`` -> ``top_k`` ->
    ``take_along_axis``, guard with a separate candidate count): kept only to show that the
    gather-free form selects the same rows."""
    import jax
    import jax.numpy as jnp

    scores = jnp.where(jnp.isnan(scores), NEG, scores)
    kk = min(k, scores.shape[-1])
    if exact:
        vals, idx = jax.lax.top_k(scores, kk)
    else:
        cand_v, cand_i = jax.lax.approx_max_k(scores, kk, aggregate_to_topk=False)
        vals, sel = jax.lax.top_k(cand_v, kk)
        idx = jnp.take_along_axis(cand_i, sel, axis=-1)
    n_valid = jnp.sum(scores > NEG, axis=-1, keepdims=True)
    idx = jnp.where((jnp.arange(kk)[None, :] < n_valid) & (vals > NEG), idx, -1)
    return np.pad(np.asarray(idx), ((0, 0), (0, k - kk)), constant_values=-1)


@pytest.mark.parametrize("seed", range(6))
def test_the_gather_free_selection_equals_the_old_one(seed):
    """Exact mode bitwise; default mode by score (ties forgiven), on random rows with -inf
    holes, NaN, ties, all-masked rows and k above and below the candidate count.

    The width is one of three (a few columns, a hundred-odd, hundreds; each for two adjacent
    seeds, the data random per seed) rather than drawn per seed: the cost is the compile of
    every op at every (width, k), so two seeds of one width share theirs."""
    rng = np.random.default_rng(seed)
    rows, cols = 24, (7, 130, 399)[seed // 2]
    scores = rng.standard_normal((rows, cols)).astype(np.float32)
    scores[:, :: int(rng.integers(2, 9))] = 0.25  # ties
    scores[rng.random((rows, cols)) < rng.random((rows, 1))] = NEG  # per-row hole density
    scores[rng.random((rows, cols)) < 0.02] = np.nan
    scores[0] = NEG
    clean = np.where(np.isnan(scores), NEG, scores)

    def pick(idx):
        return np.where(idx >= 0, np.take_along_axis(clean, np.maximum(idx, 0), 1), NEG)

    for k in (1, cols // 3 + 1, cols, cols + 7):
        np.testing.assert_array_equal(select_topk(scores, k, exact=True),
                                      _seed_select(scores, k, exact=True))
        new = np.asarray(select_topk(scores, k))
        old = _seed_select(scores, k, exact=False)
        np.testing.assert_array_equal(new < 0, old < 0)  # same -1 slots
        np.testing.assert_array_equal(pick(new), pick(old))  # same scores, slot by slot
