"""Moved to reference/formats/stacked.py; kept so old imports work."""

from __future__ import annotations

from reference.formats.stacked import (
    CACHE_RANK,
    LayerRead,
    cache_rank,
    checks_layer,
    is_fp8_index,
    is_fp8_latent,
    layer_ok,
    layer_query,
    mask_table,
    query_at,
    resolve,
    safe_layer,
    take,
)

__all__ = [
    "CACHE_RANK",
    "LayerRead",
    "cache_rank",
    "checks_layer",
    "is_fp8_index",
    "is_fp8_latent",
    "layer_ok",
    "layer_query",
    "mask_table",
    "query_at",
    "resolve",
    "safe_layer",
    "take",
]
