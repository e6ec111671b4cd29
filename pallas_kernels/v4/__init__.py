"""DeepSeek-V4 attention on TPU (Pallas): ``v4_attention`` runs one fused kernel over the window
and compressed parts (``fused``, the default; packed, f32 or fp8 MODEL1 caches) or, with
``fused=False``, milestone 1: both parts on the token-mode sparse MLA gather kernel, merged in
XLA (``attention``)."""

from pallas_kernels.v4.attention import v4_attention

__all__ = ["v4_attention"]
