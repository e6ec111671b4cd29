"""The Pallas V4 compressor (``pallas_kernels.v4_compressor.compress_step``) under the strict
interpreter (race detection, NaN-filled uninitialised memory, out-of-bounds reads raising)
against the reference ``compress_step`` (entries to f32 rounding, state bit for bit) and the
float64 oracle, and its own chunk invariance (bit for bit). Unused pool slots, unused ring
rows and padding rows are NaN, so a stray read shows. Shapes are tiny: the interpreter runs
every DMA as a host callback."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import v4_compressor_oracle as oracle
from hypothesis import given, settings
from hypothesis import strategies as st
from test_v4_compressor import (
    _assert_same,
    _collect,
    _nan_state,
    _params,
    _run,
    _split,
    _Step,
    _tokens,
)

from pallas_kernels import v4_compressor as pvc
from reference import v4_compressor as vc

pytestmark = pytest.mark.kernel_gate

# The pooled rows agree with the reference to f32 rounding (the same tree of the same ops;
# measured bit-identical under the interpreter on CPU, not required).
RTOL, ATOL = 1e-6, 1e-6


def _both(step, params, state, slots, ratio, precision="f32"):
    """``(pallas, reference)`` results of one step."""
    ape, weight, cos, sin = params
    args = (*step.args, ape, weight, cos, sin, state, slots, step.kv_lens, step.cu_q_lens,
            step.distribution)
    return (pvc.compress_step(*args, ratio=ratio, interpret=True, precision=precision),
            vc.compress_step(*args, ratio=ratio, precision=precision))


def _check_step(got, want):
    (e, s), (e_ref, s_ref) = got, want
    np.testing.assert_array_equal(np.asarray(e.seq), np.asarray(e_ref.seq))
    np.testing.assert_array_equal(np.asarray(e.entry), np.asarray(e_ref.entry))
    np.testing.assert_allclose(np.asarray(e.rows), np.asarray(e_ref.rows), rtol=RTOL, atol=ATOL)
    for part in ("kv", "score"):  # data movement and one add: exact (NaN where NaN)
        np.testing.assert_array_equal(np.asarray(getattr(s, part)),
                                      np.asarray(getattr(s_ref, part)))


# (ratio, d): sequence lengths, step 1's chunks (step 2 brings the rest, a decode token where
# one is left); sequence 2 has a state slot outside the pool (skipped), one slot is inactive
CASES = {
    (4, 512): ([11, 6, 9], [6, 5, 9]),
    (4, 128): ([14, 9, 5], [9, 8, 5]),
    (128, 128): ([260, 130, 5], [250, 129, 5]),
    (128, 512): ([257, 129, 3], [129, 128, 3]),
}


@pytest.mark.parametrize("ratio,d", list(CASES))
def test_two_steps_match_the_reference_and_the_oracle(ratio, d):
    """Prefill chunks crossing group boundaries (ratio 4 from group 0), then the rest of each
    sequence (a decode token where one is left), an out-of-range slot and an inactive
    sequence, from a NaN pool: each step equals the reference (entries to f32 rounding, the
    pool bit for bit), and every complete group equals the oracle."""
    rng = np.random.default_rng([ratio, d, 1])
    params = _params(rng, ratio, d, 64)
    lens, first = CASES[ratio, d]
    seqs = [_tokens(rng, n, ratio, d) for n in lens]
    state, slots = _nan_state(3, ratio, d), jnp.asarray([2, 0, 7, 1], jnp.int32)
    found = {}
    for chunks in ([(0, q) for q in first], [(q, n - q) for q, n in zip(first, lens, strict=True)]):
        got, want = _both(_Step(seqs, chunks, sum(q for _, q in chunks) + 2, inactive=1),
                          params, state, slots, ratio)
        _check_step(got, want)
        _collect(found, got[0])
        state = got[1]
    ape, weight, cos, sin = params
    for i in (0, 1):
        kv, score = seqs[i]
        want = oracle.compress_sequence(kv, score, ape, weight, np.asarray(cos), np.asarray(sin),
                                        ratio=ratio)
        for j, row in enumerate(want):
            np.testing.assert_allclose(found[i, j], row, rtol=2e-5, atol=2e-5,
                                       err_msg=f"seq {i} entry {j}")
    assert not [key for key in found if key[0] == 2]  # the out-of-range slot is skipped
    assert np.isnan(np.asarray(state.kv)[1]).all()  # the inactive sequence's slot is untouched


def test_group_zero_and_a_step_with_nothing_complete():
    """Ratio 4: a first chunk completing only group 0 (no previous group: its NaN-filled
    ring slot and the rows' first halves are never read), then steps that complete nothing
    (every output slot a zero row), then the token that completes group 1 from the ring."""
    rng = np.random.default_rng(11)
    d = 128
    params = _params(rng, 4, d, 64)
    seq = _tokens(rng, 8, 4, d)
    state, slots = _nan_state(1, 4, d), jnp.asarray([0], jnp.int32)
    for start, q in ((0, 5), (5, 1), (6, 1), (7, 1)):
        got, want = _both(_Step([seq], [(start, q)], q + 1), params, state, slots, 4)
        _check_step(got, want)
        assert np.isfinite(np.asarray(got[0].rows)).all()
        state = got[1]
        if start in (5, 6):
            assert (np.asarray(got[0].seq) == -1).all() and not np.asarray(got[0].rows).any()
    assert np.asarray(got[0].entry)[0] == 1


def test_bf16_precision_rounds_the_entries_as_the_reference():
    """``precision="bf16"`` (the official regime: the pooled row rounded before its norm, the
    norm and the RoPE outputs rounded): the Pallas entries equal the reference's bf16 entries
    (values bf16-exact) and the state is the f32 state of both (the pooling stays f32); the
    entries differ from the f32 regime's."""
    rng = np.random.default_rng(17)
    d = 128
    params = _params(rng, 4, d, 64)
    seqs = [_tokens(rng, n, 4, d) for n in (9, 6)]
    state, slots = _nan_state(2, 4, d), jnp.asarray([1, 0], jnp.int32)
    step = _Step(seqs, [(0, 9), (0, 6)], 16)
    got, want = _both(step, params, state, slots, 4, precision="bf16")
    _check_step(got, want)
    rows = np.asarray(got[0].rows)
    np.testing.assert_array_equal(rows, rows.astype(jnp.bfloat16).astype(np.float32))
    f32_entries, f32_state = _run(step, params, state, slots, 4)  # the reference's, f32
    assert not np.array_equal(rows, np.asarray(f32_entries.rows))
    np.testing.assert_array_equal(np.asarray(got[1].kv), np.asarray(f32_state.kv))


@pytest.mark.parametrize("ratio,d,n,cut", [(4, 16, 13, 5), (128, 16, 140, 128)])
def test_decode_steps_give_the_bits_of_one_prefill(ratio, d, n, cut):
    """A prefill chunk then single-token decode steps (T = S = 1) against one prefill of the
    whole sequence: every entry and the pool, bit for bit, on the kernel itself."""
    rng = np.random.default_rng(5)
    params = _params(rng, ratio, d, 8)
    seq = _tokens(rng, n, ratio, d)
    slots = jnp.asarray([0], jnp.int32)

    def run(chunks):
        found, state = {}, _nan_state(1, ratio, d)
        for start, q in chunks:
            entries, state = _pallas(_Step([seq], [(start, q)], q), params, state, slots, ratio)
            _collect(found, entries)
        return found, state

    _assert_same(run([(0, cut)] + [(t, 1) for t in range(cut, n)]), run([(0, n)]))


def _pallas(step, params, state, slots, ratio):
    ape, weight, cos, sin = params
    return pvc.compress_step(*step.args, ape, weight, cos, sin, state, slots, step.kv_lens,
                             step.cu_q_lens, step.distribution, ratio=ratio, interpret=True)


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_any_split_gives_bit_identical_entries_and_state(data):
    """Two sequences (ratio 4, d 16) split independently into prefill chunks and decode steps
    (one step carries both; rows padded to a few sizes, so steps run different programs) equal
    one prefill of both: every entry and the whole pool, bit for bit."""
    lens = [data.draw(st.integers(1, 14), label=f"len{i}") for i in range(2)]
    splits = [_split(data.draw, n, 4) for n in lens]
    rng = np.random.default_rng(lens)
    params = _params(rng, 4, 16, 8)
    seqs = [_tokens(rng, n, 4, 16) for n in lens]

    def run(splits):
        state, slots = _nan_state(3, 4, 16), jnp.asarray([1, 0, 2], jnp.int32)
        done, found = [0, 0], {}
        for k in range(max(len(s) for s in splits)):
            chunks = [(done[i], splits[i][k] if k < len(splits[i]) else 0) for i in range(2)]
            rows = min(b for b in (2, 8, 29) if b >= sum(q for _, q in chunks))
            entries, state = _pallas(_Step(seqs, chunks, rows, inactive=1), params, state,
                                     slots, 4)
            _collect(found, entries)
            done = [a + q for a, q in chunks]
        return found, state

    one_shot = run([[n] for n in lens])
    assert len(one_shot[0]) == sum(n // 4 for n in lens)
    _assert_same(run(splits), one_shot)


def test_bad_input_is_refused_naming_the_numbers():
    """The reference's checks (``check_step_args``) and the VMEM knob."""
    cos, sin = vc.rope_tables(64, 8)
    args = [jnp.zeros((5, 32)), jnp.zeros((5, 32)), jnp.zeros((4, 32)), jnp.ones(16), cos, sin,
            vc.init_compressor_state(3, 4, 16), jnp.zeros(2, jnp.int32),
            jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32)]
    with pytest.raises(ValueError, match=r"ratio=8"):
        pvc.compress_step(*args, ratio=8, interpret=True)
    with pytest.raises(ValueError, match=r"kv must have shape \(5, 32\)"):
        pvc.compress_step(jnp.zeros((5, 16)), *args[1:], ratio=4, interpret=True)
    with pytest.raises(ValueError, match=r"precision=.bf8."):
        pvc.compress_step(*args, ratio=4, interpret=True, precision="bf8")
    with pytest.raises(ValueError, match=r"vmem_limit_bytes=-1"):
        pvc.compress_step(*args, ratio=4, interpret=True, vmem_limit_bytes=-1)
    with pytest.raises(ValueError, match=r"kv has T = 0 rows.*at least one row"):  # empty step
        pvc.compress_step(jnp.zeros((0, 32)), jnp.zeros((0, 32)), *args[2:], ratio=4,
                          interpret=True)


@pytest.mark.parametrize("ratio,d,precision", [(4, 512, "f32"), (4, 128, "bf16")])
def test_rope_rows_give_the_reference_bits(ratio, d, precision):
    """The tables given in the kernel's row layout (``rope_rows``: one 512-B row per entry):
    the layout is the definition's (each ``cos`` / ``sin`` value on both lanes of its pair,
    zero padding below), and a prefill-and-decode step from a NaN pool gives the reference's
    entries bit for bit (the same ops on the same values as the tables' tiles)."""
    rng = np.random.default_rng()
    params = _params(rng, ratio, d, 64)
    ape, weight, cos, sin = params
    rows = np.asarray(pvc.rope_rows(cos, sin))
    half = cos.shape[1]
    want_rows = np.zeros((cos.shape[0], 128), np.float32)
    want_rows[:, 128 - 4 * half:128 - 2 * half] = np.repeat(np.asarray(cos), 2, axis=1)
    want_rows[:, 128 - 2 * half:] = np.repeat(np.asarray(sin), 2, axis=1)
    np.testing.assert_array_equal(rows, want_rows)
    n = (3 if ratio == 4 else 1) * ratio + 1
    seqs = [_tokens(rng, m, ratio, d) for m in (n, ratio)]
    state, slots = _nan_state(2, ratio, d), jnp.asarray([1, 0], jnp.int32)
    step = _Step(seqs, [(0, n), (ratio - 1, 1)], n + 2)
    args = (*step.args, ape, weight, cos, sin, state, slots, step.kv_lens, step.cu_q_lens,
            step.distribution)
    got = pvc.compress_step(*args, ratio=ratio, interpret=True, precision=precision,
                            rope_rows=jnp.asarray(rows))
    want = vc.compress_step(*args, ratio=ratio, precision=precision)
    assert (np.asarray(got[0].entry) >= 0).sum() == n // ratio + 1
    np.testing.assert_array_equal(np.asarray(got[0].entry), np.asarray(want[0].entry))
    np.testing.assert_array_equal(np.asarray(got[0].rows).view(np.uint32),
                                  np.asarray(want[0].rows).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(got[1].kv), np.asarray(want[1].kv))


def test_rope_rows_counted_bytes_and_descriptors_equal_the_model():
    """``hbm_traffic.compressor_case`` with the tables in the row layout (4 sequences completing
    an entry, ratio 4, d 128): the interpreter's bytes and descriptors equal
    ``compressor_traffic(row_table=True)``'s, one 512-B table row DMA per entry (the tiles: 2 x 16
    KB and 2 DMAs per tile)."""
    from pallas_kernels.measure import hbm_traffic as ht

    case = ht.compressor_case(rope_rows=True)
    n = ht.count(case)
    assert n.dmas_unexecuted == 0
    assert n.bytes(lane_padded=True) + n.bytes("hbm", "hbm") == case.model.bytes_moved, n.table()
    assert n.descriptors == case.model.dmas == 7 * 4 + 5 + 2 + 1 + 4, n.table()
    tables = [c for c in n.select("hbm", "vmem", "dma") if c.shape == (1, 128)]
    assert len(tables) == 4 and {c.nbytes for c in tables} == {512}


def test_bad_rope_rows_are_refused_naming_the_shapes():
    cos, sin = vc.rope_tables(64, 64)
    args = [jnp.zeros((5, 256)), jnp.zeros((5, 256)), jnp.zeros((4, 256)), jnp.ones(128), cos,
            sin, vc.init_compressor_state(3, 4, 128), jnp.zeros(2, jnp.int32),
            jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32)]
    with pytest.raises(ValueError, match=r"rope_rows shape \(32, 128\) != \(64, 128\)"):
        pvc.compress_step(*args, ratio=4, interpret=True, rope_rows=jnp.zeros((32, 128)))
    with pytest.raises(ValueError, match=r"4 \* h <= 128: cos width h 64"):
        pvc.rope_rows(*vc.rope_tables(8, 128))
