"""Compatibility shim: DeepSeek-V4 attention moved to ``dsa_jax.v4_attention`` (the op family's
name in all three trees). Every name this module had still imports from here; new code
imports ``from dsa_jax.v4_attention import ...`` (``dsa_jax.v4_attention`` itself is the
function)."""

from __future__ import annotations

from dsa_jax.layout import LayoutError, aligned_page_size
from dsa_jax.v4_attention import (
    RESERVED_FORMATS,
    V4_CACHE_FORMATS,
    V4Layout,
    V4LayoutWarning,
    _check_window_pages,  # noqa: F401
    check_v4_batch,
    layout_batch,
    v4_attention,
)

__all__ = ["RESERVED_FORMATS", "V4_CACHE_FORMATS", "LayoutError", "V4Layout", "V4LayoutWarning",
           "aligned_page_size", "check_v4_batch", "layout_batch", "v4_attention"]
