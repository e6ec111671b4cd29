"""The lightning-indexer ops: token top-k (``indexer_topk``) and page top-k (``page_topk``),
the references' arguments (``reference.streamindex_topk_ref`` /
``reference.streamindex_page_topk_ref``) plus ``backend`` / ``validate`` / ``kernel_options`` /
``layer`` (``dsa_jax.dispatch``); the Pallas entries are ``pallas_kernels.indexer``'s.

Both backends have the same semantics; compare top-k results by score (``reference.selection``).
"""

from __future__ import annotations

import numpy as np

from dsa_jax import backend as _backend
from dsa_jax import dispatch as _dispatch
from reference.indexer.selection import DEFAULT_RECALL_TARGET


def indexer_topk(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                 distribution, *, k: int, pages_per_seq: int, one_token_per_seq: bool = False,
                 num_segments: int = 0, fill: str = "tail",
                 refuse_full_overwrite: bool = False,
                 recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
                 compression_ratio: int = 1, index_quant: str | None = None,
                 backend: str | None = None, validate: bool = False,
                 kernel_options: dict | None = None, layer=None, precision: str = "f32"):
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
    rounds each key tile in the kernel), ``precision`` (static; ``"f32"`` default, or
    ``"bf16"``: DeepSeek-V4's official scoring, q ``[T, H, D]``, keys and weights cast to bf16
    (f32 inputs are rounded first), each head's dot, each ``relu(dot) * w`` and the f32 head sum
    rounded to bf16, the top-k on those scores; not defined with ``index_quant`` or an fp8
    cache, ``ValueError``), plus ``backend`` / ``validate`` / ``kernel_options``
    (``dsa_jax.dispatch``).
    """
    fn, extra = _backend.implementation("indexer_topk", backend, kernel_options)
    statics = dict(k=k, pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                   num_segments=num_segments, fill=fill,
                   refuse_full_overwrite=refuse_full_overwrite, recall_target=recall_target,
                   exact=exact, compression_ratio=compression_ratio,
                   index_quant=index_quant, precision=precision)
    arrays = (q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    return _dispatch.call(fn, extra, arrays, statics, validate,
                          num_rows=int(np.shape(q)[0]), cache_index=2, seq_lens_index=3,
                          pages_per_seq=pages_per_seq, layer=layer)


def page_topk(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
              distribution, *, k_pages: int, pages_per_seq: int, one_token_per_seq: bool = False,
              num_segments: int = 0, fill: str = "tail", refuse_full_overwrite: bool = False,
              recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
              compression_ratio: int = 1, index_quant: str | None = None,
              backend: str | None = None, validate: bool = False,
              kernel_options: dict | None = None, layer=None, precision: str = "f32"):
    """Lightning-indexer page top-k: ``i32[T, k_pages]`` sequence-local page numbers.

    Args as ``reference.streamindex_page_topk_ref`` (``fill``, ``refuse_full_overwrite``,
    ``compression_ratio``, ``index_quant``, ``precision`` as ``indexer_topk``, the guard against
    ``k_pages``; ``"bf16"``: a page scores the max of its visible entries' bf16 scores)
    plus ``backend`` / ``validate`` / ``kernel_options`` (``dsa_jax.dispatch``).
    """
    fn, extra = _backend.implementation("page_topk", backend, kernel_options)
    statics = dict(k_pages=k_pages, pages_per_seq=pages_per_seq,
                   one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                   fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                   recall_target=recall_target, exact=exact,
                   compression_ratio=compression_ratio, index_quant=index_quant,
                   precision=precision)
    arrays = (q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    return _dispatch.call(fn, extra, arrays, statics, validate,
                          num_rows=int(np.shape(q)[0]), cache_index=2, seq_lens_index=3,
                          pages_per_seq=pages_per_seq, layer=layer)
