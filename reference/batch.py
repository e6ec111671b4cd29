"""Moved to reference/core/batch.py; kept so old imports work."""

from __future__ import annotations

from reference.core.batch import (
    RaggedBatch,
    RowFacts,
    SeqPages,
    capacity_tokens,
    decode_row_facts,
    entries_of_tokens,
    gather_pages,
    last_visible_key,
    lookup_page,
    num_active_seqs,
    row_facts,
)

__all__ = [
    "RaggedBatch",
    "RowFacts",
    "SeqPages",
    "capacity_tokens",
    "decode_row_facts",
    "entries_of_tokens",
    "gather_pages",
    "last_visible_key",
    "lookup_page",
    "num_active_seqs",
    "row_facts",
]
