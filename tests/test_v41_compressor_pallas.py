"""The V4.1 Pallas compressor (``pallas_kernels.v41_compressor``) against
``reference.v41.compress_step`` (itself held to a float64 oracle in
``tests/test_v41_compressor.py``), bit for bit, in the strict interpreter (NaN-filled
uninitialised memory, out-of-bounds reads raising): every output stage, a chunked sequence whose
chunks start on odd positions, a ragged batch with an inactive slot, NaN rows outside every
sequence and NaN state rows that must not be read; d 128 (the kernel finishes the rows) and
d 64 (the glue does). Its traffic and DMA descriptors counted in the interpreter equal the
model (``traffic.step_traffic``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.measure import hbm_traffic as ht
from pallas_kernels.v41_compressor import compress_step, traffic
from reference.v4_compressor import CompressorState
from reference.v41 import compressor as ref

NUM_POS = 64
CHUNKS = (7, 4, 1, 1, 6, 3)  # starts 0, 7, 11, 12, 13, 19: odd starts take their partner


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _assert_no_races(capfd):
    """The strict interpreter (``interpret=True``: ``detect_races``) prints ``RACE DETECTED``
    for a race and goes on (its flag resets with each call), so the output is what tells."""
    out, err = capfd.readouterr()
    assert "RACE DETECTED" not in out + err, (out + err)[:2000]


def _nan_state(slots, d):
    return CompressorState(jnp.full((slots, 2, d), jnp.nan), jnp.full((slots, 2, d), jnp.nan))


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("output", ref.OUTPUTS)
def test_a_chunked_sequence_equals_the_reference_bit_for_bit(d, output, capfd):
    rng = np.random.default_rng(d)
    n = sum(CHUNKS)
    kv, score = rng.standard_normal((2, n, d), dtype=np.float32)
    weight = _bf16(1 + 0.25 * rng.standard_normal(d))
    cos, sin = ref.compressed_rope_tables(NUM_POS)
    s_ref = s_pal = _nan_state(3, d)  # slot 1 used; every row NaN until written
    start = 0
    for q in CHUNKS:
        args = (kv[start:start + q], score[start:start + q], weight, cos, sin)
        meta = (np.array([1]), np.array([start + q]), np.array([0, q]), np.array([0, 1, 1]))
        e_ref, s_ref = ref.compress_step(*args, s_ref, *meta, ratio=2, output=output)
        e_pal, s_pal = compress_step(*args, s_pal, *meta, ratio=2, output=output,
                                     interpret=True)
        assert _same(e_ref, e_pal), (output, start, q)
        assert _same(s_ref, s_pal), (output, start, q)
        start += q
    _assert_no_races(capfd)


def test_a_ragged_batch_with_nan_outside_equals_the_reference(capfd):
    """Two sequences (a prefill from an odd position, a decode completing an entry), an
    inactive third slot, two NaN rows after the last sequence's."""
    d, rng = 128, np.random.default_rng(1)
    kv, score = rng.standard_normal((2, 9 + 1 + 2, d), dtype=np.float32)
    kv[10:], score[10:] = np.nan, np.nan
    weight = _bf16(1 + 0.25 * rng.standard_normal(d))
    cos, sin = ref.compressed_rope_tables(NUM_POS)
    # sequence 0 (state slot 2): tokens 5..13, token 5's partner token 4 in ring row 0;
    # sequence 1 (slot 0): token 1, its partner token 0 in ring row 0; every other ring row NaN
    state = _nan_state(3, d)
    state = CompressorState(state.kv.at[2, 0].set(0.75).at[0, 0].set(1.5),
                            state.score.at[2, 0].set(-1.0).at[0, 0].set(0.25))
    meta = (np.array([2, 0, 1]), np.array([14, 2, 9]), np.array([0, 9, 10, 10]),
            np.array([0, 2, 2]))
    for output in ref.OUTPUTS:
        want = ref.compress_step(kv, score, weight, cos, sin, state, *meta, ratio=2,
                                 output=output)
        got = compress_step(kv, score, weight, cos, sin, state, *meta, ratio=2, output=output,
                            interpret=True)
        assert _same(want, got), output
        assert not np.isnan(np.asarray(got[0].rows)).any()
    _assert_no_races(capfd)


def test_ratio_1_is_the_reference_and_bad_arguments_are_refused():
    d, rng = 64, np.random.default_rng(2)
    kv = rng.standard_normal((5, d), dtype=np.float32)
    weight = np.ones(d, np.float32)
    cos, sin = ref.compressed_rope_tables(NUM_POS)
    meta = (np.array([0]), np.array([5]), np.array([0, 5]), np.array([0, 1, 1]))
    want = ref.compress_step(kv, None, weight, cos, sin, None, *meta, ratio=1)
    assert _same(want, compress_step(kv, None, weight, cos, sin, None, *meta, ratio=1))
    with pytest.raises(ValueError, match=r"ratio must be one of \(1, 2\), got ratio=4"):
        compress_step(kv, kv, weight, cos, sin, None, *meta, ratio=4)
    with pytest.raises(ValueError, match="output must be one of"):
        compress_step(kv, None, weight, cos, sin, None, *meta, ratio=1, output="bytes")
    with pytest.raises(ValueError, match="ratio 1 has no gate and no state"):
        compress_step(kv, kv, weight, cos, sin, None, *meta, ratio=1)
    with pytest.raises(ValueError, match=r"state.kv must be f32\[num_slots, ratio, d\]"):
        compress_step(kv, kv, weight, cos, sin, _nan_state(1, d + 1), *meta, ratio=2)


@pytest.mark.kernel_gate
@pytest.mark.parametrize("output", ["latent", "roped"])
def test_counted_traffic_and_descriptors_equal_the_model(output):
    """A decode step of 4 sequences at d 128, each completing an entry from its ring row: the
    bytes and DMA descriptors the interpreter counts equal ``traffic.step_traffic``'s (per
    sequence 7 descriptors, one per output slot, the two ape blocks and the norm weight block (a
    zero block for ``"latent"``, whose norm the glue applies); ``"roped"``: one cos and one sin
    table tile, every position in tile 0)."""
    d, seqs, rng = 128, 4, np.random.default_rng(3)
    kv_lens = [2 * (i + 2) for i in range(seqs)]
    kv, score = rng.standard_normal((2, seqs, d), dtype=np.float32)
    state = CompressorState(*rng.standard_normal((2, seqs, 2, d), dtype=np.float32))
    cos, sin = ref.compressed_rope_tables(NUM_POS)
    counts = traffic.decode_counts(seqs, traffic.RATIO)
    if output == "roped":
        counts = dataclasses.replace(counts, table_tiles=1)
    model = traffic.step_traffic(counts, d=d, output=output)
    case = ht.Case("v41_compressor", f"decode {seqs} ratio 2 d{d} {output}", lambda: compress_step(
        kv, score, np.ones(d, np.float32), cos, sin, state, np.arange(seqs), np.array(kv_lens),
        np.arange(seqs + 1), np.array([seqs] * 3), ratio=2, output=output,
        interpret=ht.INTERPRET), model, 0, "R=2")
    n = ht.count(case)
    assert n.dmas_unexecuted == 0
    assert n.bytes(lane_padded=True) + n.bytes("hbm", "hbm") == model.bytes_moved, n.table()
    slots = seqs // traffic.RATIO + seqs
    assert n.descriptors == model.dmas == 7 * seqs + slots + 3 + 2 * (output == "roped")
