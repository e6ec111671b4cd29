"""reference.fp8 against an oracle written from the rules, not from the module.

The oracle: e4m3fn encode/decode from the format definition (1 sign, 4 exponent bits bias 7,
3 mantissa bits, no inf, NaN = S.1111.111, max 448, subnormals m * 2**-9) in float64 NumPy,
cross-checked against ml_dtypes (an independent implementation); the scale rules in exact
rational arithmetic (``fractions.Fraction``). Where a rule rounds to f32 the oracle rounds a
float64 result of one operation on f32 inputs to f32, which equals the correctly rounded f32
result (double rounding is innocuous for +-*/ when 53 >= 2 * 24 + 2, Figueroa 1995).
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from reference import fp8

F32_1E4 = Fraction(float(np.float32(1e-4)))  # rule 1 floors the amax with the f32 constant


# ---------------------------------------------------------------------------------------------
# Oracle.

def e4m3_encode(v) -> np.ndarray:
    """RNE encoding of float64 values (NaN and |v| > 464 -> NaN code; 464 is a tie -> 448)."""
    v = np.asarray(v, np.float64)
    a = np.abs(v)
    code = np.zeros(v.shape, np.int64)
    sub = a < 2.0 ** -6
    code[sub] = np.rint(a[sub] * 2.0 ** 9)  # 8 (a tie at 7.5 rounding up) is the min normal
    norm = ~sub & np.isfinite(a)
    m, e = np.frexp(a[norm])  # a = m * 2**e, m in [0.5, 1)
    q = np.rint((2 * m - 1) * 8).astype(np.int64)  # exact product; np.rint is half-to-even
    e = e - 1 + (q == 8)
    q = np.where(q == 8, 0, q)
    code[norm] = ((e + 7) << 3) | q
    code = np.where(~np.isfinite(a) | (code > 0x7E), 0x7F, code)
    return (code | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def e4m3_decode(c) -> np.ndarray:
    c = np.asarray(c, np.uint8).astype(np.int64)
    exp, man = (c >> 3) & 0xF, c & 7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag)


def bf16_bits(x32) -> np.ndarray:
    """f32 -> bf16 bits, RNE (finite inputs)."""
    u = np.asarray(x32, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def ceil_log2(q: Fraction) -> int:
    k = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** k < q:
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return k


def oracle_scale_index(block, scale_fmt) -> float:
    amax = max(Fraction(float(np.max(np.abs(block)))), F32_1E4)
    if scale_fmt == "ue8m0":
        return 2.0 ** ceil_log2(amax / 448)
    return float(np.float32(float(amax / 448)))


def oracle_scale_latent(tile) -> float:
    return 2.0 ** ceil_log2(max(Fraction(float(np.max(np.abs(tile)))) / 448,
                                Fraction(1, 10000)))


def oracle_blocks(x, block_size, scale_of):
    """(codes u8[..., D], scale f64[..., D // block_size]) for f32 ``x``."""
    x = np.asarray(x, np.float64)
    blocks = x.reshape(-1, block_size)
    s = np.array([scale_of(b) for b in blocks], np.float64).reshape(-1, 1)
    y = np.clip((blocks / s).astype(np.float32).astype(np.float64), -448, 448)
    n = x.shape[-1] // block_size
    return e4m3_encode(y).reshape(x.shape), s.reshape(*x.shape[:-1], n)


def oracle_quantize(x, block_size=128, scale_fmt="ue8m0"):
    return oracle_blocks(x, block_size, lambda b: oracle_scale_index(b, scale_fmt))


def oracle_latent(x):
    x = np.asarray(x, np.float32)
    codes, s = oracle_blocks(x[..., :512], 128, oracle_scale_latent)
    return codes, s, bf16_bits(x[..., 512:])


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def varied(rng, shape, block) -> np.ndarray:
    """f32 values whose magnitudes span 1e-6..1e4, varying by block (some blocks all below the
    amax floor), with exact zeros and -0.0 sprinkled in."""
    lead = (*shape[:-1], shape[-1] // block, 1)
    lo = rng.uniform(-6, 4, lead)
    hi = lo + rng.uniform(0, 1, lead) * (4 - lo)
    mag = 10.0 ** (lo + rng.uniform(0, 1, (*lead[:-1], block)) * (hi - lo))
    x = (rng.choice([-1.0, 1.0], mag.shape) * mag).reshape(shape)
    x[rng.uniform(size=shape) < 0.03] = 0.0
    x[rng.uniform(size=shape) < 0.03] = -0.0
    return x.astype(np.float32)


def tie_heavy(rng, shape) -> np.ndarray:
    """Small integers times powers of two: after a power-of-two scale many land on e4m3
    midpoints exactly."""
    k = rng.integers(-1000, 1000, shape).astype(np.float64)
    return (k * 2.0 ** rng.integers(-20, 4, (*shape[:-1], 1))).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The oracle itself and jnp's cast.

def _cast_sweep():
    step = np.arange(0, 0x43E00001, 997, dtype=np.uint64).astype(np.uint32)  # 0 .. 448.0
    mids = (e4m3_decode(np.arange(0, 0x7E)) + e4m3_decode(np.arange(1, 0x7F))) / 2
    mids = mids.astype(np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(0)),
                           np.nextafter(mids, np.float32(np.inf))])
    v = np.concatenate([step.view(np.float32), near])
    return np.concatenate([v, -v])


def test_oracle_encoder_matches_ml_dtypes_and_decodes_back():
    v = _cast_sweep()
    np.testing.assert_array_equal(e4m3_encode(v), v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    codes = np.arange(256, dtype=np.uint8)
    dec = e4m3_decode(codes)
    np.testing.assert_array_equal(dec, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    finite = ~np.isnan(dec)
    np.testing.assert_array_equal(e4m3_encode(dec[finite]), codes[finite])


def test_jnp_cast_is_rne_and_nan_on_overflow():
    v = _cast_sweep()
    np.testing.assert_array_equal(bits(jnp.asarray(v).astype(jnp.float8_e4m3fn)), e4m3_encode(v))
    # No saturation: (448, 464] rounds to 448 (464 is a tie to the even code), beyond is NaN.
    edge = np.array([448, 460, 464, np.nextafter(np.float32(464), np.float32(500)), 1e6,
                     np.inf, -np.inf], np.float32)
    got = bits(jnp.asarray(edge).astype(jnp.float8_e4m3fn))
    np.testing.assert_array_equal(got, [0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0xFF])


# ---------------------------------------------------------------------------------------------
# Rule 1 (indexer), hand cases.

def test_zero_block_floors_the_amax():
    x = np.zeros((2, 256), np.float32)
    x[1, 128:] = -0.0
    x8, s = fp8.quantize_fp8(x)
    # f32(1e-4) / 448 = 2.23e-7, which 2**-22 = 2.38e-7 is the next power of two above.
    np.testing.assert_array_equal(np.asarray(s), np.full((2, 2), 2.0 ** -22, np.float32))
    assert (bits(x8)[0] == 0).all() and (bits(x8)[1, :128] == 0).all()
    assert (bits(x8)[1, 128:] == 0x80).all()
    _, s_none = fp8.quantize_fp8(x, scale_fmt=None)
    expect = np.float32(1e-4) / np.float32(448)
    np.testing.assert_array_equal(np.asarray(s_none), np.full((2, 2), expect, np.float32))


def test_tiny_amax_below_the_floor():
    x = np.zeros((1, 128), np.float32)
    x[0, :4] = [1e-5, -5e-6, 3e-7, -1e-5]
    x8, s = fp8.quantize_fp8(x)
    assert float(s[0, 0]) == 2.0 ** -22  # the floor binds: same scale as an all-zero block
    # 1e-5 / 2**-22 = 41.94 -> 40 (e4m3 step in [32, 64) is 4; 41.94 < the midpoint 42).
    assert e4m3_decode(bits(x8)[0, 0]) == 40 and e4m3_decode(bits(x8)[0, 3]) == -40
    codes, _ = oracle_quantize(x)
    np.testing.assert_array_equal(bits(x8), codes)


def _exact_table():
    """(input at scale 1, expected e4m3 value): ties (RNE), just off ties, subnormals."""
    def up(v):
        return float(np.nextafter(np.float32(v), np.float32(1e9)))

    def down(v):
        return float(np.nextafter(np.float32(v), np.float32(0)))
    rows = [(1.0625, 1.0), (1.1875, 1.25), (17, 16), (19, 20), (248, 256), (432, 448),
            (up(1.0625), 1.125), (down(1.1875), 1.125), (up(432), 448), (down(432), 416),
            # subnormal results, |x / s| < 2**-6: multiples of 2**-9 and their ties
            (2.0 ** -10, 0.0), (3 * 2.0 ** -10, 2.0 ** -8), (5 * 2.0 ** -10, 2.0 ** -8),
            (7.5 * 2.0 ** -9, 2.0 ** -6), (up(2.0 ** -10), 2.0 ** -9), (2.0 ** -9, 2.0 ** -9),
            (3 * 2.0 ** -9, 3 * 2.0 ** -9), (7 * 2.0 ** -9, 7 * 2.0 ** -9),
            (2.0 ** -7, 2.0 ** -7), (0.4 * 2.0 ** -9, 0.0), (0.6 * 2.0 ** -9, 2.0 ** -9),
            (447.0, 448.0), (448.0, 448.0)]
    rows += [(-a, -b) for a, b in rows]
    return np.array([a for a, _ in rows]), np.array([b for _, b in rows])


@pytest.mark.parametrize("k", [0, -4, 7])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_ties_subnormals_and_448_at_a_power_of_two_scale(k, scale_fmt):
    inputs, expect = _exact_table()
    x = np.zeros((1, 128), np.float32)
    x[0, :inputs.size] = inputs * 2.0 ** k  # exact; the block's amax is 448 * 2**k
    x8, s = fp8.quantize_fp8(x, scale_fmt=scale_fmt)
    assert float(s[0, 0]) == 2.0 ** k
    np.testing.assert_array_equal(e4m3_decode(bits(x8)[0, :inputs.size]), expect)
    np.testing.assert_array_equal(np.signbit(e4m3_decode(bits(x8)[0, :inputs.size])),
                                  np.signbit(expect))  # -0.0 where a negative rounds to zero
    np.testing.assert_array_equal(bits(x8), oracle_quantize(x, scale_fmt=scale_fmt)[0])


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 20])
def test_amax_exactly_448_times_a_power_of_two(k):
    amax = np.float32(448 * 2.0 ** k)
    x = np.zeros((3, 128), np.float32)
    x[0, 5], x[1, 5], x[2, 5] = amax, np.nextafter(amax, np.inf), -np.nextafter(amax, 0)
    x8, s = fp8.quantize_fp8(x)
    np.testing.assert_array_equal(np.asarray(s)[:, 0], [2.0 ** k, 2.0 ** (k + 1), 2.0 ** k])
    assert bits(x8)[0, 5] == 0x7E and bits(x8)[2, 5] == 0xFE  # +-448
    _, s_none = fp8.quantize_fp8(x[:1], scale_fmt=None)
    assert float(s_none[0, 0]) == 2.0 ** k


def test_unrounded_scale_can_put_the_amax_above_448():
    # scale_fmt=None: f32(amax / 448) may round down, so amax / s exceeds 448 by an ulp; the
    # result is still the code for 448.
    a = np.float32(1000) + np.arange(4096, dtype=np.float32) * np.float32(0.37)
    s = a / np.float32(448)
    over = a[(a / s) > np.float32(448)]
    assert over.size > 0
    x = np.zeros((over.size, 128), np.float32)
    x[:, 0], x[:, 1] = over, -over
    x8, _ = fp8.quantize_fp8(x, scale_fmt=None)
    assert (bits(x8)[:, 0] == 0x7E).all() and (bits(x8)[:, 1] == 0xFE).all()


def test_block_division_is_correctly_rounded():
    # XLA rewrites x / broadcast(s) as x * broadcast(1 / s). Values within a few ulps of
    # s * (an e4m3 midpoint) where the two disagree on the e4m3 code pin the true division.
    amax = np.float32(1000.0)
    s = np.float32(float(Fraction(1000) / 448))
    vals = e4m3_decode(np.arange(0x7F, dtype=np.uint8))
    x0 = ((vals[:-1] + vals[1:]) / 2 * float(s)).astype(np.float32)
    near = (x0.view(np.uint32)[:, None].astype(np.int64) + np.arange(-4, 5)).astype(np.uint32)
    near = near.view(np.float32).ravel()
    div = e4m3_encode(np.float32(near.astype(np.float64) / float(s)))
    mul = e4m3_encode(near * (np.float32(1) / s))
    picked = near[div != mul]
    assert 0 < picked.size < 128
    x = np.zeros((1, 128), np.float32)
    x[0, 0], x[0, 1:1 + picked.size] = amax, picked
    x8, scale = fp8.quantize_fp8(x, scale_fmt=None)
    assert float(scale[0, 0]) == float(s)
    np.testing.assert_array_equal(bits(x8)[0, 1:1 + picked.size], div[div != mul])


def test_nan_and_inf_behaviour():
    x = np.ones((3, 256), np.float32)
    x[0, 3] = np.nan
    x[1, 130] = np.inf
    x[2, 0] = -np.inf
    x8, s = fp8.quantize_fp8(x)
    dec = e4m3_decode(bits(x8))
    s = np.asarray(s)
    assert np.isnan(s[0, 0]) and np.isnan(dec[0, :128]).all()  # NaN poisons its block
    assert s[0, 1] == 2.0 ** -8 and (dec[0, 128:] == 256).all()  # ... only
    assert np.isinf(s[1, 1]) and np.isnan(dec[1, 130])  # inf / inf
    finite = np.delete(dec[1, 128:], 2)
    assert (finite == 0).all() and not np.signbit(finite).any()  # 1 / inf = +0
    assert np.isnan(dec[2, 0]) and (dec[2, 1:128] == 0).all()


# ---------------------------------------------------------------------------------------------
# Rule 1, randomised against the oracle.

@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("block_size", [128, 32])
def test_random_f32_matches_oracle(seed, scale_fmt, block_size):
    rng = np.random.default_rng(seed)
    x = varied(rng, (3, 4, 256), block_size)
    if seed == 4:
        x = tie_heavy(rng, x.shape)
    x8, s = fp8.quantize_fp8(x, block_size=block_size, scale_fmt=scale_fmt)
    codes, s_ref = oracle_quantize(x, block_size, scale_fmt)
    assert x8.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s, np.float64), s_ref)
    np.testing.assert_array_equal(bits(x8), codes)
    y = fp8.dequantize_fp8(x8, s, block_size=block_size)
    expect = (e4m3_decode(codes) * np.repeat(s_ref, block_size, -1)).astype(np.float32)
    np.testing.assert_array_equal(bits(y), bits(expect))


