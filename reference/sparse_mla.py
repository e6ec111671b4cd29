"""Moved to reference/mla/sparse.py; kept so old imports work."""

from __future__ import annotations

from reference.mla.sparse import (
    check_mla_args,
    sparse_mla_ref,
)

__all__ = [
    "check_mla_args",
    "sparse_mla_ref",
]
