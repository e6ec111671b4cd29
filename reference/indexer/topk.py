"""Token top-k of the lightning indexer (reference; also the flag-off serving path)."""

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

_STATICS = ("k", "pages_per_seq", "one_token_per_seq", "num_segments", "fill",
            "refuse_full_overwrite", "recall_target", "exact", "compression_ratio",
            "index_quant", "precision")


@stacked.checks_layer(cache_pos=2)
@functools.partial(jax.jit, static_argnames=_STATICS)
def streamindex_topk_ref(q: jax.Array, weights: jax.Array, cache_kv: jax.Array, seq_lens: jax.Array,
                         page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                         distribution: jax.Array, *, k: int, pages_per_seq: int,
                         one_token_per_seq: bool = False, num_segments: int = 0,
                         fill: str = "tail", refuse_full_overwrite: bool = False,
                         recall_target: float = selection.DEFAULT_RECALL_TARGET,
                         exact: bool = False, compression_ratio: int = 1,
                         index_quant: str | None = None, layer=None,
                         precision: str = "f32") -> jax.Array:
    """Lightning-indexer token top-k over a ragged paged batch.

    Shapes: ``q``: f32|bf16[T, H, D] indexer query heads; ``weights``: f32|bf16[T, H] per-head
    mixing weights; ``cache_kv``: f32|bf16[num_pages, page_size, D] paged indexer keys, or an
    ``Fp8IndexCache`` (``reference.formats.fp8_cache``; then ``q`` may also be float8_e4m3fn with
    its scale folded into ``weights``, and each score is ``scale[s] * sum_h w * relu(q . k8[s])``,
    ``reference.indexer.scores.scaled_scores``); the batch
    arrays as ``reference.core.batch``.

    ``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` for every causal, existing token ``s``
    of row ``t``'s sequence, then the selection stage (``reference.indexer.selection``).

    Args:
      k: static budget; may exceed a row's candidates (the tail is ``-1``).
      pages_per_seq: static page-table stride; capacity is ``pages_per_seq * page_size``.
      one_token_per_seq: decode batches (T == S, row i is sequence i's last token).
      num_segments: segment witnesses per row (0 = off), merged after the guard with the row's
        causal context length ``abs_pos + 1`` (capped at the sequence's length).
      fill: where the witnesses go: ``"tail"`` (upstream, default) or ``"lowest"``
        (``reference.witnesses.scatter_topology_witnesses``).
      refuse_full_overwrite: opt-in guard, ValueError when ``num_segments >= k``
        (``reference.witnesses.check_witness_policy`` gives the reason).
      recall_target, exact: selection mode (see ``reference.indexer.selection``).
      compression_ratio: static ``r >= 1``. ``1``: keys are tokens (DeepSeek-V3.2). ``r > 1``
        (DeepSeek-V4's indexer, ``r = 4``): keys are compressed entries, one per group of ``r``
        tokens; ``cache_kv``, ``page_indices``, ``cu_kv_lens``, ``page_size`` and the capacity
        ``pages_per_seq * page_size`` count entries, ``seq_lens`` stays in tokens; a sequence
        holds ``seq_len // r`` entries and entry ``j`` is a candidate of a row at token
        position ``p`` iff ``j < (p + 1) // r`` (``reference.core.batch.last_visible_key``); the
        witnesses' context length is that visible entry count. Refused
        (``args.check_compression_ratio``): not an int >= 1, or a capacity whose
        tokens pass i32.
      index_quant: ``None`` (scores as given), or ``"fp4_sim"``: DeepSeek-V4's simulation
        (``scores.fp4_sim``): q heads and the cache's keys (stored unrotated, f32/bf16,
        D = 128) are each rotated by the normalized Hadamard transform and FP4-simulated
        (block 32, ue8m0) before the scores (``scores.INDEX_QUANT_MAPS``; the Pallas
        entries run the same rule on the key tiles in the kernel). Refused
        (``args.check_index_quant``, ``ValueError``): another name, ``D != 128``, an
        fp8 index cache (the other format).
      precision: static, ``"f32"`` (default: scores in f32, the traced program unchanged) or
        ``"bf16"``: DeepSeek-V4's official scoring (docs/V4_OFFICIAL_REGIME.md steps 20-25,
        ``scores.index_scores``): q f32|bf16[T, H, D] and the keys are cast to bf16 (bf16 inputs
        are used as given; f32 ones are rounded first, so the mode always means bf16
        operands), ``weights`` rounded to bf16, then ``dot = bf16(q_h . k_s)`` (f32
        accumulation), ``prod = bf16(relu(dot) * w_h)``, ``score = bf16(sum_h prod)`` (f32
        accumulation, one rounding); the top-k runs on those bf16-valued scores (``exact``:
        ties go to the lower entry, as ``lax.top_k`` and the official CUDA top-k). Refused
        (``args.check_index_precision``, ``ValueError``): another name; ``"bf16"`` with
        ``index_quant`` or an fp8 index cache (that combination is not defined).

    Returns:
      i32[T, k]: sequence-local token offsets (entry numbers when ``compression_ratio > 1``) by
      descending score, ``-1`` padding in the tail; rows outside every sequence are all ``-1``.
    """
    cache_kv = fp8_index_pages.as_keys(cache_kv)  # fp8 index pages: their Fp8IndexCache
    one_layer = stacked.resolve("cache_kv", cache_kv, layer).one
    check_topk_args((q, weights, one_layer, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution), k=k, k_name="k", pages_per_seq=pages_per_seq,
                    one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                    fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                    recall_target=recall_target, exact=exact,
                    compression_ratio=compression_ratio)
    check_index_quant(index_quant, int(q.shape[2]), one_layer)
    check_index_precision(precision, index_quant, one_layer)
    key_map = index_scores.INDEX_QUANT_MAPS[index_quant]
    if key_map is not None:
        q = key_map(q)

    def finish(scores, token_ok, key_pos, kv_len):  # key_pos, kv_len: keys (index_scores)
        scores = jnp.where(token_ok, scores, selection.NEG_INF)
        return selection.select_and_merge(scores, k, selection.causal_token_count(key_pos, kv_len),
                                          recall_target=recall_target, exact=exact,
                                          num_segments=num_segments, fill=fill)

    return index_scores.score_and_select(
        q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
        pages_per_seq=pages_per_seq, out_width=k, one_token_per_seq=one_token_per_seq,
        finish=finish, layer=layer, compression_ratio=compression_ratio, key_map=key_map,
        precision=precision)
