"""Token and page top-k references against the float64 oracle of the definition."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from batches import PAGE_SIZE, PAGES_PER_SEQ, SCENARIOS, indexer_args, rounded_to_bf16, scenario
from oracle import check_page_topk, check_token_topk

from reference import streamindex_page_topk_ref, streamindex_topk_ref

_bf16 = rounded_to_bf16
_args = indexer_args


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("k", [5, 24, 100])
def test_token_topk_selects_the_highest_scoring_causal_tokens(name, k, dtype):
    b = scenario(name, seed=k)
    oracle_b = _bf16(b) if dtype == jnp.bfloat16 else b
    idx = streamindex_topk_ref(*_args(b, dtype), k=k, pages_per_seq=PAGES_PER_SEQ)
    check_token_topk(idx, oracle_b, k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("k_pages", [2, 12])
def test_page_topk_selects_the_highest_scoring_pages(name, k_pages, dtype):
    b = scenario(name, seed=k_pages)
    oracle_b = _bf16(b) if dtype == jnp.bfloat16 else b
    idx = streamindex_page_topk_ref(*_args(b, dtype), k_pages=k_pages,
                                    pages_per_seq=PAGES_PER_SEQ)
    check_page_topk(idx, oracle_b, k_pages)


@pytest.mark.parametrize("op,kw", [(streamindex_topk_ref, {"k": 16}),
                                   (streamindex_page_topk_ref, {"k_pages": 3})])
def test_decode_fast_path_equals_general_path(op, kw):
    b = scenario("decode", seed=3)
    fast = op(*b.args(), pages_per_seq=PAGES_PER_SEQ, one_token_per_seq=True, exact=True, **kw)
    general = op(*b.args(), pages_per_seq=PAGES_PER_SEQ, exact=True, **kw)
    np.testing.assert_array_equal(fast, general)


def test_long_prefill_uses_several_windows_and_stays_exact():
    # 300 rows of one sequence: the window ladder (256, 64, 16, 4, 1) takes 256 + 4*... passes.
    rng = np.random.default_rng(7)
    from reference.synthetic import make_ragged_batch

    b = make_ragged_batch(rng, q_lens=[3, 300], kv_lens=[9, 310], page_size=16,
                          pages_per_seq=20, num_heads=2, dim=8)
    idx = streamindex_topk_ref(*b.args(), k=32, pages_per_seq=20)
    check_token_topk(idx, b, 32)


def test_exact_mode_breaks_ties_by_lowest_offset():
    b = scenario("prefill", seed=1)
    cache = np.where(np.isnan(b.cache), np.nan, 1.0).astype(np.float32)  # every key equal
    b = dataclasses.replace(b, cache=cache)
    idx = np.asarray(streamindex_topk_ref(*b.args(), k=6, pages_per_seq=PAGES_PER_SEQ,
                                          exact=True))
    # row 25 is token 5 of sequence 1 (kv 50, q 33): abs position 50 - 33 + 5 = 22
    np.testing.assert_array_equal(idx[25], np.arange(6))
    np.testing.assert_array_equal(idx[0], [0, -1, -1, -1, -1, -1])  # first token: itself only


def test_tail_padding_in_page_indices_changes_nothing():
    a = scenario("mixed_padding", seed=2)
    b = scenario("mixed_padding", seed=2, tail_pages=3)
    assert len(b.page_indices) == len(a.page_indices) + 3
    for bb in (a, b):
        idx = streamindex_topk_ref(*bb.args(), k=8, pages_per_seq=PAGES_PER_SEQ, exact=True)
        check_token_topk(idx, bb, 8)


def test_out_of_range_page_ids_mask_their_tokens():
    b = scenario("mtp", seed=4)
    pages = b.page_indices.copy()
    pages[1] = 10_000  # sequence 0's second page: its tokens no longer exist
    pages[-1] = -3
    idx = streamindex_topk_ref(*b.args()[:4], pages, *b.meta()[2:], k=20,
                               pages_per_seq=PAGES_PER_SEQ)
    check_token_topk(idx, b, 20, page_indices=pages)
    assert not np.any((idx[:3] >= 8) & (idx[:3] < 12))


def test_inactive_sequences_by_distribution_give_all_minus_one_rows():
    b = scenario("mixed_padding", seed=5)
    dist = b.distribution.copy()
    dist[2] = 2  # only sequences 0 and 1 active
    idx = np.asarray(streamindex_topk_ref(*b.args()[:7], dist, k=4,
                                          pages_per_seq=PAGES_PER_SEQ))
    assert np.all(idx[2:] == -1) and np.all(idx[:2, 0] >= 0)


def test_kv_len_past_capacity_is_clipped_to_capacity():
    b = scenario("decode", seed=6)
    lens = b.seq_lens.copy()
    lens[1] = 10_000  # capacity is 64
    idx = np.asarray(streamindex_topk_ref(*b.args()[:3], lens, *b.meta()[1:], k=80,
                                          pages_per_seq=PAGES_PER_SEQ))
    assert idx[1].max() < PAGE_SIZE * PAGES_PER_SEQ and np.sum(idx[1] >= 0) == 64


@pytest.mark.parametrize("fill", ["tail", "lowest"])
@pytest.mark.parametrize("page_level", [False, True])
def test_witnesses_are_merged_with_each_rows_causal_context(page_level, fill):
    from reference.page_topk import causal_page_count
    from reference.witnesses import scatter_topology_witnesses

    b = scenario("mixed_padding", seed=21)
    S, k = 4, 10 if not page_level else 6
    op = streamindex_page_topk_ref if page_level else streamindex_topk_ref
    kw = {"k_pages" if page_level else "k": k, "pages_per_seq": PAGES_PER_SEQ, "exact": True}
    plain = np.asarray(op(*b.args(), **kw))
    merged = np.asarray(op(*b.args(), num_segments=S, fill=fill, **kw))
    # row contexts from the definition: abs position + 1 tokens (pages: the causal page count)
    from oracle import row_sequences

    rows = row_sequences(b.q.shape[0], b.cu_q_lens, b.seq_lens, b.distribution)
    ctx = np.array([0 if r is None else r[1] + 1 for r in rows], np.int32)
    if page_level:
        ctx = np.asarray(causal_page_count(jnp.asarray(ctx - 1), jnp.asarray(ctx), PAGE_SIZE))
    np.testing.assert_array_equal(merged, scatter_topology_witnesses(plain, ctx, S, fill=fill))
    outside = [i for i, r in enumerate(rows) if r is None]
    assert outside and np.all(merged[outside] == -1)
    assert np.all(merged < np.maximum(ctx, 1)[:, None])  # every entry causal
    np.testing.assert_array_equal(merged[:, : k - S], plain[:, : k - S])


@pytest.mark.parametrize("page_level", [False, True])
def test_the_full_overwrite_guard_and_a_bad_fill_are_refused_by_the_entries(page_level):
    b = scenario("mixed_padding", seed=21)
    op = streamindex_page_topk_ref if page_level else streamindex_topk_ref
    name = "k_pages" if page_level else "k"
    kw = {name: 4, "pages_per_seq": PAGES_PER_SEQ}
    with pytest.raises(ValueError, match=rf"num_segments=4 >= {name}=4 with refuse_full"):
        op(*b.args(), num_segments=4, refuse_full_overwrite=True, **kw)
    with pytest.raises(ValueError, match="fill must be one of"):
        op(*b.args(), num_segments=2, fill="top", **kw)
    # allowed by default (the upstream behaviour), and below k with the guard on
    assert np.asarray(op(*b.args(), num_segments=4, **kw)).shape[1] == 4
    assert np.asarray(op(*b.args(), num_segments=3, refuse_full_overwrite=True,
                         **kw)).shape[1] == 4
