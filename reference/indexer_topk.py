"""Moved to reference/indexer/topk.py; kept so old imports work."""

from __future__ import annotations

from reference.indexer.topk import (
    check_index_quant,
    check_topk_args,
    streamindex_topk_ref,
)

__all__ = [
    "check_index_quant",
    "check_topk_args",
    "streamindex_topk_ref",
]
