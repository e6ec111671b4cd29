"""reference.v4_cache: FlashMLA's MODEL1 fp8 rule, the TPU words, the FlashMLA page bytes.

Every expected value is built in NumPy from the module docstring's description and FlashMLA's
``tests/quant.py`` rule, never with the module's own helpers. The oracle: amax in float64, the
scale ``2**ceil(log2(max(amax / 448, 1e-4)))`` exactly from ``np.frexp`` (the float64 quotient of
an f32 amax is a power of two exactly when the true one is), ``x / s`` exact in float64 (``s`` a
power of two) then rounded once to f32, e4m3 and bf16 casts from ``ml_dtypes`` (RNE).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_fp8 import varied

from reference import attend
from reference import v4_cache as vc

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


# ---------------------------------------------------------------------------------------------
# NumPy oracle.

def pow2_ceil(q) -> np.ndarray:
    m, e = np.frexp(np.asarray(q, np.float64))  # q = m * 2**e, m in [0.5, 1)
    return np.where(m == 0.5, np.ldexp(1.0, e - 1), np.ldexp(1.0, e))


def oracle(x):
    """f32 ``x[..., 512]`` -> (codes u8[..., 448], s float64[..., 7], scale bytes u8[..., 7],
    rope bits u16[..., 64])."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    tiles = x[..., :448].astype(np.float64).reshape(*lead, 7, 64)
    s = pow2_ceil(np.maximum(np.abs(tiles).max(-1) / 448, 1e-4))
    y = np.clip((tiles / s[..., None]).astype(np.float32), -448, 448)
    codes = y.astype(E4M3).view(np.uint8).reshape(*lead, 448)
    sbytes = (np.frexp(s)[1] - 1 + 127).astype(np.uint8)  # s = 2**(e - 1)
    return codes, s, sbytes, x[..., 448:].astype(BF16).view(np.uint16)


