"""reference.fp8_cache: the TPU storage layouts of the fp8 caches, checked against NumPy.

Every expected value here is built independently in NumPy from the layout description in the
module docstring and from the quantization rules in ``reference.fp8``'s docstring; the
module's own helpers (``parts_to_words``, ``words_to_parts``, ``quantize_latent_rows``...) are
never used to make an expected value.

The NumPy oracle of the rules: e4m3 and bf16 casts from ``ml_dtypes`` (RNE from f32, checked
against a from-the-format encoder in tests/test_fp8.py). A power-of-two ceiling is exact from
``np.frexp`` of the float64 quotient ``amax / 448``: that quotient of an f32 ``amax`` is a power
of two in float64 exactly when the true quotient is (``amax`` would have to lie within 2**-44
relative of ``448 * 2**k``, far below an f32 ulp). Where a rule rounds to f32, one float64
operation on f32 inputs rounded to f32 is the correctly rounded f32 result (Figueroa 1995).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_fp8 import varied  # the same magnitude-spread inputs as the rule tests

from reference import fp8_cache as fc

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
F32_1E4 = float(np.float32(1e-4))  # rule 1 floors the amax with the f32 constant


# ---------------------------------------------------------------------------------------------
# NumPy oracle.

def bits(a) -> np.ndarray:
    """The bit patterns of an array (u8 / u16 / u32 by item size)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def pow2_ceil(q) -> np.ndarray:
    """``2**ceil(log2 q)`` for float64 ``q > 0``, exactly."""
    m, e = np.frexp(np.asarray(q, np.float64))  # q = m * 2**e, m in [0.5, 1)
    return np.where(m == 0.5, np.ldexp(1.0, e - 1), np.ldexp(1.0, e))


def to_e4m3(y32) -> np.ndarray:
    """Rule 1/2's last step: clip an f32 quotient to +-448, then RNE to e4m3 (codes)."""
    y32 = np.clip(np.asarray(y32, np.float32), np.float32(-448), np.float32(448))
    return y32.astype(E4M3).view(np.uint8)


def oracle_index(k, scale_fmt="ue8m0"):
    """Rule 1, one 128-block per token: f32 ``k[..., 128]`` -> (codes u8[..., 128], s f32[...])."""
    k64 = np.asarray(k, np.float32).astype(np.float64)
    amax = np.maximum(np.abs(k64).max(-1), F32_1E4)
    q = amax / 448
    s = pow2_ceil(q).astype(np.float32) if scale_fmt == "ue8m0" else q.astype(np.float32)
    y = (k64 / s.astype(np.float64)[..., None]).astype(np.float32)  # f32 division
    return to_e4m3(y), s


def oracle_latent(x):
    """Rule 2: f32 ``x[..., 576]`` -> (codes u8[..., 512], s f32[..., 4],
    rope bits u16[..., 64])."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    tiles = x[..., :512].astype(np.float64).reshape(*lead, 4, 128)
    s = pow2_ceil(np.maximum(np.abs(tiles).max(-1) / 448, 1e-4))
    y = (tiles / s[..., None]).astype(np.float32)  # exact: s is a power of two
    codes = to_e4m3(y).reshape(*lead, 512)
    return codes, s.astype(np.float32), bits(x[..., 512:].astype(BF16))


def np_words(codes, s, rope_bits) -> np.ndarray:
    """The module docstring's word layout, built by shifts: ``u32[..., 256]``."""
    lead = codes.shape[:-1]
    c = codes.reshape(*lead, 4, 128).astype(np.uint32)
    w = np.zeros((*lead, 256), np.uint32)
    for j in range(4):
        w[..., :128] |= c[..., j, :] << np.uint32(8 * j)
    r = rope_bits.astype(np.uint32)
    w[..., 128:160] = r[..., :32] | (r[..., 32:] << np.uint32(16))
    w[..., 160:164] = bits(np.asarray(s, np.float32))
    return w


