"""Moved to reference/formats/cache_format.py; kept so old imports work."""

from __future__ import annotations

from reference.formats.cache_format import (
    CacheFormat,
    check_packed_width,
)

__all__ = [
    "CacheFormat",
    "check_packed_width",
]
