"""Moved to reference/core/synthetic.py; kept so old imports work."""

from __future__ import annotations

from reference.core.synthetic import (
    SyntheticBatch,
    make_ragged_batch,
)

__all__ = [
    "SyntheticBatch",
    "make_ragged_batch",
]
