"""Moved to reference/core/checks.py; kept so old imports work."""

from __future__ import annotations

from reference.core.checks import (
    FLOAT_DTYPES,
    dim,
    floating,
    integer,
    nonneg_int,
    paged_cache,
    positive_int,
    ragged_metadata,
    rank,
)

__all__ = [
    "FLOAT_DTYPES",
    "dim",
    "floating",
    "integer",
    "nonneg_int",
    "paged_cache",
    "positive_int",
    "ragged_metadata",
    "rank",
]
