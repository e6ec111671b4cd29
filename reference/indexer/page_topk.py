"""Page top-k of the lightning indexer (reference; also the flag-off serving path)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from reference.formats import fp8_index_pages, stacked
from reference.indexer import scores as index_scores
from reference.indexer import selection
from reference.indexer.args import (
    check_index_precision,
    check_index_quant,
    check_topk_args,
)

_STATICS = ("k_pages", "pages_per_seq", "one_token_per_seq", "num_segments", "fill",
            "refuse_full_overwrite", "recall_target", "exact", "compression_ratio",
            "index_quant", "precision")


def page_max(scores: jax.Array, token_ok: jax.Array, page_size: int) -> jax.Array:
    """Max-pool ``scores f32[R, P*page_size]`` over each page's valid tokens -> f32[R, P];
    a page with no valid token scores ``-inf``, a NaN among its valid tokens NaN (``lax.max``).
    A strided window over the row as it lies: a ``[R, P, page_size]`` view pads ``page_size``
    lanes to 128 on TPU (16x the row's bytes at pages of 8; measured 256 MiB of temp for V4.1's
    candidate blocks over 4 rows of 1M entries)."""
    masked = jnp.where(token_ok, scores, selection.NEG_INF)
    return jax.lax.reduce_window(masked, selection.NEG_INF, jax.lax.max, (1, page_size),
                                 (1, page_size), "VALID")


def causal_page_count(abs_pos: jax.Array, kv_len: jax.Array, page_size: int) -> jax.Array:
    """Pages holding at least one causal, existing token of each row (i32[R])."""
    tokens = selection.causal_token_count(abs_pos, kv_len)
    return (tokens + page_size - 1) // page_size


@stacked.checks_layer(cache_pos=2)
@functools.partial(jax.jit, static_argnames=_STATICS)
def streamindex_page_topk_ref(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                              seq_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                              cu_kv_lens: jax.Array, distribution: jax.Array, *, k_pages: int,
                              pages_per_seq: int, one_token_per_seq: bool = False,
                              num_segments: int = 0, fill: str = "tail",
                              refuse_full_overwrite: bool = False,
                              recall_target: float = selection.DEFAULT_RECALL_TARGET,
                              exact: bool = False, compression_ratio: int = 1,
                              index_quant: str | None = None, layer=None,
                              precision: str = "f32") -> jax.Array:
    """Page-level lightning-indexer top-k over a ragged paged batch.

    Shapes: ``q``: f32|bf16[T, H, D]; ``weights``: f32|bf16[T, H]; ``cache_kv``: f32|bf16[num_pages,
    page_size, D] or an ``Fp8IndexCache`` (``q`` then also fp8, as ``streamindex_topk_ref``);
    the batch arrays as ``reference.core.batch``.

    Token scores as in ``streamindex_topk_ref``, max-pooled over each page's causal, existing
    tokens; then the selection stage over the sequence's ``pages_per_seq`` pages. Witnesses
    (``num_segments > 0``) use the row's causal page count as its context length; ``fill``
    and ``refuse_full_overwrite`` as ``streamindex_topk_ref`` (the guard compares with
    ``k_pages``). ``compression_ratio`` as ``streamindex_topk_ref``: with ``r > 1`` pages hold
    entries and a page's score is the max over its visible entries. ``index_quant`` as
    ``streamindex_topk_ref`` (``"fp4_sim"``: the token scores, hence the page maxima, are those
    of the rotated, FP4-simulated q heads and keys; same map, ``scores.INDEX_QUANT_MAPS``).
    ``precision`` as ``streamindex_topk_ref`` (``"bf16"``: a page's score is the max over its
    visible entries of the bf16-valued token scores; not with ``index_quant`` or an fp8 cache).

    Returns:
      i32[T, k_pages]: sequence-local page numbers by descending page score, ``-1`` padding;
      rows outside every sequence all ``-1``.
    """
    cache_kv = fp8_index_pages.as_keys(cache_kv)  # fp8 index pages: their Fp8IndexCache
    one_layer = stacked.resolve("cache_kv", cache_kv, layer).one
    check_topk_args((q, weights, one_layer, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution), k=k_pages, k_name="k_pages", pages_per_seq=pages_per_seq,
                    one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                    fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                    recall_target=recall_target, exact=exact,
                    compression_ratio=compression_ratio)
    check_index_quant(index_quant, int(q.shape[2]), one_layer)
    check_index_precision(precision, index_quant, one_layer)
    key_map = index_scores.INDEX_QUANT_MAPS[index_quant]
    if key_map is not None:
        q = key_map(q)
    page_size = cache_kv.shape[-2]

    def finish(scores, token_ok, key_pos, kv_len):  # key_pos, kv_len: keys (index_scores)
        return selection.select_and_merge(
            page_max(scores, token_ok, page_size), k_pages,
            causal_page_count(key_pos, kv_len, page_size), recall_target=recall_target,
            exact=exact, num_segments=num_segments, fill=fill)

    return index_scores.score_and_select(
        q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
        pages_per_seq=pages_per_seq, out_width=k_pages, one_token_per_seq=one_token_per_seq,
        finish=finish, layer=layer, compression_ratio=compression_ratio, key_map=key_map,
        precision=precision)
