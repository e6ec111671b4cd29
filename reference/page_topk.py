"""Moved to reference/indexer/page_topk.py; kept so old imports work."""

from __future__ import annotations

from reference.indexer.page_topk import (
    causal_page_count,
    check_index_quant,
    check_topk_args,
    page_max,
    streamindex_page_topk_ref,
)

__all__ = [
    "causal_page_count",
    "check_index_quant",
    "check_topk_args",
    "page_max",
    "streamindex_page_topk_ref",
]
