"""Token-sparse absorbed MLA on TPU (Pallas): each query row attends its own top-k cache rows.

Math (``reference.sparse_mla.sparse_mla_ref`` is the definition)::

    logits[t, h, j] = sm_scale * q[t, h, :] . c[j, :]        j in topk_indices[t] (valid only)
    out[t, h, :]    = softmax_j(logits) @ c[j, :v_dim]        f32 online softmax over blocks

The gather kernel, its design and traffic are ``pallas_kernels.mla.kernel``'s (token mode: one
DMA per selected token row). A plain bf16 cache is packed per call (a full copy: the documented
slow path; serving stores the cache packed, ``reference.packed_cache``).
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

from pallas_kernels import tpu
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import pool as mla_pool
from pallas_kernels.mla.common import PerformanceWarning, attend_entries
from pallas_kernels.mla.kernel import check_kernel_args
from reference.formats import packed_cache, stacked
from reference.formats.cache_format import CacheFormat
from reference.mla import sinks


@stacked.checks_layer(cache_pos=1)
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "pages_per_seq", "v_dim", "return_lse", "tokens_per_block", "blocks",
    "vmem_limit_bytes", "interpret"))
def sparse_mla(q: jax.Array, cache_kv: jax.Array, kv_lens: jax.Array, topk_indices: jax.Array,
               page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
               distribution: jax.Array, *, sm_scale: float, pages_per_seq: int, v_dim: int,
               return_lse: bool = False, tokens_per_block: int | None = None,
               blocks: mla_blocks.MlaBlocks | None = None, vmem_limit_bytes: int | None = None,
               interpret=False, layer=None, attn_sink=None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Token-sparse absorbed MLA (Pallas TPU); same semantics as ``sparse_mla_ref``.

    Shapes: ``q``: f32|bf16[T, H, D]; ``cache_kv``: f32[P, ps, D] | u32[P, ps, Wp] packed bf16 |
    bf16[P, ps, D] (slow) | ``Fp8LatentCache`` (words read as stored, D = 576 or 640);
    ``topk_indices``: i32[T, k] sequence-local token offsets, -1 = ignore;
    the batch arrays as ``reference.batch``.

    Args:
      q .. distribution: as ``reference.sparse_mla_ref``; ``cache_kv`` may also be the packed
        bf16 cache ``u32[P, ps, packed_words(D)]`` of ``reference.packed_cache.pack_cache``
        (the fast bf16 path); a plain bf16 cache is packed per call (a full cache copy).
      sm_scale, pages_per_seq, v_dim, return_lse: as the reference.
      tokens_per_block: cache rows per gathered block (multiple of 8); default from
        ``blocks``, else the block table (``mla_blocks.TABLE``) for the detected chip.
      blocks: an ``MlaBlocks`` (typed, validated; its ``tokens_per_block`` is used here).
      vmem_limit_bytes: scoped VMEM limit; default ``tpu.vmem_limit`` (one policy).
      interpret: False (compile), True (strict interpret mode) or a ``pltpu.InterpretParams``.

    ``attn_sink``: optional f32[H] sink logits (``reference.sinks``), applied in the kernel's
    finalize; the LSE stays sink-free; ``None`` compiles the kernel without the operand.

    Returns:
      ``q.dtype[T, H, v_dim]``; with ``return_lse=True`` also ``f32[T, H]``.
    """
    read = stacked.resolve("cache_kv", cache_kv, layer)
    mla_pool.refuse_token_rows("sparse_mla", read.one)
    q_one = stacked.layer_query(q, read, layer=layer)
    fmt, b = check_kernel_args(q_one, read.one, kv_lens, topk_indices, page_indices, cu_q_lens,
                            cu_kv_lens, distribution, sm_scale=sm_scale,
                            pages_per_seq=pages_per_seq, v_dim=v_dim,
                            selected_name="topk_indices")
    sinks.check_sink(attn_sink, np.shape(q_one)[1])
    if fmt is CacheFormat.BF16:  # slow path: a full copy of the cache into the packed format
        if not interpret:  # on a TPU this is a full-cache copy per call: say so once per trace
            warnings.warn("sparse_mla: a plain bf16 cache is packed into u32 words on every "
                          "call (a full copy of the cache); store it packed "
                          "(reference.packed_cache.pack_cache, or dsa_jax.PagedLayout("
                          "packed_latent=True))", PerformanceWarning, stacklevel=2)
        read = read._replace(stacked=packed_cache.pack_cache(read.stacked))
        fmt = CacheFormat.PACKED_BF16
    units = mla_blocks.token_block(topk_indices.shape[1], tpu.device_chip(),
                                   mla_blocks.pick(blocks, "tokens_per_block", tokens_per_block))
    return attend_entries(q, read.stacked, topk_indices, b, mode="token", fmt=fmt, units=units,
                          sm_scale=sm_scale, v_dim=v_dim, return_lse=return_lse,
                          vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
                          layer=read.layer, attn_sink=attn_sink)


# ----------------------------------------------------------------------------- cost model