@pytest.mark.parametrize("seed", range(3))
def test_bf16_input_is_upcast_exactly(seed):
    rng = np.random.default_rng(100 + seed)
    xb = jnp.asarray(varied(rng, (4, 256), 128)).astype(jnp.bfloat16)
    x32 = np.asarray(xb.astype(jnp.float32))
    for fmt in ("ue8m0", None):
        x8, s = fp8.quantize_fp8(xb, scale_fmt=fmt)
        codes, s_ref = oracle_quantize(x32, 128, fmt)
        np.testing.assert_array_equal(bits(x8), codes)
        np.testing.assert_array_equal(np.asarray(s, np.float64), s_ref)


# ---------------------------------------------------------------------------------------------
# Rule 2 (latent cache).

def test_latent_floor_is_on_the_scale():
    x = np.zeros((2, 576), np.float32)
    x[1, :128] = 0.01  # amax / 448 = 2.2e-5 < 1e-4: floored to 1e-4 -> 2**-13
    x[1, 128] = -0.0
    x[1, 512:] = [-0.0, 1.0] * 32
    nope8, s, rope = fp8.quantize_latent_fp8(x)
    np.testing.assert_array_equal(np.asarray(s), np.full((2, 4), 2.0 ** -13, np.float32))
    # 0.01 * 2**13 = 81.92 -> 80 (step 8 in [64, 128)); rule 1 would pick 2**-15 instead.
    assert (e4m3_decode(bits(nope8)[1, :128]) == 80).all()
    assert float(fp8.quantize_fp8(x[1, :128])[1][0]) == 2.0 ** -15
    assert bits(nope8)[1, 128] == 0x80 and (bits(nope8)[0] == 0).all()
    assert (bits(rope)[1, ::2] == 0x8000).all()
    y = np.asarray(fp8.dequantize_latent_fp8(nope8, s, rope))
    assert np.signbit(y[1, 128]) and np.signbit(y[1, 512]) and y[1, 513] == 1.0


