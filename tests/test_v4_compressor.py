"""The V4 compressor (``reference.v4_compressor``) against the float64 oracle of its definition
(``tests/v4_compressor_oracle.py``), its state contract, chunk invariance, the cache writers and
its refusals. Unused cache pages, state slots and padding rows are NaN, so a stray read shows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import v4_compressor_oracle as oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import fp8_cache, v4_cache
from reference import v4_compressor as vc

TABLE_LEN = 1024


def _params(rng, ratio, d, rope_dim):
    coff = vc.compressor_coff(ratio)
    ape = rng.standard_normal((ratio, coff * d)).astype(np.float32)
    weight = (1 + 0.25 * rng.standard_normal(d)).astype(np.float32)
    cos, sin = vc.rope_tables(TABLE_LEN, rope_dim)
    return ape, weight, cos, sin


def _tokens(rng, n, ratio, d):
    """``(kv, score) f32[n, coff * d]`` of one whole sequence (scores spread enough that the
    softmax is far from uniform)."""
    coff = vc.compressor_coff(ratio)
    kv = rng.standard_normal((n, coff * d)).astype(np.float32)
    score = (2 * rng.standard_normal((n, coff * d))).astype(np.float32)
    return kv, score


def _nan_state(num_slots, ratio, d):
    shape = (num_slots, vc.state_rows(ratio), vc.compressor_coff(ratio) * d)
    return vc.CompressorState(jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan))


class _Step:
    """One step's batch: sequence ``i`` brings tokens ``[start_i, start_i + q_i)`` of its
    ``seqs[i]``; ``num_rows`` rows in all, padding rows NaN; the last ``inactive`` sequence
    slots are inactive (their rows are NaN too)."""

    def __init__(self, seqs, chunks, num_rows, inactive=0):
        width = seqs[0][0].shape[1]
        kv = np.full((num_rows, width), np.nan, np.float32)
        score = kv.copy()
        cu, kv_lens, row = [0], [], 0
        for (skv, ssc), (start, q) in zip(seqs, chunks, strict=True):
            kv[row:row + q], score[row:row + q] = skv[start:start + q], ssc[start:start + q]
            row += q
            cu.append(row)
            kv_lens.append(start + q)
        for _ in range(inactive):
            cu.append(row)
            kv_lens.append(7)
        self.args = (jnp.asarray(kv), jnp.asarray(score))
        self.kv_lens = jnp.asarray(kv_lens, jnp.int32)
        self.cu_q_lens = jnp.asarray(cu, jnp.int32)
        self.distribution = jnp.asarray([0, len(seqs), len(seqs)], jnp.int32)


def _run(step, params, state, slots, ratio):
    ape, weight, cos, sin = params
    return vc.compress_step(*step.args, ape, weight, cos, sin, state, slots, step.kv_lens,
                            step.cu_q_lens, step.distribution, ratio=ratio)


def _collect(found, entries):
    for rows, s, j in zip(np.asarray(entries.rows), np.asarray(entries.seq),
                          np.asarray(entries.entry), strict=True):
        if s >= 0:
            assert (int(s), int(j)) not in found, f"entry {(s, j)} emitted twice"
            found[int(s), int(j)] = rows


# ---------------------------------------------------------------------------------------------
# The ragged batch against the oracle, through the paged cache.

PAGE_SIZE, PAGES_PER_SEQ = 4, 3

CASES = {  # (ratio, d): sequence lengths, step 1 chunk lengths (step 2 brings the rest)
    (4, 512): ([11, 23, 6], [7, 20, 3]),
    (4, 128): ([11, 23, 6], [7, 22, 3]),
    (128, 512): ([300, 129, 5], [200, 100, 2]),
    (128, 128): ([300, 129, 5], [127, 128, 5]),
}


@pytest.mark.parametrize("ratio,d", list(CASES))
def test_ragged_batch_matches_oracle(ratio, d):
    """Three sequences (prefill, then prefill chunks and decode tokens mixed, lengths not
    multiples of the ratio) and an inactive slot, written to a NaN-filled paged cache: every
    complete group equals the oracle, nothing else is written, the state is the ring."""
    rng = np.random.default_rng([ratio, d])
    params = _params(rng, ratio, d, 64)
    lens, first = CASES[ratio, d]
    seqs = [_tokens(rng, n, ratio, d) for n in lens]
    num_rows = sum(lens) + 3
    num_pages = 4 * PAGES_PER_SEQ + 2
    page_indices = jnp.asarray(rng.permutation(num_pages)[:4 * PAGES_PER_SEQ], jnp.int32)
    cu_lens = jnp.arange(5, dtype=jnp.int32) * PAGES_PER_SEQ * PAGE_SIZE
    cache = jnp.full((num_pages, PAGE_SIZE, d), jnp.nan)
    state, slots = _nan_state(5, ratio, d), jnp.asarray([2, 0, 4, 1], jnp.int32)
    steps = [[(0, q) for q in first], [(q, n - q) for q, n in zip(first, lens, strict=True)]]
    for chunks in steps:
        entries, state = _run(_Step(seqs, chunks, num_rows, inactive=1), params, state, slots,
                              ratio)
        valid = np.asarray(entries.seq) >= 0
        assert np.isfinite(np.asarray(entries.rows)).all()
        assert not np.asarray(entries.rows)[~valid].any()
        cache = vc.write_entries(cache, entries, page_indices, cu_lens,
                                 pages_per_seq=PAGES_PER_SEQ)
    cache = np.asarray(cache)
    written = np.zeros(cache.shape[:2], bool)
    ape, weight, cos, sin = params
    for i, ((kv, score), n) in enumerate(zip(seqs, lens, strict=True)):
        want = oracle.compress_sequence(kv, score, ape, weight, np.asarray(cos), np.asarray(sin),
                                        ratio=ratio)
        for j in range(min(n // ratio, PAGES_PER_SEQ * PAGE_SIZE)):
            page = int(page_indices[i * PAGES_PER_SEQ + j // PAGE_SIZE])
            np.testing.assert_allclose(cache[page, j % PAGE_SIZE], want[j], rtol=2e-5,
                                       atol=2e-5, err_msg=f"seq {i} entry {j}")
            written[page, j % PAGE_SIZE] = True
        nan = np.full(state.kv.shape[1:], np.nan, np.float32)
        ring = oracle.ring_state(kv, score, ape, ratio=ratio, slot_kv=nan, slot_score=nan)
        slot = int(slots[i])
        np.testing.assert_array_equal(np.asarray(state.kv[slot]), ring[0])
        np.testing.assert_array_equal(np.asarray(state.score[slot]), ring[1])
    assert np.isnan(cache[~written]).all()  # unwritten slots and spare pages keep their NaN
    assert np.isnan(np.asarray(state.kv)[[1, 3]]).all()  # the inactive and the unused slot


def test_group_zero_of_ratio_4_pools_only_its_own_tokens():
    """Entry 0 of ratio 4 has no previous group: a 4-slot softmax over the second halves; the
    first halves of its rows do not matter, and a NaN-filled fresh slot is never read."""
    rng = np.random.default_rng(3)
    d = 16
    ape, weight, cos, sin = _params(rng, 4, d, 8)
    kv, score = _tokens(rng, 4, 4, d)
    state, slots = _nan_state(1, 4, d), jnp.asarray([0], jnp.int32)
    out = _run(_Step([(kv, score)], [(0, 4)], 8), (ape, weight, cos, sin), state, slots, 4)[0]
    g = score[:, d:].astype(np.float64) + ape[:, d:]
    w = np.exp(g - g.max(0))
    pooled = (w / w.sum(0) * kv[:, d:]).sum(0)
    normed = pooled / np.sqrt(np.mean(pooled ** 2) + 1e-6) * weight  # position 0: no rotation
    np.testing.assert_allclose(np.asarray(out.rows[0]), normed, rtol=1e-5, atol=1e-6)
    kv2 = kv.copy()
    kv2[:, :d] = 1e30
    out2 = _run(_Step([(kv2, score)], [(0, 4)], 8), (ape, weight, cos, sin), state, slots, 4)[0]
    np.testing.assert_array_equal(np.asarray(out2.rows), np.asarray(out.rows))


def test_a_partial_group_is_not_emitted_until_its_last_token():
    """kv_len 7 at ratio 4: only entry 0; the 8th token completes entry 1 from the state."""
    rng = np.random.default_rng(4)
    d = 16
    params = _params(rng, 4, d, 8)
    kv, score = _tokens(rng, 8, 4, d)
    state, slots = _nan_state(1, 4, d), jnp.asarray([0], jnp.int32)
    e1, state = _run(_Step([(kv, score)], [(0, 7)], 8), params, state, slots, 4)
    assert np.asarray(e1.seq).tolist() == [0, -1, -1] and int(e1.entry[0]) == 0
    e2, _ = _run(_Step([(kv, score)], [(7, 1)], 8), params, state, slots, 4)
    assert np.asarray(e2.seq).tolist() == [0, -1, -1] and int(e2.entry[0]) == 1
    ape, weight, cos, sin = params
    want = oracle.compress_sequence(kv, score, ape, weight, np.asarray(cos), np.asarray(sin),
                                    ratio=4)
    np.testing.assert_allclose(np.asarray(e2.rows[0]), want[1], rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Chunk invariance: any split into prefill chunks and decode steps, bit-identical.

def _split(draw, n, ratio):
    """Chunk lengths summing to ``n``: random cuts plus a run of single-token decode steps
    placed around a group boundary."""
    cuts = draw(st.sets(st.integers(1, n - 1), max_size=8)) if n > 1 else set()
    start = draw(st.integers(0, n // ratio)) * ratio - draw(st.integers(0, 3))
    cuts |= {c for c in range(start, start + draw(st.integers(0, 7))) if 0 < c < n}
    bounds = [0, *sorted(cuts), n]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def _bucket(rows, max_rows):
    """The step's row count: padded to a few sizes, so steps of different sizes run different
    programs (XLA CPU's reductions round differently at different shapes; a test with one
    padded shape for every step could not see that)."""
    return min(b for b in (2, 8, max_rows) if b >= rows)


def _run_splits(seqs, splits, params, ratio, max_rows):
    """Run two sequences (state slots 1 and 0) plus an inactive slot through their splits,
    step by step, from a NaN state pool; return ``(entries by (seq, j), state)``."""
    d = params[1].shape[0]
    state, slots = _nan_state(3, ratio, d), jnp.asarray([1, 0, 2], jnp.int32)
    done = [0, 0]
    found = {}
    for k in range(max(len(s) for s in splits)):
        chunks = [(done[i], splits[i][k] if k < len(splits[i]) else 0) for i in range(2)]
        num_rows = _bucket(sum(q for _, q in chunks), max_rows)
        entries, state = _run(_Step(seqs, chunks, num_rows, inactive=1), params, state, slots,
                              ratio)
        _collect(found, entries)
        done = [a + q for a, q in chunks]
    return found, state


def _assert_same(a, b):
    (found_a, state_a), (found_b, state_b) = a, b
    assert sorted(found_a) == sorted(found_b)
    for key in found_a:
        np.testing.assert_array_equal(found_a[key], found_b[key], err_msg=f"entry {key}")
    for part in ("kv", "score"):
        np.testing.assert_array_equal(np.asarray(getattr(state_a, part)),
                                      np.asarray(getattr(state_b, part)))


MAX_LEN = {4: 40, 128: 300}


@pytest.mark.parametrize("ratio", [4, 128])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_any_split_gives_bit_identical_entries_and_state(ratio, data):
    """Two sequences split independently into prefill chunks and decode steps (one step
    carries both) equal one prefill of both: every entry and the whole state pool, bit for
    bit (d = 16, rope_dim = 8)."""
    d, max_n = 16, MAX_LEN[ratio]
    lens = [data.draw(st.integers(1, max_n), label=f"len{i}") for i in range(2)]
    splits = [_split(data.draw, n, ratio) for n in lens]
    rng = np.random.default_rng(lens)
    params = _params(rng, ratio, d, 8)
    seqs = [_tokens(rng, n, ratio, d) for n in lens]
    one_shot = _run_splits(seqs, [[n] for n in lens], params, ratio, 2 * max_n + 1)
    assert len(one_shot[0]) == sum(n // ratio for n in lens)
    _assert_same(_run_splits(seqs, splits, params, ratio, 2 * max_n + 1), one_shot)


@pytest.mark.parametrize("ratio,d,n,cut", [(4, 512, 13, 5), (128, 16, 132, 120)])
def test_decode_steps_give_the_bits_of_one_prefill(ratio, d, n, cut):
    """The serving pattern at its own shapes: a prefill chunk, then single-token decode steps
    of a one-sequence batch (T = S = 1, one output slot), against one prefill of the whole
    sequence (a run with sums instead of ``_tree`` fails here: measured)."""
    rng = np.random.default_rng(5)
    params = _params(rng, ratio, d, 64 if d >= 64 else 8)
    seq = _tokens(rng, n, ratio, d)
    slots = jnp.asarray([0], jnp.int32)
    entries, one_shot = _run(_Step([seq], [(0, n)], n), params, _nan_state(1, ratio, d), slots,
                             ratio)
    want = {}
    _collect(want, entries)
    found, state = {}, _nan_state(1, ratio, d)
    for start, q in [(0, cut)] + [(t, 1) for t in range(cut, n)]:
        entries, state = _run(_Step([seq], [(start, q)], q), params, state, slots, ratio)
        _collect(found, entries)
    _assert_same((found, state), (want, one_shot))


# ---------------------------------------------------------------------------------------------
# The fp8 cache formats.

def _prefill_entries(ratio, d, n, seed):
    rng = np.random.default_rng(seed)
    params = _params(rng, ratio, d, 64)
    seq = _tokens(rng, n, ratio, d)
    state, slots = _nan_state(1, ratio, d), jnp.asarray([0], jnp.int32)
    return _run(_Step([seq], [(0, n)], n), params, state, slots, ratio)[0]


def test_fp8_v4_cache_stores_the_model1_words_of_each_entry():
    entries = _prefill_entries(4, 512, 13, 6)
    num_pages, ps = 5, 16
    page_indices = jnp.asarray([3, 1], jnp.int32)
    cache = vc.write_entries(v4_cache.empty_v4_cache(num_pages, ps), entries, page_indices,
                             jnp.asarray([0, 2 * ps], jnp.int32), pages_per_seq=2)
    slots = 3 * ps + np.arange(3)
    np.testing.assert_array_equal(np.asarray(v4_cache.gather_v4_rows(cache, slots)),
                                  np.asarray(v4_cache.quantize_v4_rows(entries.rows[:3])))
    others = np.setdiff1d(np.arange(num_pages * ps), slots)
    assert not np.asarray(v4_cache.gather_v4_rows(cache, others)).any()


def test_fp8_index_cache_stores_the_v32_key_rule_of_each_entry():
    entries = _prefill_entries(4, 128, 13, 7)
    num_pages, ps = 3, 32
    cache = fp8_cache.Fp8IndexCache(
        jnp.zeros((num_pages, ps, 128), jnp.float8_e4m3fn),
        jnp.zeros((num_pages, fp8_cache.scale_lanes(ps)), jnp.float32))
    cache = vc.write_entries(cache, entries, jnp.asarray([2], jnp.int32),
                             jnp.asarray([0, ps], jnp.int32), pages_per_seq=1)
    k8, s = fp8_cache.quantize_index_rows(entries.rows[:3])
    keys = np.asarray(cache.keys.astype(jnp.float32))
    np.testing.assert_array_equal(keys[2, :3], np.asarray(k8.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(cache.scales)[2, :3], np.asarray(s))
    assert not keys[2, 3:].any() and not keys[:2].any()


def test_stacked_plain_cache_writes_only_the_given_layer():
    entries = _prefill_entries(4, 128, 13, 7)
    cache = jnp.full((2, 3, 4, 128), jnp.nan, jnp.bfloat16)
    cache = np.asarray(vc.write_entries(cache, entries, jnp.asarray([1], jnp.int32),
                                        jnp.asarray([0, 4], jnp.int32), pages_per_seq=1,
                                        layer=1).astype(jnp.float32))
    np.testing.assert_array_equal(
        cache[1, 1, :3], np.asarray(entries.rows[:3].astype(jnp.bfloat16).astype(jnp.float32)))
    assert np.isnan(cache[0]).all() and np.isnan(cache[1, 0]).all()
    assert np.isnan(cache[1, 1, 3:]).all() and np.isnan(cache[1, 2]).all()


def test_entries_past_the_capacity_or_the_page_table_are_dropped():
    entries = _prefill_entries(4, 128, 13, 7)  # entries 0, 1, 2
    cache = jnp.full((3, 2, 128), jnp.nan)
    out = np.asarray(vc.write_entries(cache, entries, jnp.asarray([0, 7], jnp.int32),
                                      jnp.asarray([0, 4], jnp.int32), pages_per_seq=2))
    assert np.isfinite(out[0]).all()  # entries 0, 1 on page 0
    assert np.isnan(out[1:]).all()  # entry 2: page id 7 is outside [0, 3)


# ---------------------------------------------------------------------------------------------
# RoPE tables.

def test_rope_tables_match_the_yarn_definition():
    inv = oracle.inv_freq(64, 160000.0, 16.0, 65536, 32, 1)
    assert vc.yarn_inv_freq(64).dtype == np.float32
    np.testing.assert_allclose(vc.yarn_inv_freq(64), inv, rtol=3e-7)
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    # theta 160000: the correction range is [15, 25]: below it unscaled, above it / factor
    np.testing.assert_array_equal(inv[:15], base[:15])
    np.testing.assert_allclose(inv[25:], base[25:] / 16, rtol=1e-15)
    cos, sin = vc.rope_tables(4096)
    p = np.arange(4096)[:, None]
    np.testing.assert_allclose(np.asarray(cos), np.cos(p * inv), atol=4096 * 5e-7)
    np.testing.assert_allclose(np.asarray(sin), np.sin(p * inv), atol=4096 * 5e-7)
    plain = vc.yarn_inv_freq(64, theta=10000.0, original_seq_len=0)
    np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=3e-7)


# ---------------------------------------------------------------------------------------------
# Refusals.

def _good(ratio=4, d=16, T=5, S=2, slots=3):
    coff = vc.compressor_coff(ratio)
    cos, sin = vc.rope_tables(64, 8)
    return dict(kv=jnp.zeros((T, coff * d)), score=jnp.zeros((T, coff * d)),
                ape=jnp.zeros((ratio, coff * d)), norm_weight=jnp.ones(d), cos=cos, sin=sin,
                state=vc.init_compressor_state(slots, ratio, d),
                state_slots=jnp.zeros(S, jnp.int32), kv_lens=jnp.zeros(S, jnp.int32),
                cu_q_lens=jnp.zeros(S + 1, jnp.int32), distribution=jnp.zeros(3, jnp.int32))


BAD = {
    "ratio": (dict(), dict(ratio=8), r"ratio=8"),
    "kv width": (dict(kv=jnp.zeros((5, 16))), {}, r"kv must have shape \(5, 32\).*2 \* 16"),
    "score shape": (dict(score=jnp.zeros((4, 32))), {}, r"score must have shape \(5, 32\)"),
    "ape shape": (dict(ape=jnp.zeros((128, 32))), {}, r"ape must have shape \(4, 32\)"),
    "ape for ratio 128": (dict(), dict(ratio=128), r"kv must have shape \(5, 16\)"),
    "norm weight rank": (dict(norm_weight=jnp.ones((16, 1))), {}, r"norm_weight must have rank 1"),
    "norm weight size": (dict(norm_weight=jnp.ones(20)), {}, r"\(5, 40\).*2 \* 20"),
    "state rows": (dict(state=vc.init_compressor_state(3, 128, 16)), {},
                   r"state.kv must be f32\[num_slots, coff \* ratio, coff \* d\] = "
                   r"f32\(3, 8, 32\).*\(3, 128, 16\)"),
    "state type": (dict(state=(jnp.zeros((3, 8, 32)),) * 2), {}, r"CompressorState"),
    "rope too wide": (dict(cos=jnp.zeros((8, 16)), sin=jnp.zeros((8, 16))), {},
                      r"rope_dim = 2 \* cos.shape\[1\] = 32.*d = 16"),
    "cos vs sin": (dict(sin=jnp.zeros((8, 4))), {}, r"cos and sin must have one shape"),
    "cu_q_lens": (dict(cu_q_lens=jnp.zeros(2, jnp.int32)), {}, r"cu_q_lens.shape\[0\].* 3"),
    "state_slots": (dict(state_slots=jnp.zeros(3, jnp.int32)), {}, r"state_slots.shape\[0\]"),
    "empty step": (dict(kv=jnp.zeros((0, 32)), score=jnp.zeros((0, 32))), {},
                   r"kv has T = 0 rows \(shape \(0, 32\)\).*at least one row"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_naming_the_numbers(name):
    args, kw, match = BAD[name]
    kw = {"ratio": 4, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        vc.compress_step(**{**_good(), **args}, **kw)


def test_bad_cache_width_and_ratio_helpers_are_refused():
    entries = vc.CompressedEntries(jnp.zeros((3, 128)), jnp.full(3, -1), jnp.full(3, -1))
    with pytest.raises(ValueError, match=r"512 wide but the entries are d = 128"):
        vc.write_entries(v4_cache.empty_v4_cache(2, 16), entries, jnp.zeros(2, jnp.int32),
                         jnp.zeros(2, jnp.int32), pages_per_seq=1)
    with pytest.raises(ValueError, match=r"ratio=2"):
        vc.init_compressor_state(2, 2, 16)
    with pytest.raises(ValueError, match=r"rope_dim=7"):
        vc.rope_tables(8, 7)


def test_inv_freq_rounds_at_the_official_f32_steps_not_once():
    """The official ``precompute_freqs_cis`` computes in f32: ``1.0 / (base ** (arange / dim))``
    then the YaRN blend, each step rounded; the correctly rounded frequencies differ from that in
    some entries (a deliberate choice: the official tables, not the exact ones)."""
    f32 = np.float32
    freqs = f32(1) / (f32(160000.0) ** (np.arange(0, 64, 2, dtype=f32) / f32(64)))
    smooth = f32(1) - np.clip((np.arange(32, dtype=f32) - f32(15)) / f32(10), f32(0), f32(1))
    official = freqs / f32(16) * (f32(1) - smooth) + freqs * smooth
    np.testing.assert_array_equal(vc.yarn_inv_freq(64), official)
    once = oracle.inv_freq(64, 160000.0, 16.0, 65536, 32, 1).astype(np.float32)
    assert (once != official).any()


@pytest.mark.parametrize("slot,kv_len", [(-1, 8), (1, 8), (0, 3)])
def test_a_sequence_with_a_bad_slot_or_length_is_skipped(slot, kv_len):
    """State slot outside the pool, or more new rows than tokens (q_len 8 > kv_len 3): no entry,
    no state write (masking rules of the module docstring)."""
    rng = np.random.default_rng(8)
    params = _params(rng, 4, 16, 8)
    kv, score = _tokens(rng, 8, 4, 16)
    step = _Step([(kv, score)], [(0, 8)], 8)
    step.kv_lens = jnp.asarray([kv_len], jnp.int32)
    state = _nan_state(1, 4, 16)
    entries, new = _run(step, params, state, jnp.asarray([slot], jnp.int32), 4)
    assert (np.asarray(entries.seq) == -1).all() and not np.asarray(entries.rows).any()
    assert np.isnan(np.asarray(new.kv)).all() and np.isnan(np.asarray(new.score)).all()
