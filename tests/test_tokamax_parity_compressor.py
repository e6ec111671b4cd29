"""``dsa_jax.engines.tokamax.compressor`` against tokamax 0.0.17 itself (``implementation="xla"``,
CPU), on the same inputs in all three modes (``tests/test_engines_tokamax_compressor.py``'s
cases: NaN in every state no stored entry reads): the signatures match; ``proj_and_save_state``
writes the same state bytes exactly; ``dsv4_compressor`` writes the same bytes everywhere except
where a stored bf16 / e4m3 code is the neighbour of tokamax's and this package's f32 value lies
within ``TOL`` of the rounding midpoint between the two codes. Why: the pooled sum, the softmax
and the norm's mean are the same operations, summed by fixed trees here and by XLA's reductions
in tokamax, so the f32 entries differ in the last bits (``reference.v4_compressor.paged_state``).
Measured over 150 random cases per mode on CPU (jax 0.12.0.1): no e4m3 code differed (450 CSA
and 450 indexer records), 1 CSA RoPE bf16 value in 28 800 and 13 HCA bf16 values in 153 600."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest
from test_engines_tokamax_compressor import MODES, make_case, saved

from dsa_jax.engines.tokamax import compressor as tc
from reference.formats import tokamax_v4
from reference.v4_compressor import paged_state

tokamax = pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 (CI's 3.12 leg)")
pytestmark = pytest.mark.kernel_gate

TOL = 1e-5  # |f32 value - midpoint of the two codes| allowed, relative to the entry's RMS
# seed 31: on jax 0.12.0.1's CPU one HCA bf16 value differs (rounding, explained below)
CASES = [(mode, 0) for mode in sorted(MODES)] + [("hca", 31)]
_BF16_SIGN, _E4M3_SIGN = 0x8000, 0x80


def _jnp(x):
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def test_signatures_are_tokamax():
    for ours, theirs in ((tc.proj_and_save_state, tokamax.ops.proj_and_save_state),
                         (tc.dsv4_compressor, tokamax.ops.dsv4_compressor)):
        got = [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()]
        want = [(p.name, p.kind, p.default)
                for p in inspect.signature(theirs).parameters.values()]
        assert got == want


def _code_fields(mode, cache, rope_cache, slots):
    """Each stored record's codes, read from the bytes as docs/engines/tokamax.md states them:
    ``[(kind, bits [n, K], scale f32[n, K], first feature)]`` and the record's other bytes
    (scales, padding) ``u8[n, _]``."""
    c = np.asarray(cache)
    if mode == "hca":  # two rows; row 2k word w = feature w | 128 + w << 16, row 2k+1: 256, 384
        w = np.asarray(tokamax_v4.slabs_to_words(c.reshape(-1, 4, tc.LANES)))
        w = w[slots[:, None] + np.arange(2)]
        bits = np.concatenate([w[:, 0] & 0xFFFF, w[:, 0] >> 16, w[:, 1] & 0xFFFF, w[:, 1] >> 16],
                              axis=1)
        return [("bf16", bits, np.ones(bits.shape), 0)], np.zeros((len(slots), 0), np.uint8)
    if mode == "indexer":  # 128 e4m3, the ue8m0 scale, zeros
        rec = c.reshape(-1, c.shape[-1])[slots]
        scale = np.exp2(rec[:, 128:129].astype(np.float64) - 127) * np.ones((1, 128))
        return [("e4m3", rec[:, :128], scale, 0)], rec[:, 128:]
    # CSA: record byte i is byte i // 128 of word i % 128; 448 e4m3, 64 lane-periodic scales
    rec = c.reshape(-1, tc.LANES)[slots].view(np.uint8).reshape(-1, tc.LANES, 4)
    rec = rec.transpose(0, 2, 1).reshape(len(slots), -1)
    scale = np.exp2(rec[:, 448:].astype(np.float64) - 127)[:, np.arange(448) % 64]
    rw = np.asarray(rope_cache).view(np.uint32).reshape(-1, 32)[slots]
    rope = np.concatenate([rw & 0xFFFF, rw >> 16], axis=1)
    return ([("e4m3", rec[:, :448], scale, 0), ("bf16", rope, np.ones(rope.shape), 448)],
            rec[:, 448:])


def _values(kind, bits):
    if kind == "bf16":
        return np.asarray(bits, np.uint16).view(jnp.bfloat16).astype(np.float64)
    return np.asarray(bits, np.uint8).view(jnp.float8_e4m3fn).astype(np.float64)


def _blank(mode, cache, rope_cache, slots):
    """Copies of the caches' bytes with the records at ``slots`` zeroed (the rest must be
    equal): ``(u8[rows, bytes], u8[rope slots, 128] | None)``."""
    rows = np.array(cache).view(np.uint8).reshape(-1, 256 if mode == "indexer" else 512)
    rows[np.concatenate([slots, slots + 1]) if mode == "hca" else slots] = 0
    if rope_cache is None:
        return rows, None
    rope = np.array(rope_cache).view(np.uint8).reshape(-1, 128)  # a slot's 32 words
    rope[slots] = 0
    return rows, rope


def assert_same_up_to_rounding(mode, ours, theirs, rows, slots):
    """``ours`` / ``theirs`` (the ``dsv4_compressor`` results) equal byte for byte, except codes
    of the records at ``slots`` explained by rounding (module docstring); ``rows`` our
    f32 entries of those records."""
    for a, b in zip(_blank(mode, *ours, slots), _blank(mode, *theirs, slots), strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)
    fields_o, other_o = _code_fields(mode, *ours, slots)
    fields_t, other_t = _code_fields(mode, *theirs, slots)
    np.testing.assert_array_equal(other_o, other_t)  # scales and padding
    rms = np.sqrt(np.mean(np.float64(rows) ** 2, axis=1, keepdims=True))
    for (kind, bo, so, lo), (_, bt, st, _) in zip(fields_o, fields_t, strict=True):
        np.testing.assert_array_equal(so, st)
        t, k = np.nonzero(bo != bt)
        assert len(t) <= 1 + bo.size // 1000, f"{kind}: {len(t)} of {bo.size} codes differ"
        sign = _BF16_SIGN if kind == "bf16" else _E4M3_SIGN
        a, b = np.int64(bo[t, k]), np.int64(bt[t, k])
        assert np.all(np.abs(a - b) == 1) and np.all((a & sign) == (b & sign)), (a, b)
        mid = (_values(kind, bo[t, k]) + _values(kind, bt[t, k])) / 2 * so[t, k]
        dist = np.abs(np.float64(rows[t, lo + k]) - mid) / rms[t, 0]
        assert np.all(dist <= TOL), (kind, t, k, dist)


@pytest.mark.parametrize("mode, seed", CASES)
def test_bytes_equal_tokamax(mode, seed):
    c = make_case(mode, seed)
    ours_state = tc.proj_and_save_state(*c.proj, compress_ratio=c.ratio)
    theirs_state = tokamax.ops.proj_and_save_state(*map(_jnp, c.proj), compress_ratio=c.ratio,
                                                   implementation="xla")
    assert ours_state.dtype == theirs_state.dtype
    np.testing.assert_array_equal(np.asarray(ours_state), np.asarray(theirs_state))
    args, kw = saved(c)
    ours = tc.dsv4_compressor(*args, **kw)
    theirs = tokamax.ops.dsv4_compressor(*map(_jnp, args),
                                         **{k: _jnp(v) for k, v in kw.items()},
                                         implementation="xla")
    assert (theirs[1] is None) == (ours[1] is None) == (mode != "csa")
    assert ours[0].dtype == theirs[0].dtype and ours[0].shape == theirs[0].shape
    d, r, overlap, sbs, _, _ = MODES[mode]
    cache, pos, table, reqs, slots, rms = args
    state = cache if kw["state_cache"] is None else kw["state_cache"]
    t = np.flatnonzero(c.stored)
    rows = np.asarray(paged_state.paged_entries(
        state, jnp.asarray(pos), jnp.asarray(table), jnp.asarray(reqs), jnp.asarray(c.stored),
        jnp.asarray(rms), jnp.asarray(kw["cos_sin_cache"]),
        block_table_stride=kw["block_table_stride"], state_block_size=sbs, ratio=r,
        overlap=overlap, eps=1e-6))[t]
    assert_same_up_to_rounding(mode, ours, theirs, rows, slots[t])
