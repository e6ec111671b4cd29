"""Old path of ``pallas_kernels.v4_attention.entry`` (the public entry ``v4_attention``; its
``fused=False`` path is now ``pallas_kernels.v4_attention.two_pass``): every name anything
imported from here, re-exported. New code imports ``pallas_kernels.v4_attention``."""

from __future__ import annotations

from pallas_kernels.mla import sparse_mla  # noqa: F401
from pallas_kernels.v4_attention.entry import v4_attention  # noqa: F401
from pallas_kernels.v4_attention.kernel import DEFAULT_BLOCK, v4_attention_fused  # noqa: F401
from pallas_kernels.v4_attention.two_pass import _part  # noqa: F401
