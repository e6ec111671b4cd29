"""The four DSA ops, one signature each, with a ``backend=`` switch.

Every op takes the reference's arguments (``reference.*_ref``) plus:

- ``backend``: ``"reference"``, ``"pallas"`` or ``None`` (``dsa_jax.backend``);
- ``validate``: run the batch checks of ``dsa_jax.validate`` first (checkify; raises
  ``checkify.JaxRuntimeError`` naming the offending sequence and numbers; eager only);
- ``kernel_options``: knobs for the Pallas entry (block sizes, ``chip``, ``interpret``...);
  ignored by the reference;
- ``layer``: with a stacked cache (``[L, num_pages, page_size, W]``, or an fp8 cache with a
  leading ``L``), the layer to read, in place (``reference.stacked``: a Python int outside
  ``[0, L)`` is a ``ValueError``; a traced one reads nothing, and ``validate`` reports it).

Both backends have the same semantics; compare top-k results by score (``reference.selection``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import checkify

from dsa_jax import backend as _backend
from dsa_jax import validate as _validate
from reference import stacked
from reference.selection import DEFAULT_RECALL_TARGET


def _call(fn, extra, arrays, statics, validate: bool, *, num_rows: int, cache_index: int,
          seq_lens_index: int, pages_per_seq: int, layer=None, keyword_arrays=None):
    """Run ``fn(*arrays, **statics, **extra, **keyword_arrays, layer=layer)``, under the
    checkify rules when ``validate`` (the batch rules, and the layer rule for a stacked cache).
    ``keyword_arrays``: traced keyword operands (e.g. ``attn_sink``); a ``None`` value is not
    passed (the op's default), so a call without them is exactly the call before them."""
    kw_arrays = {k: v for k, v in (keyword_arrays or {}).items() if v is not None}
    if not validate:
        return fn(*arrays, **statics, **extra, **kw_arrays, layer=layer)
    cache = arrays[cache_index]  # an array, or an fp8 cache object (both have ``.shape``)
    read = stacked.resolve("cache_kv", cache, layer)  # static refusals before tracing
    shape = tuple(getattr(cache, "shape", np.shape(cache)))
    num_pages, page_size = (int(d) for d in shape[-3:-1])
    key = (fn, tuple(statics.items()), tuple(sorted(extra.items())), num_rows, seq_lens_index,
           page_size, pages_per_seq, num_pages, None if layer is None else read.num_layers)
    err, res = _checked(key)(arrays, read.layer, kw_arrays)  # kw_arrays: traced, by name
    err.throw()
    return res


@functools.lru_cache(maxsize=64)
def _checked(key):
    """``jit(checkify(fn + the batch rules))``, built once per op and statics."""
    (fn, statics, extra, num_rows, seq_lens_index, page_size, pages_per_seq, num_pages,
     num_layers) = key

    def checked(xs, layer, kw_arrays):
        kv, rest = xs[seq_lens_index], xs[-4:]  # page_indices, cu_q_lens, cu_kv_lens, dist
        _validate.check_batch(num_rows, kv, *rest, page_size=page_size,
                              pages_per_seq=pages_per_seq, num_pages=num_pages,
                              compression_ratio=dict(statics).get("compression_ratio", 1))
        if num_layers is not None:
            _validate.check_layer(layer, num_layers)
        return fn(*xs, **dict(statics), **dict(extra), **kw_arrays,
                  layer=None if num_layers is None else layer)

    return jax.jit(checkify.checkify(checked))


def indexer_topk(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                 distribution, *, k: int, pages_per_seq: int, one_token_per_seq: bool = False,
                 num_segments: int = 0, fill: str = "tail",
                 refuse_full_overwrite: bool = False,
                 recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
                 compression_ratio: int = 1, index_quant: str | None = None,
                 backend: str | None = None, validate: bool = False,
                 kernel_options: dict | None = None, layer=None):
    """Lightning-indexer token top-k: ``i32[T, k]`` sequence-local token offsets, ``-1`` tail.

    Args as ``reference.streamindex_topk_ref`` (q ``f[T, H, D]``, weights ``f[T, H]``, cache
    ``f[num_pages, page_size, D]``, ragged metadata), ``num_segments`` witnesses merged per row
    (0 = off) by the ``fill`` policy (``"tail"`` upstream default, ``"lowest"``;
    ``scatter_topology_witnesses``), ``refuse_full_overwrite`` the opt-in ``S >= k`` guard,
    ``compression_ratio`` (static; 1 = DeepSeek-V3.2 tokens; ``r > 1`` = DeepSeek-V4's
    compressed keys: cache, page table, ``cu_kv_lens`` and ``page_size`` in entries,
    ``seq_lens`` in tokens, entry ``j`` visible iff ``j < (p + 1) // r``; the result then holds
    entry numbers), ``index_quant`` (static; ``None``, or ``"fp4_sim"``: DeepSeek-V4's
    simulation, q heads and keys rotated by the normalized Hadamard transform and FP4-rounded,
    block 32 ue8m0, before scoring; D = 128, f32/bf16 keys stored unrotated; the Pallas backend
    rounds each key tile in the kernel), plus ``backend`` / ``validate`` / ``kernel_options``
    (module docstring).
    """
    fn, extra = _backend.implementation("indexer_topk", backend, kernel_options)
    statics = dict(k=k, pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                   num_segments=num_segments, fill=fill,
                   refuse_full_overwrite=refuse_full_overwrite, recall_target=recall_target,
                   exact=exact, compression_ratio=compression_ratio,
                   index_quant=index_quant)
    arrays = (q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    return _call(fn, extra, arrays, statics, validate,
                 num_rows=int(np.shape(q)[0]), cache_index=2, seq_lens_index=3,
                 pages_per_seq=pages_per_seq, layer=layer)


def page_topk(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
              distribution, *, k_pages: int, pages_per_seq: int, one_token_per_seq: bool = False,
              num_segments: int = 0, fill: str = "tail", refuse_full_overwrite: bool = False,
              recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
              compression_ratio: int = 1, index_quant: str | None = None,
              backend: str | None = None, validate: bool = False,
              kernel_options: dict | None = None, layer=None):
    """Lightning-indexer page top-k: ``i32[T, k_pages]`` sequence-local page numbers.

    Args as ``reference.streamindex_page_topk_ref`` (``fill``, ``refuse_full_overwrite``,
    ``compression_ratio``, ``index_quant`` as ``indexer_topk``, the guard against ``k_pages``)
    plus ``backend`` / ``validate`` / ``kernel_options``.
    """
    fn, extra = _backend.implementation("page_topk", backend, kernel_options)
    statics = dict(k_pages=k_pages, pages_per_seq=pages_per_seq,
                   one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                   fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                   recall_target=recall_target, exact=exact,
                   compression_ratio=compression_ratio, index_quant=index_quant)
    arrays = (q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    return _call(fn, extra, arrays, statics, validate,
                 num_rows=int(np.shape(q)[0]), cache_index=2, seq_lens_index=3,
                 pages_per_seq=pages_per_seq, layer=layer)


def sparse_mla(q, cache_kv, kv_lens, topk_indices, page_indices, cu_q_lens, cu_kv_lens,
               distribution, *, sm_scale: float, pages_per_seq: int, v_dim: int,
               return_lse: bool = False, backend: str | None = None, validate: bool = False,
               kernel_options: dict | None = None, layer=None, attn_sink=None):
    """Token-sparse absorbed MLA: ``q.dtype[T, H, v_dim]`` (and ``f32[T, H]`` LSE).

    Args as ``reference.sparse_mla_ref`` plus ``backend`` / ``validate`` / ``kernel_options``
    and ``layer``; with ``layer``, ``q`` may be the stacked ``[L, T, H, D]``, read in place at
    that layer (``reference.stacked.layer_query``). ``attn_sink``: optional ``f32[H]``
    attention-sink logits (``reference.sinks``: denominator only; the LSE stays sink-free).
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
    return _call(fn, extra, arrays, statics, validate, num_rows=int(np.shape(arrays[0])[-3]),
                 cache_index=1, seq_lens_index=2, pages_per_seq=pages_per_seq, layer=layer,
                 keyword_arrays=dict(attn_sink=attn_sink))
