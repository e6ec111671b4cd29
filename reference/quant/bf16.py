"""The precision regimes of the DeepSeek-V4 statements: ``"f32"`` (everything f32) and
``"bf16"`` (the official inference code's: bf16 activations, rounded at fixed points; see
``reference.statements.deepseek_v4``'s docstring for where). This module holds the regime names,
their check and the one rounding the bf16 regime uses: round to nearest even to bf16, the value
kept in an f32 array (so the f32 arithmetic around it is unchanged, and a bf16 product of two such
values accumulated in f32 is an f32 matmul of them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["PRECISIONS", "V4_DEFAULT_PRECISION", "check_precision", "round_bf16", "rounding"]

PRECISIONS = ("f32", "bf16")
# The default regime of the DeepSeek-V4 layer: its statement and pieces
# (``reference.statements``), ``dsa_jax.v4_project`` / ``v4_step`` / ``v4_output`` and the
# sharded step: the official one (issue 27). The ops below them (indexer, V4 attention,
# compressor) keep ``"f32"`` as theirs: their callers choose.
V4_DEFAULT_PRECISION = "bf16"


def check_precision(precision) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else ValueError listing them."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got precision={precision!r}")
    return precision


def round_bf16(x: jax.Array) -> jax.Array:
    """``f32[...] -> f32[...]``: each value rounded to the nearest bf16 (ties to even; +-inf and
    NaN kept), still held in f32.

    Written as ``lax.reduce_precision`` (8 exponent, 7 mantissa bits: bf16's), not as the convert
    pair ``f32 -> bf16 -> f32``: XLA may drop such a pair as excess precision, and XLA:CPU's
    YNNPACK fusion (a dot fused with its elementwise consumers and a reduce, jax 0.10.2) does,
    so ``round(dot)`` and ``round(relu(.) * w)`` came back unrounded under ``jit`` on CPU.
    ``reduce_precision`` is the op XLA keeps (and rounds the same: RNE, inf and NaN kept).

    A bf16 ``x`` is its own rounding: only the convert, no ``reduce_precision`` (XLA keeps that op
    even then, and on a weight it is a rounded copy of the whole weight in HBM every call:
    measured 9 x 134 MB a V4.1 step on ``wo_a``, XLA's TPU model)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        return x.astype(jnp.float32)
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def _identity(x: jax.Array) -> jax.Array:
    return x


def rounding(precision: str):
    """The activation rounding of a regime: ``round_bf16`` for ``"bf16"``, the identity (no op
    in the traced program) for ``"f32"``."""
    return round_bf16 if check_precision(precision) == "bf16" else _identity
