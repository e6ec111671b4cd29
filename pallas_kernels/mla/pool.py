"""The token-packed page cache: a page-kernel cache format for pools stored ``[P, ps / k, k, D]``.

``TokenPackedCache(pool)`` wraps ``pool: f32|bf16[P, page_size / k, k, D]``, ``k = 32 // bits``
(2 for bf16: two tokens per 32-bit word row; 1 for f32), the layout sglang-jax's
``get_kv_cache_shape`` gives its pools. Token ``t`` of page ``p`` is ``pool[p, t // k, t % k]``;
the logical cache is the row-major reshape ``[P, page_size, D]`` (``view``), which is what the
format means: the same rows in the same order, so every op's definition holds unchanged. A
stacked pool (``[L, P, ps / k, k, D]``) reads in place at ``layer=`` as any stacked cache does
(``reference.formats.stacked``). A pytree: it passes through ``jax.jit``.

Why a format and not the reshape (measured, AOT through libtpu 0.0.42, jax 0.10.2): on a CPU the
reshape is a bitcast, but XLA TPU tiles ``bf16[P, 32, 2, 640]`` as ``T(2,128)(2,1)`` and
``bf16[P, 64, 640]`` as ``T(8,128)(2,1)``: different bytes, so the reshape is a full relayout
copy of the pool, and a donated pool written and returned 4-D pays it twice (in and out). At 8
decode rows x 8K context, H = 16, ``P = 1025``, ``ps = 64`` (an 84 MB pool) the XLA side of
sglang-jax's ``sparse_mla_page_level`` was 676 MB against the kernel's 21 MB on v6e
(``scripts/cost/engine_glue.py``).

How the page kernel reads it in place (``kernel.gather_attend``): the pallas_call operand is the
pool itself (5-D with the layer dim; Mosaic takes XLA's ``T(2,128)(2,1)`` tiling for it, no copy
in the program), one DMA per selected page moves ``pool[layer, page]`` (``[ps / k, k, D]``: whole
``(2, 128)`` tiles, the same bytes as a ``[ps, D]`` page) into a VMEM buffer of that shape, and
the block is read as ``buf.reshape(rows, D)``: token order, so the masks are the plain path's.
Mosaic compiles that reshape on v5e, v6e and tpu7x. Every form probed compiles on all three
(the reshape; the even / odd token halves ``buf[:, h, :]`` attended apart; the pair bitcast to
u32 in VMEM, or as the HBM ref, and unpacked by shift / mask); the reshape emits by far the
fewest vector ops (Mosaic's dump after apply-vector-layout, one 64 x 640 bf16 page into the
natural ``[64, 640]`` layout: v6e and tpu7x 64 sublane shuffles + 56 gathers, v5e 56 loads;
the u32 unpack 320 rotates + 320 gathers + 280 selects; the halves ~1650 such ops). The VMEM
buffer gets the same ``(2,128)(2,1)`` tiling (Mosaic's dump), so it is the page's bytes, as a
``[ps, D]`` page's buffer is. Not measured (no TPU here): the time of that in-VMEM relayout per
page; it replaces two HBM copies of the whole pool per call.

Page mode only: a single token row shares its 32-bit words with its pair, so a token gather
(``sparse_mla``) cannot DMA it (``NotImplementedError``; the packed cache of
``reference.formats.packed_cache`` is the token kernel's format).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from reference.core.checks import FLOAT_DTYPES
from reference.formats import fp8_cache

WORD_BITS = 32  # tokens per word row: 32 // bits of the dtype


def tokens_per_word(dtype) -> int:
    """``k = 32 // bits``: tokens sharing one 32-bit word row (bf16: 2, f32: 1)."""
    return WORD_BITS // (jnp.dtype(dtype).itemsize * 8)


@dataclass(frozen=True)
class TokenPackedCache:
    """``pool f32|bf16[..., P, page_size / k, k, D]`` read as the ``[..., P, page_size, D]``
    cache it holds (module docstring). A pytree."""

    pool: jax.Array

    @property
    def dtype(self):
        return jnp.dtype(jnp.result_type(self.pool))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., P, page_size, D)``."""
        *lead, pairs, k, dim = np.shape(self.pool)
        return (*lead, pairs * k, dim)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def logical(self) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the logical cache (what the single-layer checks read)."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    def view(self) -> jax.Array:
        """The logical cache as an array: the row-major reshape (free on CPU; on TPU a relayout
        copy of the pool: for implementations that read rows, e.g. the jnp reference)."""
        return jnp.reshape(self.pool, self.shape)


jax.tree_util.register_dataclass(TokenPackedCache, data_fields=["pool"], meta_fields=[])


def wrap(pool, name: str = "cache_kv") -> TokenPackedCache:
    """``TokenPackedCache(pool)`` after the static checks: rank >= 4, a float dtype the ops
    read (f32 / bf16), and dim ``-2`` equal to ``32 // bits``; ``ValueError`` /
    ``TypeError`` naming ``name`` and the numbers otherwise."""
    shape = tuple(np.shape(pool))
    if len(shape) < 4:
        raise ValueError(f"{name} must be [..., P, page_size / k, k, D] (rank >= 4), got "
                         f"shape {list(shape)}")
    dtype = jnp.dtype(jnp.result_type(pool))
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} dtype {dtype} is not a token-packed format (f32 / bf16)")
    k = tokens_per_word(dtype)
    if shape[-2] != k:
        raise ValueError(f"{name}.shape[-2] must be 32 // bits = {k} for {dtype}, got shape "
                         f"{list(shape)}")
    return TokenPackedCache(pool)


def kernel_operand(cache):
    """The array the gather kernel DMAs from: an fp8 latent cache's words, a token-packed
    cache's pool (rank one more than the logical cache), else the cache itself."""
    if isinstance(cache, TokenPackedCache):
        return cache.pool
    return cache.words if isinstance(cache, fp8_cache.Fp8LatentCache) else cache


def refuse_token_rows(where: str, cache) -> None:
    """``NotImplementedError`` for a token gather of a ``TokenPackedCache`` (module
    docstring: a token row shares its words with its pair)."""
    if isinstance(cache, TokenPackedCache):
        raise NotImplementedError(
            f"{where}: a TokenPackedCache {list(np.shape(cache.pool))} is read by whole pages "
            f"only (page_sparse_mla); a single token row shares its 32-bit words with its pair")
