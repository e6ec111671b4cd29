"""Moved to reference/mla/page_sparse.py; kept so old imports work."""

from __future__ import annotations

from reference.mla.page_sparse import (
    check_mla_args,
    page_sparse_mla_ref,
    pages_to_tokens,
)

__all__ = [
    "check_mla_args",
    "page_sparse_mla_ref",
    "pages_to_tokens",
]
