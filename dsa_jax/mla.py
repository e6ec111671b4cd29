"""The absorbed MLA ops: token-sparse (``sparse_mla``) and page-sparse (``page_sparse_mla``),
the references' arguments (``reference.sparse_mla_ref`` / ``reference.page_sparse_mla_ref``)
plus ``backend`` / ``validate`` / ``kernel_options`` / ``layer`` (``dsa_jax.dispatch``) and an
optional ``attn_sink``; the Pallas entries are ``pallas_kernels.mla``'s.
"""

from __future__ import annotations

import numpy as np

from dsa_jax import backend as _backend
from dsa_jax import batch as _batch
from dsa_jax import dispatch as _dispatch
from dsa_jax.dispatch import static_float


def sparse_mla(q, cache_kv, kv_lens=None, topk_indices=None, page_indices=None,
               cu_q_lens=None, cu_kv_lens=None, distribution=None, *, sm_scale: float,
               pages_per_seq: int | None = None, v_dim: int | None = None,
               return_lse: bool = False, backend: str | None = None, validate: bool = False,
               kernel_options: dict | None = None, layer=None, attn_sink=None, batch=None,
               layout=None, implementation=None, config=None):
    """Token-sparse absorbed MLA: ``q.dtype[T, H, v_dim]`` (and ``f32[T, H]`` LSE).

    ``out[t, h] = softmax_j(sm_scale * q[t, h] . c[j]) @ c[j, :v_dim]`` over the selected
    tokens ``j`` of the row's sequence.

    Args:
      q: ``f32|bf16[T, H, D]`` absorbed queries ``[nope | rope]`` in latent space; with
        ``layer``, also the stacked ``[L, T, H, D]`` read in place.
      cache_kv: ``f32|bf16[num_pages, page_size, D]`` latent cache ``[c_kv | k_rope]``, the
        packed bf16 words ``u32[num_pages, page_size, D / 2]``, an ``Fp8LatentCache``, or any
        of them stacked with a leading ``L``.
      kv_lens: ``i32[S]`` tokens per sequence (this step's rows included).
      topk_indices: ``i32[T, k]`` sequence-local token offsets; ``-1`` or ``>= kv_len``:
        never read. With ``batch=`` it may be the third positional argument:
        ``sparse_mla(q, cache, topk, batch=b, ...)``.
      page_indices, cu_q_lens, cu_kv_lens, distribution: ``i32[N]``, ``i32[S+1]``,
        ``i32[S+1]``, ``i32[3]`` (``reference.core.batch``), or ``batch=`` instead.
      sm_scale: the softmax scale (a Python float, or a concrete scalar; static).
      pages_per_seq: the page-table stride (static); from ``layout`` or ``batch`` if omitted.
      v_dim: value dims (``<= D``); from ``layout.latent_dim`` if omitted.
      return_lse: also return the natural-log LSE ``f32[T, H]`` (``-inf`` for an empty row).
      backend / implementation, validate, kernel_options / config (an ``MlaBlocks``), layer,
        batch, layout: as ``dsa_jax.indexer_topk``.
      attn_sink: optional ``f32[H]`` attention-sink logits (denominator only; the LSE stays
        sink-free; ``reference.mla.sinks``).

    Returns:
      ``q.dtype[T, H, v_dim]`` (and the LSE); a row with nothing to read is zeros; an empty
      batch is served. Details: ``reference.sparse_mla_ref``.
    """
    return _mla("sparse_mla", (q, cache_kv, kv_lens, topk_indices, page_indices, cu_q_lens,
                               cu_kv_lens, distribution),
                sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                return_lse=return_lse, backend=backend, validate=validate,
                kernel_options=kernel_options, layer=layer, attn_sink=attn_sink, batch=batch,
                layout=layout, implementation=implementation, config=config)


