"""Old path of ``pallas_kernels.v4_attention.compile_cases``: every name anything imported from
here, re-exported. New code imports ``pallas_kernels.v4_attention.compile_cases``."""

from __future__ import annotations

from pallas_kernels.v4_attention.blocks import DEFAULT_BLOCK  # noqa: F401
from pallas_kernels.v4_attention.compile_cases import (  # noqa: F401
    FORMATS,
    FP8_ROW_BYTES,
    FP8_STORED_BYTES,
    HEAD_DIM,
    INFO_WORDS,
    PAGE,
    PREP_BYTES_PER_ENTRY,
    SCALE,
    SHAPES,
    WINDOW,
    WORDS,
    CacheFormat,
    PagedKV,
    _cache_spec,
    compile_cases,
    fused_traffic,
    fused_v4_traffic,
    mla_traffic,
    specs,
    v4_attention,
    v4_traffic,
)
