"""The V4 layer statement's official bf16 regime (``attention_layer(..., precision="bf16")``)
against a float64 NumPy oracle of that regime (``tests/v4_bf16_oracle.py``), on every layer type
(window only, CSA, HCA) over a prefill then one-token decodes that cross the window (128) or a
group boundary; and ``"bf16"`` as the default, bit for bit (``"f32"`` on request).

Tolerances. The oracle is exact between the official bf16 roundings; the statement computes there in
f32. Where an exact value lies within f32 rounding of a bf16 rounding boundary the two round to
adjacent bf16 values (1 ulp); a flipped value before a QAT simulation can move its fp8 / fp4 code by
one step. So the rounded intermediates (window keys, compressed entries, index keys, index scores)
must be bit-equal but for a few elements (``FLIP_FRACTION``), each at most one quantizer step (fp8
e4m3: 2**-3 relative) away. A flip moves everything downstream by about one ulp of its size, and the
output's own rounding adds one more, so the outputs are compared in bf16 ulps of the row's largest
output (ulp at magnitude ``m``: ``2**(floor(log2 m) - 7)``): at most ``OUT_ULPS = 3`` (measured: up
to 2, from a few 1-ulp flips upstream, e.g. in a probability near 1, plus the output's rounding), a
mean of at most ``OUT_MEAN_ULPS`` (measured: 0.004 to 0.073, the highest where one window key's fp8
code moved), and at most ``OUT_FLIP_FRACTION`` of the elements a whole ulp or more apart (measured:
under 0.9%). The f32 statement fails it (measured against the same oracle with QAT: 4.5 to 8.2 ulps,
about 30% of the elements a whole ulp or more apart;
``test_the_f32_statement_is_not_the_bf16_regime`` checks it without QAT). The CSA selections are
compared by the oracle's scores: the statement's picks must score (by the oracle) as the oracle's
own top-k does, entry by entry in sorted order, within one ulp of the cut-off score (ties at a bf16
score are common); the outputs are then compared with the oracle fed the statement's picks."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import v4_bf16_oracle as oracle

import dsa_jax
from reference import deepseek_v4 as dv
from reference import v4_compressor as vc
from reference.quant.bf16 import V4_DEFAULT_PRECISION
from reference.statements import deepseek_v4_layer as dl
from reference.statements.deepseek_v4_layer import rope_tables

B = 2
OUT_ULPS = 3.0
OUT_MEAN_ULPS = 0.15
OUT_FLIP_FRACTION = 0.02
FLIP_FRACTION = 1e-3
# (ratio, prefill tokens, total tokens, max_seq_len): ratio 0 and 128 cross the window (the ring
# wraps at 128) and ratio 128's first group completes (token 127) during the decodes; ratio 4
# completes groups 9 and 10 during the decodes, with more visible entries (up to 11) than its
# top-k (8), so the indexer chooses.
RUNS = {0: (126, 131, 136), 128: (125, 130, 136), 4: (37, 45, 48)}


@functools.cache
def _params(config):
    return dv.init_params(config, seed=7)


def _x(config, n, b=B):
    return np.random.default_rng(1).standard_normal((b, n, config.dim), dtype=np.float32)


def _tables(config, max_seq):
    """The official f32 RoPE tables of the layer type (the statement's own, public), as float64
    (the oracle's input)."""
    return tuple(np.asarray(t, np.float64) for t in rope_tables(config, max_seq))


@functools.cache
def _run(ratio, qat, precision):
    """The statement over ``RUNS[ratio]``: a prefill then one-token decodes. Returns ``(out
    f32[B, n, dim], state, topk, scores)`` (selection arrays ``None`` off CSA)."""
    cut, n, max_seq = RUNS[ratio]
    config = dv.tiny_config(ratio)
    x = _x(config, n)
    state = dv.init_state(config, B, max_seq)
    outs, sels = [], []
    for start, stop in [(0, cut), *((t, t + 1) for t in range(cut, n))]:
        pos = 0 if start == 0 else jnp.int32(start)
        out, state, sel = dv.attention_layer(_params(config), x[:, start:stop], pos, state,
                                             config, qat=qat, return_selection=True,
                                             precision=precision)
        assert out.dtype == (jnp.bfloat16 if precision == "bf16" else jnp.float32)
        outs.append(np.asarray(out, np.float32))
        sels.append(sel)
    topk = scores = None
    if ratio == 4:
        topk = np.concatenate([np.asarray(s.topk) for s in sels], axis=1)
        scores = np.concatenate([np.asarray(s.scores) for s in sels], axis=1)
    return np.concatenate(outs, axis=1), state, topk, scores


def _oracle(config, b, n, max_seq, qat, picks=None):
    p = {k: np.asarray(v) for k, v in _params(config).items()}
    cos, sin = _tables(config, max_seq)
    return oracle.layer(p, _x(config, n)[b].astype(np.float64), config, cos, sin, qat=qat,
                        picks=picks)


def _out_close(got, want):
    """``(within the tolerance, mean error)`` of an output against the oracle's."""
    worst, mean, flips = oracle.out_error(got, want)
    return worst <= OUT_ULPS and mean <= OUT_MEAN_ULPS and flips <= OUT_FLIP_FRACTION, mean


def _assert_out_close(got, want):
    assert _out_close(got, want)[0], oracle.out_error(got, want)


def _assert_rounded_close(name, got, want, step=2.0 ** -3, floor=2.0 ** -12):
    """Bit-equal but for ``FLIP_FRACTION`` of the elements, each within one quantizer step:
    ``step |want| + floor max|want|`` over the last axis (defaults: an e4m3 step, which also
    bounds a bf16 ulp, and e4m3's subnormal step; for e2m1 codes ``step=0, floor=0.7``: its
    largest step, ``2 s``, is under ``2 / 3`` of the block's amax)."""
    got = np.asarray(got, np.float64)
    assert (got != want).mean() <= FLIP_FRACTION, (name, (got != want).mean())
    bound = step * np.abs(want) + floor * np.abs(want).max(axis=-1, keepdims=True)
    assert (np.abs(got - want) <= bound).all(), (name, np.abs(got - want).max())


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_bf16_regime_matches_the_f64_oracle(ratio):
    """QAT on (the released model's regime); every batch row, prefill and decode rows."""
    cut, n, max_seq = RUNS[ratio]
    config = dv.tiny_config(ratio)
    out, state, topk, scores = _run(ratio, True, "bf16")
    for b in range(B):
        want = _oracle(config, b, n, max_seq, True)
        lo = max(0, n - config.window_size)
        ring_rows = np.arange(lo, n) % config.window_size
        _assert_rounded_close("window", np.asarray(state.window[b])[ring_rows], want["kv"][lo:])
        if ratio:
            _assert_rounded_close("compressed", state.compressed[b, :n // ratio], want["comp"])
        picks = None
        if ratio == 4:
            _assert_rounded_close("index_keys", state.index_keys[b, :n // 4],
                                  want["index_keys"], step=0.0, floor=0.7)
            seen = np.isfinite(want["scores"])
            np.testing.assert_array_equal(np.isfinite(scores[b, :, :n // 4]), seen)
            _assert_rounded_close("scores", scores[b, :, :n // 4][seen], want["scores"][seen],
                                  step=0.0, floor=2.0 ** -3)
            same = oracle.same_selection_by_score(topk[b], want["scores"], want["picks"],
                                                   config.index_topk)
            assert same >= 0.95 * n, same
            picks = [row[row >= 0] for row in topk[b]]
            want = _oracle(config, b, n, max_seq, True, picks)
        _assert_out_close(out[b], want["out"])


# ---------------------------------------------------------------------------------------------
# Without QAT, "bf16" as the default, the names.

PREFILL = 12  # one window-only prefill (cheap to compile)


@functools.cache
def _prefill(precision=None):
    config = dv.tiny_config(0)
    kwargs = {} if precision is None else {"precision": precision}
    return dv.attention_layer(_params(config), _x(config, PREFILL), 0,
                              dv.init_state(config, B, 16), config, **kwargs)


def test_bf16_is_the_default_bit_for_bit():
    """The statement's default is the official regime (issue 27), bit for bit; and the default
    of every V4 layer entry is that one declaration (``V4_DEFAULT_PRECISION``)."""
    out, state = _prefill()
    out16, state16 = _prefill("bf16")
    assert out.dtype == out16.dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves((out, state)), jax.tree.leaves((out16, state16)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(a).dtype == np.asarray(b).dtype
    assert V4_DEFAULT_PRECISION == "bf16"
    for fn in (dv.attention_layer, dl.project_layer_inputs, dl.layer_output, dsa_jax.v4_project,
               dsa_jax.v4_output, dsa_jax.v4_step, dsa_jax.sharded_v4_step):
        default = inspect.signature(fn).parameters["precision"].default
        assert default == V4_DEFAULT_PRECISION, (fn.__qualname__, default)


def test_bf16_without_qat_matches_the_f64_oracle():
    """QAT off (no fp8 simulation on the keys), one window-only prefill."""
    config = dv.tiny_config(0)
    out, state = _prefill("bf16")
    assert out.dtype == jnp.bfloat16
    for b in range(B):
        want = _oracle(config, b, PREFILL, 16, False)
        _assert_rounded_close("window", state.window[b, :PREFILL], want["kv"])
        _assert_out_close(np.asarray(out[b], np.float32), want["out"])


def test_the_f32_statement_is_not_the_bf16_regime():
    """The tolerance has teeth: on the same prefill the f32 statement fails it, its mean error
    at least 10 times the bf16 statement's (measured: 0.39 / 0.45 ulp against 0.014 / 0.025)."""
    config = dv.tiny_config(0)
    out32, out16 = _prefill("f32")[0], _prefill("bf16")[0]
    for b in range(B):
        want = _oracle(config, b, PREFILL, 16, False)["out"]
        ok32, mean32 = _out_close(np.asarray(out32[b]), want)
        ok16, mean16 = _out_close(np.asarray(out16[b], np.float32), want)
        assert ok16 and not ok32 and mean32 > 10 * mean16, (mean32, mean16)


def test_an_unknown_precision_is_refused_naming_the_names():
    config = dv.tiny_config(4)
    x = _x(config, 4)
    with pytest.raises(ValueError, match=r"precision must be one of \('f32', 'bf16'\), got "
                                         r"precision='bfloat16'"):
        dv.attention_layer(_params(config), x, 0, dv.init_state(config, B, 16), config,
                           precision="bfloat16")
    kv = jnp.zeros((4, 256))
    state = vc.init_compressor_state(1, 4, 128)
    cos, sin = vc.rope_tables(16)
    with pytest.raises(ValueError, match=r"precision must be one of \('f32', 'bf16'\)"):
        vc.compress_step(kv, kv, jnp.zeros((4, 256)), jnp.ones(128), cos, sin, state,
                         jnp.zeros(1, jnp.int32), jnp.full(1, 4, jnp.int32),
                         jnp.array([0, 4], jnp.int32), jnp.array([0, 1, 1], jnp.int32),
                         ratio=4, precision="fp16")
