"""The official DeepSeek-V4 QAT simulations (the tilelang ``act_quant`` / ``fp4_act_quant``
with ``inplace=True``, and ``rotate_activation``), pure ``jnp``, f32.

- ``act_quant_sim``: fp8 e4m3 with ue8m0 (power-of-two) block scales, block 64 by default (the
  nope dims of the V4 window keys and compressed entries).
- ``fp4_act_quant_sim``: FP4 e2m1 with ue8m0 block scales, block 32 by default (the V4 indexer's
  query and compressed keys).
- ``hadamard_rotate``: the normalized Sylvester Hadamard rotation that precedes the FP4
  simulation on the indexer.

Where they apply: ``reference.statements.deepseek_v4`` (the dense layer statement, its module
docstring's "QAT" paragraph) and ``reference.indexer.scores`` (``fp4_sim``). They live here, not
in the statement, so that the index scores need not import the layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "FP4_AMAX_FLOOR", "FP4_MAX", "FP8_AMAX_FLOOR", "FP8_MAX", "QAT_FP4_BLOCK", "QAT_FP8_BLOCK",
    "act_quant_sim", "fp4_act_quant_sim", "hadamard_rotate",
]

QAT_FP8_BLOCK = 64  # act_quant on the nope dims of window / compressed keys
QAT_FP4_BLOCK = 32  # fp4_act_quant on the indexer's q and keys
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4  # act_quant: amax = max(amax, 1e-4)
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126  # fp4_act_quant: amax = max(amax, 6 * 2**-126)


def _pow2_ceil(s: jax.Array) -> jax.Array:
    """``2**ceil(log2(s))`` of f32 ``s > 0`` from the bits (the official ``fast_log2_ceil``:
    the biased exponent, plus one if any mantissa bit is set)."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return lax.bitcast_convert_type(exponent << 23, jnp.float32)


def _block_scale(x: jax.Array, block: int, floor: float, qmax: float):
    """``(blocks f32[..., n, block], s f32[..., n, 1])``: ``s = 2**ceil(log2(max(amax, floor) *
    f32(1 / qmax)))``, the official multiply by the f32 reciprocal (its power-of-two ceiling
    equals that of the exact quotient for every f32 amax)."""
    if x.shape[-1] % block:
        raise ValueError(f"the quantized width {x.shape[-1]} must be a multiple of the block "
                         f"size {block}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), jnp.float32(floor))
    return blocks, _pow2_ceil(amax * jnp.float32(1.0 / qmax))


def act_quant_sim(x: jax.Array, block: int = QAT_FP8_BLOCK) -> jax.Array:
    """The official fp8 QAT simulation of ``x f32[..., N]`` (``N % block == 0``), f32 out: per
    block ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, ``x -> e4m3(clamp(x / s, +-448)) * s``
    (RNE). The released model rounds the result to bf16, which is exact here (an e4m3 value
    times a power of two)."""
    blocks, s = _block_scale(x.astype(jnp.float32), block, FP8_AMAX_FLOOR, FP8_MAX)
    q = jnp.clip(blocks / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return (q * s).reshape(x.shape)


def _round_e2m1(y: jax.Array) -> jax.Array:
    """Round ``|y| <= 6`` to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even
    mantissa: the grid step is 0.5 below 2, 1 below 4, 2 up to 6, and the even mantissas are
    the even multiples of the step, so it is a half-to-even integer rounding of ``|y| / step``."""
    a = jnp.abs(y)
    step = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0)).astype(jnp.float32)
    return jnp.sign(y) * jnp.round(a / step) * step


def fp4_act_quant_sim(x: jax.Array, block: int = QAT_FP4_BLOCK) -> jax.Array:
    """The official FP4 QAT simulation of ``x f32[..., N]`` (``N % block == 0``), f32 out: per
    block ``s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))``, ``x -> e2m1(clamp(x / s, +-6)) *
    s`` (round to nearest, ties to even). Exact in bf16 as the released model stores it."""
    blocks, s = _block_scale(x.astype(jnp.float32), block, FP4_AMAX_FLOOR, FP4_MAX)
    return (_round_e2m1(jnp.clip(blocks / s, -FP4_MAX, FP4_MAX)) * s).reshape(x.shape)


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:  # Sylvester: [[H, H], [H, -H]]
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """The official ``rotate_activation``: ``(x @ H) * n**-0.5`` over the last dim ``n`` (a power
    of two), ``H`` the Sylvester Hadamard matrix (natural order, ``fast_hadamard_transform``'s)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    # HIGHEST: a TPU's default f32 matmul is one bf16 pass, which would round x before the sum
    return jnp.matmul(x, jnp.asarray(_hadamard_matrix(n)),
                      precision=lax.Precision.HIGHEST) * jnp.float32(n ** -0.5)
