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
