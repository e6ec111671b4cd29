"""The step on a Mesh (sequences on 'data', MLA heads on 'model') equals the single-device step
on each local batch. conftest.py gives this process 8 CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import dsa_jax
from dsa_jax import BatchMeta, PagedLayout, StepInputs
from reference.synthetic import make_ragged_batch

LAYOUT = PagedLayout(page_size=8, pages_per_seq=4, index_dim=16, latent_dim=100, rope_dim=12)
TYPES = ("full", "shared")
HEADS, INDEX_HEADS, K = 4, 2, 6


def _local_batch(seed):
    """One data shard's batch: its own sequences, pages and page table (same shapes)."""
    rng = np.random.default_rng(seed)
    b = make_ragged_batch(rng, q_lens=[1, 3, 4], kv_lens=[9, 20, 13], page_size=8,
                          pages_per_seq=4, num_heads=INDEX_HEADS, dim=16, pad_rows=1, pad_seqs=1)
    t, p = b.q.shape[0], b.cache.shape[0]
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    inputs = StepInputs(f32(2, t, HEADS, LAYOUT.qk_dim), f32(2, t, LAYOUT.qk_dim),
                        f32(1, t, INDEX_HEADS, 16), f32(1, t, INDEX_HEADS), f32(1, t, 16))
    latent = f32(2, *LAYOUT.latent_cache_shape(p))
    latent[..., LAYOUT.qk_dim:] = 0.0
    return inputs, latent, f32(1, *LAYOUT.index_cache_shape(p)), BatchMeta(*b.meta())


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


KW = dict(layout=LAYOUT, indexer_types=TYPES, k=K, sm_scale=0.12, exact=True, num_segments=2,
          backend="reference")


@pytest.mark.parametrize("shape", [(4, 2), (8, 1)])
def test_the_sharded_step_equals_the_single_device_step_on_each_local_batch(shape):
    data, model = shape
    assert len(jax.devices()) == 8, "conftest.py must give this process 8 CPU devices"
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
    local = [_local_batch(seed) for seed in range(data)]
    want = [dsa_jax.dsa_step(i, lat.copy(), idx.copy(), m, **KW) for i, lat, idx, m in local]
    inputs, latent, index, meta = (_stack([x[j] for x in local]) for j in range(4))
    got = dsa_jax.sharded_dsa_step(mesh, inputs, latent, index, meta, **KW)
    assert got.out.sharding.spec[0] == "data"
    if model > 1:
        assert got.out.addressable_shards[0].data.shape[3] == HEADS // model  # heads split
    for d, w in enumerate(want):
        np.testing.assert_array_equal(got.topk[d], w.topk)
        np.testing.assert_allclose(got.out[d], w.out, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got.latent_caches[d], w.latent_caches)
        np.testing.assert_array_equal(got.index_caches[d], w.index_caches)


def test_a_mesh_that_does_not_match_the_batch_is_refused_naming_the_numbers():
    local = [_local_batch(seed) for seed in range(2)]
    inputs, latent, index, meta = (_stack([x[j] for x in local]) for j in range(4))
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    with pytest.raises(ValueError, match="2 batches but mesh axis 'data' has 4 devices"):
        dsa_jax.sharded_dsa_step(mesh, inputs, latent, index, meta, **KW)
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "model"))
    with pytest.raises(ValueError, match=r"heads H=4 must be divisible by the 'model' axis size "
                                         r"3 \(H % 3 = 1\)"):
        dsa_jax.sharded_dsa_step(mesh, inputs, latent, index, meta, **KW)
