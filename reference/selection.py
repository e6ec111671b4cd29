"""Moved to reference/indexer/selection.py; kept so old imports work."""

from __future__ import annotations

from reference.indexer.selection import (
    DEFAULT_RECALL_TARGET,
    NEG_INF,
    causal_token_count,
    check_selection_args,
    check_witness_policy,
    finish_selection,
    scatter_topology_witnesses,
    select_and_merge,
    select_topk,
    select_topk_scored,
)

__all__ = [
    "DEFAULT_RECALL_TARGET",
    "NEG_INF",
    "causal_token_count",
    "check_selection_args",
    "check_witness_policy",
    "finish_selection",
    "scatter_topology_witnesses",
    "select_and_merge",
    "select_topk",
    "select_topk_scored",
]
