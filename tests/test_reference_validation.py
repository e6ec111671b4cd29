"""Bad static input raises ValueError/TypeError naming the argument and the numbers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from batches import PAGES_PER_SEQ, scenario

from reference import (
    page_sparse_mla_ref,
    sparse_mla_ref,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
)


@pytest.fixture(scope="module")
def b():
    return scenario("mtp", seed=0)


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


@pytest.mark.parametrize("op,kname", [(streamindex_topk_ref, "k"),
                                      (streamindex_page_topk_ref, "k_pages")])
@pytest.mark.parametrize("i,value,exc,match", [
    (0, np.zeros((9, 4)), ValueError, "q must have rank 3"),
    (0, np.zeros((9, 4, 16), np.int32), TypeError, "q must be a floating"),
    (0, np.ones((9, 4, 16), np.float16), ValueError,
     "q has dtype float16, which no kernel supports; supported: float32, bfloat16"),
    (2, np.ones((4, 8, 16), np.float16), ValueError, "cache_kv has dtype float16"),
    (1, np.zeros((8, 4), np.float32), ValueError, r"weights.shape\[0\] must equal .* = 9, got 8"),
    (1, np.zeros((9, 5), np.float32), ValueError, r"weights.shape\[1\] must equal .* = 4, got 5"),
    (2, np.zeros((4, 8, 17), np.float32), ValueError, r"cache_kv.shape\[2\] .* = 16, got 17"),
    (3, np.zeros(3, np.float32), TypeError, "seq_lens must be an integer"),
    (5, np.zeros(3, np.int32), ValueError, r"cu_q_lens.shape\[0\] must equal len\(seq_lens\)"),
    (7, np.zeros(2, np.int32), ValueError, r"distribution.shape\[0\] must equal 3"),
])
def test_indexer_refuses_bad_arrays(b, op, kname, i, value, exc, match):
    with pytest.raises(exc, match=match):
        op(*_replace(b.args(), i, value), pages_per_seq=PAGES_PER_SEQ, **{kname: 4})


@pytest.mark.parametrize("op,kname", [(streamindex_topk_ref, "k"),
                                      (streamindex_page_topk_ref, "k_pages")])
def test_indexer_refuses_bad_statics(b, op, kname):
    with pytest.raises(ValueError, match=f"{kname} must be positive, got {kname}=0"):
        op(*b.args(), pages_per_seq=PAGES_PER_SEQ, **{kname: 0})
    with pytest.raises(TypeError, match=f"{kname} must be a static Python int"):
        op(*b.args(), pages_per_seq=PAGES_PER_SEQ, **{kname: 2.5})
    with pytest.raises(ValueError, match="pages_per_seq must be positive"):
        op(*b.args(), pages_per_seq=0, **{kname: 2})
    with pytest.raises(ValueError, match=r"one_token_per_seq=True .*\(T\) = 9 != .*\(S\) = 3"):
        op(*b.args(), pages_per_seq=PAGES_PER_SEQ, one_token_per_seq=True, **{kname: 2})
    with pytest.raises(ValueError, match="recall_target must be in"):
        op(*b.args(), pages_per_seq=PAGES_PER_SEQ, recall_target=1.5, **{kname: 2})


@pytest.mark.parametrize("op", [sparse_mla_ref, page_sparse_mla_ref])
def test_mla_refuses_bad_input(b, op):
    idx = np.zeros((9, 4), np.int32)
    args = (b.q, b.cache, b.seq_lens, idx) + b.meta()[1:]
    kw = dict(sm_scale=0.1, pages_per_seq=PAGES_PER_SEQ, v_dim=8)
    op(*args, **kw)  # the baseline call is accepted
    with pytest.raises(ValueError, match=r"v_dim must be <= .*v_dim=17 > 16"):
        op(*args, **{**kw, "v_dim": 17})
    with pytest.raises(ValueError, match=r"\.shape\[0\] must equal q.shape\[0\] \(T\) = 9, got 8"):
        op(*_replace(args, 3, idx[:8]), **kw)
    with pytest.raises(TypeError, match="must be an integer array"):
        op(*_replace(args, 3, idx.astype(np.float32)), **kw)
    with pytest.raises(ValueError, match="sm_scale must be finite and positive"):
        op(*args, **{**kw, "sm_scale": -1.0})
    with pytest.raises(ValueError, match=r"cache_kv.shape\[2\] must equal q.shape\[2\]"):
        op(*_replace(args, 1, jnp.zeros((4, 8, 32))), **kw)


def test_an_f16_cache_is_refused_by_every_path_never_rounded():
    """f16 is neither computed nor silently rounded to bf16 (pack_cache, sparse MLA)."""
    from pallas_kernels import sparse_mla
    from reference.packed_cache import pack_cache

    b = scenario("mtp", seed=1, dim=128)
    cache16 = jnp.asarray(b.cache, jnp.float16)
    with pytest.raises(ValueError, match="pack_cache packs bfloat16 .* got dtype float16"):
        pack_cache(cache16)
    sel = np.zeros((b.q.shape[0], 4), np.int32)
    meta = b.meta()
    for op in (sparse_mla_ref, sparse_mla):
        with pytest.raises(ValueError, match="cache_kv has dtype float16"):
            op(jnp.asarray(b.q, jnp.float32), cache16, meta[0], sel, *meta[1:], sm_scale=0.1,
               pages_per_seq=PAGES_PER_SEQ, v_dim=64)


def test_cache_formats_are_typed_and_detected_from_the_dtype():
    from reference.cache_format import CacheFormat

    assert CacheFormat.of(np.zeros((1, 8, 128), np.float32)) is CacheFormat.F32
    assert CacheFormat.of(jnp.zeros((1, 8, 128), jnp.bfloat16)) is CacheFormat.BF16
    packed = CacheFormat.of(np.zeros((1, 8, 384), np.uint32))
    assert packed is CacheFormat.PACKED_BF16 and packed.row_words(640) == 384
    assert packed.row_bytes(640) == 1536 and packed.plain_row_bytes(640) == 1280
    assert CacheFormat.named("bf16") is CacheFormat.BF16
    with pytest.raises(ValueError, match="unknown cache format 'fp4'"):
        CacheFormat.named("fp4")
    with pytest.raises(ValueError, match=r"latent has dtype int8, which no cache format "
                                         r"supports; supported: float32 \(F32\)"):
        CacheFormat.of(np.zeros((1, 8, 128), np.int8), "latent")
