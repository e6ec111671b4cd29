"""Moved to reference/indexer/args.py; kept so old imports work."""

from __future__ import annotations

from reference.indexer.args import (
    INDEX_QUANT_DIM,
    INDEX_QUANTS,
    check_compression_ratio,
    check_index_quant,
    check_indexer_args,
    check_selection_args,
    check_topk_args,
)

__all__ = [
    "INDEX_QUANTS",
    "INDEX_QUANT_DIM",
    "check_compression_ratio",
    "check_index_quant",
    "check_indexer_args",
    "check_selection_args",
    "check_topk_args",
]
