"""Sparse MLA references against the float64 oracle: junk entries, NaN, empty rows, LSE."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from batches import PAGES_PER_SEQ, SCENARIOS, scenario
from oracle import mla_oracle

from reference import (
    page_sparse_mla_ref,
    sparse_mla_ref,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
)

SM_SCALE = 0.35
V_DIM = 12


def _junk_topk(b, k, rng):
    """Reference top-k with junk mixed in: -1, kv_len, huge, negative, and duplicates."""
    idx = np.array(streamindex_topk_ref(*b.args(), k=k, pages_per_seq=PAGES_PER_SEQ))
    junk = np.array([-1, -7, 10**6, 2**31 - 1, int(b.seq_lens.max())], np.int32)
    mask = rng.random(idx.shape) < 0.3
    idx[mask] = rng.choice(junk, size=mask.sum())
    idx[:, -1] = idx[:, 0]  # a duplicate in every row
    return idx


def _rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sparse_mla_matches_the_oracle_and_ignores_junk(name, dtype, tol):
    b = scenario(name, seed=11, num_heads=3, dim=16)
    rng = np.random.default_rng(0)
    idx = _junk_topk(b, 10, rng)
    q, cache = jnp.asarray(b.q, dtype), jnp.asarray(b.cache, dtype)
    out, lse = sparse_mla_ref(q, cache, b.seq_lens, idx, *b.meta()[1:], sm_scale=SM_SCALE,
                              pages_per_seq=PAGES_PER_SEQ, v_dim=V_DIM, return_lse=True)
    want, want_lse = mla_oracle(q, cache, b.seq_lens, idx, *b.meta()[1:], sm_scale=SM_SCALE,
                                v_dim=V_DIM, pages_per_seq=PAGES_PER_SEQ)
    assert out.dtype == dtype and out.shape == (b.q.shape[0], 3, V_DIM)
    assert not np.any(np.isnan(np.asarray(out, np.float32)))
    assert _rel_err(out, want) <= tol
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_page_sparse_mla_attends_causal_tokens_of_selected_pages(name):
    b = scenario(name, seed=12, num_heads=2, dim=16)
    pages = np.array(streamindex_page_topk_ref(*b.args(), k_pages=3,
                                               pages_per_seq=PAGES_PER_SEQ))
    pages[:, -1] = np.where(pages[:, 0] >= 0, pages[:, 0], 99)  # duplicate / junk page
    out, lse = page_sparse_mla_ref(b.q, b.cache, b.seq_lens, pages, *b.meta()[1:],
                                   sm_scale=SM_SCALE, pages_per_seq=PAGES_PER_SEQ, v_dim=V_DIM,
                                   return_lse=True)
    want, want_lse = mla_oracle(b.q, b.cache, b.seq_lens, pages, *b.meta()[1:],
                                sm_scale=SM_SCALE, v_dim=V_DIM, pages_per_seq=PAGES_PER_SEQ,
                                page=True)
    assert _rel_err(out, want) <= 1e-5
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


def test_an_empty_row_gives_zeros_and_minus_inf_lse():
    b = scenario("mixed_padding", seed=13)
    idx = np.full((b.q.shape[0], 4), -1, np.int32)
    idx[0] = [3, 1000, -1, 5]  # row 0 has two valid entries; all others none
    out, lse = sparse_mla_ref(b.q, b.cache, b.seq_lens, idx, *b.meta()[1:], sm_scale=SM_SCALE,
                              pages_per_seq=PAGES_PER_SEQ, v_dim=V_DIM, return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(out[1:] == 0) and np.all(np.isneginf(lse[1:]))
    assert np.all(np.isfinite(lse[0])) and np.any(out[0] != 0)


def test_a_nan_in_a_selected_slot_does_show():
    # The NaN-safety is about unselected slots; a selected NaN row must not be hidden.
    b = scenario("decode", seed=14)
    cache = b.cache.copy()
    pid = b.seq_pages[1][0]
    cache[pid, 2] = np.nan
    idx = np.zeros((b.q.shape[0], 2), np.int32)
    idx[:, 1] = 2
    out = np.asarray(sparse_mla_ref(b.q, cache, b.seq_lens, idx, *b.meta()[1:],
                                    sm_scale=SM_SCALE, pages_per_seq=PAGES_PER_SEQ, v_dim=V_DIM))
    assert np.all(np.isnan(out[1])) and not np.any(np.isnan(out[np.arange(5) != 1]))


def test_long_batches_are_chunked_without_changing_results(monkeypatch):
    from reference import attend

    b = scenario("prefill", seed=15)
    idx = np.array(streamindex_topk_ref(*b.args(), k=9, pages_per_seq=PAGES_PER_SEQ))
    full = sparse_mla_ref(b.q, b.cache, b.seq_lens, idx, *b.meta()[1:], sm_scale=SM_SCALE,
                          pages_per_seq=PAGES_PER_SEQ, v_dim=V_DIM)
    monkeypatch.setattr(attend, "GATHER_BLOCK_BYTES", 4 * 2000)  # forces 7-row chunks
    sparse_mla_ref.clear_cache()
    chunked = sparse_mla_ref(b.q, b.cache, b.seq_lens, idx, *b.meta()[1:], sm_scale=SM_SCALE,
                             pages_per_seq=PAGES_PER_SEQ, v_dim=V_DIM)
    sparse_mla_ref.clear_cache()
    np.testing.assert_allclose(chunked, full, rtol=1e-6)


def test_the_packed_bf16_cache_gives_the_same_result_as_plain_bf16():
    from reference.packed_cache import pack_cache

    b = scenario("mixed_padding", seed=16, dim=128)
    idx = _junk_topk(b, 6, np.random.default_rng(1))
    q, cache = jnp.asarray(b.q, jnp.bfloat16), jnp.asarray(b.cache, jnp.bfloat16)
    kw = dict(sm_scale=SM_SCALE, pages_per_seq=PAGES_PER_SEQ, v_dim=64)
    plain = sparse_mla_ref(q, cache, b.seq_lens, idx, *b.meta()[1:], **kw)
    packed = sparse_mla_ref(q, pack_cache(cache), b.seq_lens, idx, *b.meta()[1:], **kw)
    np.testing.assert_array_equal(np.asarray(packed, np.float32), np.asarray(plain, np.float32))
    with pytest.raises(ValueError, match=r"packed_words\(q.shape\[2\]\)"):
        sparse_mla_ref(q, pack_cache(cache)[..., :64], b.seq_lens, idx, *b.meta()[1:], **kw)
