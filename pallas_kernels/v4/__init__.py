"""Old path of ``pallas_kernels.v4_attention`` (kept so existing imports work): ``fused`` is now
``v4_attention.kernel``, ``attention`` is ``v4_attention.entry`` (the two-pass path it selected
with ``fused=False`` is ``v4_attention.two_pass``), ``compile_cases`` is
``v4_attention.compile_cases``. New code imports ``pallas_kernels.v4_attention``."""

from pallas_kernels.v4_attention import v4_attention

__all__ = ["v4_attention"]
