"""The public ops: one signature each, a backend flag, and both backends agreeing.

Pallas runs in interpret mode here (no TPU), so its cases use one tiny batch (D = 128, the
smallest the MLA kernel allows)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from oracle import check_page_topk, check_token_topk, mla_oracle

import dsa_jax
from dsa_jax import backend as backend_mod
from reference import (
    page_sparse_mla_ref,
    sparse_mla_ref,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
)
from reference.synthetic import make_ragged_batch

PAGE, PAGES = 8, 4
SM_SCALE, V_DIM = 0.1, 64


@pytest.fixture(scope="module")
def tiny():
    """Decode + MTP + prefill rows, a padding row and an inactive slot; NaN in unowned slots."""
    rng = np.random.default_rng(7)
    return make_ragged_batch(rng, q_lens=[1, 3, 5], kv_lens=[9, 20, 13], page_size=PAGE,
                             pages_per_seq=PAGES, num_heads=2, dim=128, pad_rows=1, pad_seqs=1)


# ----------------------------------------------------------------------------- backend flag


def test_an_unknown_backend_is_refused_listing_the_valid_ones(tiny):
    with pytest.raises(ValueError, match=r"unknown backend 'triton'.*\('reference', 'pallas'\)"):
        dsa_jax.indexer_topk(*tiny.args(), k=4, pages_per_seq=PAGES, backend="triton")


def test_none_means_reference_off_tpu_and_the_env_var_overrides_only_the_default(monkeypatch):
    monkeypatch.delenv("DSA_USE_PALLAS", raising=False)
    assert dsa_jax.resolve_backend(None) == "reference"  # this machine has no TPU
    monkeypatch.setattr(backend_mod, "on_tpu", lambda: True)
    assert dsa_jax.resolve_backend(None) == "pallas"
    monkeypatch.setenv("DSA_USE_PALLAS", "0")
    assert dsa_jax.resolve_backend(None) == "reference"
    monkeypatch.setenv("DSA_USE_PALLAS", "1")
    monkeypatch.setattr(backend_mod, "on_tpu", lambda: False)
    assert dsa_jax.resolve_backend(None) == "pallas"
    assert dsa_jax.resolve_backend("reference") == "reference"  # explicit wins
    monkeypatch.setenv("DSA_USE_PALLAS", "yes")
    with pytest.raises(ValueError, match="DSA_USE_PALLAS must be '1'.*'yes'"):
        dsa_jax.resolve_backend(None)


def test_dispatch_names_the_functions_and_knobs_never_reach_the_reference():
    import pallas_kernels

    assert backend_mod.OPS["sparse_mla"] == (sparse_mla_ref, pallas_kernels.sparse_mla)
    fn, extra = backend_mod.implementation("sparse_mla", "reference", {"tokens_per_block": 8})
    assert fn is sparse_mla_ref and extra == {}  # knobs never break the reference
    with pytest.raises(ValueError, match="unknown op 'mla'"):
        backend_mod.implementation("mla", "reference")


def test_off_tpu_pallas_runs_in_interpret_mode_unless_told_otherwise():
    _, extra = backend_mod.implementation("indexer_topk", "pallas")
    assert extra == {"interpret": True}
    _, extra = backend_mod.implementation("indexer_topk", "pallas", {"interpret": False})
    assert extra == {"interpret": False}


# ----------------------------------------------------------------------------- reference


def test_the_reference_backend_is_the_reference_bit_for_bit(tiny):
    kw = dict(pages_per_seq=PAGES, exact=True)
    idx = dsa_jax.indexer_topk(*tiny.args(), k=6, num_segments=2, backend="reference", **kw)
    np.testing.assert_array_equal(idx, streamindex_topk_ref(*tiny.args(), k=6, num_segments=2,
                                                            **kw))
    pages = dsa_jax.page_topk(*tiny.args(), k_pages=2, backend="reference", **kw)
    np.testing.assert_array_equal(pages, streamindex_page_topk_ref(*tiny.args(), k_pages=2, **kw))
    mla = dict(sm_scale=SM_SCALE, pages_per_seq=PAGES, v_dim=V_DIM)
    meta = tiny.meta()
    out = dsa_jax.sparse_mla(tiny.q, tiny.cache, meta[0], idx, *meta[1:], backend="reference",
                             **mla)
    np.testing.assert_array_equal(out, sparse_mla_ref(tiny.q, tiny.cache, meta[0], idx,
                                                      *meta[1:], **mla))
    out = dsa_jax.page_sparse_mla(tiny.q, tiny.cache, meta[0], pages, *meta[1:],
                                  backend="reference", **mla)
    np.testing.assert_array_equal(out, page_sparse_mla_ref(tiny.q, tiny.cache, meta[0], pages,
                                                           *meta[1:], **mla))


# ----------------------------------------------------------------------------- both backends


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_token_topk_then_sparse_mla_meet_the_oracle_on_both_backends(tiny, backend):
    idx = np.asarray(dsa_jax.indexer_topk(*tiny.args(), k=6, pages_per_seq=PAGES, exact=True,
                                          backend=backend))
    check_token_topk(idx, tiny, 6)
    meta = tiny.meta()
    out = dsa_jax.sparse_mla(tiny.q, tiny.cache, meta[0], idx, *meta[1:], sm_scale=SM_SCALE,
                             pages_per_seq=PAGES, v_dim=V_DIM, backend=backend)
    want, _ = mla_oracle(tiny.q, tiny.cache, meta[0], idx, *meta[1:], sm_scale=SM_SCALE,
                         v_dim=V_DIM, pages_per_seq=PAGES)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_page_topk_then_page_sparse_mla_meet_the_oracle_on_both_backends(tiny, backend):
    pages = np.asarray(dsa_jax.page_topk(*tiny.args(), k_pages=2, pages_per_seq=PAGES,
                                         exact=True, backend=backend))
    check_page_topk(pages, tiny, 2)
    meta = tiny.meta()
    out = dsa_jax.page_sparse_mla(tiny.q, tiny.cache, meta[0], pages, *meta[1:],
                                  sm_scale=SM_SCALE, pages_per_seq=PAGES, v_dim=V_DIM,
                                  backend=backend)
    want, _ = mla_oracle(tiny.q, tiny.cache, meta[0], pages, *meta[1:], sm_scale=SM_SCALE,
                         v_dim=V_DIM, pages_per_seq=PAGES, page=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5)


def test_public_names_are_sorted_resolve_and_include_the_packed_path():
    import pallas_kernels

    assert dsa_jax.__all__ == sorted(dsa_jax.__all__)
    for name in dsa_jax.__all__:
        assert getattr(dsa_jax, name) is not None, name
    assert dsa_jax.PerformanceWarning is pallas_kernels.PerformanceWarning
    x = np.random.default_rng(0).standard_normal((2, 4, 256)).astype(np.float32)
    words = dsa_jax.pack_cache(x)
    assert words.shape == (2, 4, dsa_jax.packed_words(256))
    np.testing.assert_array_equal(dsa_jax.unpack_cache(words, 256),
                                  np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_the_witness_fill_and_guard_reach_both_backends(tiny, backend):
    kw = dict(k=8, pages_per_seq=PAGES, exact=True, backend=backend)
    got = {f: np.asarray(dsa_jax.indexer_topk(*tiny.args(), num_segments=5, fill=f, **kw))
           for f in ("tail", "lowest")}
    assert np.any(got["tail"] != got["lowest"])  # the case tells the fills apart
    for f, idx in got.items():
        np.testing.assert_array_equal(idx, streamindex_topk_ref(
            *tiny.args(), k=8, pages_per_seq=PAGES, exact=True, num_segments=5, fill=f))
    with pytest.raises(ValueError, match="num_segments=8 >= k=8 with refuse_full_overwrite"):
        dsa_jax.indexer_topk(*tiny.args(), num_segments=8, refuse_full_overwrite=True, **kw)
    with pytest.raises(ValueError, match="num_segments=2 >= k_pages=2"):
        dsa_jax.page_topk(*tiny.args(), k_pages=2, pages_per_seq=PAGES, num_segments=2,
                          refuse_full_overwrite=True, backend=backend)
