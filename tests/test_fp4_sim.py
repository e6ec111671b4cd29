"""DeepSeek-V4's FP4 simulation of the indexer (``index_quant="fp4_sim"``: the layer statement's
``reference.deepseek_v4.hadamard_rotate`` then ``fp4_act_quant_sim``)
against a NumPy statement of the rule in SPEC.md ("DeepSeek-V4 attention"): per block of 32,
``amax = max(max|x|, 6 * 2**-126)``, ``s = 2**ceil(log2(amax / 6))`` (ceil from the f32 bits),
``x' = e2m1(clamp(x / s, +-6)) * s`` with ties to the even mantissa. The quantizer is compared
bit for bit (the e2m1 choice is a brute-force nearest-with-ties search here, the scale comes from
``np.frexp``, and ``ml_dtypes``' own e2m1 cast is a second witness; a NaN feature stays NaN and
stays out of its block's amax, as a GPU ``fmax`` reduction leaves it); the Hadamard rotation in
f64; the op against the float64 indexer oracle on the simulated values."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracle import check_token_topk
from test_compressed_indexer import compressed_batch

from reference import deepseek_v4, streamindex_topk_ref

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MANTISSA_ODD = np.array([0, 1, 0, 1, 0, 1, 0, 1], bool)


def _e2m1(y: float) -> float:
    """Nearest e2m1 value of ``|y| <= 6`` (sign kept), ties to the even mantissa."""
    d = np.abs(GRID - abs(y))
    best = np.flatnonzero(d == d.min())
    pick = best[0] if len(best) == 1 else next(i for i in best if not MANTISSA_ODD[i])
    return float(np.copysign(GRID[pick], y))


def oracle_fp4(x: np.ndarray) -> np.ndarray:
    """The rule as SPEC.md writes it, block by block, in Python floats; f32 out."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    flat, res = x.reshape(-1, 32), out.reshape(-1, 32)
    for b, blk in enumerate(flat):
        # a NaN feature is NaN out and, like a GPU fmax reduction, does not enter the amax
        real = np.abs(blk[~np.isnan(blk)])
        if real.size == 0:
            res[b] = np.nan
            continue
        amax = max(float(real.max()), 6.0 * 2.0**-126)
        quot = np.float32(amax) / np.float32(6.0)  # a correctly rounded f32 division
        m, e = np.frexp(np.float64(quot))  # quot = m * 2**e, m in [0.5, 1)
        s = 2.0 ** (e - 1 if m == 0.5 else e)  # 2**ceil(log2(quot))
        res[b] = [np.nan if np.isnan(v) else _e2m1(min(max(float(v) / s, -6.0), 6.0)) * s
                  for v in blk]
    return out


def _ties_block(scale: float) -> np.ndarray:
    """A block with amax 6 * scale (so s = scale) and every e2m1 tie, both signs, and -0."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, 5.9, 6.0]
    v = np.array(ties + [-t for t in ties] + [-0.0, 0.0, 2.25, -4.4, 1.9, 0.3, 0.7, 3.99, 4.5,
                                               -5.5, 0.5, -1.0], np.float64)
    return (v[:32] * scale).astype(np.float32)


def _inputs():
    rng = np.random.default_rng(21)
    blocks = [rng.standard_normal(32) * 10.0 ** rng.uniform(-6, 6) for _ in range(200)]
    blocks += [_ties_block(2.0**k) for k in (-20, -3, 0, 1, 7)]
    blocks += [np.zeros(32), np.full(32, 1e-39), np.full(32, -3e-41),  # floor: s = 2**-126
               np.full(32, 6.0 * 2**5), np.full(32, 6.0 * 2**5 * (1 + 2**-23))]  # exact pow2
    nan = rng.standard_normal(32)
    nan[7] = np.nan
    blocks.append(nan)
    blocks += [rng.standard_normal(32)] * (-len(blocks) % 4)  # whole 128-dim rows
    return np.stack(blocks).astype(np.float32).reshape(-1, 128)


def test_fp4_sim_is_bit_exact_with_the_rule():
    x = _inputs()
    got = np.asarray(deepseek_v4.fp4_act_quant_sim(jnp.asarray(x)))
    want = oracle_fp4(x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # ml_dtypes' e2m1 cast (round to nearest even) agrees on the finite scaled values
    xb = x.reshape(-1, 32).astype(np.float64)
    finite = ~np.isnan(xb).any(axis=1)
    amax = np.maximum(np.abs(xb[finite]).max(axis=1, keepdims=True), 6.0 * 2.0**-126)
    quot = (amax.astype(np.float32) / np.float32(6)).astype(np.float64)
    m, e = np.frexp(quot)
    scale = 2.0 ** np.where(m == 0.5, e - 1, e)
    cast = np.clip(xb[finite] / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal((cast * scale).astype(np.float32), want.reshape(-1, 32)[finite])


def test_hadamard_is_the_normalized_sylvester_rotation():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 128)).astype(np.float32)
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)])
    want = x.astype(np.float64) @ h / np.sqrt(128)
    got = np.asarray(deepseek_v4.hadamard_rotate(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    back = np.asarray(deepseek_v4.hadamard_rotate(jnp.asarray(got)))
    np.testing.assert_allclose(back, x, atol=4e-6)


def test_indexer_with_fp4_sim_scores_the_rotated_quantized_q_and_keys():
    b, ratio, otp = compressed_batch("prefill_r4", 11)
    got = np.asarray(streamindex_topk_ref(*b.args(), k=6, pages_per_seq=b.pages_per_seq,
                                          exact=True, compression_ratio=ratio,
                                          index_quant="fp4_sim"))
    sim = lambda a: oracle_fp4(np.asarray(deepseek_v4.hadamard_rotate(jnp.asarray(a))))  # noqa: E731
    check_token_topk(got, b, 6, compression_ratio=ratio, rtol=1e-5, q=sim(b.q),
                     cache=sim(b.cache))
    plain = np.asarray(streamindex_topk_ref(*b.args(), k=6, pages_per_seq=b.pages_per_seq,
                                            exact=True, compression_ratio=ratio))
    assert not np.array_equal(got, plain)  # the simulation changes the selection


@pytest.mark.parametrize("kw,err,match", [
    (dict(index_quant="fp8"), ValueError, r"index_quant must be one of \(None, 'fp4_sim'\)"),
    (dict(index_quant="fp4_sim", dim=64), ValueError, r"rotates the 128 index dims; q.shape"),
])
def test_bad_index_quant_is_refused_by_name(kw, err, match):
    b, ratio, _ = compressed_batch("decode_r4")
    dim = kw.pop("dim", 128)
    b = dataclasses.replace(b, q=b.q[..., :dim], cache=b.cache[..., :dim])
    with pytest.raises(err, match=match):
        streamindex_topk_ref(*b.args(), k=2, pages_per_seq=b.pages_per_seq,
                             compression_ratio=ratio, **kw)
