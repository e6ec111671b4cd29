"""``dsa_jax.engines.sglang_jax`` (issue 29, the MLA side): sglang-jax's
``sparse_mla_page_level`` and ``prefill_write_and_attend`` with its names, arguments and
results. On sglang-jax's 4-D pool (bf16 ``[P, ps / 2, 2, 640]`` and f32 ``[P, ps, 1, 640]``)
with NaN in every unowned slot: this step's rows land at their slots and nothing else changes;
``o`` equals ``dsa_jax.page_sparse_mla`` on the written cache and sglang-jax's page list, and
the float64 oracle (``tests/oracle.py``; prefill: a direct one of sglang-jax's rule); refusals
are named."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import mla_oracle

import dsa_jax
from dsa_jax.engines import sglang_jax as sj
from reference.synthetic import make_ragged_batch

PAGE, PAGES, LKV, ROPE, D, H, SM = 8, 4, 512, 64, 640, 2, 0.05
# sglang-jax cddbf6f: python/sgl_jax/srt/kernels/dsa/sparse_mla.py, sparse_mla_prefill.py.
THEIR_DECODE_PARAMS = ["ql_nope", "q_pe", "new_kv_c", "new_k_pe", "cache_kv", "kv_lens",
                       "topk_indices", "page_indices", "cu_q_lens", "cu_kv_lens", "distribution",
                       "topk_pages", "sm_scale", "page_size", "pages_per_seq", "kv_lora_rank",
                       "k_pages_max", "num_kv_pages_per_block", "num_queries_per_block",
                       "vmem_limit_bytes"]
THEIR_PREFILL_PARAMS = ["ql", "qpe", "kvc", "kpe", "cache", "topk_pages", "positions", "loc",
                        "kv_lora_rank", "page_size", "sm_scale", "read_block", "interpret"]


def _pool(cache3, dtype):
    packing = 32 // (jnp.dtype(dtype).itemsize * 8)
    return jnp.asarray(cache3, dtype).reshape(cache3.shape[0], PAGE // packing, packing, D)


def _decode_inputs(rng, dtype):
    """A decode batch (3 rows, a padding row, an inactive slot) with a packed table of
    ``S * PAGES`` slots (sglang-jax's ``pages_per_seq = len // S``), spare slots all-NaN."""
    b = make_ragged_batch(rng, q_lens=[1, 1, 1], kv_lens=[9, 30, 13], page_size=PAGE,
                          pages_per_seq=PAGES, num_heads=H, dim=D, pad_rows=1, pad_seqs=1,
                          spare_pages=9, tail_pages=8)
    cache = b.cache.copy()
    cache[..., LKV + ROPE:] = np.where(np.isnan(cache[..., LKV + ROPE:]), np.nan, 0.0)
    q = b.q.copy()
    q[..., LKV + ROPE:] = 0.0
    t = q.shape[0]
    new = rng.standard_normal((t, LKV + ROPE)).astype(np.float32)
    dt = jnp.dtype(dtype)
    args = (jnp.asarray(q[..., :LKV], dt), jnp.asarray(q[..., LKV:LKV + ROPE], dt),
            jnp.asarray(new[:, :LKV], dt), jnp.asarray(new[:, LKV:], dt), _pool(cache, dtype))
    return b, cache, args


def _written(b, cache3, new_rows, dtype):
    """The cache after the decode write (NumPy): each active row at its slot ``kv_len - 1``."""
    out = np.asarray(jnp.asarray(cache3, dtype).astype(jnp.float32)).copy()
    rows = np.asarray(jnp.asarray(new_rows, dtype).astype(jnp.float32))
    for s in range(int(b.distribution[2])):
        for r in range(int(b.cu_q_lens[s]), int(b.cu_q_lens[s + 1])):
            pos = int(b.seq_lens[s]) - 1
            page = int(b.page_indices[int(b.cu_kv_lens[s]) // PAGE + pos // PAGE])
            out[page, pos % PAGE] = np.pad(rows[r], (0, D - rows.shape[1]))
    return out


def _their_page_list(b, topk, topk_pages, k_pages_max):
    """sglang-jax's page list per row, from its definition: hit pages (less the new token's),
    then the new token's page."""
    rows = []
    seq_of = np.clip(np.searchsorted(b.cu_q_lens[1:], np.arange(b.q.shape[0]), side="right"),
                     0, len(b.seq_lens) - 1)
    for r, s in enumerate(seq_of):
        new_page = max(int(b.seq_lens[s]) - 1, 0) // PAGE
        if topk_pages is None:
            hits = sorted({int(x) // PAGE for x in topk[r] if x >= 0} - {new_page})
            hits = [p for p in hits if p < PAGES][:k_pages_max - 1]
        else:
            hits = [int(p) for p in topk_pages[r][:k_pages_max - 1] if p >= 0 and p != new_page]
        rows.append(hits + [-1] * (k_pages_max - 1 - len(hits)) + [new_page])
    return np.array(rows, np.int32)


@pytest.mark.parametrize("dtype,use_pages,impl", [(jnp.bfloat16, False, "xla"),
                                                   (jnp.float32, True, "xla"),
                                                   (jnp.bfloat16, True, "pallas"),
                                                   (jnp.float32, False, "pallas")])
def test_sparse_mla_page_level_writes_and_matches_page_sparse_mla_and_the_oracle(dtype,
                                                                                  use_pages, impl):
    """``impl="pallas"``: the Pallas page kernel (the strict interpreter off TPU) behind the
    same adapter, reading the pool in place (``TokenPackedCache``: bf16 ``[P, ps / 2, 2, D]``,
    f32 ``[P, ps, 1, D]``), checked against the same jnp result and oracle."""
    rng = np.random.default_rng(2929)
    b, cache, (ql, qpe, kvc, kpe, pool) = _decode_inputs(rng, dtype)
    t = b.q.shape[0]
    topk = np.full((t, 6), -1, np.int32)
    for r in range(3):
        kv = int(b.seq_lens[r])
        topk[r, :5] = rng.choice(kv, size=min(5, kv), replace=False)
    topk[1, :4] = [0, 9, 17, 25]  # four pages, one the new token's (29 // 8 = 3)
    tpages = np.array([[0, -1, 1, 0], [3, 2, -1, 0], [1, 0, 0, 1], [-1, -1, -1, -1]], np.int32)
    k_pages_max = 3
    meta = (b.seq_lens, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    o, pool_out = sj.sparse_mla_page_level(
        ql, qpe, kvc, kpe, pool, b.seq_lens, topk, *meta[1:], tpages if use_pages else None,
        sm_scale=SM, page_size=PAGE, pages_per_seq=PAGES, kv_lora_rank=LKV,
        k_pages_max=k_pages_max, vmem_limit_bytes=None, implementation=impl)
    assert o.shape == (t, H, LKV) and o.dtype == jnp.dtype(dtype)
    assert pool_out.shape == pool.shape and pool_out.dtype == pool.dtype
    want_cache = _written(b, cache, jnp.concatenate([kvc, kpe], axis=-1), dtype)
    got_cache = np.asarray(pool_out.astype(jnp.float32)).reshape(want_cache.shape)
    np.testing.assert_array_equal(got_cache, want_cache)  # NaN == NaN: nothing else changed
    pages = _their_page_list(b, topk, tpages if use_pages else None, k_pages_max)
    q640 = jnp.pad(jnp.concatenate([ql, qpe], axis=-1), ((0, 0), (0, 0), (0, D - LKV - ROPE)))
    direct = dsa_jax.page_sparse_mla(q640, jnp.asarray(want_cache, dtype), *meta[:1], pages,
                                     *meta[1:], sm_scale=SM, pages_per_seq=PAGES, v_dim=LKV,
                                     implementation="xla")
    if impl == "xla":
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(direct, np.float32))
    else:  # the kernel's f32 summation order: within a bf16 ulp of the output's scale
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(direct, np.float32),
                                   rtol=1e-2, atol=1e-2)
    want, _ = mla_oracle(np.asarray(q640.astype(jnp.float32)), want_cache, *meta[:1], pages,
                         *meta[1:], sm_scale=SM, v_dim=LKV, pages_per_seq=PAGES, page=True)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=tol, atol=tol)
    assert np.all(np.asarray(o[3], np.float32) == 0)  # the padding row: zeros, no write


def _prefill_oracle(q, cache3, pages, positions, table):
    """sglang-jax's prefill rule in float64: row ``t`` attends token ``kp`` of each listed page
    iff ``kp <= positions[t]`` and ``kp < T``, at ``table[kp // ps]``."""
    t_rows = q.shape[0]
    out = np.zeros((t_rows, H, LKV))
    for r in range(t_rows):
        toks = [int(p) * PAGE + o for p in pages[r] if p >= 0 for o in range(PAGE)]
        toks = [k for k in toks if k <= positions[r] and k < t_rows]
        if not toks:
            continue
        c = np.stack([cache3[table[k // PAGE], k % PAGE] for k in toks]).astype(np.float64)
        s = SM * q[r].astype(np.float64) @ c.T
        p = np.exp(s - s.max(-1, keepdims=True))
        out[r] = (p / p.sum(-1, keepdims=True)) @ c[:, :LKV]
    return out


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefill_write_and_attend_writes_at_loc_and_meets_the_oracle(impl):
    rng = np.random.default_rng(31)
    t, num_pages, table = 13, 6, np.array([4, 1], np.int32)
    cache = np.full((num_pages, PAGE, D), np.nan, np.float32)
    loc = (table[np.arange(t) // PAGE] * PAGE + np.arange(t) % PAGE).astype(np.int32)
    positions = np.arange(t, dtype=np.int32)
    loc[12], positions[12] = -1, -1  # a padding row: not written, attends nothing
    new = rng.standard_normal((t, LKV + ROPE)).astype(np.float32)
    q = np.pad(rng.standard_normal((t, H, LKV + ROPE)), ((0, 0), (0, 0), (0, D - LKV - ROPE)))
    pages = np.array([[0, -1], [1, 0], [0, 0], [5, 1]] * 3 + [[0, 1]], np.int32)
    bf = jnp.bfloat16
    o, pool_out = sj.prefill_write_and_attend(
        jnp.asarray(q[..., :LKV], bf), jnp.asarray(q[..., LKV:LKV + ROPE], bf),
        jnp.asarray(new[:, :LKV], bf), jnp.asarray(new[:, LKV:], bf), _pool(cache, bf), pages,
        positions, loc, kv_lora_rank=LKV, page_size=PAGE, sm_scale=SM, implementation=impl)
    assert o.shape == (t, H, LKV) and o.dtype == jnp.float32
    want_cache = cache.copy()
    rows = np.asarray(jnp.asarray(new, bf).astype(jnp.float32))
    for r in range(12):
        want_cache[loc[r] // PAGE, loc[r] % PAGE] = np.pad(rows[r], (0, D - LKV - ROPE))
    got_cache = np.asarray(pool_out.astype(jnp.float32)).reshape(want_cache.shape)
    np.testing.assert_array_equal(got_cache, want_cache)
    qb = np.asarray(jnp.asarray(q, bf).astype(jnp.float32))
    want = _prefill_oracle(qb, want_cache, pages, positions, table)
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(o[12]) == 0)


def test_signatures_are_theirs_plus_implementation_and_kernel_options():
    for fn, theirs in ((sj.sparse_mla_page_level, THEIR_DECODE_PARAMS),
                       (sj.prefill_write_and_attend, THEIR_PREFILL_PARAMS)):
        assert list(inspect.signature(fn).parameters) == theirs + ["implementation",
                                                                   "kernel_options"]


def test_refusals_are_named():
    rng = np.random.default_rng(5)
    b, _, (ql, qpe, kvc, kpe, pool) = _decode_inputs(rng, jnp.bfloat16)
    topk = np.full((b.q.shape[0], 2), -1, np.int32)
    meta = (b.seq_lens, topk, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SM, page_size=PAGE, pages_per_seq=PAGES, kv_lora_rank=LKV)
    with pytest.raises(ValueError, match="page_size=16"):
        sj.sparse_mla_page_level(ql, qpe, kvc, kpe, pool, *meta, **{**kw, "page_size": 16})
    with pytest.raises(ValueError, match="k_pages_max"):
        sj.sparse_mla_page_level(ql, qpe, kvc, kpe, pool, *meta, **kw, k_pages_max=0)
    with pytest.raises(NotImplementedError, match="kv_lora_rank=448"):
        sj.sparse_mla_page_level(ql[..., :448], qpe, kvc[:, :448], kpe, pool, *meta,
                                 **{**kw, "kv_lora_rank": 448})
    with pytest.raises(NotImplementedError, match="uint8"):
        sj.sparse_mla_page_level(ql, qpe, kvc, kpe, jnp.zeros(pool.shape, jnp.uint8), *meta, **kw)
    with pytest.raises(ValueError, match="dim 3 must be 640"):
        sj.sparse_mla_page_level(ql, qpe, kvc, kpe, pool[..., :576], *meta, **kw)
    with pytest.raises(NotImplementedError, match="read_block=16"):
        sj.prefill_write_and_attend(ql, qpe, kvc, kpe, pool, np.zeros((4, 1), np.int32),
                                    np.arange(4), np.arange(4), kv_lora_rank=LKV,
                                    page_size=PAGE, sm_scale=SM, read_block=16)


def test_both_run_under_jit_as_their_caller_runs_them():
    """sglang-jax calls both inside ``jax.jit`` / ``shard_map`` with the statics bound."""
    rng = np.random.default_rng(7)
    b, _, (ql, qpe, kvc, kpe, pool) = _decode_inputs(rng, jnp.bfloat16)
    topk = np.full((b.q.shape[0], 3), -1, np.int32)
    topk[:3, 0] = 0
    args = (ql, qpe, kvc, kpe, pool, b.seq_lens, topk, b.page_indices, b.cu_q_lens,
            b.cu_kv_lens, b.distribution)
    fn = functools.partial(sj.sparse_mla_page_level, sm_scale=SM, page_size=PAGE,
                           pages_per_seq=PAGES, kv_lora_rank=LKV, k_pages_max=2,
                           implementation="xla")
    for got, want in zip(jax.jit(fn)(*args), fn(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    t = 4
    pargs = (ql[:t], qpe[:t], kvc[:t], kpe[:t], pool, np.zeros((t, 1), np.int32),
             np.arange(t, dtype=np.int32), np.arange(t, dtype=np.int32) + 2 * PAGE)
    pfn = functools.partial(sj.prefill_write_and_attend, kv_lora_rank=LKV, page_size=PAGE,
                            sm_scale=SM, implementation="xla")
    for got, want in zip(jax.jit(pfn)(*pargs), pfn(*pargs), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
