"""Moved to reference/formats/packed_cache.py; kept so old imports work."""

from __future__ import annotations

from reference.formats.packed_cache import (
    HIGH_MASK,
    LANES,
    PACKED_DTYPE,
    is_packed,
    pack_cache,
    packed_words,
    unpack_cache,
    unpack_words,
)

__all__ = [
    "HIGH_MASK",
    "LANES",
    "PACKED_DTYPE",
    "is_packed",
    "pack_cache",
    "packed_words",
    "unpack_cache",
    "unpack_words",
]
