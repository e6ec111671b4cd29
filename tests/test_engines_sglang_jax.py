"""``dsa_jax.engines.sglang_jax`` (issue 29, the indexer side): sglang-jax's call names,
arguments and results. ``streamindex_topk`` on sglang-jax's 4-D cache and fixed-stride table
equals ``dsa_jax.indexer_topk`` on the same keys and meets the float64 top-k oracle
(``tests/oracle.py``), on a decode batch and a prefill chunk with NaN in every unowned cache
slot; ``compute_topk_pages`` equals the pages-touched definition; refusals are named."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batches import fixed_stride_table
from oracle import check_token_topk

import dsa_jax
import reference
from dsa_jax.engines import sglang_jax as sj
from reference.synthetic import make_ragged_batch

PAGE, PAGES, K = 8, 4, 12
# sglang-jax cddbf6f: python/sgl_jax/srt/kernels/dsa/streamindex_topk.py and sparse_mla.py.
THEIR_TOPK_PARAMS = ["q", "indexer_weights", "cache_kv", "seq_lens", "page_indices",
                     "cu_q_lens", "distribution", "k", "compression_ratio",
                     "num_kv_pages_per_block", "num_queries_per_block", "vmem_limit_bytes",
                     "decode_req_batch_size"]
THEIR_PAGES_PARAMS = ["topk_indices", "page_size", "pages_per_seq", "k_pages_max"]


def their_inputs(b, dtype, distribution):
    """sglang-jax's arguments for synthetic batch ``b``: the cache as ``[P, ps / kv_packing,
    kv_packing, D]``, a flat fixed-stride table whose unused slots name a spare (all-NaN)
    page, and ``distribution`` as sglang-jax sends it."""
    spare = sorted(set(range(b.cache.shape[0])) - set(np.concatenate(b.seq_pages).tolist()))
    table = fixed_stride_table(b, fill=spare[0])
    packing = 32 // (jnp.dtype(dtype).itemsize * 8)
    cache = jnp.asarray(b.cache, dtype).reshape(b.cache.shape[0], PAGE // packing, packing, -1)
    dist = np.asarray(distribution, np.int32)
    return (b.q, b.weights, cache, b.seq_lens, table.reshape(-1), b.cu_q_lens, dist), table


BATCHES = {
    # decode: one row per sequence, a padding row, an inactive slot; sglang-jax's [n, n, n]
    "decode": (dict(q_lens=[1, 1, 1], kv_lens=[9, 30, 13], pad_rows=1, pad_seqs=1),
               [3, 3, 3], jnp.bfloat16),
    # a prefill chunk (extend): sglang-jax's [0, 0, n]
    "prefill": (dict(q_lens=[4, 3, 5], kv_lens=[13, 3, 21], pad_rows=2, pad_seqs=0),
                [0, 0, 3], jnp.float32),
}


@pytest.fixture(scope="module", params=sorted(BATCHES))
def case(request):
    spec, dist, dtype = BATCHES[request.param]
    b = make_ragged_batch(np.random.default_rng(29), page_size=PAGE, pages_per_seq=PAGES,
                          num_heads=2, dim=128, **spec)
    args, table = their_inputs(b, dtype, dist)
    return b, args, table, dtype


def test_the_signatures_are_sglang_jax_s_plus_implementation():
    assert list(inspect.signature(sj.streamindex_topk).parameters) == (
        THEIR_TOPK_PARAMS + ["implementation"])
    assert list(inspect.signature(sj.compute_topk_pages).parameters) == (
        THEIR_PAGES_PARAMS + ["implementation"])
    assert sj.streamindex_topk_ref is reference.streamindex_topk_ref
    assert sj.streamindex_page_topk_ref is reference.streamindex_page_topk_ref


def test_streamindex_topk_is_indexer_topk_and_meets_the_oracle(case):
    b, args, table, dtype = case
    got = sj.streamindex_topk(*args, k=K, compression_ratio=1, num_kv_pages_per_block=64,
                              num_queries_per_block=1, implementation="xla")
    assert got.shape == (b.q.shape[0], K) and got.dtype == jnp.int32
    cache3d = jnp.asarray(b.cache, dtype)
    batch = dsa_jax.Batch.from_fixed_stride(b.seq_lens, table, b.cu_q_lens, args[-1],
                                            page_size=PAGE)
    want = dsa_jax.indexer_topk(b.q, b.weights, cache3d, batch=batch, k=K, recall_target=1.0,
                                implementation="xla")
    np.testing.assert_array_equal(got, want)
    # float64 oracle on the keys as stored (bf16 rounding included), packed table
    check_token_topk(got, b, K, cache=np.asarray(cache3d.astype(jnp.float32)))


def test_streamindex_topk_pallas_on_a_decode_batch():
    """implementation="pallas" (the package's kernel, interpreted here; ~6 s): the oracle's
    top-k, and the jnp implementation's result."""
    spec, dist, dtype = BATCHES["decode"]
    b = make_ragged_batch(np.random.default_rng(29), page_size=PAGE, pages_per_seq=PAGES,
                          num_heads=2, dim=128, **spec)
    args, _ = their_inputs(b, dtype, dist)
    got = sj.streamindex_topk(*args, k=K, compression_ratio=1, implementation="pallas")
    check_token_topk(got, b, K, cache=np.asarray(jnp.asarray(b.cache, dtype), np.float32))
    np.testing.assert_array_equal(
        got, sj.streamindex_topk(*args, k=K, compression_ratio=1, implementation="xla"))


def test_compute_topk_pages_is_the_ascending_set_of_touched_pages(case):
    b, args, _, _ = case
    topk = np.array(sj.streamindex_topk(*args, k=K, compression_ratio=1,
                                         implementation="xla"))
    topk[0, -1] = PAGES * PAGE + 3  # past the table: touches no page
    for k_pages_max in (1, 2, PAGES + 2):
        got = np.asarray(sj.compute_topk_pages(topk, page_size=PAGE, pages_per_seq=PAGES,
                                               k_pages_max=k_pages_max))
        assert got.shape == (topk.shape[0], k_pages_max) and got.dtype == np.int32
        for r, row in enumerate(topk):
            pages = sorted({int(t) // PAGE for t in row if 0 <= t < PAGES * PAGE})
            want = (pages + [-1] * k_pages_max)[:k_pages_max]
            assert got[r].tolist() == want, (r, row)


def test_the_4d_cache_view_is_a_bitcast():
    cache = jnp.zeros((5, PAGE // 2, 2, 128), jnp.bfloat16)
    view = sj.index_cache_view(cache)
    assert view.shape == (5, PAGE, 128)
    hlo = jax.jit(sj.index_cache_view, donate_argnums=0).lower(cache).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert "bitcast(" in entry and "copy(" not in entry, entry


def test_refusals_are_named(case):
    b, args, _, _ = case
    q, w, cache, seq_lens, pages, cu_q, dist = args
    call = sj.streamindex_topk
    with pytest.raises(NotImplementedError, match=r"compression_ratio=4 .*j <= p // r"):
        call(*args, k=K, compression_ratio=4)
    u8 = jnp.zeros((cache.shape[0], PAGE // 4, 4, 129), jnp.uint8)
    with pytest.raises(NotImplementedError, match="uint8"):
        call(q, w, u8, seq_lens, pages, cu_q, dist, k=K, compression_ratio=1)
    with pytest.raises(ValueError, match="must be 4-D"):
        call(q, w, jnp.asarray(b.cache), seq_lens, pages, cu_q, dist, k=K, compression_ratio=1)
    wrong = jnp.zeros((cache.shape[0], PAGE, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"kv_packing\) must be 32 // bits = 2"):
        call(q, w, wrong, seq_lens, pages, cu_q, dist, k=K, compression_ratio=1)
    with pytest.raises(ValueError, match="q head dim 64 != cache_kv dim 128"):
        call(q[..., :64], w, cache, seq_lens, pages, cu_q, dist, k=K, compression_ratio=1)
    with pytest.raises(ValueError, match="multiple of len"):
        call(q, w, cache, seq_lens, pages[:-1], cu_q, dist, k=K, compression_ratio=1)
    with pytest.raises(ValueError, match="num_kv_pages_per_block"):
        call(*args, k=K, compression_ratio=1, num_kv_pages_per_block=(64, 0, 64))
    with pytest.raises(ValueError, match="unknown implementation 'pallas'"):
        sj.compute_topk_pages(np.zeros((2, 3), np.int32), page_size=PAGE,
                              pages_per_seq=PAGES, k_pages_max=4, implementation="pallas")
    with pytest.raises(ValueError, match="compute_topk_pages: k_pages_max must be positive"):
        sj.compute_topk_pages(np.zeros((2, 3), np.int32), page_size=PAGE,
                              pages_per_seq=PAGES, k_pages_max=0)
