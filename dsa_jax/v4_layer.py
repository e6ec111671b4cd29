"""The DeepSeek-V4 layer around the paged step, public: ``v4_project`` (the per-layer inputs the
step takes, from the layer's tokens), ``v4_output`` (the layer output from the step's attention
output) and ``v4_rope_tables`` (the RoPE tables of a layer type). They call the dense statement's
own pieces (``reference.statements.deepseek_v4_layer``: ``project_layer_inputs``,
``layer_output``, ``rope_tables``), which the statement's layer calls too, so in both precision
regimes they equal the statement's computation by construction.

A whole layer on the paged step: ``v4_project`` per layer -> stack into ``V4StepInputs`` ->
``v4_step`` -> ``v4_output`` per layer on ``result.out[l]``, in either precision regime:
``"bf16"`` (the default of all three and of the statement: the official regime) or ``"f32"``;
given the same regime throughout, step + these functions equal the statement
(``tests/test_v4_step.py``, both backends).

Positions index RoPE tables of ``max_seq_len`` rows: a concrete position outside ``[0,
max_seq_len)`` raises ValueError; a traced one is the caller's business (``jnp.take`` clips it:
an unspecified result)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from reference.core import checks as _checks
from reference.quant.bf16 import V4_DEFAULT_PRECISION, check_precision
from reference.statements.deepseek_v4 import _check_qat
from reference.statements.deepseek_v4_config import V4AttentionConfig, check_params
from reference.statements.deepseek_v4_layer import (
    BF16_WEIGHTS,
    layer_output,
    project_layer_inputs,
    rope_tables,
)

__all__ = ["v4_output", "v4_project", "v4_rope_tables"]


def v4_rope_tables(config: V4AttentionConfig, max_seq_len: int):
    """``(cos, sin) f32[max_seq_len, rope_head_dim // 2]`` (NumPy) of ``config``'s layer type:
    compressed layers ``compress_rope_theta`` with YaRN, window-only layers ``rope_theta``
    without. (``V4StepParams.cos`` / ``sin`` are the compressed layers' tables.)"""
    _check_config(config, max_seq_len)
    return rope_tables(config, int(max_seq_len))


def _check_config(config, max_seq_len):
    """``config`` a ``V4AttentionConfig`` (TypeError), ``max_seq_len`` a positive int."""
    if not isinstance(config, V4AttentionConfig):
        raise TypeError(f"config must be a V4AttentionConfig, got {type(config).__name__}")
    if not isinstance(max_seq_len, int | np.integer) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")


def _check(params, x, positions, config, max_seq_len, precision, x_name, x_rank, x_dims):
    """The shared refusals: config, precision, params (``check_params``), ``x``'s trailing dims,
    ``positions i32[S]`` matching ``x``'s token axis and inside the RoPE tables."""
    _check_config(config, max_seq_len)
    check_precision(precision)
    check_params(params, config)
    _checks.rank(x_name, x, x_rank)
    _checks.floating(x_name, x)
    for axis, (want, what) in x_dims.items():
        _checks.dim(x_name, x, axis, want, what)
    _checks.rank("positions", positions, 1)
    _checks.integer("positions", positions)
    s = np.shape(x)[-x_rank]
    if np.shape(positions)[0] != s:
        raise ValueError(f"positions must hold one position per token of {x_name}: "
                         f"{x_name} has {s} tokens (shape {tuple(np.shape(x))}), positions "
                         f"has shape {tuple(np.shape(positions))}")
    if not isinstance(positions, jax.core.Tracer) and s:
        p = np.asarray(positions)
        lo, hi = int(p.min()), int(p.max())
        if hi >= max_seq_len:
            raise ValueError(f"positions must be < max_seq_len={max_seq_len} (the RoPE "
                             f"tables' rows), got position {hi}")
        if lo < 0:
            raise ValueError(f"positions must be >= 0, got position {lo}")


@functools.partial(jax.jit, static_argnames=("config", "max_seq_len", "qat", "precision"))
def _project(params, x, positions, config, max_seq_len, qat, precision):
    return project_layer_inputs(_f32(params, precision), x, positions, config, max_seq_len, qat,
                                precision)


@functools.partial(jax.jit, static_argnames=("config", "max_seq_len", "precision"))
def _output(params, o, positions, config, max_seq_len, precision):
    out = layer_output(_f32(params, precision), o, positions, config, max_seq_len, precision)
    return out if precision == "f32" else out.astype(jax.numpy.bfloat16)


def _f32(params, precision):
    """Inside the jit: every weight upcast (exactly) where it is read, not copied to f32 in HBM;
    under ``"bf16"`` a bf16 weight the regime rounds (``BF16_WEIGHTS``) stays bf16 for the
    statement's rounding, which is then only its convert (``round_bf16``), not a rounded copy
    of the weight."""
    keep = precision == "bf16"
    return {k: v if keep and k in BF16_WEIGHTS and v.dtype == jax.numpy.bfloat16
            else jax.numpy.asarray(v, jax.numpy.float32) for k, v in params.items()}


def v4_project(params, x, positions, config: V4AttentionConfig, *, max_seq_len: int,
               qat: bool = False, precision: str = V4_DEFAULT_PRECISION):
    """One layer's step inputs for the tokens ``x f32|bf16[T, dim]`` (after ``attn_norm``) at
    absolute positions ``positions i32[T]`` (any sequences, any order).

    Args:
      params: the layer's parameters by the checkpoint's names (``param_shapes(config)``,
        exactly as ``attention_layer`` takes them; dequantized).
      x: ``[T, dim]``.
      positions: ``i32[T]``, each token's absolute position in its sequence.
      config: the layer's ``V4AttentionConfig`` (static).
      max_seq_len: rows of the RoPE tables (static): every position must be below it.
      qat: the official QAT simulations on the window key (fp8 nope dims) and the indexer query
        (Hadamard, fp4) (static).
      precision: ``"bf16"`` (the default, the official regime's rounding points, as the
        statement's ``precision``) or ``"f32"``; static.

    Returns a dict of f32 arrays (bf16 values under ``"bf16"``): ``q [T, n_heads, head_dim]``,
    ``window_kv [T, head_dim]``; compressed layers ``kv`` / ``score [T, head_dim]``; ratio 4
    ``index_q [T, index_n_heads, index_head_dim]``, ``index_weights [T, index_n_heads]``,
    ``index_kv`` / ``index_score [T, index_head_dim]``: one layer's slice of ``V4StepInputs``.

    Raises ValueError on a missing, unexpected or misshapen param (naming the key and both
    shapes), an unknown precision, ``x``'s last dim != ``config.dim``, a ``positions`` length
    != ``T`` or a concrete position outside ``[0, max_seq_len)`` (a traced one out of range
    gives an unspecified result)."""
    _check(params, x, positions, config, max_seq_len, precision, "x", 2,
           {1: (config.dim if isinstance(config, V4AttentionConfig) else None, "config.dim")})
    if qat:
        _check_qat(config)
    return _project(params, jax.numpy.asarray(x, jax.numpy.float32),
                    jax.numpy.asarray(positions, jax.numpy.int32), config, int(max_seq_len),
                    bool(qat), precision)


def v4_output(params, o, positions, config: V4AttentionConfig, *, max_seq_len: int,
              precision: str = V4_DEFAULT_PRECISION):
    """The layer output from attention's ``o f32|bf16[T, n_heads, head_dim]`` (the step's
    ``result.out[l]``) at ``positions i32[T]``: inverse RoPE on the last ``rope_head_dim`` dims,
    the heads in ``o_groups`` groups each through its ``wo_a`` block, ``wo_b``.

    Returns ``f32[T, dim]`` (``bf16`` under ``"bf16"``, as ``attention_layer``). ``params``,
    ``max_seq_len``, ``precision`` and the refusals as ``v4_project`` (``o``'s last two dims
    must be ``(n_heads, head_dim)``)."""
    dims = {}
    if isinstance(config, V4AttentionConfig):
        dims = {1: (config.n_heads, "config.n_heads"), 2: (config.head_dim, "config.head_dim")}
    _check(params, o, positions, config, max_seq_len, precision, "o", 3, dims)
    return _output(params, jax.numpy.asarray(o, jax.numpy.float32),
                   jax.numpy.asarray(positions, jax.numpy.int32), config, int(max_seq_len),
                   precision)
