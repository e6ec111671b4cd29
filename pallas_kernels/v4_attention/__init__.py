"""DeepSeek-V4 attention on TPU (Pallas), the op family ``reference.v4_attention`` and
``dsa_jax`` name the same way: ``v4_attention`` (``entry``) runs one fused kernel over the window
and compressed parts (``kernel``: ``fused=True``, the default; packed, f32, fp8 MODEL1 or
tokamax ``CsaCache`` / ``PlaneCache`` caches, ``formats``) or, with ``fused=False``, two passes
of the token-sparse MLA gather kernel merged in XLA (``two_pass``); ``state`` runs the fused
kernel from and to a flash state (tokamax's ``mla_swa`` -> ``sparse_mla`` split:
``v4_attention_state``, ``v4_entries_from_state``, ``FlashState``; ``writes``: this step's rows
written in place first); ``compile_cases`` holds the AOT compile-gate cases and their traffic
models (``traffic``)."""

from pallas_kernels.v4_attention.entry import v4_attention
from pallas_kernels.v4_attention.state import FlashState, v4_attention_state, v4_entries_from_state

__all__ = ["FlashState", "v4_attention", "v4_attention_state", "v4_entries_from_state"]
