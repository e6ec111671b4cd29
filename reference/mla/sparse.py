"""Token-sparse absorbed MLA (reference; also the flag-off serving path)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from reference.core import batch
from reference.formats import stacked
from reference.mla import attend, sinks
from reference.mla.args import check_mla_args


@stacked.checks_layer(cache_pos=1)
@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_seq", "v_dim", "return_lse"))
def sparse_mla_ref(q: jax.Array, cache_kv: jax.Array, kv_lens: jax.Array, topk_indices: jax.Array,
                   page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                   distribution: jax.Array, *, sm_scale: float, pages_per_seq: int, v_dim: int,
                   return_lse: bool = False, layer=None, attn_sink=None
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Sparse absorbed MLA over per-row token top-k.

    Shapes: ``q``: f32|bf16[T, H, D] packed [nope|rope] query in latent space; ``cache_kv``:
    f32|bf16[num_pages, page_size, D] packed [c_kv|k_rope] latent cache, or the u32 packed bf16
    cache, or an ``Fp8LatentCache`` (``reference.formats.fp8_cache``: rows dequantized, exact in
    bf16; then D is 576 or 576 zero-padded to 640, v_dim <= 512); ``topk_indices``: i32[T, k]
    sequence-local token offsets, -1 = ignore; the batch arrays as ``reference.core.batch``.

    ``out[t, h] = softmax_j(sm_scale * q[t, h] . c[j]) @ c[j, :v_dim]`` over ``j`` in
    ``topk_indices[t]``. Entries ``< 0`` or ``>= kv_len`` (and rows outside every sequence) are
    never gathered and never change the output; a row with no valid entry gives zeros. See
    ``reference.mla.attend`` for the full gather rule.

    ``attn_sink``: optional f32[H], one sink logit per head (DeepSeek-V4 / FlashMLA,
    ``reference.mla.sinks``): ``out[t, h] = sum_j e^(s_j - m) c_j / (sum_j e^(s_j - m) +
    e^(sink_h - m))``; the returned LSE excludes the sink; ``-inf`` = no sink; an empty row
    stays zeros. ``None`` (default): no sink, exactly the op without it.

    Returns:
      ``q.dtype[T, H, v_dim]``, and with ``return_lse=True`` also ``f32[T, H]`` natural-log LSE
      (``-inf`` for an empty row; never includes the sink).
    """
    read = stacked.resolve("cache_kv", cache_kv, layer)
    one_layer, page_indices = read.one, stacked.mask_table(page_indices, read)
    q_one = stacked.layer_query(q, read, layer=layer)
    q = stacked.query_at(q, read)
    check_mla_args(q_one, one_layer, kv_lens, topk_indices, page_indices, cu_q_lens, cu_kv_lens,
                   distribution, sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                   selected_name="topk_indices")
    sinks.check_sink(attn_sink, np.shape(q_one)[1])
    b = batch.RaggedBatch.of(cache_kv, kv_lens, page_indices, cu_q_lens, cu_kv_lens,
                             distribution, pages_per_seq=pages_per_seq)
    slots, valid = attend.token_slots(topk_indices, b.rows(q.shape[0]), b, causal=False)
    o, lse = attend.attend_selected(q, cache_kv, slots, valid, sm_scale=sm_scale, v_dim=v_dim,
                                     layer=layer)
    res = sinks.apply_sink(o, lse, attn_sink).astype(q.dtype)  # f32; the LSE stays sink-free
    return (res, lse) if return_lse else res
