"""The V4 compressor as a public op (``dsa_jax.v4_compress_step``, ``dsa_jax.v4_compressor``):
with ``backend="reference"`` it is ``reference.v4_compressor.compress_step`` bit for bit
(prefill then decode), with ``backend="pallas"`` under the interpreter it is the Pallas entry's
result (entries to f32 rounding, the pool bit for bit: ``test_v4_compressor_pallas``), and a bad
backend name is refused naming it. Case builders from ``test_v4_compressor``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_v4_compressor import _nan_state, _params, _Step, _tokens
from test_v4_compressor_pallas import _check_step

import dsa_jax
from dsa_jax.v4_compressor import compress_step
from reference import v4_compressor as vc


def _args(step, params, state, slots):
    ape, weight, cos, sin = params
    return (*step.args, ape, weight, cos, sin, state, slots, step.kv_lens, step.cu_q_lens,
            step.distribution)


def _assert_bits(got, want):
    (e, s), (e_ref, s_ref) = got, want
    for part in ("rows", "seq", "entry"):
        np.testing.assert_array_equal(np.asarray(getattr(e, part)),
                                      np.asarray(getattr(e_ref, part)), err_msg=part)
    for part in ("kv", "score"):  # NaN where the pool was never written
        np.testing.assert_array_equal(np.asarray(getattr(s, part)),
                                      np.asarray(getattr(s_ref, part)), err_msg=part)


def test_the_package_exports_the_op():
    assert dsa_jax.v4_compress_step is compress_step
    assert "v4_compress_step" in dsa_jax.__all__


@pytest.mark.parametrize("ratio,d,lens,first", [(4, 128, [13, 8], [9, 4]),
                                                (128, 16, [131, 130], [128, 127])])
def test_reference_backend_is_the_reference_bit_for_bit_prefill_then_decode(ratio, d, lens,
                                                                              first):
    """A prefill chunk per sequence (plus an inactive slot) from a NaN pool, then decode steps
    of one token per sequence: entries and pool equal the reference's, bit for bit (the Pallas
    knobs are ignored by the reference)."""
    rng = np.random.default_rng([ratio, d, 2])
    params = _params(rng, ratio, d, 64 if d >= 64 else 8)
    seqs = [_tokens(rng, n, ratio, d) for n in lens]
    slots = jnp.asarray([2, 0, 1], jnp.int32)
    state = _nan_state(3, ratio, d)
    steps = [_Step(seqs, [(0, q) for q in first], sum(first) + 1, inactive=1)]
    for t in range(lens[0] - first[0]):  # decode: one token per sequence (entries complete)
        step = _Step(seqs, [(q + t, 1) for q in first], len(seqs) + 1, inactive=1)
        step.distribution = jnp.asarray([len(seqs), len(seqs), len(seqs)], jnp.int32)
        steps.append(step)
    for step in steps:
        args = _args(step, params, state, slots)
        want = vc.compress_step(*args, ratio=ratio)
        _assert_bits(compress_step(*args, ratio=ratio, backend="reference"), want)
        _assert_bits(compress_step(*args, ratio=ratio, backend="reference", interpret=True,
                                   vmem_limit_bytes=1 << 20), want)
        state = want[1]
    assert np.isnan(np.asarray(state.kv)[1]).all()  # the inactive sequence's slot


@pytest.mark.kernel_gate
def test_pallas_backend_in_interpret_mode_matches_the_reference():
    """Ratio 4, d 128, three sequences (prefill chunks crossing group boundaries, a slot
    outside the pool) and an inactive one: the Pallas backend under the interpreter equals the
    reference (entries to f32 rounding, the pool bit for bit)."""
    ratio, d = 4, 128
    rng = np.random.default_rng([ratio, d, 1])
    params = _params(rng, ratio, d, 64)
    lens, first = [14, 9, 5], [9, 8, 5]
    seqs = [_tokens(rng, n, ratio, d) for n in lens]
    step = _Step(seqs, [(0, q) for q in first], sum(first) + 2, inactive=1)
    args = _args(step, params, _nan_state(3, ratio, d), jnp.asarray([2, 0, 7, 1], jnp.int32))
    got = compress_step(*args, ratio=ratio, backend="pallas", interpret=True)
    _check_step(got, vc.compress_step(*args, ratio=ratio))


def _one_sequence(seed: int, tokens: int):
    """The arguments of one prefill chunk of ``tokens`` tokens (ratio 4, d 16) from a NaN pool."""
    rng = np.random.default_rng(seed)
    params = _params(rng, 4, 16, 8)
    seqs = [_tokens(rng, tokens, 4, 16)]
    return _args(_Step(seqs, [(0, tokens)], tokens), params, _nan_state(1, 4, 16),
                 jnp.asarray([0], jnp.int32))


def test_a_bad_backend_name_is_a_value_error_naming_it():
    args = _one_sequence(0, 5)
    with pytest.raises(ValueError, match="'tpu'"):
        compress_step(*args, ratio=4, backend="tpu")


def test_implementation_xla_is_backend_reference_and_names_are_checked():
    args = _one_sequence(1, 9)
    _assert_bits(compress_step(*args, ratio=4, implementation="xla"),
                 compress_step(*args, ratio=4, backend="reference"))
    with pytest.raises(ValueError, match=r"unknown implementation 'mosaic'.*'xla', 'pallas'"):
        compress_step(*args, ratio=4, implementation="mosaic")
