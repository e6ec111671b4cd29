"""V4.1's cache formats (``reference.v41.formats``): hand cases at every rounding boundary, a
float64 NumPy oracle written from the definitions for ``decode(encode(x))``, byte layouts and
sizes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from reference.v41 import (
    Mode,
    compressed_kv_bytes,
    decode_compressed_kv,
    decode_index_fp4,
    decode_window_kv,
    encode_compressed_kv,
    encode_index_fp4,
    encode_window_kv,
    index_fp4_bytes,
    resolve_layers,
    v41_flash,
    window_kv_bytes,
)

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---------------------------------------------------------------------------------------------
# The float64 oracle, from the definitions (not from the module's code).

def _e2m1(v):
    """Nearest e2m1 value by distance, ties to the even code; sign kept (also on zero)."""
    a = np.abs(v)[..., None]
    d = np.abs(a - GRID)
    best = d.min(-1, keepdims=True)
    tied = d == best
    even = tied & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), np.argmax(even, -1), np.argmax(tied, -1))
    return np.copysign(GRID[idx], v)


def _e4m3(v):
    """Nearest e4m3fn value (|v| <= 448), ties to even: 3 mantissa bits, min exponent -6."""
    a = np.abs(v)
    e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6)
    step = 2.0 ** (e - 3)
    return np.copysign(np.round(a / step) * step, v)


def _blocks(x, block):
    return np.asarray(x, np.float64).reshape(*np.shape(x)[:-1], -1, block)


def oracle_window(x):
    b = _blocks(x, 32)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float64(np.float32(1e-4)))
    s = 2.0 ** np.ceil(np.log2(amax / 448))
    return (_e4m3(np.clip(b / s, -448, 448)) * s).reshape(np.shape(x))


def oracle_compressed(x):
    b = _blocks(x, 16)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -9)
    s = _e4m3(np.minimum(amax / 6, 448))
    return (_e2m1(np.clip(b / s, -6, 6)) * s).reshape(np.shape(x))


def oracle_index(x):
    b = _blocks(x, 32)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -126)
    s = 2.0 ** np.ceil(np.log2(amax / 6))
    return (_e2m1(np.clip(b / s, -6, 6)) * s).reshape(np.shape(x))


FORMATS = {
    "window": (encode_window_kv, decode_window_kv, oracle_window, 512, 528),
    "compressed": (encode_compressed_kv, decode_compressed_kv, oracle_compressed, 512, 288),
    "index": (encode_index_fp4, decode_index_fp4, oracle_index, 128, 68),
}


def _same(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _round_trip(name, x):
    enc, dec, _, dim, size = FORMATS[name]
    b = np.asarray(enc(x))
    assert b.dtype == np.uint8 and b.shape == np.shape(x)[:-1] + (size * np.shape(x)[-1] // dim,)
    return b, np.asarray(dec(b))


def test_bytes_per_token():
    assert (window_kv_bytes(), compressed_kv_bytes(), index_fp4_bytes()) == (528, 288, 68)
    assert (window_kv_bytes(64), compressed_kv_bytes(64), index_fp4_bytes(32)) == (66, 36, 17)


def test_compressed_footprint_per_context_token_of_v41_flash():
    """Each KV source stores one compressed kv row and one index key per entry, an entry per
    ``ratio`` tokens: 3 ratio-2 pools and 1 ratio-1 pool give 890 B per context token."""
    entry = compressed_kv_bytes() + index_fp4_bytes()
    pools = [p.ratio for p in resolve_layers(v41_flash()) if p.mode is Mode.FULL]
    assert entry == 356 and pools == [2, 2, 2, 1]
    assert sum(entry / r for r in pools) == 890


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_rows_match_the_float64_oracle(name):
    """bf16-valued rows (the kernels' input dtype), each block at its own magnitude; for bf16
    input an f32 quotient never crosses a midpoint the exact one does not, so the oracle's exact
    arithmetic is the official f32 arithmetic."""
    rng = np.random.default_rng(sorted(FORMATS).index(name))
    dim = FORMATS[name][3]
    x = rng.standard_normal((6, dim)) * 2.0 ** rng.integers(-30, 30, (6, dim // 16)).repeat(16, -1)
    x[0, :] = rng.choice(GRID, dim) * rng.choice([-1, 1], dim)  # exact grid points
    x = x.astype(ml_dtypes.bfloat16)
    _, got = _round_trip(name, x)
    _same(got, FORMATS[name][2](x.astype(np.float32)))
    # f32 input: exact for the power-of-two scales; the e4m3-scaled one is checked on bf16 above
    if name != "compressed":
        x32 = rng.standard_normal((3, dim)).astype(np.float32) * np.float32(1e3)
        _same(_round_trip(name, x32)[1], FORMATS[name][2](x32))
    # power-of-two scales: decoded rows are fixed points (an e4m3 scale can move: a block whose
    # top value rounded down to 4 s gets the scale e4m3(4 s / 6) next time)
    if name != "compressed":
        _same(_round_trip(name, got.astype(np.float32))[1], got)


def _bytes_oracle(name, x):
    """The stored bytes from NumPy alone: scales from the float64 definitions, e2m1 / e4m3 codes
    from ``ml_dtypes``' round-to-nearest-even casts, fp4 packed low nibble first."""
    b = _blocks(x, 16 if name == "compressed" else 32)
    amax = np.abs(b).max(-1, keepdims=True)
    if name == "window":
        s = 2.0 ** np.ceil(np.log2(np.maximum(amax, np.float32(1e-4)) / 448))
        codes = (b / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        s_bytes = (np.log2(s[..., 0]) + 127).astype(np.uint8)
        return np.concatenate([codes.reshape(np.shape(x)), s_bytes], axis=-1)
    if name == "compressed":
        s = _e4m3(np.minimum(np.maximum(amax, 6 * 2.0 ** -9) / 6, 448))
        s_bytes = s[..., 0].astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    else:
        s = 2.0 ** np.ceil(np.log2(np.maximum(amax, 6 * 2.0 ** -126) / 6))
        s_bytes = (np.log2(s[..., 0]) + 127).astype(np.uint8)
    y = np.clip(b / s, -6, 6).astype(np.float32).reshape(np.shape(x))
    nib = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return np.concatenate([nib[..., 0::2] | (nib[..., 1::2] << 4), s_bytes], axis=-1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_bytes_match_a_numpy_byte_oracle(name):
    rng = np.random.default_rng(7)
    dim = FORMATS[name][3]
    x = rng.standard_normal((4, dim)) * 2.0 ** rng.integers(-20, 20, (4, dim // 16)).repeat(16, -1)
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(FORMATS[name][0](x)), _bytes_oracle(name, x))


MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
TIES_TO_EVEN = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("name", ["compressed", "index"])
def test_fp4_midpoints_ties_to_even_and_neighbours(name):
    """Scale exactly 1 (amax 6): each midpoint goes to the even code, one f32 ulp either side goes
    to the nearer value; negatives mirror; -0.2 keeps its sign as -0."""
    mids = np.float32(MIDPOINTS)
    above, below = np.nextafter(mids, np.float32(7)), np.nextafter(mids, np.float32(0))
    lo = np.float32([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    hi = np.float32([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    block = 16 if name == "compressed" else 32
    x = np.zeros(32 * 2, np.float32)
    vals = np.concatenate([[6.0], mids, above, below, -mids, [-0.2, -0.0, 0.2]]).astype(np.float32)
    want = np.concatenate([[6.0], TIES_TO_EVEN, hi, lo, -np.float32(TIES_TO_EVEN),
                           [-0.0, -0.0, 0.0]])
    # keep every block's amax at 6: put a 6 at the start of each block
    x[::block] = 6.0
    slots = [i for i in range(x.size) if i % block][:vals.size - 1]
    x[slots] = vals[1:]
    got = FORMATS[name][1](FORMATS[name][0](x[None]))[0]
    _same(np.asarray(got)[slots], want[1:])
    assert np.all(np.asarray(got)[::block] == 6.0)


def test_fp4_nibble_order_and_negative_zero_code():
    x = np.zeros((1, 128), np.float32)
    x[0, :4] = [0.5, 1.0, -0.0, 6.0]
    b = np.asarray(encode_index_fp4(x))[0]
    assert b[0] == (2 << 4) | 1  # feature 0 (0.5, code 1) low, feature 1 (1.0, code 2) high
    assert b[1] == (7 << 4) | 0x8  # feature 2 (-0, 0x8) low, feature 3 (6, code 7) high
    assert b[64] == 127  # ue8m0 byte of scale 2**0 (amax 6)


def _compressed_scale(amax):
    """(scale byte, decoded row) of a 512-wide row whose first block has max |x| = amax."""
    x = np.zeros((1, 512), np.float32)
    x[0, 0] = amax
    b = np.asarray(encode_compressed_kv(x))[0]
    return b[256], np.asarray(decode_compressed_kv(b[None]))[0]


def test_e4m3_scale_rounding():
    e4m3 = lambda v: int(np.float32(v).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))  # noqa: E731
    six = np.float32(6)
    # amax / 6 = 1.0625: midpoint of 1 and 1.125, ties to even -> 1; x / s = 6.375 saturates to 6
    byte, row = _compressed_scale(six * np.float32(1.0625))
    assert byte == e4m3(1.0) == 0x38 and row[0] == 6.0
    # one ulp above the midpoint -> 1.125
    assert _compressed_scale(np.nextafter(six * np.float32(1.0625), np.float32(7)))[0] == 0x39
    # amax / 6 = 1.1875: midpoint of 1.125 and 1.25 -> 1.25 (even mantissa)
    assert _compressed_scale(six * np.float32(1.1875))[0] == e4m3(1.25) == 0x3A
    # subnormal scales (m * 2**-9): 1.5 * 2**-9 ties to 2 * 2**-9
    assert _compressed_scale(six * np.float32(1.5 * 2 ** -9))[0] == 0x02
    # a zero block keeps the smallest subnormal scale 2**-9 and decodes to +0
    byte, row = _compressed_scale(0.0)
    assert byte == 0x01 and not np.any(row) and not np.any(np.signbit(row))
    # saturation: amax / 6 = 500 > 448 -> scale 448 (0x7E), x / s clamps to 6 -> 2688
    byte, row = _compressed_scale(3000.0)
    assert byte == 0x7E and row[0] == 6 * 448


@pytest.mark.parametrize("name,qmax,block", [("window", 448, 32), ("index", 6, 32)])
@pytest.mark.parametrize("k", [-20, 0, 7])
def test_ue8m0_at_and_just_above_powers_of_two(name, qmax, block, k):
    enc, dec, _, dim, size = FORMATS[name]
    x = np.zeros((2, dim), np.float32)
    x[0, 0] = np.float32(qmax * 2.0 ** k)
    x[1, 0] = np.nextafter(x[0, 0], np.float32(np.inf))
    b = np.asarray(enc(x))
    scale_at = dim if name == "window" else dim // 2
    assert list(b[:, scale_at]) == [127 + k, 128 + k]
    got = np.asarray(dec(b))
    # just above: the next scale, and the value rounds down to the top code
    assert got[0, 0] == x[0, 0] and got[1, 0] == np.float32(qmax * 2.0 ** k)


def test_zero_blocks_and_negative_zero():
    # 2**-22 = pow2ceil(1e-4 / 448); 2**-126 = pow2ceil(6 * 2**-126 / 6)
    for name, byte in (("window", 127 - 22), ("index", 1)):
        enc, dec, _, dim, _ = FORMATS[name]
        x = np.zeros((1, dim), np.float32)
        x[0, 1] = -0.0
        b = np.asarray(enc(x))
        assert b[0, dim if name == "window" else dim // 2] == byte
        got = np.asarray(dec(b))
        assert not np.any(got) and list(np.flatnonzero(np.signbit(got[0]))) == [1]
    assert np.asarray(encode_window_kv(np.full((1, 512), -0.0, np.float32)))[0, 0] == 0x80


def test_nan_poisons_only_its_block():
    for name, (enc, dec, _, dim, _) in FORMATS.items():
        block = 16 if name == "compressed" else 32
        x = np.ones((1, dim), np.float32)
        clean = np.asarray(dec(enc(x)))[0]
        x[0, 3] = np.nan
        got = np.asarray(dec(enc(x)))[0]
        assert np.all(np.isnan(got[:block])), name
        np.testing.assert_array_equal(got[block:], clean[block:])


def test_e4m3_scale_division_equals_reciprocal_multiply_for_every_bf16_amax():
    """The official compressed-kv scale is ``e4m3(amax / 6)``; V4-style code multiplies by
    ``f32(1/6)``. Over every positive finite bf16 amax (after the 6 * 2**-9 floor) the two give
    the same e4m3 byte, so the reading does not matter for bf16 input."""
    a = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    a = np.maximum(a, np.float32(6 * 2 ** -9))
    e = lambda q: np.minimum(q, np.float32(448)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(e(a / np.float32(6)), e(a * np.float32(1 / 6)))


def test_refusals():
    with pytest.raises(ValueError, match="dtype float16"):
        encode_window_kv(np.zeros((1, 512), np.float16))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] = 40 is not a multiple of the block"):
        encode_compressed_kv(np.zeros((1, 40), np.float32))
    with pytest.raises(ValueError, match=r"b.shape\[-1\] = 70 is not a positive multiple of 17"):
        decode_index_fp4(np.zeros((1, 70), np.uint8))
    with pytest.raises(ValueError, match="b must have dtype uint8, got dtype int8"):
        decode_window_kv(np.zeros((1, 528), np.int8))


def test_every_fp4_byte_decodes_to_its_two_grid_values():
    """All 256 packed bytes: low nibble feature ``2i``, high ``2i + 1``, each ``sign << 3 |
    code`` read as ``+-E2M1_GRID[code]`` (0x8 is -0.0), with a unit scale."""
    from reference.v41 import formats as f

    packed = np.arange(256, dtype=np.uint8)[None]
    got = np.asarray(f._unpack_values(packed))[0]
    grid = np.asarray(f.E2M1_GRID, np.float32)
    for b in range(256):
        for nib, value in ((b & 0xF, got[2 * b]), (b >> 4, got[2 * b + 1])):
            want = -grid[nib & 7] if nib & 8 else grid[nib & 7]
            assert value == want and np.signbit(value) == bool(nib & 8), (b, nib, value)