@pytest.mark.parametrize("k", [-13, -3, 0, 5, 20])
def test_latent_amax_exactly_448_times_a_power_of_two(k):
    x = np.zeros((1, 576), np.float32)
    amax = np.float32(448 * 2.0 ** k)
    x[0, 0], x[0, 128], x[0, 256] = amax, np.nextafter(amax, np.inf), -np.nextafter(amax, 0)
    x[0, 384] = 448 * 2.0 ** (k - 1)
    nope8, s, _ = fp8.quantize_latent_fp8(x)
    expect = [2.0 ** k, 2.0 ** (k + 1), 2.0 ** k, max(2.0 ** (k - 1), 2.0 ** -13)]
    np.testing.assert_array_equal(np.asarray(s)[0], expect)
    assert bits(nope8)[0, 0] == 0x7E and bits(nope8)[0, 256] == 0xFE


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_latent_random_matches_oracle(seed, dtype):
    rng = np.random.default_rng(200 + seed)
    x = varied(rng, (2, 6, 576), 64)
    if seed == 3:
        x[..., :512] = tie_heavy(rng, (2, 6, 512))
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    nope8, s, rope = fp8.quantize_latent_fp8(jnp.asarray(x).astype(dtype))
    codes, s_ref, rope_ref = oracle_latent(x)
    assert (nope8.dtype, s.dtype, rope.dtype) == (jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16)
    np.testing.assert_array_equal(bits(nope8), codes)
    np.testing.assert_array_equal(np.asarray(s, np.float64), s_ref)
    np.testing.assert_array_equal(bits(rope), rope_ref)
    y = fp8.dequantize_latent_fp8(nope8, s, rope)
    nope = e4m3_decode(codes) * np.repeat(s_ref, 128, -1)
    rope_f = (rope_ref.astype(np.uint32) << 16).view(np.float32)
    expect = np.concatenate([nope.astype(np.float32), rope_f], -1)
    np.testing.assert_array_equal(bits(y), bits(expect))


