"""Old path of ``pallas_kernels.v4_attention.kernel`` (the fused V4 attention kernel): every name
anything imported from here, re-exported. New code imports ``pallas_kernels.v4_attention``."""

from __future__ import annotations

from pallas_kernels.v4_attention.kernel import (  # noqa: F401
    _CLIMIT,
    _CN,
    _CSLOT0,
    _WFIRST,
    _WN,
    _WSLOT0,
    DEFAULT_BLOCK,
    FP8_ROW_BYTES,
    FP8_STORED_BYTES,
    HALF,
    INFO_WORDS,
    LANES,
    NEG,
    WORDS,
    _decode_fp8,
    _format,
    _kernel,
    _kernel_cache,
    fused_call,
    fused_traffic,
    row_info,
    v4_attention_fused,
)
