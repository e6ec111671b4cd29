"""Moved to reference/indexer/index_share.py; kept so old imports work."""

from __future__ import annotations

from reference.indexer.index_share import (
    INDEXER_TYPES,
    build_index_share_map,
    glm_index_share_pattern,
)

__all__ = [
    "INDEXER_TYPES",
    "build_index_share_map",
    "glm_index_share_pattern",
]
