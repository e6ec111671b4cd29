"""The lightning-indexer ops: token top-k (``indexer_topk``) and page top-k (``page_topk``),
the references' arguments (``reference.streamindex_topk_ref`` /
``reference.streamindex_page_topk_ref``) plus ``backend`` / ``validate`` / ``kernel_options`` /
``layer`` (``dsa_jax.dispatch``); the Pallas entries are ``pallas_kernels.indexer``'s.

Both backends have the same semantics; compare top-k results by score (``reference.selection``).
"""

from __future__ import annotations

import numpy as np

from dsa_jax import backend as _backend
from dsa_jax import batch as _batch
from dsa_jax import dispatch as _dispatch
from reference.formats import fp8_index_pages as fip
from reference.indexer.selection import DEFAULT_RECALL_TARGET


def indexer_topk(q, weights, cache_kv, seq_lens=None, page_indices=None, cu_q_lens=None,
                 cu_kv_lens=None, distribution=None, *, k: int, pages_per_seq: int | None = None,
                 one_token_per_seq: bool = False,
                 num_segments: int = 0, fill: str = "tail",
                 refuse_full_overwrite: bool = False,
                 recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
                 compression_ratio: int = 1, index_quant: str | None = None,
                 backend: str | None = None, validate: bool = False,
                 kernel_options: dict | None = None, layer=None, precision: str = "f32",
                 batch=None, layout=None, implementation=None, config=None):
    """Lightning-indexer token top-k: ``i32[T, k]`` sequence-local token offsets, ``-1`` tail.

    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . key[s])`` over the keys a row may see
    (causal, in its own sequence); the ``k`` best by descending score.

    Args:
      q: ``f32|bf16[T, H, D]`` index queries (D = 128 for DeepSeek).
      weights: ``f32|bf16[T, H]`` per-head weights.
      cache_kv: ``f32|bf16[num_pages, page_size, D]`` index keys, an ``Fp8IndexCache``, fp8
        index pages ``u8[num_pages, G, 4, 128]`` (``reference.formats.fp8_index_pages``: the
        ``Fp8IndexCache``'s codes and scales in one array, one DMA per page; an
        ``IndexPages`` or the bare bytes; the same results bit for bit), or any of them
        stacked with a leading ``L`` (read in place at ``layer``).
      seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution: the batch,
        ``i32[S]``, ``i32[N]``, ``i32[S+1]``, ``i32[S+1]``, ``i32[3]``
        (``reference.core.batch``), or ``batch=`` instead.
      k: the token budget per row (static, >= 1; past a row's context the tail is ``-1``).
      pages_per_seq: the page-table stride (static); from ``layout`` or ``batch`` if omitted.
      one_token_per_seq: decode shortcut: row ``i`` is sequence ``i``'s last token.
      num_segments: segment witnesses merged per row (0 = off), by ``fill`` (``"tail"``,
        upstream default, or ``"lowest"``; ``reference.witnesses``);
        ``refuse_full_overwrite``: the opt-in ``num_segments >= k`` guard.
      recall_target, exact: the approximate top-k's recall target; ``exact=True`` for
        ``lax.top_k`` (ties to the lower offset).
      compression_ratio: static; 1 = DeepSeek-V3.2 tokens; ``r > 1`` = DeepSeek-V4's
        compressed keys (cache, page table, ``cu_kv_lens`` and ``page_size`` in entries,
        ``seq_lens`` in tokens, entry ``j`` visible iff ``j < (p + 1) // r``; the result then
        holds entry numbers).
      index_quant: ``None`` or ``"fp4_sim"`` (DeepSeek-V4's Hadamard + FP4 simulation of q
        and keys, D = 128; the Pallas kernel rounds each key tile in VMEM).
      precision: ``"f32"`` (default) or ``"bf16"``: DeepSeek-V4's official scoring (bf16
        operands, each dot, ``relu(dot) * w`` and the head sum rounded to bf16; not with
        ``index_quant`` or an fp8 cache).
      backend / implementation: ``implementation=`` ``"xla"`` (the jnp reference),
        ``"pallas"``, an ordered list (``NotImplementedError`` passes to the next), or
        ``None`` (Pallas on TPU, else jnp; ``DSA_USE_PALLAS``); ``backend=`` the older
        spelling (``"reference"`` / ``"pallas"``). ``dsa_jax.backend``.
      validate: check the batch first (checkify; raises naming the sequence and numbers).
      kernel_options / config: Pallas knobs (ignored by the jnp path); ``config`` an
        ``IndexerBlocks``.
      layer: the layer of a stacked cache (a Python int is checked; a traced one masked).
      batch: a ``dsa_jax.Batch`` in place of the five batch arrays.
      layout: a ``dsa_jax.PagedLayout`` giving ``pages_per_seq``.

    Returns:
      ``i32[T, k]``; rows outside every sequence all ``-1``. An empty batch (``T = 0`` or
      ``S = 0``) is served (``dsa_jax.dispatch.empty_batch``). Details:
      ``reference.streamindex_topk_ref``.
    """
    cache_kv = _index_pages(cache_kv)
    meta, pages_per_seq = _batch.op_batch(
        "indexer_topk", batch, (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution),
        names=_NAMES, cache=cache_kv, pages_per_seq=pages_per_seq, layout=layout,
        tokens=compression_ratio == 1)
    statics = dict(k=k, pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                   num_segments=num_segments, fill=fill,
                   refuse_full_overwrite=refuse_full_overwrite, recall_target=recall_target,
                   exact=exact, compression_ratio=compression_ratio,
                   index_quant=index_quant, precision=precision)
    return _run("indexer_topk", (q, weights, cache_kv, *meta), statics, validate,
                pages_per_seq=pages_per_seq, layer=layer, backend=backend,
                implementation=implementation, kernel_options=kernel_options, config=config)


