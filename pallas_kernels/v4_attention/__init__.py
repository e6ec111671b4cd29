"""DeepSeek-V4 attention on TPU (Pallas), the op family ``reference.v4_attention`` and
``dsa_jax`` name the same way: ``v4_attention`` (``entry``) runs one fused kernel over the window
and compressed parts (``kernel``: ``fused=True``, the default; packed, f32 or fp8 MODEL1 caches)
or, with ``fused=False``, two passes of the token-sparse MLA gather kernel merged in XLA
(``two_pass``); ``compile_cases`` holds the AOT compile-gate cases and their traffic models."""

from pallas_kernels.v4_attention.entry import v4_attention

__all__ = ["v4_attention"]
