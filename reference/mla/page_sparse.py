"""Page-sparse absorbed MLA (reference; also the flag-off serving path)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.formats import stacked
from reference.mla import attend, sinks
from reference.mla.args import check_mla_args


def pages_to_tokens(topk_pages: jax.Array, page_size: int, pages_per_seq: int) -> jax.Array:
    """Expand ``i32[T, k_pages]`` sequence-local page numbers to ``i32[T, k_pages*page_size]``
    sequence-local token offsets; a page number outside ``[0, pages_per_seq)`` gives ``-1``."""
    ok = (topk_pages >= 0) & (topk_pages < pages_per_seq)
    tok = topk_pages[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)
    tok = jnp.where(ok[:, :, None], tok, -1)
    return tok.reshape(topk_pages.shape[0], -1)


@stacked.checks_layer(cache_pos=1)
@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_seq", "v_dim", "return_lse"))
def page_sparse_mla_ref(q: jax.Array, cache_kv: jax.Array, kv_lens: jax.Array,
                        topk_pages: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                        cu_kv_lens: jax.Array, distribution: jax.Array, *, sm_scale: float,
                        pages_per_seq: int, v_dim: int, return_lse: bool = False,
                        layer=None, attn_sink=None
                        ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Sparse absorbed MLA over per-row page top-k.

    Shapes: ``q``: f32|bf16[T, H, D]; ``cache_kv``: f32|bf16[num_pages, page_size, D] (or the
    packed or fp8 latent cache, as ``sparse_mla_ref``);
    ``topk_pages``: i32[T, k_pages] sequence-local page numbers, -1 = ignore; the batch arrays as
    ``reference.core.batch``.

    Each row attends every valid, causal token (``token < kv_len`` and ``token <= abs_pos``) of
    its selected pages. Page numbers ``< 0`` or ``>= pages_per_seq`` are ignored; a page listed
    twice counts twice (as a duplicated token does in ``sparse_mla_ref``).

    ``attn_sink``: optional f32[H] per-head sink logit (``reference.mla.sinks``): it enters the
    softmax denominator only; the returned LSE excludes it; ``-inf`` = no sink.

    Returns:
      ``q.dtype[T, H, v_dim]`` (and ``f32[T, H]`` sink-free LSE with ``return_lse=True``).
    """
    read = stacked.resolve("cache_kv", cache_kv, layer)
    one_layer, page_indices = read.one, stacked.mask_table(page_indices, read)
    q_one = stacked.layer_query(q, read, layer=layer)
    q = stacked.query_at(q, read)
    check_mla_args(q_one, one_layer, kv_lens, topk_pages, page_indices, cu_q_lens, cu_kv_lens,
                   distribution, sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                   selected_name="topk_pages")
    sinks.check_sink(attn_sink, np.shape(q_one)[1])
    b = batch.RaggedBatch.of(cache_kv, kv_lens, page_indices, cu_q_lens, cu_kv_lens,
                             distribution, pages_per_seq=pages_per_seq)
    tokens = pages_to_tokens(topk_pages, b.page_size, pages_per_seq)
    slots, valid = attend.token_slots(tokens, b.rows(q.shape[0]), b, causal=True)
    o, lse = attend.attend_selected(q, cache_kv, slots, valid, sm_scale=sm_scale, v_dim=v_dim,
                                     layer=layer)
    res = sinks.apply_sink(o, lse, attn_sink).astype(q.dtype)  # f32; the LSE stays sink-free
    return (res, lse) if return_lse else res
