"""validate=True: each runtime rule of dsa_jax.validate reported with its numbers (checkify)."""

from __future__ import annotations

import numpy as np
import pytest
from jax.experimental import checkify

import dsa_jax
from dsa_jax import BatchMeta, PagedLayout, StepInputs
from reference.synthetic import make_ragged_batch

PAGE, PAGES, K = 8, 4, 4


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(11)
    return make_ragged_batch(rng, q_lens=[1, 1, 4], kv_lens=[9, 20, 13], page_size=PAGE,
                             pages_per_seq=PAGES, num_heads=2, dim=16, pad_rows=1, pad_seqs=1)


def _topk(b, **overrides):
    args = dict(zip(("q", "weights", "cache", "seq_lens", "page_indices", "cu_q_lens",
                     "cu_kv_lens", "distribution"), b.args(), strict=True))
    args.update(overrides)
    return dsa_jax.indexer_topk(*args.values(), k=K, pages_per_seq=PAGES, validate=True,
                                backend="reference")


def test_a_valid_batch_passes_and_gives_the_unvalidated_result(batch):
    got = _topk(batch)
    want = dsa_jax.indexer_topk(*batch.args(), k=K, pages_per_seq=PAGES, backend="reference")
    np.testing.assert_array_equal(got, want)


def test_rule_page_id_out_of_range(batch):
    table = batch.page_indices.copy()
    base = batch.cu_kv_lens[1] // PAGE
    table[base + 2] = 99
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"page id out of range: sequence 1 page 2: page_indices\[{base + 2}"
                             rf"\] = 99 is outside \[0, num_pages=\d+\)"):
        _topk(batch, page_indices=table)


def test_rule_page_slot_past_the_end_of_the_page_table(batch):
    table = batch.page_indices[:-1]  # sequence 2's second page has no slot
    n = len(table)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"sequence 2 needs page slot {n} \(page 1 of its 2 pages\) but "
                             rf"page_indices has only {n} entries"):
        _topk(batch, page_indices=table)


def test_rule_kv_len_past_capacity(batch):
    kv = batch.seq_lens.copy()
    kv[1] = 40
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"kv_len past capacity: sequence 1 has kv_len=40 tokens, "
                             r"capacity_tokens = pages_per_seq 4 x page_size 8 = 32"):
        _topk(batch, seq_lens=kv)


def test_rule_non_monotone_cu_arrays(batch):
    cu_q = batch.cu_q_lens.copy()
    cu_q[2] = 0  # [0, 1, 0, 6, 6]
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"non-monotone cu_q_lens: cu_q_lens\[1\] = 1 > cu_q_lens\[2\] = 0"):
        _topk(batch, cu_q_lens=cu_q)
    cu_kv = batch.cu_kv_lens.copy()
    cu_kv[3] = cu_kv[2] - PAGE
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"non-monotone cu_kv_lens: cu_kv_lens\[2\] = {cu_kv[2]} > "
                             rf"cu_kv_lens\[3\] = {cu_kv[3]}"):
        _topk(batch, cu_kv_lens=cu_kv)
    cu_kv = batch.cu_kv_lens.copy()
    cu_kv[1] += 3
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"cu_kv_lens\[1\] = {cu_kv[1]} tokens is not a whole number of "
                             r"pages \(page_size 8, remainder 3\)"):
        _topk(batch, cu_kv_lens=cu_kv)


def test_rule_distribution_inconsistent_with_the_batch(batch):
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"need 0 <= decode_end 2 <= prefill_end 3 <= num_seqs 5 <= S 4"):
        _topk(batch, distribution=np.array([2, 3, 5], np.int32))
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"sequence 2 < decode_end 3 is a decode sequence but has q_len=4"):
        _topk(batch, distribution=np.array([3, 3, 3], np.int32))
    kv = batch.seq_lens.copy()
    kv[2] = 3
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"active sequence 2 has q_len=4 > kv_len=3"):
        _topk(batch, seq_lens=kv)


def test_every_op_and_the_step_validate(batch):
    bad = batch.seq_lens.copy()
    bad[0] = 33
    meta = (bad, *batch.meta()[1:])
    idx = np.zeros((batch.q.shape[0], K), np.int32)
    q = np.zeros((batch.q.shape[0], 2, 16), np.float32)
    for call in (
            lambda: dsa_jax.page_topk(*batch.args()[:3], *meta, k_pages=2, pages_per_seq=PAGES,
                                      validate=True),
            lambda: dsa_jax.sparse_mla(q, batch.cache, bad, idx, *meta[1:], sm_scale=0.1,
                                       pages_per_seq=PAGES, v_dim=8, validate=True),
            lambda: dsa_jax.page_sparse_mla(q, batch.cache, bad, idx, *meta[1:], sm_scale=0.1,
                                            pages_per_seq=PAGES, v_dim=8, validate=True)):
        with pytest.raises(checkify.JaxRuntimeError, match="sequence 0 has kv_len=33"):
            call()
    layout = PagedLayout(page_size=PAGE, pages_per_seq=PAGES, index_dim=16, latent_dim=100,
                         rope_dim=12)
    t, p = batch.q.shape[0], batch.cache.shape[0]
    inputs = StepInputs(np.zeros((1, t, 2, 128), np.float32), np.zeros((1, t, 128), np.float32),
                        np.zeros((1, t, 2, 16), np.float32), np.zeros((1, t, 2), np.float32),
                        np.zeros((1, t, 16), np.float32))
    with pytest.raises(checkify.JaxRuntimeError, match="sequence 0 has kv_len=33"):
        dsa_jax.dsa_step(inputs, np.zeros((1, *layout.latent_cache_shape(p)), np.float32),
                         np.zeros((1, *layout.index_cache_shape(p)), np.float32),
                         BatchMeta(*meta), layout=layout, indexer_types=("full",), k=K,
                         sm_scale=0.1, validate=True)