def test_latent_nan_stays_in_its_tile_or_slot():
    x = np.ones((1, 576), np.float32)
    x[0, 200] = np.nan
    x[0, 520] = np.nan
    nope8, s, rope = fp8.quantize_latent_fp8(x)
    dec = e4m3_decode(bits(nope8))[0]
    assert np.isnan(np.asarray(s)[0, 1]) and np.isnan(dec[128:256]).all()
    assert not np.isnan(dec[:128]).any() and not np.isnan(dec[256:]).any()
    r = np.asarray(rope.astype(jnp.float32))[0]
    assert np.isnan(r[8]) and np.isnan(r).sum() == 1


# ---------------------------------------------------------------------------------------------
# Byte layouts.

def np_latent_bytes(nope8, scales, rope) -> np.ndarray:
    lead = np.shape(scales)[:-1]
    return np.concatenate([
        bits(nope8),
        np.asarray(scales).astype("<f4").view(np.uint8).reshape(*lead, 16),
        bits(rope).astype("<u2").view(np.uint8).reshape(*lead, 128)], axis=-1)


def test_latent_bytes_layout():
    x = varied(np.random.default_rng(7), (3, 2, 576), 64)
    parts = fp8.quantize_latent_fp8(x)
    b = fp8.latent_to_flashmla_bytes(*parts)
    assert b.dtype == jnp.uint8 and b.shape == (3, 2, 656)
    np.testing.assert_array_equal(np.asarray(b), np_latent_bytes(*parts))
    # One token by hand: scale 1.0 is bytes 00 00 80 3f; bf16 -2.0 is c0 00 -> 00 c0.
    nope8 = jnp.zeros((512,), jnp.float8_e4m3fn).at[0].set(-448.0)
    scales = jnp.asarray([1.0, 2.0 ** -13, 0.5, 2.0], jnp.float32)
    rope = jnp.full((64,), -2.0, jnp.bfloat16)
    row = np.asarray(fp8.latent_to_flashmla_bytes(nope8, scales, rope))
    assert row[0] == 0xFE and list(row[512:516]) == [0, 0, 0x80, 0x3F]
    assert list(row[516:520]) == [0, 0, 0, 0x39] and list(row[528:530]) == [0, 0xC0]