def page_topk(q, weights, cache_kv, seq_lens=None, page_indices=None, cu_q_lens=None,
              cu_kv_lens=None, distribution=None, *, k_pages: int,
              pages_per_seq: int | None = None, one_token_per_seq: bool = False,
              num_segments: int = 0, fill: str = "tail", refuse_full_overwrite: bool = False,
              recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
              compression_ratio: int = 1, index_quant: str | None = None,
              backend: str | None = None, validate: bool = False,
              kernel_options: dict | None = None, layer=None, precision: str = "f32",
              batch=None, layout=None, implementation=None, config=None):
    """Lightning-indexer page top-k: ``i32[T, k_pages]`` sequence-local page numbers.

    A page scores the max of its visible keys' scores (``indexer_topk``'s score); the
    ``k_pages`` best pages by descending score, ``-1`` tail.

    Args:
      q, weights, cache_kv, the batch arrays (or ``batch=``), ``pages_per_seq``,
        ``one_token_per_seq``, ``num_segments``, ``fill``, ``refuse_full_overwrite``,
        ``recall_target``, ``exact``, ``compression_ratio``, ``index_quant``, ``precision``,
        ``backend`` / ``implementation``, ``validate``, ``kernel_options`` / ``config``,
        ``layer``, ``layout``: as ``indexer_topk`` (q ``f32|bf16[T, H, D]``, weights
        ``f32|bf16[T, H]``, cache ``[num_pages, page_size, D]``; the guard against
        ``k_pages``).
      k_pages: the page budget per row (static, >= 1).

    Returns:
      ``i32[T, k_pages]``; rows outside every sequence all ``-1``; an empty batch is served.
      Details: ``reference.streamindex_page_topk_ref``.
    """
    cache_kv = _index_pages(cache_kv)
    meta, pages_per_seq = _batch.op_batch(
        "page_topk", batch, (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution),
        names=_NAMES, cache=cache_kv, pages_per_seq=pages_per_seq, layout=layout,
        tokens=compression_ratio == 1)
    statics = dict(k_pages=k_pages, pages_per_seq=pages_per_seq,
                   one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                   fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                   recall_target=recall_target, exact=exact,
                   compression_ratio=compression_ratio, index_quant=index_quant,
                   precision=precision)
    return _run("page_topk", (q, weights, cache_kv, *meta), statics, validate,
                pages_per_seq=pages_per_seq, layer=layer, backend=backend,
                implementation=implementation, kernel_options=kernel_options, config=config)


def _index_pages(cache_kv):
    """fp8 index pages ``u8[..., P, G, 4, 128]`` as an ``IndexPages`` (their logical keys
    shape, checked: ``reference.formats.fp8_index_pages``); any other cache as given."""
    return fip.as_index_pages(cache_kv) if fip.is_index_pages(cache_kv) else cache_kv


_NAMES = ("seq_lens", "page_indices", "cu_q_lens", "cu_kv_lens", "distribution")


def _run(op: str, arrays: tuple, statics: dict, validate: bool, *, pages_per_seq: int, layer,
         backend, implementation, kernel_options, config):
    """Both indexer ops: ``arrays`` = (q, weights, cache, the five batch arrays)."""
    kernel_options = _backend.with_config(op, kernel_options, config)
    # q f[T, H, D] (or [L, T, H, D] is not taken: the indexer q is per layer), weights f[T, H]
    rows = {0: (-3, 0), 1: (0, 0)}

    def call(fn, extra):
        return _dispatch.call(fn, extra, arrays, statics, validate,
                              num_rows=int(np.shape(arrays[0])[0]), cache_index=2,
                              seq_lens_index=3, pages_per_seq=pages_per_seq, layer=layer,
                              row_axes=rows)

    return _backend.run(op, implementation, backend, kernel_options, call)
