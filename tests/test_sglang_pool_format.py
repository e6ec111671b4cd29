"""``pallas_kernels.mla.pool.TokenPackedCache``: the page kernel reading sglang-jax's pool
``[P, ps / k, k, D]`` (``k = 32 // bits``) in place.

- Strict interpret: the kernel on the token-packed pool gives exactly what it gives on the
  same cache as ``[P, ps, D]`` (output and LSE; bf16 and f32; a stacked pool at ``layer=``), on
  ragged batches with causal rows, junk page entries and NaN in every unowned slot.
- Refusals: a token gather, and pools that are not ``[..., P, ps / k, k, D]``.
- sglang-jax's ``sparse_mla_page_level`` under ``jax.jit`` with an implementation list.
- AOT (libtpu, no TPU; the Pallas path compiled through ``kernel_options={"interpret":
  False}``): sglang-jax's ``sparse_mla_page_level`` and the kernel on an f32 pool compile with
  no copy, reshape or transpose of a pool-sized buffer, and the row writer is one scatter into
  the 4-D pool; the old route (the ``[P, ps, D]`` reshape) is seen copying the pool, so the
  check can see a relayout (``scripts/cost/engine_glue.py`` prints the bytes).
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax.engines import sglang_jax as sj
from pallas_kernels import chips, page_sparse_mla, sparse_mla
from pallas_kernels.measure import hlo
from pallas_kernels.mla.pool import TokenPackedCache, wrap
from reference.synthetic import make_ragged_batch
from scripts.cost import engine_glue
from tests import batches

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # parallel AOT compiles (libtpu lock)

SCALE, DIM, V_DIM, BIG = 0.125, 128, 96, np.iinfo(np.int32).max


def _packed(cache, dtype):
    """``[..., P, ps, D]`` -> sglang-jax's ``[..., P, ps / k, k, D]`` (the row-major split)."""
    k = 32 // (jnp.dtype(dtype).itemsize * 8)
    *lead, pages, ps, dim = cache.shape
    return jnp.asarray(cache, dtype).reshape(*lead, pages, ps // k, k, dim)


def _page_topk(rng, b, k_pages: int):
    """Valid page numbers mixed with junk (``-1``, past the table, huge, negative)."""
    pps = b.pages_per_seq
    choices = np.concatenate([np.arange(pps), [-1, pps, pps + 3, BIG, -BIG - 1]])
    return rng.choice(choices, size=(b.q.shape[0], k_pages)).astype(np.int32)


@pytest.mark.parametrize("dtype,layers", [(jnp.bfloat16, 0), (jnp.float32, 0),
                                          (jnp.bfloat16, 2)])
def test_token_packed_pool_gives_exactly_the_row_cache_result(dtype, layers):
    b = batches.scenario("small_mixed", 29, dim=DIM)
    rng = np.random.default_rng([29, layers])
    sel = _page_topk(rng, b, 5)
    cache = b.cache
    if layers:  # layer 1 of 2 holds the batch; layer 0 is NaN (never read)
        cache = np.stack([np.full_like(cache, np.nan), cache])
    q = jnp.asarray(b.q, dtype)
    meta = (b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=V_DIM, return_lse=True,
              pages_per_block=2, interpret=True, layer=1 if layers else None)
    rows = page_sparse_mla(q, jnp.asarray(cache, dtype), *meta, **kw)
    pool = page_sparse_mla(q, TokenPackedCache(_packed(cache, dtype)), *meta, **kw)
    for got, want in zip(pool, rows, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.isfinite(np.asarray(pool[0], np.float32)).all()


def test_refusals_are_named():
    b = batches.scenario("decode", 3, dim=DIM)
    pool = _packed(b.cache, jnp.bfloat16)
    meta = (b.seq_lens, np.zeros((b.q.shape[0], 2), np.int32), b.page_indices, b.cu_q_lens,
            b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=V_DIM, interpret=True)
    with pytest.raises(NotImplementedError, match="whole pages only"):
        sparse_mla(jnp.asarray(b.q, jnp.bfloat16), TokenPackedCache(pool), *meta, **kw)
    with pytest.raises(ValueError, match=r"shape\[-2\] must be 32 // bits = 2"):
        wrap(jnp.asarray(b.cache, jnp.bfloat16)[:, :, None])
    with pytest.raises(ValueError, match="rank >= 4"):
        wrap(jnp.asarray(b.cache, jnp.bfloat16))
    with pytest.raises(TypeError, match="int32"):
        wrap(jnp.zeros((2, 4, 1, 128), jnp.int32))
    assert wrap(pool).shape == b.cache.shape and wrap(pool).view().shape == b.cache.shape
    with pytest.raises(ValueError, match="multiple of 128"):  # checked as the cache it holds
        page_sparse_mla(jnp.asarray(b.q, jnp.bfloat16)[..., :96], TokenPackedCache(pool[..., :96]),
                        *meta, **kw)


def test_the_adapter_tries_an_implementation_list_in_order_under_jit():
    """sglang-jax jits its calls; a list (``["pallas", "xla"]``) runs its first, the Pallas
    kernel on the pool in place: the pool written as the jnp path writes it, ``o`` within
    bf16 rounding of it (the kernel's f32 summation order)."""
    rng = np.random.default_rng(11)
    lkv, rope, heads, ps, pps = 512, 64, 2, 8, 4
    b = make_ragged_batch(rng, q_lens=[1, 1], kv_lens=[9, 20], page_size=ps,
                          pages_per_seq=pps, num_heads=heads, dim=lkv + rope, spare_pages=2)
    cache = np.pad(b.cache, ((0, 0), (0, 0), (0, engine_glue.D - lkv - rope)))
    bf = jnp.bfloat16
    new = rng.standard_normal((2, lkv + rope))
    args = (jnp.asarray(b.q[..., :lkv], bf), jnp.asarray(b.q[..., lkv:], bf),
            jnp.asarray(new[:, :lkv], bf), jnp.asarray(new[:, lkv:], bf), _packed(cache, bf),
            b.seq_lens, np.array([[0, 3, -1], [9, 17, 2]], np.int32), b.page_indices,
            b.cu_q_lens, b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SCALE, page_size=ps, pages_per_seq=pps, kv_lora_rank=lkv, k_pages_max=3)
    o, pool = jax.jit(functools.partial(sj.sparse_mla_page_level, **kw,
                                        implementation=["pallas", "xla"]))(*args)
    o_want, pool_want = sj.sparse_mla_page_level(*args, **kw, implementation="xla")
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_want, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(pool, np.float32),
                                  np.asarray(pool_want, np.float32))
    assert pool.shape == args[4].shape and np.isfinite(np.asarray(o, np.float32)).all()


# ----------------------------------------------------------------------------- AOT gate

AOT_CHIPS = (chips.DEFAULT, chips.NEWEST)


def _pool_scatters(text: str, pool_bytes: int) -> list[str]:
    """Result shapes of the entry computation's pool-sized scatters (fused or not)."""
    entry = text.split("\nENTRY ", 1)[1]
    found = re.findall(r"= (\S+?)\{[^}]*\} (?:scatter|fusion)\([^\n]*op_name=\"[^\"]*scatter\"",
                       entry)
    return [s for s in found if hlo.shape_bytes(s) >= pool_bytes]


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_decode_reads_and_writes_the_pool_in_place(chip):
    sh = engine_glue.SMALL
    row, text = engine_glue.measure(chip, "mla_decode", sh)
    assert row.pool_copies == (), row.pool_copies
    pool = f"bf16[{sh.num_pages},{sh.page_size // 2},2,{engine_glue.D}]"
    scatters = _pool_scatters(text, row.pool_bytes)
    assert scatters == [pool], scatters  # the writer: one scatter into the 4-D pool
    assert row.kernel_bytes > 0


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_an_f32_pool_is_read_in_place(chip):
    row, _ = engine_glue.measure(chip, "mla_read_pool_f32", engine_glue.SMALL)
    assert row.pool_copies == (), row.pool_copies


def test_the_reshape_route_is_seen_copying_the_pool():
    """The check's witness: the old route (``[P, ps, D]`` reshape) relayouts the pool."""
    row, _ = engine_glue.measure(chips.DEFAULT, "mla_read_view", engine_glue.SMALL)
    assert any(r.opcode in ("reshape", "copy", "copy-done") for r in row.pool_copies), row
