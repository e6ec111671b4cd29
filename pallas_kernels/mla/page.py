"""Page-sparse absorbed MLA on TPU (Pallas): each query row attends the tokens of its top-k pages.

Math (``reference.page_sparse_mla.page_sparse_mla_ref`` is the definition): row ``t`` attends
every token ``s`` of each page listed in ``topk_pages[t]`` with ``s < kv_len`` and
``s <= abs_pos(t)`` (causal inside pages); a page listed twice counts twice.

Shapes: ``q: f32|bf16[T, H, D]`` (D a multiple of 128), cache ``f32|bf16[P, page_size, D]``,
the packed ``u32[P, page_size, packed_words(D)]`` (``reference.packed_cache``), or a
``TokenPackedCache`` (``pallas_kernels.mla.pool``: sglang-jax's pool ``[P, page_size / k, k, D]``
read in place, each page DMA'd as ``[page_size / k, k, D]``);
``topk_pages: i32[T, k_pages]`` sequence-local page numbers. Out ``q.dtype[T, H, v_dim]``,
optional LSE ``f32[T, H]``.

Design: the gather unit is a whole page, one DMA per selected page (``cache[page_id]`` into a
``[pages_per_block, page_size, W]`` VMEM buffer, double-buffered); a plain bf16 cache needs no
packing because a page of ``page_size % 16 == 0`` rows is whole (16, 128) tiles. The pipeline,
the walk over each row's raw entries (DMA'd one row ahead into SMEM), the in-kernel page-table
lookup (the table scalar-prefetched into SMEM), masking and online softmax are the token
kernel's (``pallas_kernels.mla.kernel.gather_attend`` with ``mode="page"``). XLA prepares only
``row_info``: per row the limit ``min(kv_len, abs_pos + 1)``, the count of pages that can be
valid and where they end (elementwise and two row reductions: no gather, no scatter). For each
page it issues, the kernel records the in-page limit ``thr = clip(limit - page * page_size, 0,
page_size)``; rows ``>= thr`` of a page are zeroed in VMEM by a select and their logits are
-inf, so the NaN past ``kv_len`` never reaches the output.

Traffic per query row: ``k_pages * page_size`` rows x D x itemsize (the minimum for this op;
a partly causal or partly filled page is still moved whole), plus q read and out written once,
plus the row's ``k_pages`` raw entries into SMEM and 4 bytes per entry of XLA preparation.
"""


from __future__ import annotations

import functools

import jax
import numpy as np

from pallas_kernels import tpu
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla.common import attend_entries
from pallas_kernels.mla.kernel import check_kernel_args
from reference.formats import stacked
from reference.mla import sinks


@stacked.checks_layer(cache_pos=1)
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "pages_per_seq", "v_dim", "return_lse", "pages_per_block", "blocks",
    "vmem_limit_bytes", "interpret"))
def page_sparse_mla(q: jax.Array, cache_kv: jax.Array, kv_lens: jax.Array, topk_pages: jax.Array,
                    page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                    distribution: jax.Array, *, sm_scale: float, pages_per_seq: int, v_dim: int,
                    return_lse: bool = False, pages_per_block: int | None = None,
                    blocks: mla_blocks.MlaBlocks | None = None, vmem_limit_bytes: int | None = None,
                    interpret=False, layer=None, attn_sink=None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Page-sparse absorbed MLA (Pallas TPU); same semantics as ``page_sparse_mla_ref``.

    Shapes: ``q``: f32|bf16[T, H, D]; ``cache_kv``: f32|bf16[P, ps, D] | u32[P, ps, Wp] packed bf16
    | ``Fp8LatentCache`` | ``TokenPackedCache`` (f32|bf16[P, ps / k, k, D], ``mla.pool``);
    ``topk_pages``: i32[T, k_pages] sequence-local page numbers, -1 = ignore; the batch arrays as
    ``reference.batch``.

    Args: as ``pallas_kernels.sparse_mla`` (``q``, the cache formats, ``blocks``,
    ``vmem_limit_bytes``, ``interpret``), with ``topk_pages`` for ``topk_indices`` and
    ``pages_per_block`` (pages gathered per block; default ``blocks``' field, else
    ``mla_blocks.page_block``) for ``tokens_per_block``. A plain bf16 cache needs no packing here.

    ``attn_sink``: optional f32[H] sink logits (``reference.sinks``), applied in the kernel's
    finalize; the LSE stays sink-free; ``None`` compiles the kernel without the operand.

    Returns:
      ``q.dtype[T, H, v_dim]``; with ``return_lse=True`` also ``f32[T, H]``.
    """
    read = stacked.resolve("cache_kv", cache_kv, layer)
    q_one = stacked.layer_query(q, read, layer=layer)
    fmt, b = check_kernel_args(q_one, read.one, kv_lens, topk_pages, page_indices, cu_q_lens,
                            cu_kv_lens, distribution, sm_scale=sm_scale,
                            pages_per_seq=pages_per_seq, v_dim=v_dim,
                            selected_name="topk_pages")
    sinks.check_sink(attn_sink, np.shape(q_one)[1])
    units = mla_blocks.page_block(topk_pages.shape[1], b.page_size, tpu.device_chip(),
                                  mla_blocks.pick(blocks, "pages_per_block", pages_per_block))
    return attend_entries(q, read.stacked, topk_pages, b, mode="page", fmt=fmt, units=units,
                          sm_scale=sm_scale, v_dim=v_dim, return_lse=return_lse,
                          vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
                          layer=read.layer, attn_sink=attn_sink)

