"""tokamax 0.0.17's DeepSeek-V4 cache byte layouts, as this package's cache formats (issue 29;
``docs/engines/tokamax.md`` sections 1, 3.2 and 4.2 state the layouts and where they were read).

Every tokamax V4 cache is 32-bit words with 128 lanes, ``i32[P, rows, 128]`` (the same bytes as
its ``u8[P, rows, 4, 128]`` "slab" view: slab ``(b, w)`` is byte ``b`` of word ``w``, little
endian).

- ``CsaCache`` (the CSA cache of tokamax's ``sparse_mla`` / ``dsv4_compressor``): ``nope
  i32[P, ps, 128]``, one 512-byte record per entry: feature ``i < 448`` is the e4m3 byte ``i //
  128`` of word ``i % 128``, and the 64 ue8m0 scales are byte 3 of words ``64 .. 127``, scale
  ``j`` applying to every feature ``d`` with ``d % 64 == j`` ("lane-periodic"); ``rope
  i32[P, ps // 4, 128]``, four entries per row, entry ``t``'s words ``32 (t % 4) ..`` holding
  bf16 rope ``k`` (low half) and ``k + 32`` (high half): MODEL1's rope rows
  (``reference.formats.model1``), which differ only in the nope record's scales.
- ``PlaneCache`` (tokamax's ``mla_swa`` window cache and its HCA cache): raw bf16 rows, two
  128-word rows per token: row ``2 k`` word ``w`` holds features ``w`` (low half) and ``128 + w``
  (high half), row ``2 k + 1`` word ``w`` features ``256 + w`` and ``384 + w``. Token ``k`` of a
  page is rows ``2 k, 2 k + 1``; a page holds ``logical_page_size <= rows // 2`` used tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from reference.formats import fp8_cache, model1

LANES = model1.LANES  # 128 words per row in every tokamax V4 cache
ROWS_PER_TOKEN = 2  # a PlaneCache token: 2 rows of 128 words = 1024 B = 512 bf16


@dataclass(frozen=True)
class CsaCache(fp8_cache._Paged):
    """tokamax's CSA cache (module docstring): ``nope i32[..., P, ps, 128]``, ``rope
    i32[..., P, ps // 4, 128]``. A pytree: it passes through ``jax.jit``."""

    nope: jax.Array
    rope: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, 512)`` of the entries it holds."""
        return (*np.shape(self.nope)[:-1], model1.V4_DIM)


@dataclass(frozen=True)
class PlaneCache(fp8_cache._Paged):
    """tokamax's window / HCA cache (module docstring): ``words i32[..., P, rows, 128]``, two
    rows per token, ``logical_page_size`` tokens used per page (static: pytree metadata)."""

    words: jax.Array
    logical_page_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, logical_page_size, 512)`` of the tokens it holds."""
        return (*np.shape(self.words)[:-2], self.logical_page_size, model1.V4_DIM)


jax.tree_util.register_dataclass(CsaCache, data_fields=["nope", "rope"], meta_fields=[])
jax.tree_util.register_dataclass(PlaneCache, data_fields=["words"],
                                 meta_fields=["logical_page_size"])