def np_unwords(words):
    """Read the layout back element by element: (codes u8[..., 512], rope u16[..., 64],
    scale bits u32[..., 4], tail u32[..., 92])."""
    w = np.asarray(words, np.uint32)
    lead = w.shape[:-1]
    codes = np.zeros((*lead, 512), np.uint8)
    for f in range(512):  # feature f = 128 j + w  ->  byte j of word w
        j, word = divmod(f, 128)
        codes[..., f] = (w[..., word] >> np.uint32(8 * j)) & np.uint32(0xFF)
    rope = np.zeros((*lead, 64), np.uint16)
    for i in range(32):
        rope[..., i] = w[..., 128 + i] & np.uint32(0xFFFF)
        rope[..., 32 + i] = w[..., 128 + i] >> np.uint32(16)
    return codes, rope, w[..., 160:164], w[..., 164:]


def np_flashmla(codes, s, rope_bits) -> np.ndarray:
    """FlashMLA V32_FP8Sparse token bytes: 512 e4m3, 16 LE f32 scales, 128 LE bf16 rope."""
    lead = codes.shape[:-1]
    return np.concatenate([
        codes.astype(np.uint8),
        np.asarray(s, "<f4").view(np.uint8).reshape(*lead, 16),
        np.asarray(rope_bits, "<u2").view(np.uint8).reshape(*lead, 128)], axis=-1)


def np_paged(key_codes, scales_f32) -> np.ndarray:
    """vLLM / DeepGEMM page bytes: ``ps * 128`` key bytes token-major, then ``ps`` LE f32."""
    p, ps, _ = key_codes.shape
    return np.concatenate([key_codes.reshape(p, ps * 128).astype(np.uint8),
                           np.asarray(scales_f32, "<f4").view(np.uint8).reshape(p, ps * 4)], -1)


def random_u8(rng, shape) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


def random_u32(rng, shape) -> np.ndarray:
    return rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32)


def random_index_cache(rng, pages, ps) -> fc.Fp8IndexCache:
    """Arbitrary bits everywhere (NaN codes, NaN / -0.0 / subnormal scales, junk padding)."""
    keys = random_u8(rng, (pages, ps, 128)).view(E4M3)
    scales = random_u32(rng, (pages, fc.scale_lanes(ps))).view(np.float32)
    return fc.Fp8IndexCache(jnp.asarray(keys), jnp.asarray(scales))


# ---------------------------------------------------------------------------------------------
# Index cache: quantize / dequantize.