def page_sparse_mla(q, cache_kv, kv_lens=None, topk_pages=None, page_indices=None,
                    cu_q_lens=None, cu_kv_lens=None, distribution=None, *, sm_scale: float,
                    pages_per_seq: int | None = None, v_dim: int | None = None,
                    return_lse: bool = False, backend: str | None = None,
                    validate: bool = False, kernel_options: dict | None = None, layer=None,
                    attn_sink=None, batch=None, layout=None, implementation=None,
                    config=None):
    """Page-sparse absorbed MLA (causal inside pages): ``q.dtype[T, H, v_dim]``.

    Args:
      q, cache_kv, kv_lens, the batch arrays (or ``batch=``), ``sm_scale``,
        ``pages_per_seq``, ``v_dim``, ``return_lse``, ``backend`` / ``implementation``,
        ``validate``, ``kernel_options`` / ``config``, ``layer``, ``attn_sink``, ``layout``:
        as ``sparse_mla``.
      topk_pages: ``i32[T, k_pages]`` sequence-local page numbers (``page_topk``); ``-1``:
        none. With ``batch=`` it may be the third positional argument.

    Returns:
      ``q.dtype[T, H, v_dim]`` (and ``f32[T, H]`` LSE); an empty batch is served. Details:
      ``reference.page_sparse_mla_ref``.
    """
    return _mla("page_sparse_mla", (q, cache_kv, kv_lens, topk_pages, page_indices,
                                    cu_q_lens, cu_kv_lens, distribution),
                sm_scale=sm_scale, pages_per_seq=pages_per_seq, v_dim=v_dim,
                return_lse=return_lse, backend=backend, validate=validate,
                kernel_options=kernel_options, layer=layer, attn_sink=attn_sink, batch=batch,
                layout=layout, implementation=implementation, config=config)


def _mla(op: str, arrays: tuple, *, sm_scale: float, pages_per_seq: int | None,
         v_dim: int | None, return_lse: bool, backend: str | None, validate: bool,
         kernel_options: dict | None, layer=None, attn_sink=None, batch=None, layout=None,
         implementation=None, config=None):
    """Both MLA ops: ``arrays`` = (q, cache, kv_lens, selected, the other batch arrays)."""
    q, cache, kv_lens, selected, *rest = arrays
    if batch is not None and selected is None and kv_lens is not None and not any(
            x is not None for x in rest):
        kv_lens, selected = None, kv_lens  # op(q, cache, selection, batch=b)
    if selected is None:
        raise TypeError(f"{op}: the selection ({_SELECTED[op]}) is missing")
    meta, pages_per_seq = _batch.op_batch(op, batch, (kv_lens, *rest), names=_NAMES,
                                          cache=cache, pages_per_seq=pages_per_seq,
                                          layout=layout)
    v_dim = _batch._agree(op, [("v_dim", v_dim),
                               ("layout.latent_dim", getattr(layout, "latent_dim", None))])
    if v_dim is None:
        raise TypeError(f"{op}: v_dim is required (or layout=PagedLayout(...))")
    statics = dict(sm_scale=static_float(op, "sm_scale", sm_scale), pages_per_seq=pages_per_seq,
                   v_dim=v_dim, return_lse=return_lse)
    arrays = (q, cache, meta[0], selected, *meta[1:])
    kernel_options = _backend.with_config(op, kernel_options, config)
    rows = {0: (-3, 0), 3: (0, -1)}  # q [.., T, H, D], the selection i32[T, k]

    def call(fn, extra):
        return _dispatch.call(fn, extra, arrays, statics, validate,
                              num_rows=int(np.shape(arrays[0])[-3]), cache_index=1,
                              seq_lens_index=2, pages_per_seq=pages_per_seq, layer=layer,
                              keyword_arrays=dict(attn_sink=attn_sink), row_axes=rows)

    return _backend.run(op, implementation, backend, kernel_options, call)


_NAMES = ("kv_lens", "page_indices", "cu_q_lens", "cu_kv_lens", "distribution")
_SELECTED = {"sparse_mla": "topk_indices", "page_sparse_mla": "topk_pages"}
