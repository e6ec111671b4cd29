"""Moved to reference/indexer/scores.py; kept so old imports work."""

from __future__ import annotations

from reference.indexer.scores import (
    INDEX_QUANT_MAPS,
    MAX_WINDOW_ROWS,
    SCORE_BLOCK_BYTES,
    Finish,
    fp4_sim,
    gather_keys,
    index_scores,
    scaled_scores,
    score_and_select,
    window_ladder,
)

__all__ = [
    "Finish",
    "INDEX_QUANT_MAPS",
    "MAX_WINDOW_ROWS",
    "SCORE_BLOCK_BYTES",
    "fp4_sim",
    "gather_keys",
    "index_scores",
    "scaled_scores",
    "score_and_select",
    "window_ladder",
]
