"""Every layer's sparse MLA of a serving step in ONE kernel call (what ``dsa_jax.dsa_step`` runs
on the Pallas backend).

Shapes: ``q f32|bf16[L, T, H, D]`` (every layer's query, stacked), the stacked latent cache
``[L, P, page_size, W]`` (or an ``Fp8LatentCache`` with a leading ``L``), ``selected i32[L, T,
k]`` (each layer's top-k: token offsets, or page numbers in page mode; a shared layer's is its
source layer's), the batch arrays as ``reference.batch``. Out ``q.dtype[L, T, H, v_dim]``.

Why one call: a call per layer leaves L outputs that XLA must then stack into ``[L, T, H,
v_dim]`` (it reads and writes every output once more, and keeps all of them live until then:
at 61 layers x 64 decode rows x 128 heads, 1 GB of traffic and 418 MiB of temporaries in its
v6e model). Here the kernel's grid walks the ``L x T`` rows layer-major, row ``t`` reads layer
``t // T`` of the stacked cache in place (``kernel.gather_attend``'s ``rows_per_layer``), and
each row's output block lands at its place in the one ``[L * T, H, v_dim]`` output (a reshape
of ``[L, T, H, v_dim]``): no stack, no copy. Semantics per layer are exactly
``pallas_kernels.sparse_mla`` / ``page_sparse_mla`` on that layer (the tests compare them).

Bound: the per-row facts are scalar-prefetched, ``4 * L * T`` words of SMEM; past
``MAX_INFO_WORDS`` (``fits``) the step calls the per-layer entries instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tpu
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import pool as mla_pool
from pallas_kernels.mla.blocks import ROW_INFO_WORDS
from pallas_kernels.mla.common import compute_query, row_info
from pallas_kernels.mla.kernel import check_kernel_args, gather_attend
from reference.formats import stacked
from reference.formats.cache_format import CacheFormat
from reference.mla import sinks

MAX_INFO_WORDS = 1 << 15  # 128 KiB of SMEM for the rows' facts (decode 61 layers x 64: 15616)


def _check_layer_sink(attn_sink, num_layers: int, heads: int) -> None:
    """Refuse an ``attn_sink`` that is neither ``f32[L, H]`` nor ``f32[H]`` (None passes)."""
    if attn_sink is None:
        return
    if np.ndim(attn_sink) == 2:
        if tuple(np.shape(attn_sink)) != (num_layers, heads):
            raise ValueError(f"attn_sink must have shape (L, H) = ({num_layers}, {heads}) or "
                             f"(H,) = ({heads},), got shape {tuple(np.shape(attn_sink))}")
        sinks.check_sink(attn_sink[0], heads)  # the dtype rule
        return
    sinks.check_sink(attn_sink, heads)


def fits(num_layers: int, num_rows: int) -> bool:
    """Whether one call's per-row facts (``4 * L * T`` i32 words) fit ``MAX_INFO_WORDS``."""
    return ROW_INFO_WORDS * num_layers * num_rows <= MAX_INFO_WORDS


@functools.partial(jax.jit, static_argnames=(
    "mode", "sm_scale", "pages_per_seq", "v_dim", "tokens_per_block", "pages_per_block",
    "blocks", "vmem_limit_bytes", "interpret"))
def sparse_mla_layers(q, cache_kv, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens,
                      distribution, *, mode: str, sm_scale: float, pages_per_seq: int,
                      v_dim: int, tokens_per_block: int | None = None,
                      pages_per_block: int | None = None,
                      blocks: mla_blocks.MlaBlocks | None = None,
                      vmem_limit_bytes: int | None = None, interpret=False,
                      attn_sink=None) -> jax.Array:
    """Sparse MLA of every layer (module docstring): ``q.dtype[L, T, H, v_dim]``. ``mode``:
    ``"token"`` or ``"page"``; the knobs as the per-layer entries. A plain bf16 cache is refused
    in token mode (store it packed: ``reference.packed_cache``). ``attn_sink``: optional
    attention-sink logits (``reference.sinks``), ``f32[L, H]`` (one row per layer) or ``f32[H]``
    (shared by every layer), applied in the kernel's finalize."""
    num_layers, num_rows = np.shape(q)[:2]
    read = stacked.resolve("cache_kv", cache_kv, 0)
    for name, x in (("q", q), ("selected", selected)):
        if np.shape(x)[0] != read.num_layers:
            raise ValueError(f"{name}.shape[0] = {np.shape(x)[0]} must equal the stacked "
                             f"cache's layers L = {read.num_layers}")
    one = lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], jnp.result_type(x))
    fmt, b = check_kernel_args(one(q), read.one, kv_lens, one(selected), page_indices,
                               cu_q_lens, cu_kv_lens, distribution, sm_scale=sm_scale,
                               pages_per_seq=pages_per_seq, v_dim=v_dim,
                               selected_name="selected")
    if mode == "token" and fmt is CacheFormat.BF16:
        raise ValueError("sparse_mla_layers: a plain bf16 cache cannot be gathered by token "
                         "rows; store it packed (reference.packed_cache)")
    if not fits(num_layers, num_rows):
        raise ValueError(f"{ROW_INFO_WORDS} x L x T = {ROW_INFO_WORDS * num_layers * num_rows} "
                         f"row-fact words exceed MAX_INFO_WORDS = {MAX_INFO_WORDS}")
    _check_layer_sink(attn_sink, num_layers, np.shape(q)[2])
    k = np.shape(selected)[-1]
    chip = tpu.device_chip()
    units = (mla_blocks.token_block(k, chip, mla_blocks.pick(blocks, "tokens_per_block",
                                                             tokens_per_block))
             if mode == "token" else
             mla_blocks.page_block(k, b.page_size, chip,
                                   mla_blocks.pick(blocks, "pages_per_block", pages_per_block)))
    flat = lambda x: x.reshape(num_layers * num_rows, *x.shape[2:])  # layer-major rows
    info = flat(row_info(selected, b, mode=mode))
    cache = mla_pool.kernel_operand(read.stacked)
    out, _ = gather_attend(flat(compute_query(q, fmt)), cache, read.layer,
                           flat(selected.astype(jnp.int32)), info,
                           tpu.smem_page_table(b.page_indices), mode=mode, fmt=fmt, units=units,
                           pages_per_seq=b.pages_per_seq, sm_scale=sm_scale, v_dim=v_dim,
                           return_lse=False, vmem_limit_bytes=vmem_limit_bytes,
                           interpret=interpret, rows_per_layer=num_rows,
                           sink=None if attn_sink is None else jnp.reshape(attn_sink,
                                                                           (-1, np.shape(q)[2])))
    return out.astype(q.dtype).reshape(num_layers, num_rows, *out.shape[1:])
