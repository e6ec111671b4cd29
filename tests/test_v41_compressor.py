"""DeepSeek-V4.1's ratio-1 / ratio-2 compressors (``reference.v41.compressor``) against a float64
NumPy oracle written from the definition, bit-exact where the bf16 regime fixes the bits, chunk
invariant bit for bit, with the visibility rule and NaN in every state row that must not be read."""

import math

import numpy as np
import pytest

from reference.v41 import compressor as C
from reference.v41.config import v41_flash
from reference.v41.formats import decode_compressed_kv, encode_compressed_kv

D = 128  # 64 nope dims + the 64-dim RoPE tail
NUM_POS = 64


def _bf16(x):
    import jax.numpy as jnp
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _inputs(rng, n):
    kv = rng.standard_normal((n, D)).astype(np.float32)
    score = (2 * rng.standard_normal((n, D))).astype(np.float32)
    weight = _bf16(1 + 0.25 * rng.standard_normal(D))
    return kv, score, weight


def _one_seq(kv, score, weight, ratio, state, start, *, slot=0, output="cache",
             pad=0):
    """Feed tokens ``[start, start + len(kv))`` of one sequence, ``pad`` NaN rows after them."""
    n = kv.shape[0]
    nan = np.full((pad, D), np.nan, np.float32)
    kv = np.concatenate([kv, nan])
    score = None if ratio == 1 else np.concatenate([score, nan])
    cos, sin = C.compressed_rope_tables(NUM_POS)
    return C.compress_step(kv, score, weight, cos, sin, state, np.array([slot]),
                           np.array([start + n]), np.array([0, n]), np.array([0, 1, 1]),
                           ratio=ratio, output=output)


def _entries(e):
    rows, seq, entry = (np.asarray(a) for a in e)
    return {int(j): rows[i] for i, j in enumerate(entry) if seq[i] >= 0}


