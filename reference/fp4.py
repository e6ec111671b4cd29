"""DeepSeek-V4's FP4 simulation of the indexer's q and keys (``index_quant="fp4_sim"``).

The official V4 inference code rotates the indexer's query heads and compressed keys with a
normalized Hadamard transform of their 128 dims and then simulates FP4 on them (its tilelang
``fp4_act_quant``; ``shared/SPEC.md`` "DeepSeek-V4 attention" states the rule). Per block of 32
consecutive features of a row, in f32:

    amax = max(max |x|, 6 * 2**-126)
    s    = 2**ceil(log2(amax / 6))                 (ue8m0: a power of two; ceil from the bits)
    x'   = e2m1(clamp(x / s, -6, 6)) * s

with ``e2m1`` rounding to the nearest of ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (and their negatives),
ties to the even mantissa bit (``0.25 -> 0``, ``0.75 -> 1``, ``2.5 -> 2``, ``5 -> 4``). The
quotient ``amax / 6`` is a correctly rounded f32 division (``reference.fp8._divide``) and the
ceiling is taken from its f32 bits (``reference.fp8._pow2_ceil``), as SPEC.md says; ``x / s``
divides by a power of two (exact for every normal result). The result is exact in f32 (an e2m1
value times a power of two). NaN stays NaN (its block's amax is NaN, so the whole block is NaN).

Hadamard: ``hadamard(x) = x @ H_128 / sqrt(128)`` with Sylvester's ``H[i, j] = (-1)**popcount(i &
j)`` (the natural order of ``fast_hadamard_transform``, which the official ``rotate_activation``
calls with ``scale = 128 ** -0.5``); an f32 matmul at HIGHEST precision here, so it agrees with
the official bf16 transform to rounding, not bit for bit (only the quantizer rule is bit-exact).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reference import fp8

HADAMARD_DIM = 128
FP4_BLOCK = 32
E2M1_MAX = 6.0
E2M1_MIN_AMAX = 6.0 * 2.0**-126  # the amax floor: s >= 2**-126 (a normal power of two)
INDEX_QUANTS = (None, "fp4_sim")


@functools.lru_cache(maxsize=4)
def hadamard_matrix(dim: int = HADAMARD_DIM) -> np.ndarray:
    """Sylvester's ``f32[dim, dim]`` Hadamard matrix (entries +-1), ``dim`` a power of two."""
    i = np.arange(dim)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0).astype(np.float32)


def hadamard(x: jax.Array) -> jax.Array:
    """Normalized Hadamard rotation of the last dim (``HADAMARD_DIM``): ``f32[..., 128]``."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))
    y = jnp.einsum("...d,de->...e", x.astype(jnp.float32), h,
                   precision=jax.lax.Precision.HIGHEST)
    return y * jnp.float32(x.shape[-1] ** -0.5)


def round_e2m1(y: jax.Array) -> jax.Array:
    """Round f32 ``y`` with ``|y| <= 6`` to the e2m1 grid, ties to the even mantissa: the grid
    step is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; ``round`` (half to even) of ``|y| / step``
    picks the even mantissa at a tie because the multiples' parity is the mantissa bit."""
    a = jnp.abs(y)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    return jnp.sign(y) * jnp.round(a / step) * step


def fp4_sim(x: jax.Array) -> jax.Array:
    """The FP4 simulation (module docstring) of ``x f32[..., D]`` in blocks of ``FP4_BLOCK``
    along the last dim (``D % 32 == 0``). Returns f32 of ``x``'s shape."""
    x = x.astype(jnp.float32)
    *lead, d = x.shape
    if d % FP4_BLOCK:
        raise ValueError(f"fp4_sim needs the last dim to be whole blocks of {FP4_BLOCK}, got "
                         f"{d} ({d} % {FP4_BLOCK} = {d % FP4_BLOCK})")
    xb = x.reshape(*lead, d // FP4_BLOCK, FP4_BLOCK)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), E2M1_MIN_AMAX)
    amax = jnp.where(jnp.any(jnp.isnan(xb), axis=-1, keepdims=True), jnp.nan, amax)
    s = fp8._pow2_ceil(fp8._divide(amax, jnp.float32(E2M1_MAX)))
    y = jnp.clip(fp8._divide(xb, s), -E2M1_MAX, E2M1_MAX)
    return (round_e2m1(y) * s).reshape(x.shape)


def rotate_and_quantize(x: jax.Array) -> jax.Array:
    """``fp4_sim(hadamard(x))``: what the official indexer scores with, for q heads and keys."""
    return fp4_sim(hadamard(x))


def check_index_quant(index_quant, dim: int, cache_is_fp8: bool) -> None:
    """Refuse an unknown ``index_quant``, or ``"fp4_sim"`` with a head dim other than 128 or
    with an fp8 index cache (that cache is the other format), naming the values."""
    if index_quant not in INDEX_QUANTS:
        raise ValueError(f"index_quant must be one of {INDEX_QUANTS}, got {index_quant!r}")
    if index_quant is None:
        return
    if dim != HADAMARD_DIM:
        raise ValueError(f"index_quant={index_quant!r} rotates the {HADAMARD_DIM} index dims; "
                         f"q.shape[2] (D) = {dim}")
    if cache_is_fp8:
        raise ValueError(f"index_quant={index_quant!r} simulates FP4 on f32/bf16 keys; an fp8 "
                         "index cache (Fp8IndexCache) is the other format")
