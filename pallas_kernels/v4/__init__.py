"""DeepSeek-V4 attention on TPU (Pallas): the window and compressed parts on the token-mode
sparse MLA gather kernel, merged in XLA (``attention``)."""

from pallas_kernels.v4.attention import v4_attention

__all__ = ["v4_attention"]
