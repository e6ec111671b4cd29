"""The absorbed MLA ops: token-sparse (``sparse_mla``) and page-sparse (``page_sparse_mla``),
the references' arguments (``reference.sparse_mla_ref`` / ``reference.page_sparse_mla_ref``)
plus ``backend`` / ``validate`` / ``kernel_options`` / ``layer`` (``dsa_jax.dispatch``) and an
optional ``attn_sink``; the Pallas entries are ``pallas_kernels.mla``'s.
"""

from __future__ import annotations

import numpy as np

from dsa_jax import backend as _backend
from dsa_jax import dispatch as _dispatch


def sparse_mla(q, cache_kv, kv_lens, topk_indices, page_indices, cu_q_lens, cu_kv_lens,
               distribution, *, sm_scale: float, pages_per_seq: int, v_dim: int,
               return_lse: bool = False, backend: str | None = None, validate: bool = False,
               kernel_options: dict | None = None, layer=None, attn_sink=None):
    """Token-sparse absorbed MLA: ``q.dtype[T, H, v_dim]`` (and ``f32[T, H]`` LSE).

    Args as ``reference.sparse_mla_ref`` plus ``backend`` / ``validate`` / ``kernel_options``
    and ``layer`` (``dsa_jax.dispatch``); with ``layer``, ``q`` may be the stacked
    ``[L, T, H, D]``, read in place at that layer (``reference.stacked.layer_query``).
    ``attn_sink``: optional ``f32[H]`` attention-sink logits (``reference.sinks``: denominator
    only; the LSE stays sink-free).
    """
    return _mla("sparse_mla", (q, cache_kv, kv_lens, topk_indices, page_indices, cu_q_lens,
                               cu_kv_lens, distribution),
                sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                return_lse=return_lse, backend=backend, validate=validate,
                kernel_options=kernel_options, layer=layer, attn_sink=attn_sink)


def page_sparse_mla(q, cache_kv, kv_lens, topk_pages, page_indices, cu_q_lens, cu_kv_lens,
                    distribution, *, sm_scale: float, pages_per_seq: int, v_dim: int,
                    return_lse: bool = False, backend: str | None = None,
                    validate: bool = False, kernel_options: dict | None = None, layer=None,
                    attn_sink=None):
    """Page-sparse absorbed MLA (causal inside pages): ``q.dtype[T, H, v_dim]``.

    Args as ``reference.page_sparse_mla_ref`` plus ``backend`` / ``validate`` /
    ``kernel_options``, ``layer`` and ``attn_sink`` (as ``sparse_mla``).
    """
    return _mla("page_sparse_mla", (q, cache_kv, kv_lens, topk_pages, page_indices,
                                    cu_q_lens, cu_kv_lens, distribution),
                sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                return_lse=return_lse, backend=backend, validate=validate,
                kernel_options=kernel_options, layer=layer, attn_sink=attn_sink)


def _mla(op: str, arrays: tuple, *, sm_scale: float, pages_per_seq: int, v_dim: int,
         return_lse: bool, backend: str | None, validate: bool, kernel_options: dict | None,
         layer=None, attn_sink=None):
    """Both MLA ops: ``arrays`` = (q, cache, kv_lens, selected, the other batch arrays)."""
    fn, extra = _backend.implementation(op, backend, kernel_options)
    statics = dict(sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                   return_lse=return_lse)
    return _dispatch.call(fn, extra, arrays, statics, validate,
                          num_rows=int(np.shape(arrays[0])[-3]), cache_index=1,
                          seq_lens_index=2, pages_per_seq=pages_per_seq, layer=layer,
                          keyword_arrays=dict(attn_sink=attn_sink))