def _special_latent_parts():
    """Parts with NaN payloads (quiet and signalling), -0.0 and NaN fp8 codes."""
    rng = np.random.default_rng(3)
    nope = rng.integers(0, 256, (2, 512), dtype=np.uint8)
    nope[:, :4] = [0x7F, 0xFF, 0x80, 0x00]
    sc = rng.integers(0, 2 ** 32, (2, 4), dtype=np.uint64).astype(np.uint32)
    sc[0] = [0x7FC00001, 0xFF800001, 0x80000000, 0x7F800001]
    rp = rng.integers(0, 2 ** 16, (2, 64), dtype=np.uint64).astype(np.uint16)
    rp[0, :3] = [0xFFC1, 0x8000, 0x7F81]
    return (nope.view(ml_dtypes.float8_e4m3fn), sc.view(np.float32),
            rp.view(ml_dtypes.bfloat16))


def test_latent_bytes_round_trip_is_bit_exact():
    raw = np.random.default_rng(1).integers(0, 256, (4, 3, 656), dtype=np.uint8)
    parts = fp8.latent_from_flashmla_bytes(raw)
    assert [p.dtype for p in parts] == [jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16]
    np.testing.assert_array_equal(bits(parts[0]), raw[..., :512])
    np.testing.assert_array_equal(bits(parts[1]), raw[..., 512:528].copy().view("<u4"))
    np.testing.assert_array_equal(bits(parts[2]), raw[..., 528:].copy().view("<u2"))
    np.testing.assert_array_equal(np.asarray(fp8.latent_to_flashmla_bytes(*parts)), raw)
    special = _special_latent_parts()
    back = fp8.latent_from_flashmla_bytes(fp8.latent_to_flashmla_bytes(*special))
    for got, want in zip(back, special, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


def test_latent_bytes_then_dequantize_matches_direct():
    x = varied(np.random.default_rng(11), (5, 576), 64)
    parts = fp8.quantize_latent_fp8(x)
    again = fp8.latent_from_flashmla_bytes(fp8.latent_to_flashmla_bytes(*parts))
    np.testing.assert_array_equal(bits(fp8.dequantize_latent_fp8(*again)),
                                  bits(fp8.dequantize_latent_fp8(*parts)))


def test_paged_index_bytes_layout_and_round_trip():
    rng = np.random.default_rng(5)
    pages, page_size = 3, 4
    k = varied(rng, (pages, page_size, 128), 128)
    k8, s = fp8.quantize_fp8(k)
    b = fp8.index_to_paged_fp8_bytes(k8, s)
    assert b.dtype == jnp.uint8 and b.shape == (pages, page_size * 132)
    expect = np.concatenate([bits(k8).reshape(pages, -1),
                             np.asarray(s).astype("<f4").view(np.uint8).reshape(pages, -1)], -1)
    np.testing.assert_array_equal(np.asarray(b), expect)
    k8b, sb = fp8.index_from_paged_fp8_bytes(b, page_size=page_size)
    assert k8b.shape == (pages, page_size, 128) and sb.shape == (pages, page_size, 1)
    np.testing.assert_array_equal(bits(k8b), bits(k8))
    np.testing.assert_array_equal(bits(sb), bits(s))
    raw = rng.integers(0, 256, (2, 16 * 132), dtype=np.uint8)
    raw[0, 16 * 128:16 * 128 + 8] = [1, 0, 0xC0, 0x7F, 0, 0, 0, 0x80]  # NaN payload, -0.0
    again = fp8.index_to_paged_fp8_bytes(*fp8.index_from_paged_fp8_bytes(raw, page_size=16))
    np.testing.assert_array_equal(np.asarray(again), raw)


# ---------------------------------------------------------------------------------------------
# jit.

def test_everything_jits_to_the_same_bits():
    rng = np.random.default_rng(9)
    x = varied(rng, (2, 256), 128)
    q = jax.jit(fp8.quantize_fp8, static_argnames=("block_size", "scale_fmt"))
    for fmt in ("ue8m0", None):
        for got, want in zip(q(x, block_size=64, scale_fmt=fmt),
                             fp8.quantize_fp8(x, block_size=64, scale_fmt=fmt), strict=True):
            np.testing.assert_array_equal(bits(got), bits(want))
    x8, s = fp8.quantize_fp8(x)
    np.testing.assert_array_equal(bits(jax.jit(fp8.dequantize_fp8)(x8, s)),
                                  bits(fp8.dequantize_fp8(x8, s)))
    lat = varied(rng, (3, 576), 64)
    parts = jax.jit(fp8.quantize_latent_fp8)(lat)
    for got, want in zip(parts, fp8.quantize_latent_fp8(lat), strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))
    b = jax.jit(fp8.latent_to_flashmla_bytes)(*parts)
    np.testing.assert_array_equal(np.asarray(b), np_latent_bytes(*parts))
    for got, want in zip(jax.jit(fp8.latent_from_flashmla_bytes)(b), parts, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(jax.jit(fp8.dequantize_latent_fp8)(*parts)),
                                  bits(fp8.dequantize_latent_fp8(*parts)))
    k8, ks = fp8.quantize_fp8(varied(rng, (2, 8, 128), 128))
    pb = jax.jit(fp8.index_to_paged_fp8_bytes)(k8, ks)
    back = jax.jit(fp8.index_from_paged_fp8_bytes, static_argnames="page_size")(pb, page_size=8)
    np.testing.assert_array_equal(bits(back[0]), bits(k8))
    np.testing.assert_array_equal(bits(back[1]), bits(ks))


