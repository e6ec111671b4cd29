"""The packed bf16 latent cache: each token's bf16 row stored as 32-bit words it owns alone.

Format: ``u32[..., W]`` with ``W = packed_words(D)`` (``D/2`` rounded up to a multiple of 128;
640 -> 384). Word ``j`` of a token holds feature ``j`` in its low 16 bits and feature ``j + W``
in its high 16 bits (zero where ``j + W >= D``).

Why 32-bit words: TPU packs a plain bf16 array two *rows* per 32-bit word ((16, 128) tiles), so
one token's bf16 row cannot be moved by a DMA on its own (measured: Mosaic refuses it); a token
that owns whole words can be. Recovering the features is exact (bf16 is the top half of an
f32): ``bitcast(w << 16, f32)`` is features ``[0, W)``, ``bitcast(w & 0xFFFF0000, f32)`` is
features ``[W, 2W)``.

Why ``W`` a multiple of 128 and the "halves" pairing (j, j + W) rather than (2j, 2j + 1):
- TPU's default layout of an array whose minor dim is not a multiple of 128 may reorder its
  dims (measured: ``u32[8192, 64, 320]`` defaults to major-to-minor ``(1, 2, 0)``), so a kernel
  that needs token rows would force a relayout copy of the whole cache on every call; and
  Mosaic refuses a DMA of part of a row (320 of 384 words) at a row offset not a multiple of 8
  ("Offsets along tiled dimensions must be aligned to tiles"), so a row moves whole.
- With the split at ``W`` every slice the kernel takes (``q[:, :W]``, ``q[:, W:D]``, the value
  columns ``[0, W)`` and ``[W, v_dim)``) starts on a 128-lane boundary: the query needs no
  even/odd split copy and the output no interleave.
Cost: ``2W`` bf16 slots per token for ``D`` features (640 in 768: 1.2x the bytes of a plain
bf16 row, in HBM and in every gather).

On TPU, converting a bf16 array into this format is a full copy, so a serving cache must be
*stored* packed (the cache writer packs each new token row with ``pack_cache``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PACKED_DTYPE = jnp.uint32
LANES = 128
HIGH_MASK = 0xFFFF0000


def packed_words(dim: int) -> int:
    """Words per token row for latent dim ``dim``: ``ceil(dim / 2)`` rounded up to 128."""
    half = (dim + 1) // 2
    return (half + LANES - 1) // LANES * LANES


def is_packed(cache) -> bool:
    """True for a packed cache (``uint32`` words)."""
    return jnp.result_type(cache) == PACKED_DTYPE


def pack_cache(cache: jax.Array) -> jax.Array:
    """``bf16[..., D]`` (or ``f32``, rounded to bf16) -> ``u32[..., packed_words(D)]``.

    Other dtypes (f16, fp8, integers) are refused with a ValueError: rounding them to bf16
    would silently change their values' format."""
    dt = jnp.dtype(jnp.result_type(cache))
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"pack_cache packs bfloat16 (or float32, rounded to bfloat16) rows, "
                         f"got dtype {dt}")
    d = cache.shape[-1]
    w = packed_words(d)
    c = cache.astype(jnp.bfloat16)
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, 2 * w - d)])
    bits = jax.lax.bitcast_convert_type(c, jnp.uint16).astype(PACKED_DTYPE)
    return bits[..., :w] | (bits[..., w:] << 16)


def unpack_words(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``u32[..., W]`` -> (features ``[0, W)``, features ``[W, 2W)``), both exact ``f32``."""
    low = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
    high = jax.lax.bitcast_convert_type(words & jnp.uint32(HIGH_MASK), jnp.float32)
    return low, high


def unpack_cache(words: jax.Array, dim: int) -> jax.Array:
    """``u32[..., packed_words(dim)]`` -> ``bf16[..., dim]`` (exact inverse of ``pack_cache``).
    """
    if not is_packed(words):
        raise TypeError(f"unpack_cache needs a uint32 array, got dtype {jnp.result_type(words)}")
    if words.shape[-1] != packed_words(dim):
        raise ValueError(f"packed cache minor dim must be packed_words(dim={dim}) = "
                         f"{packed_words(dim)}, got {words.shape[-1]}")
    low, high = unpack_words(words)
    return jnp.concatenate([low, high], axis=-1)[..., :dim].astype(jnp.bfloat16)
