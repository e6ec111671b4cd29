"""``dsa_jax.engines.tokamax.attention`` against tokamax 0.0.17 itself (``implementation="xla"``,
its pure-JAX references) on the same inputs (issue 29): the cache bytes ``mla_swa`` returns are
equal; outputs agree to one bf16 ulp; ``l`` and ``m`` to f32 rounding; the CSA and plane
encoders write the bytes tokamax's compressor writes and decode as tokamax's readers do.

The bound, and why: both sides compute the same f32 values (bf16 products summed in f32, no
rounding of ``e^(s - m)``) in another summation order, so the f32 results differ by a few f32
ulps of the row's scale, and the final cast to bf16 may then round the two to neighbours: ``|ours
- theirs| <= ulp_bf16(|theirs|) + 2**-16 max|theirs|`` per element (``2**-16``: the f32 noise,
with margin, where a value is small next to its row); two ulps for the whole chain, whose
window ``acc`` is already rounded to bf16 by each side. ``l`` and ``m`` are f32: relative
1e-5."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engines_tokamax_attention import SCENARIOS, SM, make_case

from dsa_jax.engines.tokamax import attention as tk
from reference.formats import tokamax_v4 as tv

tokamax = pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 (CI's 3.12 leg)")
pytestmark = pytest.mark.kernel_gate

XLA = dict(implementation="xla")


def within_bf16_ulp(ours, theirs, ulps: int = 1):
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (ours, theirs))
    assert not np.isnan(a).any() and not np.isnan(b).any()
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), 1e-30))) - 7)
    bound = ulps * ulp + 2.0 ** -16 * np.abs(b).max()
    bad = np.abs(a - b) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst {np.abs(a - b)[bad].max()}"


def test_encoders_write_and_read_tokamaxs_bytes():
    from tokamax._src.ops.dsv4_compressor import csa_cache_layout as layout
    from tokamax._src.ops.dsv4_compressor import reference as comp
    from tokamax._src.ops.experimental.mla_swa import reference as swa
    from tokamax._src.ops.sparse_mla import reference as sparse

    rng = np.random.default_rng(0)
    n = 32
    x = (rng.standard_normal((n, 512)) * rng.uniform(1e-7, 30, (n, 1))).astype(np.float32)
    x[1, :448:64] = 0.0  # the amax floor
    codes, scales = comp.quantize_fp8_lane_periodic(jnp.asarray(x), 64, 448)
    record = jnp.concatenate([jax.lax.bitcast_convert_type(codes, jnp.uint8)[:, :448],
                              jax.lax.bitcast_convert_type(scales, jnp.uint8)], axis=-1)
    nope, rope = tv.encode_csa_records(x)
    assert np.array_equal(np.asarray(nope),
                          np.asarray(layout.slabs_to_words(record.reshape(n, 4, 128))))
    assert np.array_equal(np.asarray(rope), np.asarray(layout.rope_words(
        jnp.asarray(x[:, 448:], jnp.bfloat16))))
    theirs = sparse.dequantize_kv_cache(nope.reshape(n // 4, 4, 128), rope.reshape(n // 4, 1, 128))
    assert np.array_equal(np.asarray(theirs, np.float32).reshape(n, 512),
                          np.asarray(tv.decode_csa_records(nope, rope)))
    plane = swa.encode_kv_tokens(jnp.asarray(x, jnp.bfloat16)).reshape(n, 2, 4, 128)
    assert np.array_equal(np.asarray(tv.encode_plane_rows(x)),
                          np.asarray(layout.slabs_to_words(plane)))
    back = swa.decode_kv_slabs(plane.reshape(n // 2, 4, 4, 128), logical_page_size=2,
                               head_dim=512)
    assert np.array_equal(np.asarray(back, np.float32).reshape(n, 512),
                          np.asarray(tv.decode_plane_rows(tv.encode_plane_rows(x))))


@pytest.mark.parametrize(("name", "mode"), [
    *((name, mode) for name in sorted(SCENARIOS) for mode in ("normalized", "unnormalized")),
    ("mixed", "non_causal"), ("prefill", "u8")])
def test_mla_swa_matches_tokamax(name, mode):
    case = make_case(11, name)
    cache = tv.words_to_slabs(case.window) if mode == "u8" else jnp.asarray(case.window)
    kw = case.swa_kw(unnormalized_output=mode == "unnormalized",
                     non_causal_block=mode == "non_causal")
    ours = tk.mla_swa(*case.swa_args(cache), **kw)
    theirs = tokamax.ops.experimental.mla_swa(*case.swa_args(cache), **kw, **XLA)
    assert ours[1].dtype == theirs[1].dtype and ours[1].shape == theirs[1].shape
    assert np.array_equal(np.asarray(ours[1]), np.asarray(theirs[1]))
    assert ours[0].dtype == theirs[0].dtype
    within_bf16_ulp(ours[0], theirs[0])
    for a, b in zip(ours[2:], theirs[2:], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sparse_mla_matches_tokamax(name):
    case = make_case(12, name)
    win, _, l_, m = tokamax.ops.experimental.mla_swa(
        *case.swa_args(), **case.swa_kw(unnormalized_output=True), **XLA)
    args = case.sparse_args((win, l_, m))
    within_bf16_ulp(tk.sparse_mla(*args, sm_scale=SM),
                    tokamax.ops.sparse_mla(*args, sm_scale=SM, **XLA))
    # the whole chain, each side on its own window state: the bf16 window acc may already be
    # one ulp apart, so two ulps here
    win, _, l_, m = tk.mla_swa(*case.swa_args(), **case.swa_kw(unnormalized_output=True))
    within_bf16_ulp(tk.sparse_mla(*case.sparse_args((win, l_, m)), sm_scale=SM),
                    tokamax.ops.sparse_mla(*args, sm_scale=SM, **XLA), ulps=2)