# ---------------------------------------------------------------------------------------------
# Bad input.

_F32 = np.zeros((2, 256), np.float32)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: fp8.quantize_fp8(np.zeros((2, 200), np.float32)), ValueError,
     r"x.shape\[-1\] = 200 is not a multiple of block_size = 128"),
    (lambda: fp8.quantize_fp8(_F32, block_size=96), ValueError, "= 256 .* block_size = 96"),
    (lambda: fp8.quantize_fp8(_F32, block_size=0), ValueError, "block_size=0"),
    (lambda: fp8.quantize_fp8(_F32, block_size=-128), ValueError, "block_size=-128"),
    (lambda: fp8.quantize_fp8(_F32, block_size=128.0), TypeError, "block_size"),
    (lambda: fp8.quantize_fp8(_F32, scale_fmt="e8m0"), ValueError, "scale_fmt='e8m0'"),
    (lambda: fp8.quantize_fp8(_F32, scale_fmt=True), ValueError, "scale_fmt=True"),
    (lambda: fp8.quantize_fp8(_F32.astype(np.float16)), ValueError,
     "x has dtype float16; supported: float32, bfloat16"),
    (lambda: fp8.quantize_fp8(_F32.astype(np.float64)), ValueError, "x has dtype float64"),
    (lambda: fp8.quantize_fp8(_F32.astype(np.int32)), ValueError, "x has dtype int32"),
    (lambda: fp8.quantize_fp8(jnp.zeros((2, 256), jnp.float8_e4m3fn)), ValueError,
     "x has dtype float8_e4m3fn; supported: float32, bfloat16"),
    (lambda: fp8.quantize_fp8(np.float32(1.0)), ValueError, "rank >= 1, got rank 0"),
    (lambda: fp8.quantize_latent_fp8(np.zeros((2, 575), np.float32)), ValueError,
     r"x.shape\[-1\] must equal .* = 576, got 575"),
    (lambda: fp8.quantize_latent_fp8(np.zeros((2, 576), np.float16)), ValueError,
     "x has dtype float16"),
    (lambda: fp8.dequantize_fp8(_F32, np.ones((2, 2), np.float32)), ValueError,
     "x8 must have dtype float8_e4m3fn, got dtype float32"),
    (lambda: fp8.dequantize_fp8(jnp.zeros((2, 256), jnp.float8_e4m3fn),
                                np.ones((2, 3), np.float32)), ValueError,
     r"\(2, 2\) \(D = 256, block_size = 128\), got \(2, 3\)"),
    (lambda: fp8.dequantize_fp8(jnp.zeros((2, 250), jnp.float8_e4m3fn),
                                np.ones((2, 2), np.float32)), ValueError,
     r"x8.shape\[-1\] = 250 is not a multiple of block_size = 128"),
])
def test_bad_quantizer_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


