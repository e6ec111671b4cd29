"""fp8 caches through the public API: the layout declares them, the writer quantizes this step's
rows only, the step runs on both backends, the sharded step and the CLI take them. The values
are checked against ``reference.fp8``'s rules (bit-exact in ``tests/test_fp8.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import dsa_jax
from dsa_jax import BatchMeta, LayoutError, PagedLayout, StepInputs
from dsa_jax.__main__ import main
from reference import fp8
from reference.synthetic import make_ragged_batch

FP8 = PagedLayout(page_size=32, pages_per_seq=4, index_cache_format="fp8",
                  latent_cache_format="fp8")
TYPES = ("full", "shared")
HEADS, INDEX_HEADS, K = 4, 2, 12


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _leaves(tree):
    return [_bits(x) for x in jax.tree_util.tree_leaves(tree)]


# ----------------------------------------------------------------------------- layout


def test_layout_declares_the_fp8_formats_and_stores_values_in_them():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((2, 3, 32, 640)).astype(np.float32)
    values[..., 576:] = 0.0  # the padding of a padded latent (nonzero: refused, test_api_sweep)
    lat = FP8.to_cache(values, "latent")
    idx = FP8.to_cache(rng.standard_normal((1, 3, 32, 128)).astype(np.float32), "index")
    assert isinstance(lat, dsa_jax.Fp8LatentCache) and lat.shape == (2, 3, 32, 576)
    assert isinstance(idx, dsa_jax.Fp8IndexCache) and idx.scales.shape == (1, 3, 128)
    FP8.check_cache("lat", lat, "latent")
    FP8.check_cache("idx", idx, "index")
    assert FP8.latent_cache_width == 256
    assert PagedLayout(page_size=8, pages_per_seq=2, packed_latent=True).latent_cache_format \
        == "packed"
    assert PagedLayout(page_size=8, pages_per_seq=2, latent_cache_format="packed").packed_latent


@pytest.mark.parametrize("kw,match", [
    (dict(page_size=48, index_cache_format="fp8"), r"page_size=48 \(48 % 32 = 16\)"),
    (dict(page_size=32, index_cache_format="fp8", index_dim=64), "index_dim=64"),
    (dict(page_size=32, latent_cache_format="fp8", latent_dim=500), "latent_dim=500"),
    (dict(page_size=32, latent_cache_format="fp8", packed_latent=True), "contradicts"),
    (dict(page_size=32, index_cache_format="int8"), "index_cache_format must be one of"),
    (dict(page_size=32, latent_cache_format="fp4"), "latent_cache_format must be one of"),
    (dict(page_size=32, index_scale_fmt="e8"), "index_scale_fmt must be one of"),
])
def test_layout_refuses_what_the_fp8_formats_cannot_hold(kw, match):
    with pytest.raises(LayoutError, match=match):
        PagedLayout(pages_per_seq=2, **kw)


def test_check_cache_refuses_a_cache_that_is_not_the_declared_format():
    rng = np.random.default_rng(1)
    plain = rng.standard_normal((3, 32, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="index_cache_format='fp8'"):
        FP8.check_cache("index_cache", plain, "index")
    other = PagedLayout(page_size=64, pages_per_seq=2, index_cache_format="fp8")
    wrong_pages = other.to_cache(rng.standard_normal((3, 64, 128)).astype(np.float32), "index")
    with pytest.raises(ValueError, match=r"keys.shape must end in \(32, 128\)"):
        FP8.check_cache("index_cache", wrong_pages, "index")
    lat = FP8.to_cache(rng.standard_normal((3, 32, 576)).astype(np.float32), "latent")
    with pytest.raises(ValueError, match="latent_cache_format='plain'"):
        PagedLayout(page_size=32, pages_per_seq=4).check_cache("latent", lat, "latent")


# ----------------------------------------------------------------------------- writer


def _random_fp8_caches(rng, pages):
    """Caches full of random (finite) codes: a write must leave every other token as it was."""
    lat = FP8.to_cache(rng.standard_normal((pages, 32, 576)).astype(np.float32), "latent")
    idx = FP8.to_cache(rng.standard_normal((pages, 32, 128)).astype(np.float32), "index")
    return lat, idx


def test_update_kv_cache_quantizes_this_steps_rows_and_changes_nothing_else():
    rng = np.random.default_rng(2)
    b = make_ragged_batch(rng, q_lens=[1, 3, 2], kv_lens=[40, 100, 7], page_size=32,
                          pages_per_seq=4, num_heads=1, dim=8, pad_rows=2, pad_seqs=1)
    t, pages = b.q.shape[0], b.cache.shape[0]
    lat, idx = _random_fp8_caches(rng, pages)
    new_latent = rng.standard_normal((t, 576)).astype(np.float32) * 4
    new_index = rng.standard_normal((t, 128)).astype(np.float32)
    old = (_leaves(lat), _leaves(idx))
    lat2, idx2 = dsa_jax.update_kv_cache(lat, idx, new_latent, new_index, *b.meta(), layout=FP8)
    page_id, offset = (np.asarray(x) for x in dsa_jax.write_slots(FP8, t, pages, *b.meta()))
    written = page_id < pages
    assert written.sum() == 6  # the 6 real rows; the 2 padding rows are dropped
    got_lat = np.asarray(dsa_jax.dequantize_latent_cache(lat2))
    got_idx = np.asarray(dsa_jax.dequantize_index_cache(idx2))
    want_lat = np.asarray(fp8.dequantize_latent_fp8(*fp8.quantize_latent_fp8(new_latent)))
    k8, s = fp8.quantize_fp8(new_index)
    want_idx = np.asarray(fp8.dequantize_fp8(k8, s))
    for r in np.nonzero(written)[0]:
        np.testing.assert_array_equal(_bits(got_lat[page_id[r], offset[r]]), _bits(want_lat[r]))
        np.testing.assert_array_equal(_bits(got_idx[page_id[r], offset[r]]), _bits(want_idx[r]))
    untouched = np.ones((pages, 32), bool)
    untouched[page_id[written], offset[written]] = False
    for before, after in ((old[0][0], _leaves(lat2)[0]), (old[1][0], _leaves(idx2)[0])):
        np.testing.assert_array_equal(after[untouched], before[untouched])
    scales_before, scales_after = old[1][1], _leaves(idx2)[1]
    np.testing.assert_array_equal(scales_after[:, 32:], scales_before[:, 32:])  # padding lanes
    np.testing.assert_array_equal(scales_after[:, :32][untouched],
                                  scales_before[:, :32][untouched])


# ----------------------------------------------------------------------------- step


def _step_batch(seed, pages_extra=0):
    rng = np.random.default_rng(seed)
    b = make_ragged_batch(rng, q_lens=[1, 3, 1], kv_lens=[40, 70, 5], page_size=32,
                          pages_per_seq=4, num_heads=1, dim=8, pad_rows=1, pad_seqs=1)
    t, p = b.q.shape[0], b.cache.shape[0]
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inputs = StepInputs(f32(2, t, HEADS, 576), f32(2, t, 576), f32(1, t, INDEX_HEADS, 128),
                        f32(1, t, INDEX_HEADS), f32(1, t, 128))
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    lat = host(FP8.to_cache(f32(2, p, 32, 576), "latent"))
    idx = host(FP8.to_cache(f32(1, p, 32, 128), "index"))
    return inputs, lat, idx, BatchMeta(*b.meta())


KW = dict(layout=FP8, indexer_types=TYPES, k=K, sm_scale=0.1, exact=True, num_segments=2)


def test_step_with_fp8_caches_agrees_across_backends_and_with_the_ops():
    inputs, lat, idx, meta = _step_batch(3)
    ref = dsa_jax.dsa_step(inputs, lat, idx, meta, backend="reference", **KW)
    pal = dsa_jax.dsa_step(inputs, lat, idx, meta, backend="pallas",
                           kernel_options={"interpret": True}, **KW)
    np.testing.assert_array_equal(pal.topk, ref.topk)
    np.testing.assert_allclose(np.asarray(pal.out), np.asarray(ref.out), rtol=2e-5, atol=2e-5)
    assert not np.isnan(np.asarray(ref.out)).any()
    for a, b in zip(_leaves((ref.latent_caches, ref.index_caches)),
                    _leaves((pal.latent_caches, pal.index_caches)), strict=True):
        np.testing.assert_array_equal(a, b)
    # the step = the cache writer, then the ops on the written caches (layer 1 shares layer 0's
    # selection)
    lat0 = jax.tree.map(lambda x: x[0], lat)
    idx0 = jax.tree.map(lambda x: x[0], idx)
    lat0, idx0 = dsa_jax.update_kv_cache(lat0, idx0, inputs.new_latent[0], inputs.new_index[0],
                                         *meta, layout=FP8)
    topk = dsa_jax.indexer_topk(inputs.q_index[0], inputs.index_weights[0], idx0, *meta, k=K,
                                pages_per_seq=4, exact=True, num_segments=2,
                                backend="reference")
    np.testing.assert_array_equal(ref.topk[0], topk)
    out = dsa_jax.sparse_mla(inputs.q_mla[0], lat0, meta[0], topk, *meta[1:], sm_scale=0.1,
                             pages_per_seq=4, v_dim=512, backend="reference")
    np.testing.assert_array_equal(np.asarray(ref.out[0]), np.asarray(out))


def test_sharded_step_with_fp8_caches_equals_the_single_device_step():
    assert len(jax.devices()) == 8, "conftest.py must give this process 8 CPU devices"
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    local = [_step_batch(seed) for seed in range(4)]
    want = [dsa_jax.dsa_step(*x, backend="reference", **KW) for x in local]
    stacked = [jax.tree.map(lambda *xs: np.stack(xs), *[x[j] for x in local]) for j in range(4)]
    got = dsa_jax.sharded_dsa_step(mesh, *stacked, backend="reference", **KW)
    assert isinstance(got.latent_caches, dsa_jax.Fp8LatentCache)
    for d, w in enumerate(want):
        np.testing.assert_array_equal(got.topk[d], w.topk)
        np.testing.assert_allclose(got.out[d], w.out, rtol=1e-6, atol=1e-6)
        for a, b in zip(_leaves(jax.tree.map(lambda x, d=d: x[d], got.latent_caches)),
                        _leaves(w.latent_caches), strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_cli_runs_both_fp8_caches_on_both_backends(capsys):
    assert main(["run", "--quick", "--no-progress", "--context", "64", "--prefill", "4",
                 "--topk", "16", "--decode", "1", "--cache-format", "fp8",
                 "--dsa-use-pallas"]) == 0
    text = capsys.readouterr().out
    assert "caches: index fp8, latent fp8" in text
    assert "agreement pallas vs reference: top-k overlap mean 1.0000" in text


def test_step_refuses_plain_caches_under_an_fp8_layout():
    inputs, lat, idx, meta = _step_batch(4)
    plain = np.zeros((1, *idx.keys.shape[1:]), np.float32)
    with pytest.raises(ValueError, match="index_cache_format='fp8'"):
        dsa_jax.dsa_step(inputs, lat, jnp.asarray(plain), meta, backend="reference", **KW)