@pytest.mark.parametrize("ps", [32, 64, 128, 256])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_quantize_index_cache_matches_rule_per_token(ps, scale_fmt):
    rng = np.random.default_rng(1000 + ps + (scale_fmt is None))
    pages = 3
    keys = varied(rng, (pages, ps, 128), 128)
    c = fc.quantize_index_cache(keys, scale_fmt=scale_fmt)
    lanes = -(-ps // 128) * 128
    assert c.keys.dtype == jnp.float8_e4m3fn and c.keys.shape == (pages, ps, 128)
    assert c.scales.dtype == jnp.float32 and c.scales.shape == (pages, lanes)
    assert c.shape == (pages, ps, 128) and c.num_pages == pages and c.page_size == ps
    codes, s = oracle_index(keys, scale_fmt)
    np.testing.assert_array_equal(bits(c.keys), codes)
    scales = np.asarray(c.scales)
    np.testing.assert_array_equal(bits(scales[:, :ps]), bits(s))
    assert (bits(scales[:, ps:]) == 0).all()  # padding lanes are +0.0
    y = fc.dequantize_index_cache(c)
    expect = codes.view(E4M3).astype(np.float32) * s[..., None]
    assert y.dtype == jnp.float32 and y.shape == (pages, ps, 128)
    np.testing.assert_array_equal(bits(y), bits(expect))


def test_quantize_index_cache_bf16_input():
    rng = np.random.default_rng(11)
    kb = jnp.asarray(varied(rng, (2, 64, 128), 128)).astype(jnp.bfloat16)
    k32 = np.asarray(kb.astype(jnp.float32))
    c = fc.quantize_index_cache(kb)
    codes, s = oracle_index(k32)
    np.testing.assert_array_equal(bits(c.keys), codes)
    np.testing.assert_array_equal(bits(np.asarray(c.scales)[:, :64]), bits(s))
    assert (bits(np.asarray(c.scales)[:, 64:]) == 0).all()


def test_index_cache_hand_cases():
    k = np.random.default_rng(12).uniform(-1, 1, (1, 32, 128)).astype(np.float32)
    k[0, 0] = 0.0  # all-zero token: the amax floor f32(1e-4) / 448 -> 2**-22
    k[0, 1] = 0.0
    k[0, 1, 7] = 448 * 2.0 ** 3  # amax exactly 448 * 2**3: scale 2**3, code 448
    k[0, 1, 9] = -448 * 2.0 ** 3
    k[0, 2] = 0.0
    k[0, 2, 0] = np.nextafter(np.float32(448 * 2.0 ** -5), np.float32(1e9))  # just above
    c = fc.quantize_index_cache(k)
    s = np.asarray(c.scales)[0]
    assert s[0] == 2.0 ** -22 and s[1] == 2.0 ** 3 and s[2] == 2.0 ** -4
    kc = bits(c.keys)[0]
    assert (kc[0] == 0).all() and kc[1, 7] == 0x7E and kc[1, 9] == 0xFE
    assert kc[2, 0] == 0x76  # 448 * 2**-5 * (1 + 2**-23) / 2**-4 -> 224 = 1.75 * 2**7
    b = np.asarray(fc.index_cache_to_paged_fp8(c))[0]
    assert list(b[32 * 128 + 4:32 * 128 + 8]) == [0, 0, 0, 0x41]  # scale 2**3, LE f32
    assert list(b[32 * 128:32 * 128 + 4]) == [0, 0, 0x80, 0x34]  # 2**-22


# ---------------------------------------------------------------------------------------------
# Index cache: vLLM / DeepGEMM paged bytes.

@pytest.mark.parametrize("ps", [32, 64, 128, 256])
def test_index_paged_bytes_layout_and_round_trip(ps):
    rng = np.random.default_rng(2000 + ps)
    pages = 3
    c = fc.quantize_index_cache(varied(rng, (pages, ps, 128), 128))
    b = fc.index_cache_to_paged_fp8(c)
    assert b.dtype == jnp.uint8 and b.shape == (pages, ps * 132)
    expect = np_paged(bits(c.keys), np.asarray(c.scales)[:, :ps])
    np.testing.assert_array_equal(np.asarray(b), expect)
    for back in (fc.index_cache_from_paged_fp8(b),
                 fc.index_cache_from_paged_fp8(b, page_size=ps)):
        assert back.keys.dtype == jnp.float8_e4m3fn and back.scales.dtype == jnp.float32
        assert back.keys.shape == (pages, ps, 128)
        assert back.scales.shape == (pages, fc.scale_lanes(ps))
        np.testing.assert_array_equal(bits(back.keys), bits(c.keys))
        np.testing.assert_array_equal(bits(back.scales), bits(c.scales))  # padding zero too


@pytest.mark.parametrize("ps", [32, 64, 160])
def test_index_paged_random_bytes_survive_bit_exactly(ps):
    rng = np.random.default_rng(3000 + ps)
    pages = 4
    raw = random_u8(rng, (pages, ps * 132))
    raw[0, :4] = [0x7F, 0xFF, 0x80, 0x00]  # e4m3 NaN codes, -0.0, +0.0
    sc = ps * 128
    specials = [[0x01, 0x00, 0xC0, 0x7F],  # quiet NaN with a payload
                [0x01, 0x00, 0x80, 0xFF],  # signalling NaN, negative
                [0x00, 0x00, 0x00, 0x80],  # -0.0
                [0x01, 0x00, 0x00, 0x00],  # smallest f32 subnormal
                [0x00, 0x00, 0x80, 0x7F]]  # +inf
    raw[1, sc:sc + 20] = np.ravel(specials)
    c = fc.index_cache_from_paged_fp8(raw)
    np.testing.assert_array_equal(bits(c.keys), raw[:, :sc].reshape(pages, ps, 128))
    scales = np.asarray(c.scales)
    np.testing.assert_array_equal(bits(scales[:, :ps]),
                                  raw[:, sc:].copy().view("<u4").astype(np.uint32))
    assert (bits(scales[:, ps:]) == 0).all()
    np.testing.assert_array_equal(np.asarray(fc.index_cache_to_paged_fp8(c)), raw)
    c2 = fc.index_cache_from_paged_fp8(raw, page_size=ps)
    np.testing.assert_array_equal(np.asarray(fc.index_cache_to_paged_fp8(c2)), raw)


# ---------------------------------------------------------------------------------------------
# Latent cache: words.

@pytest.mark.parametrize("ps", [16, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_latent_cache_word_layout(ps, dtype):
    rng = np.random.default_rng(4000 + ps + (dtype == jnp.bfloat16))
    pages = 2
    x = varied(rng, (pages, ps, 576), 64)
    xin = jnp.asarray(x).astype(dtype)
    x = np.asarray(xin.astype(jnp.float32))
    c = fc.quantize_latent_cache(xin)
    assert c.words.dtype == jnp.uint32 and c.words.shape == (pages, ps, 256)
    assert c.shape == (pages, ps, 576) and c.num_pages == pages and c.page_size == ps
    codes, s, rope = oracle_latent(x)
    w = np.asarray(c.words)
    np.testing.assert_array_equal(w, np_words(codes, s, rope))
    got_codes, got_rope, got_scales, tail = np_unwords(w)
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_rope, rope)
    np.testing.assert_array_equal(got_scales, bits(s))
    assert (tail == 0).all()
    y = fc.dequantize_latent_cache(c)
    assert y.dtype == jnp.float32 and y.shape == (pages, ps, 576)
    nope = codes.view(E4M3).astype(np.float32) * np.repeat(s, 128, -1)
    expect = np.concatenate([nope, rope.view(BF16).astype(np.float32)], -1)
    np.testing.assert_array_equal(bits(y), bits(expect))


def test_latent_boundary_token_by_hand():
    x = np.zeros((1, 1, 576), np.float32)
    t = x[0, 0]
    t[1] = -0.0  # tile 0: amax exactly 0 -> scale 2**-13; -0.0 keeps its sign (code 0x80)
    t[128] = 448 * 2.0 ** 3  # tile 1: amax exactly 448 * 2**3 -> scale 2**3, code 448
    t[129] = 8.0  # -> 1.0, code 0x38
    t[256] = -448 * 2.0 ** -5  # tile 2: amax 448 * 2**-5 (negative) -> 2**-5, code -448
    t[257] = 2.0 ** -13  # -> 2**-8 = 2 * 2**-9, e4m3 subnormal code 0x02
    t[384] = np.nextafter(np.float32(448 * 4.0), np.float32(1e9))  # tile 3: just above 448*4
    t[385] = -3.0  # scale 2**3: -0.375 = -1.5 * 2**-2 -> code 0x80 | (5 << 3) | 4 = 0xAC
    rope_bits = np.zeros(64, np.uint16)
    rope_bits[:6] = [0x8000, 0x0001, 0x8003, 0x3F80, 0xC000, 0x007F]  # -0, subnormals, 1, -2
    rope_bits[32:35] = [0x0001, 0x8000, 0x4049]  # 2**-133, -0.0, 3.140625
    t[512:] = rope_bits.view(BF16).astype(np.float32)
    c = fc.quantize_latent_cache(x)
    w = np.asarray(c.words)[0, 0]
    assert w[0] == 0x76FE7E00  # features 0, 128, 256, 384 -> bytes 0..3 of word 0
    assert w[1] == 0xAC023880  # features 1, 129, 257, 385
    assert (w[2:128] == 0).all()
    assert w[128] == 0x00018000 and w[129] == 0x80000001 and w[130] == 0x40498003
    assert w[131] == 0x3F80 and w[132] == 0xC000 and w[133] == 0x007F
    assert (w[134:160] == 0).all()
    assert list(w[160:164]) == [0x39000000, 0x41000000, 0x3D000000, 0x41000000]
    assert (w[164:] == 0).all()
    codes, s, rope = oracle_latent(x)
    np.testing.assert_array_equal(w, np_words(codes, s, rope)[0, 0])
    np.testing.assert_array_equal(rope[0, 0], rope_bits)
    y = np.asarray(fc.dequantize_latent_cache(c))[0, 0]
    assert y[0] == 0 and not np.signbit(y[0]) and y[1] == 0 and np.signbit(y[1])
    assert y[128] == 3584 and y[129] == 8 and y[256] == -14 and y[257] == 2.0 ** -13
    assert y[384] == 1792 and y[385] == -3
    np.testing.assert_array_equal(bits(y[512:]), rope_bits.astype(np.uint32) << 16)
    b = np.asarray(fc.latent_cache_to_flashmla(c))[0, 0]
    assert list(b[:2]) == [0x00, 0x80] and b[128] == 0x7E and b[256] == 0xFE
    assert list(b[512:528]) == [0, 0, 0, 0x39, 0, 0, 0, 0x41, 0, 0, 0, 0x3D, 0, 0, 0, 0x41]
    assert list(b[528:532]) == [0x00, 0x80, 0x01, 0x00] and list(b[592:594]) == [0x01, 0x00]


# ---------------------------------------------------------------------------------------------
# Latent cache: FlashMLA bytes.

def test_latent_flashmla_bytes_layout_and_round_trip():
    rng = np.random.default_rng(5)
    x = varied(rng, (3, 16, 576), 64)
    c = fc.quantize_latent_cache(x)
    b = fc.latent_cache_to_flashmla(c)
    assert b.dtype == jnp.uint8 and b.shape == (3, 16, 656)
    np.testing.assert_array_equal(np.asarray(b), np_flashmla(*oracle_latent(x)))
    back = fc.latent_cache_from_flashmla(b)
    assert back.words.dtype == jnp.uint32 and back.words.shape == (3, 16, 256)
    np.testing.assert_array_equal(np.asarray(back.words), np.asarray(c.words))


def test_latent_flashmla_random_bytes_survive_bit_exactly():
    rng = np.random.default_rng(6)
    raw = random_u8(rng, (2, 8, 656))
    raw[0, 0, :4] = [0x7F, 0xFF, 0x80, 0x00]  # e4m3 NaN codes, -0.0, +0.0
    raw[0, 0, 512:528] = [0x01, 0x00, 0xC0, 0x7F,  # quiet NaN with a payload
                          0x01, 0x00, 0x80, 0xFF,  # signalling NaN
                          0x00, 0x00, 0x00, 0x80,  # -0.0
                          0x01, 0x00, 0x00, 0x00]  # f32 subnormal
    raw[0, 0, 528:536] = [0xC1, 0xFF, 0x00, 0x80, 0x81, 0x7F, 0x01, 0x00]  # bf16 NaNs, -0, sub
    c = fc.latent_cache_from_flashmla(raw)
    w = np.asarray(c.words)
    codes, rope, scale_bits, tail = np_unwords(w)
    np.testing.assert_array_equal(codes, raw[..., :512])
    np.testing.assert_array_equal(scale_bits, raw[..., 512:528].copy().view("<u4"))
    np.testing.assert_array_equal(rope, raw[..., 528:].copy().view("<u2"))
    assert (tail == 0).all()
    np.testing.assert_array_equal(np.asarray(fc.latent_cache_to_flashmla(c)), raw)


# ---------------------------------------------------------------------------------------------
# Row writes and page gathers.

@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_write_index_rows(scale_fmt):
    rng = np.random.default_rng(7 + (scale_fmt is None))
    pages, ps = 3, 64
    cache = random_index_cache(rng, pages, ps)
    keys0, scales0 = bits(cache.keys).copy(), bits(cache.scales).copy()
    page_id = np.array([2, 0, 3, 1, 2, 3, 0], np.int32)  # 3 == num_pages: dropped
    offset = np.array([63, 0, 5, 17, 0, 40, 33], np.int32)
    rows = varied(rng, (page_id.size, 128), 128)
    out = fc.write_index_rows(cache, jnp.asarray(page_id), jnp.asarray(offset), rows,
                              scale_fmt=scale_fmt)
    assert isinstance(out, fc.Fp8IndexCache)
    assert out.keys.shape == cache.keys.shape and out.scales.shape == cache.scales.shape
    codes, s = oracle_index(rows, scale_fmt)
    want_k, want_s = keys0.copy(), scales0.copy()
    for t in range(page_id.size):
        if page_id[t] < pages:
            want_k[page_id[t], offset[t]] = codes[t]
            want_s[page_id[t], offset[t]] = bits(s[t])
    np.testing.assert_array_equal(bits(out.keys), want_k)
    np.testing.assert_array_equal(bits(out.scales), want_s)  # padding lanes untouched too
    assert (want_k != keys0).any(axis=-1).sum() >= 4  # the check is not vacuous


def test_write_latent_rows():
    rng = np.random.default_rng(9)
    pages, ps = 3, 16
    words0 = random_u32(rng, (pages, ps, 256))  # junk everywhere, the zero tail included
    cache = fc.Fp8LatentCache(jnp.asarray(words0))
    page_id = np.array([1, 3, 0, 2, 3, 1], np.int32)
    offset = np.array([15, 2, 0, 7, 9, 3], np.int32)
    rows = jnp.asarray(varied(rng, (page_id.size, 576), 64)).astype(jnp.bfloat16)
    out = fc.write_latent_rows(cache, jnp.asarray(page_id), jnp.asarray(offset), rows)
    assert isinstance(out, fc.Fp8LatentCache) and out.words.shape == (pages, ps, 256)
    want = words0.copy()
    new = np_words(*oracle_latent(np.asarray(rows.astype(jnp.float32))))
    for t in range(page_id.size):
        if page_id[t] < pages:
            want[page_id[t], offset[t]] = new[t]
    np.testing.assert_array_equal(np.asarray(out.words), want)


def test_gather_index_pages():
    rng = np.random.default_rng(10)
    pages, ps = 4, 32
    cache = random_index_cache(rng, pages, ps)
    page_ids = np.array([2, 4, 0, 2, 4, 3], np.int32)  # 4 == num_pages: zeros
    k8, scale = fc.gather_index_pages(cache, jnp.asarray(page_ids))
    assert k8.dtype == jnp.float8_e4m3fn and k8.shape == (page_ids.size * ps, 128)
    assert scale.dtype == jnp.float32 and scale.shape == (page_ids.size * ps,)
    kb, sb = bits(cache.keys), bits(cache.scales)
    want_k = np.zeros((page_ids.size, ps, 128), np.uint8)
    want_s = np.zeros((page_ids.size, ps), np.uint32)
    for n, p in enumerate(page_ids):
        if p < pages:
            want_k[n], want_s[n] = kb[p], sb[p, :ps]
    np.testing.assert_array_equal(bits(k8), want_k.reshape(-1, 128))
    np.testing.assert_array_equal(bits(scale), want_s.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Pytrees and jit.

def test_pytrees_pass_through_jit():
    rng = np.random.default_rng(13)
    ic = fc.quantize_index_cache(varied(rng, (2, 64, 128), 128))
    lc = fc.quantize_latent_cache(varied(rng, (3, 16, 576), 64))
    leaves = jax.tree_util.tree_leaves(ic)
    assert len(leaves) == 2 and leaves[0] is ic.keys and leaves[1] is ic.scales
    (only,) = jax.tree_util.tree_leaves(lc)
    assert only is lc.words
    for c, shape in ((ic, (2, 64, 128)), (lc, (3, 16, 576))):
        again = jax.jit(lambda c: c)(c)
        assert type(again) is type(c) and again.shape == shape
        assert (again.num_pages, again.page_size) == shape[:2]
        for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(c),
                        strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(bits(a), bits(b))
    np.testing.assert_array_equal(bits(jax.jit(fc.dequantize_index_cache)(ic)),
                                  bits(fc.dequantize_index_cache(ic)))
    np.testing.assert_array_equal(bits(jax.jit(fc.dequantize_latent_cache)(lc)),
                                  bits(fc.dequantize_latent_cache(lc)))
    rows = varied(rng, (2, 128), 128)
    ids, offs = jnp.asarray([1, 0], jnp.int32), jnp.asarray([3, 60], jnp.int32)
    jw = jax.jit(fc.write_index_rows)(ic, ids, offs, rows)
    ew = fc.write_index_rows(ic, ids, offs, rows)
    np.testing.assert_array_equal(bits(jw.keys), bits(ew.keys))
    np.testing.assert_array_equal(bits(jw.scales), bits(ew.scales))
    lrows = varied(rng, (2, 576), 64)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(fc.write_latent_rows)(lc, ids, offs % 16, lrows).words),
        np.asarray(fc.write_latent_rows(lc, ids, offs % 16, lrows).words))


def test_empty_caches_and_bytes_per_token():
    ic = fc.empty_index_cache(2, 96)
    assert ic.keys.shape == (2, 96, 128) and ic.scales.shape == (2, 128)
    assert ic.keys.dtype == jnp.float8_e4m3fn and ic.scales.dtype == jnp.float32
    assert (bits(ic.keys) == 0).all() and (bits(ic.scales) == 0).all()
    lc = fc.empty_latent_cache(3, 5)
    assert lc.words.shape == (3, 5, 256) and lc.words.dtype == jnp.uint32
    assert (np.asarray(lc.words) == 0).all() and lc.shape == (3, 5, 576)
    assert [fc.scale_lanes(p) for p in (32, 64, 128, 160, 256)] == [128, 128, 128, 256, 256]
    assert [fc.index_bytes_per_token(p) for p in (32, 64, 128, 256)] == [144, 136, 132, 132]


# ---------------------------------------------------------------------------------------------
# Bad input.

def _index(ps=64, pages=2, keys_dtype=jnp.float8_e4m3fn, dim=128, lanes=None):
    return fc.Fp8IndexCache(jnp.zeros((pages, ps, dim), keys_dtype),
                            jnp.zeros((pages, fc.scale_lanes(ps) if lanes is None else lanes),
                                      jnp.float32))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: fc.quantize_index_cache(np.ones((2, 48, 128), np.float32)), ValueError,
     r"multiple of 32 .*=48 \(48 % 32 = 16\)"),
    (lambda: fc.quantize_index_cache(np.ones((2, 64, 128), np.float16)), ValueError,
     "float16"),
    (lambda: fc.quantize_index_cache(np.ones((64, 128), np.float32)), ValueError,
     r"keys must be \[\.\.\., num_pages, page_size, D\] \(rank >= 3\), got rank 2"),
    (lambda: fc.check_index_cache("c", _index(keys_dtype=jnp.bfloat16)), ValueError,
     "c.keys must have dtype float8_e4m3fn, got bfloat16"),
    (lambda: fc.check_index_cache("c", _index(dim=64)), ValueError,
     r"c.keys.shape\[2\] must equal .* = 128, got 64"),
    (lambda: fc.check_index_cache("c", _index(ps=64, lanes=64)), ValueError,
     r"c.scales must have shape .* \(2, 128\) .* got \(2, 64\)"),
    (lambda: fc.check_index_cache("c", _index(ps=40)), ValueError, r"=40 \(40 % 32 = 8\)"),
    (lambda: fc.check_index_cache("c", fc.Fp8LatentCache(jnp.zeros((1, 2, 256), jnp.uint32))),
     TypeError, "c must be an Fp8IndexCache, got Fp8LatentCache"),
    (lambda: fc.dequantize_index_cache(_index(keys_dtype=jnp.bfloat16)), ValueError,
     "cache.keys must have dtype float8_e4m3fn"),
    (lambda: fc.check_latent_cache("c", fc.Fp8LatentCache(jnp.zeros((2, 4, 384), jnp.uint32))),
     ValueError, r"c.words.shape\[2\] must equal .* = 256, got 384"),
    (lambda: fc.check_latent_cache("c", fc.Fp8LatentCache(jnp.zeros((2, 4, 256), jnp.int32))),
     ValueError, "c.words must have dtype uint32, got int32"),
    (lambda: fc.check_latent_cache("c", np.zeros((2, 4, 256), np.uint32)), TypeError,
     "c must be an Fp8LatentCache, got ndarray"),
    (lambda: fc.latent_cache_to_flashmla(fc.Fp8LatentCache(jnp.zeros((2, 4, 384), jnp.uint32))),
     ValueError, "= 256, got 384"),
    (lambda: fc.index_cache_from_paged_fp8(np.zeros((2, 32 * 132 + 5), np.uint8)), ValueError,
     r"b.shape\[1\] = 4229 is not a multiple of 132"),
    (lambda: fc.index_cache_from_paged_fp8(np.zeros((2, 32 * 132), np.uint8), page_size=64),
     ValueError, r"b.shape\[1\] = 4224 must equal page_size \* 132 = 8448"),
    (lambda: fc.index_cache_from_paged_fp8(np.zeros((2, 48 * 132), np.uint8)), ValueError,
     r"=48 \(48 % 32 = 16\)"),
    (lambda: fc.latent_cache_from_flashmla(np.zeros((2, 4, 655), np.uint8)), ValueError,
     r"b.shape\[-1\] must equal .* = 656, got 655"),
    (lambda: fc.latent_cache_from_flashmla(np.zeros((4, 656), np.uint8)), ValueError,
     "b must have rank 3, got rank 2"),
    (lambda: fc.quantize_latent_cache(np.ones((2, 4, 575), np.float32)), ValueError,
     r"= 576, got 575"),
    (lambda: fc.empty_index_cache(2, 100), ValueError, r"=100 \(100 % 32 = 4\)"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("width", [1000, 100])
def test_paged_bytes_width_not_multiple_of_132_names_the_width(width):
    with pytest.raises(ValueError, match=rf"b.shape\[1\] = {width} is not a multiple of 132"):
        fc.index_cache_from_paged_fp8(np.zeros((2, width), np.uint8))


def test_write_index_rows_drops_offsets_outside_the_page_and_negative_ids():
    """An offset in [page_size, scale_lanes) must not land in the scale row's padding lanes, and
    a negative page id must not wrap around to the last page."""
    rng = np.random.default_rng(41)
    c = fc.quantize_index_cache(rng.normal(size=(2, 64, 128)).astype(np.float32))
    rows = rng.normal(size=(3, 128)).astype(np.float32)
    c2 = fc.write_index_rows(c, jnp.array([0, 1, -1]), jnp.array([100, -1, 3]), rows)
    assert np.array_equal(bits(c2.scales), bits(c.scales))
    assert np.array_equal(bits(c2.keys), bits(c.keys))
    lat = fc.quantize_latent_cache(rng.normal(size=(2, 16, 576)).astype(np.float32))
    lat2 = fc.write_latent_rows(lat, jnp.array([0, -1]), jnp.array([16, 2]),
                                rng.normal(size=(2, 576)).astype(np.float32))
    assert np.array_equal(np.asarray(lat2.words), np.asarray(lat.words))


def test_whole_cache_quantizers_keep_leading_layer_dims():
    # A stacked [L, P, ps, D] cache quantizes as each layer on its own (dsa_jax's to_cache).
    rng = np.random.default_rng(31)
    keys = rng.standard_normal((2, 3, 32, 128)).astype(np.float32) * 3
    latent = rng.standard_normal((2, 3, 32, 576)).astype(np.float32)
    stacked_i, stacked_l = fc.quantize_index_cache(keys), fc.quantize_latent_cache(latent)
    for layer in range(2):
        one_i, one_l = fc.quantize_index_cache(keys[layer]), fc.quantize_latent_cache(latent[layer])
        for a, b in ((stacked_i.keys[layer], one_i.keys), (stacked_i.scales[layer], one_i.scales),
                     (stacked_l.words[layer], one_l.words)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                          np.asarray(b).view(np.uint8))
