"""DeepSeek-V4 attention on TPU (Pallas): the public entry ``v4_attention``, which dispatches to
one of two implementations by ``fused=`` (a public contract):

- ``fused=True`` (the default): ``pallas_kernels.v4_attention.kernel.v4_attention_fused``, one
  kernel, one online softmax over the window and compressed sources (1.00x the minimum bytes per
  decode row by its model; packed, f32, fp8 MODEL1 or tokamax ``CsaCache`` / ``PlaneCache``
  caches, both caches in one format);
- ``fused=False``: ``pallas_kernels.v4_attention.two_pass.v4_attention_two_pass`` (once called
  "milestone 1"), the token-sparse MLA kernel run once per source, the two states merged in XLA
  (1.43x at V4-Flash decode; packed / plain caches only, an fp8 ``Fp8V4Cache`` is refused).

Math: ``reference.v4_attention`` is the definition, ``precision="f32"`` or ``"bf16"`` (the
official ``sparse_attn`` rounding; fused only, the two-pass form refuses it). Shapes:
``q f32|bf16[T, H, 512]``; caches ``f32[P, ps, 512]``, packed ``u32[P, ps, 256]``
(``reference.packed_cache``) or (fused only) ``Fp8V4Cache`` (``reference.v4_cache``) or
tokamax's ``CsaCache`` / ``PlaneCache`` (``reference.formats.tokamax_v4``), stacked
``[L, ...]`` read in place at ``layer=``. Out ``q.dtype[T, H, 512]``, LSE ``f32[T, H]``.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import tpu
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.v4_attention import blocks as v4_blocks
from pallas_kernels.v4_attention import formats
from pallas_kernels.v4_attention.kernel import v4_attention_fused
from pallas_kernels.v4_attention.two_pass import two_pass
from reference import v4_attention as v4


@v4.checks_layers
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
    "compressed_pages_per_seq", "return_lse", "tokens_per_block", "blocks", "vmem_limit_bytes",
    "interpret", "fused", "precision", "run_grain"))
def v4_attention(q: jax.Array, window: v4.PagedKV, kv_lens: jax.Array, cu_q_lens: jax.Array,
                 distribution: jax.Array, *, sm_scale: float, window_size: int,
                 compress_ratio: int, window_pages_per_seq: int,
                 compressed_pages_per_seq: int = 0, compressed: v4.PagedKV | None = None,
                 compressed_indices: jax.Array | None = None,
                 attn_sink: jax.Array | None = None, return_lse: bool = False,
                 tokens_per_block: int | None = None,
                 blocks: mla_blocks.MlaBlocks | None = None,
                 vmem_limit_bytes: int | None = None, interpret=False, fused: bool = True,
                 layer=None, precision: str = "f32",
                 run_grain: str = v4_blocks.DEFAULT_RUN_GRAIN
                 ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """DeepSeek-V4 attention (Pallas TPU); same semantics as ``reference.v4_attention_ref``.

    Args:
      q .. layer: as ``reference.v4_attention.v4_attention_ref`` (q f32|bf16[T, H, 512], the
        window ``PagedKV`` in tokens, the compressed one in entries, kv_lens i32[S] tokens,
        compressed_indices i32[T, k] for ratio 4, attn_sink f32[H]).
      tokens_per_block, blocks, vmem_limit_bytes: fused: ``tokens_per_block`` (or
        ``blocks.tokens_per_block``) cache rows per gathered block (default: the table in
        ``pallas_kernels.v4_attention.blocks``, 256 on every chip); two-pass: the MLA kernel's knobs
        (``pallas_kernels.mla.sparse_mla``), used by both calls.
      interpret: False (compile), True (the strict interpreter) or a ``pltpu.InterpretParams``.
      fused: True (default): the one-kernel path (``kernel.v4_attention_fused``: one online
        softmax over both sources, q read once, no partial outputs; packed, f32 or fp8 caches,
        both in one format). False: two passes of the MLA kernel merged in XLA
        (``two_pass.v4_attention_two_pass``, once "milestone 1"; no fp8 caches).
      precision: ``"f32"`` (default) or ``"bf16"`` (``reference.v4_attention``'s module
        docstring; the fused kernel runs on q cast to bf16: ``kernel``'s "Precision"); static.
        ``fused=False`` refuses ``"bf16"`` (NotImplementedError); any other value: ValueError.
      run_grain: fused: how page runs move packed / f32 rows, ``"tiles"`` (default: the
        wanted rows widened to 8-row tiles, one DMA a segment) or ``"exact"`` (the wanted rows
        only, ragged ends one row a DMA): ``formats.RUN_GRAINS``; static; the two-pass path
        has no page runs and does not read it (checked either way: ValueError).

    Returns:
      ``q.dtype[T, H, 512]``; with ``return_lse`` also the sink-free ``f32[T, H]``.
    """
    statics = dict(sm_scale=sm_scale, window_size=window_size, compress_ratio=compress_ratio,
                   window_pages_per_seq=window_pages_per_seq,
                   compressed_pages_per_seq=compressed_pages_per_seq)
    formats.check_run_grain(run_grain)
    if fused:
        block = fused_block(window.cache, q.shape[1], tokens_per_block, blocks)
        return v4_attention_fused(q, window, kv_lens, cu_q_lens, distribution, **statics,
                                  compressed=compressed, compressed_indices=compressed_indices,
                                  attn_sink=attn_sink, return_lse=return_lse, block=block,
                                  vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
                                  layer=layer, precision=precision, run_grain=run_grain)
    return two_pass(q, window, kv_lens, cu_q_lens, distribution, **statics,
                    compressed=compressed, compressed_indices=compressed_indices,
                    attn_sink=attn_sink, return_lse=return_lse,
                    tokens_per_block=tokens_per_block, blocks=blocks,
                    vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, layer=layer,
                    precision=precision)


def fused_block(window_cache, heads: int, tokens_per_block: int | None = None,
                blocks: mla_blocks.MlaBlocks | None = None) -> int:
    """The fused kernel's rows per gathered block: ``tokens_per_block`` (or
    ``blocks.tokens_per_block``), else (None or 0) the table's row for the chip, the window
    cache's format and ``heads`` (``pallas_kernels.v4_attention.blocks``)."""
    block = mla_blocks.pick(blocks, "tokens_per_block", tokens_per_block)
    if not block:  # None (or 0, as before): the table's row for the chip, clamped
        fmt = v4_blocks.table_format(formats.kernel_format(window_cache))
        block = v4_blocks.block(tpu.device_chip(), fmt, heads)
    return block