def _oracle(kv, score, weight, ratio):
    """float64 from the definition: pairs, per-channel softmax, RMSNorm (eps 1e-20), then RoPE
    (interleaved pairs on the last 64 dims, entry j at position j r, theta 160000 with YaRN)."""
    c = v41_flash()
    kv, score = kv.astype(np.float64), score.astype(np.float64)
    n = kv.shape[0] // ratio
    g = kv[:n * ratio].reshape(n, ratio, D)
    if ratio == 1:
        pooled = g[:, 0]
    else:
        s = score[:n * ratio].reshape(n, ratio, D)
        w = np.exp(s - s.max(1, keepdims=True))
        pooled = (g * w / w.sum(1, keepdims=True)).sum(1)
    latent = weight * pooled / np.sqrt((pooled ** 2).mean(-1, keepdims=True) + c.rms_norm_eps)
    rd = c.rope_head_dim
    i = np.arange(rd // 2)
    inv = c.compress_rope_theta ** (-2.0 * i / rd)

    def cd(b):
        return rd * math.log(c.original_seq_len / (2 * math.pi * b)) / (2 * math.log(
            c.compress_rope_theta))
    low, high = max(math.floor(cd(c.beta_fast)), 0), min(math.ceil(cd(c.beta_slow)), rd - 1)
    smooth = 1 - np.clip((i - low) / (high - low), 0, 1)
    inv = inv / c.rope_factor * (1 - smooth) + inv * smooth
    ang = (ratio * np.arange(n))[:, None] * inv[None, :]
    a, b = latent[:, -rd::2], latent[:, -rd + 1::2]
    roped = latent.copy()
    roped[:, -rd::2] = a * np.cos(ang) - b * np.sin(ang)
    roped[:, -rd + 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return latent, roped


@pytest.mark.parametrize("ratio", [1, 2])
def test_against_float64_oracle_and_bf16_points(ratio):
    rng = np.random.default_rng(10 + ratio)
    kv, score, weight = _inputs(rng, 9)
    state = C.init_compressor_state(1, D, ratio)
    got = {out: _entries(_one_seq(kv, score, weight, ratio, state, 0, output=out)[0])
           for out in C.OUTPUTS}
    n = 9 // ratio
    assert sorted(got["cache"]) == list(range(n))
    latent, roped = _oracle(kv if ratio == 2 else _bf16(kv), score, weight, ratio)
    for j in range(n):
        # bf16 regime: a few bf16 roundings (pooled, norm, rope) on O(1) values
        np.testing.assert_allclose(got["latent"][j], latent[j], rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(got["roped"][j], roped[j], rtol=2e-2, atol=2e-2)
        for out in C.OUTPUTS:  # every stage holds bf16 values
            np.testing.assert_array_equal(got[out][j], _bf16(got[out][j]))
        np.testing.assert_array_equal(got["latent"][j][:-64], got["roped"][j][:-64])
        # the fp4 / e4m3-16 quantizer runs after RoPE, over all d dims, dequantized in place
        np.testing.assert_array_equal(
            got["cache"][j], np.asarray(decode_compressed_kv(encode_compressed_kv(
                got["roped"][j]))))


def test_ratio2_casts_pooled_to_bf16_and_ropes_at_2j():
    """Equal scores make the pooled row exactly ``f32(0.5 v0 + 0.5 v1)``; the ratio-2 entry j
    must then equal, bit for bit, the ratio-1 entry 2 j of a stream holding that row at 2 j (the
    bf16 cast before the norm, the same norm, RoPE at position 2 j)."""
    rng = np.random.default_rng(3)
    kv, _, weight = _inputs(rng, 8)
    score = np.repeat(rng.standard_normal((4, 1, D)).astype(np.float32), 2, 1).reshape(8, D)
    mid = np.float32(0.5) * kv[0::2] + np.float32(0.5) * kv[1::2]
    stream = np.repeat(mid, 2, 0)
    for out in ("roped",):  # the latent's bits and the position 2 j: roped rows carry both
        two = _entries(_one_seq(kv, score, weight, 2, C.init_compressor_state(1, D), 0,
                                output=out)[0])
        one = _entries(_one_seq(stream, None, weight, 1, None, 0, output=out)[0])
        rounded = _entries(_one_seq(_bf16(stream), None, weight, 1, None, 0, output=out)[0])
        for j in range(4):
            np.testing.assert_array_equal(two[j], one[2 * j], err_msg=f"{out} entry {j}")
            # the one cast before the norm: an f32 row and its bf16 rounding give the same bits
            np.testing.assert_array_equal(one[2 * j], rounded[2 * j])


def _run_split(kv, score, weight, ratio, split, nan_state):
    """Feed the stream in chunks ``split``; state slot 1 of 3, NaN everywhere at the start (no
    stale row may be read) or zero / -inf; NaN padding rows after each chunk. Returns the
    entries by number and the entry counts seen after each step."""
    state = C.init_compressor_state(3, D, ratio)
    if nan_state and state is not None:
        state = type(state)(state.kv * np.nan, state.score * np.nan)
    rows, counts, start = {}, [], 0
    for n in split:
        e, state = _one_seq(kv[start:start + n], score[start:start + n], weight, ratio, state,
                            start, slot=1, pad=1)
        new = _entries(e)
        assert not set(new) & set(rows), f"entries {set(new) & set(rows)} emitted twice"
        rows.update(new)
        start += n
        counts.append((start - 1, sorted(rows)))
    return rows, counts


@pytest.mark.parametrize("ratio", [1, 2])
def test_chunk_invariance_visibility_and_nan_state(ratio):
    rng = np.random.default_rng(20 + ratio)
    kv, score, weight = _inputs(rng, 12)
    whole, _ = _run_split(kv, score, weight, ratio, [12], nan_state=False)
    assert sorted(whole) == list(range(12 // ratio))
    # [3, 4, 5]: ends on position 2 (even: parks it), starts on 3 (odd: takes its partner),
    # ends on 6, starts on 7; then decodes only, and a prefill followed by decodes
    for split in ([3, 4, 5], [1] * 12, [5] + [1] * 7):
        rows, counts = _run_split(kv, score, weight, ratio, split, nan_state=True)
        assert sorted(rows) == sorted(whole), split
        for j in whole:
            assert np.isfinite(rows[j]).all()
            np.testing.assert_array_equal(rows[j], whole[j], err_msg=f"split {split} entry {j}")
        for p, seen in counts:  # entry j visible iff j < (p + 1) // r, at every step
            assert seen == list(range(int(C.visible_entries(p, ratio)))), (split, p, seen)


def test_visibility_rule_and_bad_arguments():
    assert [int(C.visible_entries(p, 2)) for p in range(6)] == [0, 1, 1, 2, 2, 3]
    assert [int(C.visible_entries(p, 1)) for p in range(4)] == [1, 2, 3, 4]
    kv, score, weight = _inputs(np.random.default_rng(0), 2)
    with pytest.raises(ValueError, match="ratio=4"):
        C.init_compressor_state(1, D, 4)
    with pytest.raises(ValueError, match="ratio 1 has no gate"):
        _one_seq(kv, score, weight, 1, C.init_compressor_state(1, D, 2), 0)
    with pytest.raises(ValueError, match="output"):
        _one_seq(kv, score, weight, 2, C.init_compressor_state(1, D), 0, output="bytes")
    with pytest.raises(ValueError, match=r"f32\(1, 2, 128\)"):
        _one_seq(kv, score, weight, 2, C.init_compressor_state(1, 64), 0)


def test_ragged_batch_two_sequences_and_an_inactive_one():
    """Two sequences share each step (slots 2 and 0 of a NaN pool; chunk borders at odd and
    even positions) and a third, inactive, holds NaN rows: every entry equals its sequence's
    one-prefill entry bit for bit."""
    rng = np.random.default_rng(7)
    streams = [_inputs(rng, 8) for _ in range(2)]
    weight = streams[0][2]
    whole = [_run_split(kv, sc, weight, 2, [8], nan_state=False)[0] for kv, sc, _ in streams]
    cos, sin = C.compressed_rope_tables(NUM_POS)
    state = C.init_compressor_state(3, D)
    state = type(state)(state.kv * np.nan, state.score * np.nan)
    got, done = [{}, {}], [0, 0]
    for lens in ([3, 5], [5, 3]):
        parts = [(kv[done[i]:done[i] + n], sc[done[i]:done[i] + n])
                 for i, ((kv, sc, _), n) in enumerate(zip(streams, lens, strict=True))]
        nan = np.full((2, D), np.nan, np.float32)
        kv = np.concatenate([p[0] for p in parts] + [nan])
        sc = np.concatenate([p[1] for p in parts] + [nan])
        done = [d + n for d, n in zip(done, lens, strict=True)]
        cu = np.array([0, lens[0], lens[0] + lens[1], lens[0] + lens[1] + 2])
        e, state = C.compress_step(kv, sc, weight, cos, sin, state, np.array([2, 0, 1]),
                                   np.array(done + [2]), cu, np.array([0, 2, 2]), ratio=2)
        rows, seq, entry = (np.asarray(a) for a in e)
        assert set(seq[seq >= 0]) <= {0, 1}
        for i in np.flatnonzero(seq >= 0):
            got[seq[i]][int(entry[i])] = rows[i]
    for s in range(2):
        assert sorted(got[s]) == sorted(whole[s]) == [0, 1, 2, 3]
        for j in whole[s]:
            np.testing.assert_array_equal(got[s][j], whole[s][j], err_msg=f"seq {s} entry {j}")


def test_write_compressed_entries_stores_the_fp4_bytes_in_pages():
    kv, score, weight = _inputs(np.random.default_rng(5), 9)
    e, _ = _one_seq(kv, score, weight, 2, C.init_compressor_state(1, D), 0, output="roped")
    width = 9 * D // 16
    cache = np.full((6, 2, width), 0xAB, np.uint8)
    out = np.asarray(C.write_compressed_entries(cache, e, np.array([5, 1, 3]), np.array([0, 6]),
                                                pages_per_seq=3))
    rows = _entries(e)
    want = cache.copy()
    for j, (page, off) in enumerate([(5, 0), (5, 1), (1, 0), (1, 1)]):
        want[page, off] = np.asarray(encode_compressed_kv(rows[j]))
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="70 bytes"):
        C.write_compressed_entries(cache[..., :70], e, np.array([5]), np.array([0, 2]),
                                   pages_per_seq=1)