def np_row_words(codes, sbytes, rope_bits) -> np.ndarray:
    """The docstring's gathered-token words ``u32[..., 160]``, built byte by byte."""
    lead = codes.shape[:-1]
    record = np.zeros((*lead, 512), np.uint8)
    record[..., :448] = codes
    record[..., 448:455] = sbytes
    w = np.zeros((*lead, 160), np.uint32)
    for b in range(512):  # record byte b -> byte b // 128 of word b % 128
        w[..., b % 128] |= record[..., b].astype(np.uint32) << np.uint32(8 * (b // 128))
    r = rope_bits.astype(np.uint32)
    w[..., 128:] = r[..., :32] | (r[..., 32:] << np.uint32(16))
    return w


def np_cache(words) -> tuple[np.ndarray, np.ndarray]:
    """``u32[..., P, ps, 160]`` -> (nope u32[..., P, ps, 128], rope u32[..., P, ceil(ps/4), 128]):
    token r's rope words at row r // 4, lanes 32 (r % 4) + i."""
    *lead, ps, _ = words.shape
    rope = np.zeros((*lead, -(-ps // 4), 128), np.uint32)
    for r in range(ps):
        rope[..., r // 4, 32 * (r % 4):32 * (r % 4) + 32] = words[..., r, 128:]
    return words[..., :128], rope


def np_flashmla(codes, sbytes, rope_bits) -> np.ndarray:
    """FlashMLA MODEL1 pages from ``[P, ps, ...]`` parts, as ``quantize_k_cache`` lays them."""
    p, ps, _ = codes.shape
    size = -(-ps * 584 // 576) * 576
    out = np.zeros((p, size), np.uint8)
    rope_bytes = np.asarray(rope_bits, "<u2").view(np.uint8).reshape(p, ps, 128)
    for r in range(ps):
        out[:, 576 * r:576 * r + 448] = codes[:, r]
        out[:, 576 * r + 448:576 * r + 576] = rope_bytes[:, r]
        out[:, 576 * ps + 8 * r:576 * ps + 8 * r + 7] = sbytes[:, r]
    return out


def np_dequant(codes, s, rope_bits) -> np.ndarray:
    """float64 values: ``bf16(e4m3 * s)`` per tile, then the rope."""
    lead = codes.shape[:-1]
    v = codes.view(E4M3).astype(np.float64).reshape(*lead, 7, 64) * s[..., None]
    nope = v.reshape(*lead, 448).astype(BF16).astype(np.float64)
    return np.concatenate([nope, rope_bits.view(BF16).astype(np.float64)], axis=-1)


def u32(a) -> np.ndarray:
    return np.asarray(a, np.uint32)


def check_cache_equals(cache, words):
    nope, rope = np_cache(words)
    np.testing.assert_array_equal(u32(cache.nope), nope)
    np.testing.assert_array_equal(u32(cache.rope), rope)


# ---------------------------------------------------------------------------------------------
# The rule.

def test_quantizer_matches_the_oracle_on_varied_magnitudes():
    x = varied(np.random.default_rng(0), (96, 512), 64)
    x[:8, :448] *= 1e-6  # every tile below the scale floor
    nope8, s, rope = vc.quantize_v4_fp8(x)
    codes, s_want, _, rope_want = oracle(x)
    np.testing.assert_array_equal(np.asarray(nope8).view(np.uint8), codes)
    np.testing.assert_array_equal(np.asarray(s, np.float64), s_want)
    np.testing.assert_array_equal(np.asarray(rope).view(np.uint16), rope_want)
    assert np.all(np.asarray(s)[:8] == 2.0 ** -13)
    # bf16 input is read exactly
    xb = jnp.asarray(x, jnp.bfloat16)
    got = vc.quantize_v4_rows(xb)
    want = np_row_words(*(oracle(np.asarray(xb, np.float32))[i] for i in (0, 2, 3)))
    np.testing.assert_array_equal(u32(got), want)


def hand_rows() -> np.ndarray:
    """Rows built to hit the rule's edges (see the comments)."""
    rows = np.zeros((10, 512), np.float32)  # row 0: all zero
    rows[1, 63] = 1000.0  # the last lane of tile 0 ...
    rows[1, 64] = 1.0  # ... and the first of tile 1: separate scales
    rows[2, 447] = -3.0  # the last nope lane (tile 6)
    rows[2, 448] = 1e30  # the first rope lane: no effect on any scale
    rows[3, 5] = 448.0 * 2.0 ** -3  # amax exactly 448 * 2**k: s = 2**k, code 448
    rows[3, 70] = -448.0 * 2.0 ** 7
    rows[3, 130] = np.nextafter(np.float32(448.0), np.float32(1e9))  # just above: s = 2
    rows[4, :448] = -np.linspace(0.5, 7.0, 448)  # negative values
    rows[4, 3] = -0.0
    rows[5, 0] = 448.0  # s = 1: e4m3 subnormals m * 2**-9 and their RNE ties
    rows[5, 1:8] = np.array([2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -10, 5 * 2.0 ** -11,
                             2.0 ** -7 + 2.0 ** -10, 1e-40, -3 * 2.0 ** -10])
    rows[6, :448] = 1e-40  # f32 subnormals: below the floor, codes 0
    rows[7, 200] = 448.0 * 1e-4  # amax / 448 = 1e-4: the floor itself
    rows[8, :448] = np.float32(3.0e38)  # huge: s = 2**120
    rows[9, 448:] = np.linspace(-1, 1, 64) * np.float32(1 + 2.0 ** -9)  # rope rounds to bf16
    return rows


def test_hand_cases_at_tile_edges_zeros_subnormals_and_powers_of_two():
    x = hand_rows()
    got = u32(vc.quantize_v4_rows(x))
    codes, s, sbytes, rope = oracle(x)
    np.testing.assert_array_equal(got, np_row_words(codes, sbytes, rope))
    assert np.all(s[0] == 2.0 ** -13) and np.all(codes[0] == 0) and np.all(sbytes[0] == 114)
    assert s[1, 0] == 4.0 and s[1, 1] == 2.0 ** -8  # 1000 / 448 -> 4; 1 / 448 -> 2**-8
    assert codes[1, 63] == 0x78 and codes[1, 64] == 0x78  # 1000 / 4 = 250 -> 256; 1 / 2**-8
    assert s[2, 6] == 2.0 ** -7 and np.all(s[2, :6] == 2.0 ** -13)
    assert s[3, 0] == 2.0 ** -3 and codes[3, 5] == 0x7E  # 448 exactly
    assert s[3, 1] == 2.0 ** 7 and codes[3, 70] == 0xFE  # -448
    assert s[3, 2] == 2.0  # amax a hair above 448: the next power of two
    assert codes[4, 3] == 0x80  # -0.0 keeps its sign
    assert list(codes[5, 1:8]) == [0x01, 0x02, 0x00, 0x01, 0x04, 0x00, 0x82]  # RNE in subnormals
    assert np.all(codes[6] == 0)
    assert s[7, 3] == 2.0 ** -13 and codes[7, 200] == 0x7B  # 0.0448 / 2**-13 = 367.0 -> 352
    assert s[8, 0] == 2.0 ** 120 and sbytes[8, 0] == 247
    np.testing.assert_array_equal(np.asarray(vc.dequantize_v4_rows(got), np.float64),
                                  np_dequant(codes, s, rope))


def test_non_finite_tiles_decode_to_nan():
    x = np.ones((2, 512), np.float32)
    x[0, 10] = np.nan
    x[1, 100] = np.inf
    words = u32(vc.quantize_v4_rows(x))
    back = np.asarray(vc.dequantize_v4_rows(words), np.float32)
    assert np.all(np.isnan(back[0, :64])) and np.all(back[0, 64:] == 1.0)
    assert np.all(np.isnan(back[1, 64:128])) and np.all(back[1, 128:] == 1.0)


@pytest.mark.parametrize("lead,ps", [((3,), 64), ((2,), 6), ((2, 3), 4), ((1,), 1)])
def test_cache_words_match_the_layout(lead, ps):
    rng = np.random.default_rng(ps)
    x = varied(rng, (*lead, ps, 512), 64)
    cache = vc.quantize_v4_cache(x)
    assert cache.shape == (*lead, ps, 512)
    assert cache.num_pages == lead[-1] and cache.page_size == ps
    codes, s, sbytes, rope = oracle(x)
    words = np_row_words(codes, sbytes, rope)
    check_cache_equals(cache, words)
    want = np_dequant(codes, s, rope)
    got = vc.dequantize_v4_cache(cache)
    assert got.dtype == jnp.bfloat16 and got.shape == (*lead, ps, 512)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    # gathered rows: the same words, zeros outside
    n = int(np.prod(lead)) * ps
    slots = np.array([n - 1, 0, -1, n, n // 2], np.int32)
    rows = u32(vc.gather_v4_rows(cache, slots))
    flat = words.reshape(n, 160)
    np.testing.assert_array_equal(rows[[0, 1, 4]], flat[[n - 1, 0, n // 2]])
    assert not rows[[2, 3]].any()
    # a pytree: through jit unchanged
    again = jax.jit(lambda c: c)(cache)
    np.testing.assert_array_equal(u32(again.rope), u32(cache.rope))


def test_dequantize_error_bound():
    x = varied(np.random.default_rng(3), (64, 512), 64)
    got = np.asarray(vc.dequantize_v4_cache(vc.quantize_v4_cache(x[None, :, None])),
                     np.float64)[0, :, 0]
    s = oracle(x)[1]
    err = np.abs(got[:, :448] - x[:, :448]).reshape(64, 7, 64)
    # e4m3: half an ulp is <= |v| / 16 for normals, 2**-10 * s in the subnormals
    bound = np.maximum(np.abs(x[:, :448]).reshape(64, 7, 64) / 16, 2.0 ** -10 * s[..., None])
    assert np.all(err <= bound)
    assert np.all(err.max(-1) <= np.abs(x[:, :448]).reshape(64, 7, 64).max(-1) / 14 + 1e-30)
    np.testing.assert_array_equal(got[:, 448:], x[:, 448:].astype(BF16).astype(np.float64))


# ---------------------------------------------------------------------------------------------
# FlashMLA MODEL1 pages.

@pytest.mark.parametrize("ps", [64, 2, 3])
def test_flashmla_pages_bit_exact_both_ways(ps):
    rng = np.random.default_rng(10 + ps)
    x = varied(rng, (3, ps, 512), 64)
    cache = vc.quantize_v4_cache(x)
    codes, _, sbytes, rope = oracle(x)
    want = np_flashmla(codes, sbytes, rope)
    assert want.shape[1] == vc.flashmla_page_bytes(ps) and want.shape[1] % 576 == 0
    got = np.asarray(vc.v4_cache_to_flashmla(cache))
    np.testing.assert_array_equal(got, want)
    back = vc.v4_cache_from_flashmla(want, ps)
    check_cache_equals(back, np_row_words(codes, sbytes, rope))
    unpadded = vc.v4_cache_from_flashmla(want[:, :584 * ps], page_size=ps)
    np.testing.assert_array_equal(u32(unpadded.nope), u32(back.nope))
    # arbitrary bytes (NaN codes and scales, junk pad): every meaningful byte survives
    junk = rng.integers(0, 256, want.shape, dtype=np.uint8)
    again = np.asarray(vc.v4_cache_to_flashmla(vc.v4_cache_from_flashmla(junk, ps)))
    meaningful = np.zeros(want.shape[1], bool)
    meaningful[:576 * ps] = True
    for r in range(ps):
        meaningful[576 * ps + 8 * r:576 * ps + 8 * r + 7] = True
    np.testing.assert_array_equal(again[:, meaningful], junk[:, meaningful])
    assert not again[:, ~meaningful].any()


def test_page_bytes_match_flashmla_sizes():
    # FlashMLA's test allocates ceil(ps * 584 / 576) * 576 bytes per block
    assert vc.flashmla_page_bytes(64) == 37440 and vc.flashmla_page_bytes(256) == 149760
    assert vc.flashmla_page_bytes(2) == 1728 and vc.flashmla_page_bytes(1) == 1152


# ---------------------------------------------------------------------------------------------
# The row writer.

def test_write_rows_unstacked_drops_out_of_range_slots():
    rng = np.random.default_rng(20)
    pages, ps = 3, 6
    base = varied(rng, (pages, ps, 512), 64)
    cache = vc.quantize_v4_cache(base)
    rows = varied(rng, (6, 512), 64)
    slots = np.array([0, 7, 17, -1, pages * ps, 2 ** 30], np.int32)
    got = vc.write_v4_rows(cache, slots, rows)
    want = base.reshape(pages * ps, 512).copy()
    want[[0, 7, 17]] = rows[:3]
    codes, _, sbytes, rope = oracle(want.reshape(pages, ps, 512))
    check_cache_equals(got, np_row_words(codes, sbytes, rope))


def test_write_rows_sharing_a_rope_row_all_land():
    """Tokens of one call on one rope row (consecutive offsets, any order, a partial last row)
    each land in their own quarter; the other tokens of the page keep their words."""
    rng = np.random.default_rng(22)
    pages, ps = 2, 6  # rope rows per page: offsets 0-3 and 4-5
    base = varied(rng, (pages, ps, 512), 64)
    cache = vc.quantize_v4_cache(base)
    rows = varied(rng, (8, 512), 64)
    slots = np.array([5, 1, 0, 3, 2, 4, -1, 10], np.int32)  # page 0 whole, then 10 on page 1
    got = vc.write_v4_rows(cache, slots, rows)
    want = base.reshape(pages * ps, 512).copy()
    keep = slots >= 0
    want[slots[keep]] = rows[keep]
    codes, _, sbytes, rope = oracle(want.reshape(pages, ps, 512))
    check_cache_equals(got, np_row_words(codes, sbytes, rope))


def test_write_rows_stacked_by_layer_and_flat():
    rng = np.random.default_rng(21)
    layers, pages, ps = 2, 2, 4
    cache = vc.empty_v4_cache(layers * pages, ps)
    cache = vc.Fp8V4Cache(cache.nope.reshape(layers, pages, ps, 128),
                          cache.rope.reshape(layers, pages, 1, 128))
    rows = varied(rng, (4, 512), 64)
    by_layer = vc.write_v4_rows(cache, np.array([1, 6, 8, -2]), rows, layer=1)
    flat = vc.write_v4_rows(cache, np.array([9, 14, 16, -2]), rows)  # 8 + the layer-1 slots
    want = np.zeros((layers * pages * ps, 512), np.float32)
    want[[9, 14]] = rows[:2]
    codes, _, sbytes, rope = oracle(want.reshape(layers, pages, ps, 512))
    words = np_row_words(codes, sbytes, rope)
    words[~want.reshape(layers, pages, ps, 512).any(-1)] = 0  # untouched slots: zero words
    check_cache_equals(by_layer, words)
    check_cache_equals(flat, words)
    skipped = vc.write_v4_rows(cache, np.array([1]), rows[:1], layer=2)  # no layer 2: dropped
    assert not u32(skipped.nope).any() and not u32(skipped.rope).any()


# ---------------------------------------------------------------------------------------------
# The attend path reads it as its values.

def test_attend_selected_reads_the_v4_cache_as_its_values():
    rng = np.random.default_rng(30)
    pages, ps, heads = 3, 8, 4
    cache = vc.quantize_v4_cache(varied(rng, (pages, ps, 512), 64))
    values = jnp.asarray(vc.dequantize_v4_cache(cache), jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, heads, 512)), jnp.float32)
    slots = jnp.asarray(rng.integers(0, pages * ps, (5, 7)), jnp.int32)
    valid = jnp.asarray(rng.uniform(size=(5, 7)) < 0.8)
    kw = dict(sm_scale=512 ** -0.5, v_dim=512)
    out, lse = attend.attend_selected(q, cache, slots, valid, **kw)
    want_out, want_lse = attend.attend_selected(q, values, slots, valid, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([jnp.zeros_like(a), a]), cache)
    out1, _ = attend.attend_selected(q, stacked, slots, valid, layer=1, **kw)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(want_out))


# ---------------------------------------------------------------------------------------------
# Bad input.

def test_bad_input_is_refused_naming_the_numbers():
    x = np.zeros((2, 4, 512), np.float32)
    with pytest.raises(ValueError, match=r"511"):
        vc.quantize_v4_cache(np.zeros((2, 4, 511), np.float32))
    with pytest.raises(ValueError, match=r"float16"):
        vc.quantize_v4_cache(x.astype(np.float16))
    with pytest.raises(ValueError, match=r"int32"):
        vc.quantize_v4_rows(np.zeros((4, 512), np.int32))
    with pytest.raises(ValueError, match=r"rank >= 3"):
        vc.quantize_v4_cache(x[0])
    cache = vc.quantize_v4_cache(x)
    pages = np.asarray(vc.v4_cache_to_flashmla(cache))  # 4 tokens: 2336 B, padded 2880
    with pytest.raises(ValueError, match=re.escape("pages.shape[-1] = 2880") + ".*page_size = 8"):
        vc.v4_cache_from_flashmla(pages, 8)
    with pytest.raises(ValueError, match=r"uint8"):
        vc.v4_cache_from_flashmla(pages.astype(np.int32), 4)
    with pytest.raises(ValueError, match=r"page_size"):
        vc.v4_cache_from_flashmla(pages, 0)
    with pytest.raises(TypeError, match=r"Fp8V4Cache"):
        vc.dequantize_v4_cache(np.zeros((2, 4, 160), np.uint32))
    with pytest.raises(ValueError, match=r"rope must have shape \(2, 1, 128\).*\(2, 2, 128\)"):
        vc.check_v4_cache("c", vc.Fp8V4Cache(cache.nope, jnp.zeros((2, 2, 128), jnp.uint32)))
    with pytest.raises(ValueError, match=r"nope.shape\[-1\] must be 128 .*got 160"):
        vc.check_v4_cache("c", vc.Fp8V4Cache(jnp.zeros((2, 4, 160), jnp.uint32), cache.rope))
    with pytest.raises(ValueError, match=r"dtype uint32, got int32"):
        vc.check_v4_cache("c", vc.Fp8V4Cache(cache.nope.astype(jnp.int32), cache.rope))
    with pytest.raises(ValueError, match=r"160"):
        vc.dequantize_v4_rows(np.zeros((3, 128), np.uint32))
    with pytest.raises(ValueError, match=r"rows \(3, 512\) and slots \(2,\)"):
        vc.write_v4_rows(cache, np.zeros(2, np.int32), np.zeros((3, 512), np.float32))
    with pytest.raises(ValueError, match=r"stacked"):
        vc.write_v4_rows(cache, np.zeros(1, np.int32), np.zeros((1, 512), np.float32), layer=0)
