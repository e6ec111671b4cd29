"""DeepSeek-V4's paged attention step (window + compressed entries), pure jnp: the oracle is
``reference.v4_attention.ref``.

The package is the old ``reference/v4_attention.py``; it re-exports every name that module had,
so old imports work."""

from __future__ import annotations

from reference.v4_attention.ref import (
    COMPRESS_RATIOS,
    DEFAULT_WINDOW,
    HEAD_DIM,
    ROPE_DIM,
    PagedKV,
    cache_format,
    check_v4_args,
    checks_layers,
    compressed_lens,
    compressed_selection,
    finish,
    v4_attention_ref,
    visible_entries,
    window_indices,
)

__all__ = [
    "COMPRESS_RATIOS",
    "DEFAULT_WINDOW",
    "HEAD_DIM",
    "PagedKV",
    "ROPE_DIM",
    "cache_format",
    "check_v4_args",
    "checks_layers",
    "compressed_lens",
    "compressed_selection",
    "finish",
    "v4_attention_ref",
    "visible_entries",
    "window_indices",
]