_NOPE = jnp.zeros((3, 512), jnp.float8_e4m3fn)
_SC = jnp.ones((3, 4), jnp.float32)
_ROPE = jnp.zeros((3, 64), jnp.bfloat16)


@pytest.mark.parametrize("fn", [fp8.latent_to_flashmla_bytes, fp8.dequantize_latent_fp8])
@pytest.mark.parametrize("args,match", [
    ((_NOPE[:, :511], _SC, _ROPE), r"nope8.shape\[-1\] must equal .* = 512, got 511"),
    ((_NOPE, _SC[:, :3], _ROPE), r"scales.shape\[-1\] must equal .* = 4, got 3"),
    ((_NOPE, _SC, _ROPE.astype(jnp.float32)), "rope must have dtype bfloat16, got dtype float32"),
    ((_NOPE, _SC.astype(jnp.bfloat16), _ROPE), "scales must have dtype float32"),
    ((_NOPE[:2], _SC, _ROPE), r"share their leading dims, got shapes \(2, 512\), \(3, 4\)"),
])
def test_bad_latent_parts(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: fp8.latent_from_flashmla_bytes(np.zeros((2, 655), np.uint8)), ValueError,
     r"b.shape\[-1\] must equal .* = 656, got 655"),
    (lambda: fp8.latent_from_flashmla_bytes(np.zeros((2, 656), np.int8)), ValueError,
     "b must have dtype uint8, got dtype int8"),
    (lambda: fp8.index_from_paged_fp8_bytes(np.zeros((2, 1000), np.uint8), page_size=8),
     ValueError, r"b.shape\[1\] = 1000 is not a multiple of 132"),
    (lambda: fp8.index_from_paged_fp8_bytes(np.zeros((2, 528), np.uint8), page_size=8),
     ValueError, r"b.shape\[1\] = 528 must equal page_size \* 132 = 1056 .* 4 tokens"),
    (lambda: fp8.index_from_paged_fp8_bytes(np.zeros((2, 528), np.uint8), page_size=0),
     ValueError, "page_size=0"),
    (lambda: fp8.index_from_paged_fp8_bytes(np.zeros((528,), np.uint8), page_size=4),
     ValueError, "b must have rank 2, got rank 1"),
    (lambda: fp8.index_to_paged_fp8_bytes(jnp.zeros((2, 4, 64), jnp.float8_e4m3fn),
                                          np.ones((2, 4, 1), np.float32)), ValueError,
     r"k8.shape\[2\] must equal .* = 128, got 64"),
    (lambda: fp8.index_to_paged_fp8_bytes(jnp.zeros((2, 4, 128), jnp.float8_e4m3fn),
                                          np.ones((2, 4), np.float32)), ValueError,
     "scale must have rank 3, got rank 2"),
    (lambda: fp8.index_to_paged_fp8_bytes(jnp.zeros((2, 4, 128), jnp.float8_e4m3fn),
                                          np.ones((2, 5, 1), np.float32)), ValueError,
     r"\(2, 4, 1\) to match k8 \(2, 4, 128\), got \(2, 5, 1\)"),
    (lambda: fp8.index_to_paged_fp8_bytes(jnp.zeros((2, 4, 128), jnp.float32),
                                          np.ones((2, 4, 1), np.float32)), ValueError,
     "k8 must have dtype float8_e4m3fn, got dtype float32"),
])
def test_bad_byte_layout_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
