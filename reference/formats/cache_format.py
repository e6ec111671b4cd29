"""How a paged cache stores its token rows: one typed declaration instead of format strings.

A cache is ``[num_pages, page_size, W]``; its format says what ``W`` words of which dtype hold
one token's ``D`` features, and what the kernels compute in:

==============  ============  =========================  ==============  ================
format          stored dtype  words per row (W)          value dtype     bytes per row
==============  ============  =========================  ==============  ================
``F32``         float32       D                          float32         4 D
``BF16``        bfloat16      D                          bfloat16        2 D
``PACKED_BF16`` uint32        ``packed_words(D)``        bfloat16        4 packed_words(D)
``FP8``         uint32        256 (``LATENT_WORDS``)     bfloat16        1024
==============  ============  =========================  ==============  ================

``PACKED_BF16`` is ``reference.formats.packed_cache``: two bf16 features per 32-bit word, so a
single token row can be DMA'd on TPU (a plain bf16 row cannot: two rows share a word). A format is
detected from a cache's dtype (``CacheFormat.of``); any other dtype (f16, fp8, integers) is
refused with a ``ValueError`` naming the dtype and the supported list.

``FP8`` is the fp8 latent cache of ``reference.formats.fp8_cache`` (``Fp8LatentCache``: 512 e4m3
features in 4 power-of-two-scaled tiles plus 64 bf16 rope values, D = 576 logical features, in
256 u32 words per token). It is detected from the object's type, not a dtype. Its values are
exact in bf16. The minimum a gather must move is FlashMLA's 656 bytes per token
(``plain_row_bytes``), and the TPU layout moves 1024 (``reference.formats.fp8_cache`` says why).
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np

from reference.formats import fp8_cache, packed_cache
from reference.quant import fp8


class CacheFormat(enum.Enum):
    """A paged cache's storage format (module docstring). Values are the short names."""

    F32 = "f32"
    BF16 = "bf16"
    PACKED_BF16 = "packed"
    FP8 = "fp8"

    @property
    def storage_dtype(self) -> jnp.dtype:
        """The dtype of the cache array (for ``FP8``, of its ``words``)."""
        return jnp.dtype({"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.uint32,
                          "packed": packed_cache.PACKED_DTYPE}[self.value])

    @property
    def value_dtype(self) -> jnp.dtype:
        """The dtype of the features it holds (what a kernel computes in, with an f32 query
        promoting bf16 to f32)."""
        return jnp.dtype(jnp.float32 if self is CacheFormat.F32 else jnp.bfloat16)

    @property
    def packed(self) -> bool:
        return self is CacheFormat.PACKED_BF16

    @property
    def fp8(self) -> bool:
        return self is CacheFormat.FP8

    def row_words(self, dim: int) -> int:
        """Stored elements per token row of ``dim`` features (FP8: always the 576 latent
        features, whatever padding the query carries)."""
        if self.fp8:
            return fp8_cache.LATENT_WORDS
        return packed_cache.packed_words(dim) if self.packed else dim

    def row_bytes(self, dim: int) -> int:
        """Bytes a token row of ``dim`` features occupies (what a gather moves)."""
        return self.row_words(dim) * self.storage_dtype.itemsize

    def plain_row_bytes(self, dim: int) -> int:
        """Bytes of ``dim`` features at the value dtype: the minimum a gather must move (FP8:
        FlashMLA's 656-byte token)."""
        if self.fp8:
            return fp8.LATENT_BYTES
        return dim * self.value_dtype.itemsize

    @classmethod
    def of(cls, cache, name: str = "cache") -> CacheFormat:
        """The format of ``cache`` (an array or ``ShapeDtypeStruct``) from its dtype, or
        ``FP8`` for an ``Fp8LatentCache``."""
        if isinstance(cache, fp8_cache.Fp8LatentCache):
            return cls.FP8
        fp8_cache.refuse_other_kind(name, cache, wanted="latent")
        dt = jnp.dtype(jnp.result_type(cache))
        for fmt in cls:
            if fmt.storage_dtype == dt and not fmt.fp8:
                return fmt
        raise ValueError(f"{name} has dtype {dt}, which no cache format supports; supported: "
                         f"{', '.join(f'{f.storage_dtype} ({f.name})' for f in cls if not f.fp8)}, "
                         "or an Fp8LatentCache (FP8)")

    @classmethod
    def named(cls, fmt: CacheFormat | str) -> CacheFormat:
        """``fmt`` itself, or the member whose value is the string ``fmt``."""
        if isinstance(fmt, cls):
            return fmt
        try:
            return cls(fmt)
        except ValueError:
            raise ValueError(f"unknown cache format {fmt!r}; expected one of "
                             f"{[f.value for f in cls]}") from None


def check_packed_width(name: str, cache, dim: int) -> None:
    """A packed cache's minor dim must be ``packed_words(dim)``."""
    words = np.shape(cache)[-1]
    if words != packed_cache.packed_words(dim):
        raise ValueError(f"packed {name}.shape[2] must equal packed_words(q.shape[2]={dim}) = "
                         f"{packed_cache.packed_words(dim)}, got {words}")
