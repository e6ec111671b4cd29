"""DeepSeek-V4's FP4 index simulation on a key tile inside the indexer kernel
(``index_quant="fp4_sim"``; the rule is ``reference.index_scores.fp4_sim``: a normalized
Hadamard rotation of the 128 dims, then ``reference.quant.qat.fp4_act_quant_sim``).

Only Mosaic-supported ops on a 2-D ``[N, 128]`` tile: the Hadamard matrix from iotas (the
parity of ``popcount(i & j)`` by xor-folds), one MXU matmul, per-32-lane-block maxima as masked
lane reductions (no lane-splitting reshape), the ue8m0 scale and its reciprocal from the f32
exponent bits, and the e2m1 rounding as integer arithmetic on exact values (no reliance on a
rounding mode). Every step after the matmul is exact or a single correctly rounded operation
that the reference also performs, so ``fp4_round`` equals ``fp4_act_quant_sim`` bit for bit on
every finite input (tests/test_fp4_indexer.py, in the interpreter). On hardware, where the TPU
flushes f32 subnormals, a result below ``2**-126`` (blocks whose amax is below ``6 * 2**-126``)
may read 0 where the reference keeps the subnormal. The matmul itself is an f32 sum of 128
terms whose order is the MXU's, so rotated values can differ from the reference's in the last
bit (compare selections by score, as across platforms).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reference.quant import qat

BLOCK = qat.QAT_FP4_BLOCK  # 32 lanes per ue8m0 scale
_SIGN = -(2**31)  # the f32 sign bit as an i32 mask
_MANTISSA = (1 << 23) - 1


def hadamard(n: int, dtype) -> jax.Array:
    """The Sylvester Hadamard matrix ``[n, n]`` (``H[i, j] = (-1)**popcount(i & j)``, the
    natural order of ``reference.quant.qat.hadamard_rotate``) built from iotas; +-1 is exact in
    bf16 and f32."""
    i = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    p = i & j
    for shift in (16, 8, 4, 2, 1):  # parity of the set bits lands in bit 0
        p = p ^ (p >> shift)
    return jnp.where((p & 1) == 1, -1.0, 1.0).astype(dtype)


def rotate(x: jax.Array, h: jax.Array) -> jax.Array:
    """``f32[N, n]``: ``(x @ H) * f32(n**-0.5)`` of ``x f32|bf16[N, n]`` (``h = hadamard(n,
    x.dtype)``). bf16 ``x`` takes one MXU pass (bf16 products with +-1 are exact, f32
    accumulate); f32 ``x`` takes ``HIGHEST`` (the products stay exact)."""
    prec = (jax.lax.Precision.HIGHEST if x.dtype == jnp.float32
            else jax.lax.Precision.DEFAULT)
    y = jax.lax.dot_general(x, h, (((1,), (0,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)
    return y * jnp.float32(x.shape[-1] ** -0.5)


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _f32(bits):
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def fp4_round(x: jax.Array) -> jax.Array:
    """``f32[N, W]`` (``W`` a multiple of 32): ``fp4_act_quant_sim`` of ``x f32[N, W]`` written
    with Mosaic ops. Per block of 32 lanes: ``amax = max(max|x|, 6 * 2**-126)``, ``s =
    2**ceil(log2(amax * f32(1/6)))`` from the bits (biased exponent, plus one if any mantissa
    bit), then ``|x| / s`` (as ``|x| * 2**-e``: the same correctly rounded value) rounded to e2m1
    with ties to the even mantissa, times ``s``, with ``x``'s sign bit (``-0`` for a negative
    value that rounds to 0, as the reference's ``sign(y) * 0``); a NaN element stays NaN (what
    the rest of its block reads then depends on the platform's max, as in the reference)."""
    rows, width = x.shape
    a = jnp.abs(x)
    group = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) // BLOCK
    s = inv = jnp.zeros((rows, width), jnp.float32)
    for g in range(width // BLOCK):
        mine = group == g
        amax = jnp.max(jnp.where(mine, a, 0.0), axis=1, keepdims=True)  # [N, 1]
        amax = jnp.maximum(amax, jnp.float32(qat.FP4_AMAX_FLOOR))
        q = _bits(amax * jnp.float32(1.0 / qat.FP4_MAX))
        e = (q >> 23) + jnp.where((q & _MANTISSA) != 0, 1, 0)  # biased exponent of s, 1..253
        s = jnp.where(mine, _f32(e << 23), s)
        inv = jnp.where(mine, _f32((254 - e) << 23), inv)  # 1 / s, exact (a power of two)
    y = jnp.minimum(a * inv, jnp.float32(qat.FP4_MAX))  # the clamp: only +-6 reach it
    # e2m1: step 0.5 below 2, 1 below 4, 2 up to 6; v = y / step in [0, 4] (exact), rounded
    # half to even as integers: the even mantissas are the even multiples of the step
    step = jnp.where(y < 2.0, 0.5, jnp.where(y < 4.0, 1.0, 2.0)).astype(jnp.float32)
    v = y * jnp.where(y < 2.0, 2.0, jnp.where(y < 4.0, 1.0, 0.5)).astype(jnp.float32)
    n = v.astype(jnp.int32)  # v >= 0: truncation is the floor
    frac = v - n.astype(jnp.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))
    mag = (n + jnp.where(up, 1, 0)).astype(jnp.float32) * step * s
    return jnp.where(x != x, x, _f32(_bits(mag) | (_bits(x) & _SIGN)))  # NaN stays NaN


def rotate_and_round(keys: jax.Array, h: jax.Array) -> jax.Array:
    """``f32[N, 128]``: the simulated keys of a tile ``keys f32|bf16[N, 128]`` (``fp4_sim``):
    the rotation ``rotate`` then ``fp4_round``. Every value is e2m1 times a power of two, so it
    is exact in bf16 (the kernel's score matmul then multiplies exactly)."""
    return fp4_round(rotate(keys, h))
