"""Lightning-indexer token top-k with a Pallas TPU score kernel.

    scores  (Pallas, ``pallas_kernels.indexer.kernel``: f32[C, pages_per_seq * page_size])
    -> selection (XLA, ``reference.selection``: approx_max_k / top_k, guard, witness merge)

Same arguments and result as ``reference.indexer_topk.streamindex_topk_ref``, plus kernel knobs.
Memory bound: one chunk (one kernel call per row-block level) scores ``C`` rows with
``f32[C, capacity] <= score_chunk_bytes`` (default 64 MiB, at least one row block); longer
batches run as ``ceil(T / C)`` chunks inside a ``fori_loop``, so peak score temporaries stay
~64 MiB (plus the selection's own temporaries of the same order) whatever ``T`` is. Example:
2048-row prefill at 32768 -> 4 chunks of 512 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.indexer import fp8_pages, fp8_pages_topk, records
from pallas_kernels.indexer.blocks import IndexerBlocks, check_kernel_knobs, entry_blocks
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, score_and_select, select_rows
from reference.core import batch
from reference.formats import stacked
from reference.indexer import selection
from reference.indexer.args import (
    check_compression_ratio,
    check_index_precision,
    check_index_quant,
    check_indexer_args,
    check_topk_args,
)

_STATICS = ("k", "pages_per_seq", "one_token_per_seq", "num_segments", "fill",
            "refuse_full_overwrite", "recall_target", "exact", "block_rows", "block_pages",
            "blocks", "chip", "score_chunk_bytes", "vmem_limit_bytes", "interpret",
            "compression_ratio", "index_quant", "precision")


@stacked.checks_layer(cache_pos=2)
@functools.partial(jax.jit, static_argnames=_STATICS)
def streamindex_topk(q: jax.Array, weights: jax.Array, cache_kv: jax.Array, seq_lens: jax.Array,
                     page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                     distribution: jax.Array, *, k: int, pages_per_seq: int,
                     one_token_per_seq: bool = False, num_segments: int = 0,
                     fill: str = "tail", refuse_full_overwrite: bool = False,
                     recall_target: float = selection.DEFAULT_RECALL_TARGET, exact: bool = False,
                     block_rows: int | None = None, block_pages: int | None = None,
                     blocks: IndexerBlocks | None = None, chip: str | None = None,
                     score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                     vmem_limit_bytes: int | None = None, interpret=False,
                     compression_ratio: int = 1, index_quant: str | None = None,
                     layer=None, precision: str = "f32") -> jax.Array:
    """Token top-k of the lightning indexer over a ragged paged batch (Pallas scores).

    Shapes: ``q``: f32|bf16[T, H, D] indexer query heads; ``weights``: f32|bf16[T, H] per-head
    mixing weights; ``cache_kv``: f32|bf16[num_pages, page_size, D] paged indexer keys, or an
    ``Fp8IndexCache`` (read as stored: e4m3 pages plus a scale row per page; ``q`` may then be
    float8_e4m3fn, run on tpu7x's fp8 MXU path); the batch
    arrays as ``reference.batch``.

    Args:
      k, pages_per_seq, one_token_per_seq, num_segments, fill, refuse_full_overwrite,
        recall_target, exact: as in
        ``streamindex_topk_ref`` (witness context length: ``min(abs_pos + 1, kv_len)``).
      block_rows, block_pages: kernel blocks (``pallas_kernels.indexer.blocks``); ``None``
        takes ``blocks``' field, else the table default for ``chip``. ``block_rows`` is the
        top of the row-block ladder ``block_rows, block_rows/4, ..., 1`` (a sequence's
        remainder rows take the smallest level that holds them: decode rows of a mixed batch
        are 1-row blocks).
      blocks: an ``IndexerBlocks`` (typed, validated; ``None`` fields take the table default).
      chip: ``"v5e" | "v6e" | "tpu7x"`` for the block table; ``None`` detects it (fallback
        table off-TPU).
      score_chunk_bytes: bound on one call's f32 score block (module docstring).
      vmem_limit_bytes: Mosaic VMEM limit; ``None`` -> ``tpu.vmem_limit`` (one policy).
      interpret: False (compile), True (the strict interpreter, ``tpu.interpret_params``) or a
        ``pltpu.InterpretParams``.
      compression_ratio: as ``streamindex_topk_ref`` (``r > 1``: the cache, page table,
        ``cu_kv_lens`` and ``page_size`` count compressed entries, ``seq_lens`` tokens; entry
        ``j`` visible iff ``j < (p + 1) // r``). The kernel is the same; its causal mask takes
        the entry rule and the work list converts lengths (``pallas_kernels.indexer.kernel``).
      index_quant: ``None`` or ``"fp4_sim"`` (DeepSeek-V4), as ``streamindex_topk_ref``: q
        ``[T, H, 128]`` is rotated and FP4-simulated here (``reference.index_scores.fp4_sim``),
        each key tile in the kernel after its DMA (Hadamard matmul plus the FP4 rounding,
        ``pallas_kernels.indexer.fp4``; the cache is read as stored, f32/bf16, same bytes as
        plain keys). Refused as the reference refuses (``D != 128``, an fp8 cache, a name).
      precision: ``"f32"`` (default, the program unchanged) or ``"bf16"``: DeepSeek-V4's official
        scoring, as ``streamindex_topk_ref`` (q f32|bf16[T, H, D] cast to bf16 and the weights
        rounded to bf16 in the glue, each key tile cast to bf16 in VMEM; each dot, each
        ``relu(dot) * w`` and each f32 head sum rounded to bf16 in the kernel; the cache read
        as stored, so the HBM bytes are the f32 mode's with a bf16 q). Refused as the
        reference refuses (a name; ``"bf16"`` with ``index_quant`` or an fp8 cache).

    Returns:
      i32[T, k]: sequence-local token offsets (entry numbers when ``compression_ratio > 1``) by
      descending score, ``-1`` padding in the tail; rows outside every sequence all ``-1``.
    """
    if isinstance(cache_kv, fp8_pages.PagesCache):  # read as stored: fp8_pages_topk
        stand_in = fp8_pages.stand_in(stacked.resolve("cache_kv", cache_kv, layer).one)
        check_index_quant(index_quant, int(q.shape[2]), stand_in)
        check_index_precision(precision, index_quant, stand_in)
        return fp8_pages_topk.streamindex_topk_fp8_pages(
            q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
            k=k, pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
            num_segments=num_segments, fill=fill, refuse_full_overwrite=refuse_full_overwrite,
            recall_target=recall_target, exact=exact, block_rows=block_rows,
            block_pages=block_pages, blocks=blocks, chip=chip,
            score_chunk_bytes=score_chunk_bytes, vmem_limit_bytes=vmem_limit_bytes,
            interpret=interpret, compression_ratio=compression_ratio, layer=layer)
    one_layer = stacked.resolve("cache_kv", cache_kv, layer).one
    check_topk_args((q, weights, one_layer, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution), k=k, k_name="k", pages_per_seq=pages_per_seq,
                    one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                    fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                    recall_target=recall_target, exact=exact,
                    compression_ratio=compression_ratio)
    check_index_quant(index_quant, int(q.shape[2]), one_layer)
    check_index_precision(precision, index_quant, one_layer)
    chip, blocks = entry_blocks(chip, blocks, block_rows, block_pages,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pages_per_seq,
                                page_size=cache_kv.shape[-2], page_mode=False, interpret=interpret)
    check_kernel_knobs(score_chunk_bytes, vmem_limit_bytes)

    return select_rows(q, weights, cache_kv, (seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                                              distribution),
                       k=k, page_mode=False, pages_per_seq=pages_per_seq,
                       one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                       fill=fill, recall_target=recall_target, exact=exact, blocks=blocks,
                       chip=chip,
                       chunk_bytes=score_chunk_bytes, vmem_limit_bytes=vmem_limit_bytes,
                       interpret=interpret, layer=layer,
                       compression_ratio=compression_ratio, index_quant=index_quant,
                       precision=precision)


@functools.partial(jax.jit, static_argnames=("pages_per_seq", "one_token_per_seq", "page_mode",
                                             "block_rows", "block_pages", "blocks", "chip",
                                             "interpret", "compression_ratio",
                                             "index_quant", "precision"))
def streamindex_scores(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                       distribution, *, pages_per_seq: int, one_token_per_seq: bool = False,
                       page_mode: bool = False, block_rows: int | None = None,
                       block_pages: int | None = None, blocks: IndexerBlocks | None = None,
                       chip: str | None = None, interpret=False,
                       compression_ratio: int = 1, index_quant: str | None = None,
                       precision: str = "f32") -> jax.Array:
    """The kernel's scores alone (tests, debugging): token mode ``f32[T, pages_per_seq *
    page_size]``, page mode ``f32[T, pages_per_seq]``; ``-inf`` for non-candidates and rows
    outside every sequence. Materialises ``[T, capacity]``: not for long prefill.
    ``compression_ratio``, ``index_quant`` and ``precision`` as ``streamindex_topk`` (columns
    are then entries; with ``"fp4_sim"`` the scores of the simulated q heads and keys; with
    ``"bf16"`` the bf16-valued scores)."""
    check_indexer_args(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                       distribution, pages_per_seq=pages_per_seq,
                       one_token_per_seq=one_token_per_seq)
    check_compression_ratio(compression_ratio, page_size=int(cache_kv.shape[-2]),
                            pages_per_seq=pages_per_seq)
    check_index_quant(index_quant, int(q.shape[2]), cache_kv)
    check_index_precision(precision, index_quant, cache_kv)
    chip, blocks = entry_blocks(chip, blocks, block_rows, block_pages,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pages_per_seq,
                                page_size=cache_kv.shape[-2], page_mode=page_mode,
                                interpret=interpret)
    width = pages_per_seq * (1 if page_mode else cache_kv.shape[1])
    b = batch.RaggedBatch.of(cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                             distribution, pages_per_seq=pages_per_seq,
                             compression_ratio=compression_ratio)
    return score_and_select(
        q, weights, cache_kv, b, one_token_per_seq=one_token_per_seq, page_mode=page_mode,
        blocks=blocks, chunk_bytes=q.shape[0] * width * 4, vmem_limit_bytes=None,
        interpret=interpret, chip=chip, out_width=width, out_dtype=jnp.float32,
        finish=lambda s, *_: s, index_quant=index_quant, precision=precision)



RECORD_CAUSAL_RULES = ("official", "tpu_inference")


@functools.partial(jax.jit, static_argnames=("k", "pages_per_seq", "compression_ratio",
                                             "causal_rule", "block_rows", "block_pages", "chip",
                                             "score_chunk_bytes", "vmem_limit_bytes",
                                             "interpret"))
def streamindex_topk_records(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                             seq_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                             cu_kv_lens: jax.Array, distribution: jax.Array, *, k: int,
                             pages_per_seq: int, compression_ratio: int = 1,
                             causal_rule: str = "official", block_rows: int | None = None,
                             block_pages: int | None = None, chip: str | None = None,
                             score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                             vmem_limit_bytes: int | None = None,
                             interpret=False) -> tuple[jax.Array, jax.Array]:
    """Exact token top-k over tokamax's index records (format ``records.RECORD_FORMAT``), with
    tokamax's score and order: ``score = (sum_h w * relu(q . code)) * scale`` (f32), the ``k``
    best visible entries by descending score, ties to the lower entry (``lax.top_k``).

    Args:
      q: ``f32|bf16|float8_e4m3fn[T, H, 128]``; weights: ``f32|bf16[T, H]``.
      cache_kv: ``u8[P, ps // 4, 4, 256]`` records (``reference.formats.tokamax_index``,
        ``"head_along_sublane"``), read in place by the kernel.
      seq_lens ... distribution: the batch arrays as ``streamindex_topk`` (``seq_lens`` in
        tokens; ``page_indices``, ``cu_kv_lens`` and pages in entries when ``r > 1``).
      k, pages_per_seq, compression_ratio: as ``streamindex_topk``.
      causal_rule: ``"official"`` (entry ``j`` visible to token position ``p`` iff ``j < (p +
        1) // r``) or ``"tpu_inference"`` (tokamax's ``j <= p // r``); both need ``j <
        kv_len // r``.
      block_rows, block_pages, chip, score_chunk_bytes, vmem_limit_bytes, interpret: as
        ``streamindex_topk``.

    Returns:
      ``(i32[T, k] entries, i32[T, k] raw f32 score bits)``: ``-1`` / ``-inf`` bits in the tail
      and in rows outside every sequence; a NaN score is no candidate.
    """
    if causal_rule not in RECORD_CAUSAL_RULES:
        raise ValueError(f"unknown causal_rule {causal_rule!r}; expected one of "
                         f"{RECORD_CAUSAL_RULES}")
    cache = records.wrap(cache_kv)
    check_topk_args((q, weights, jax.ShapeDtypeStruct(cache.shape, jnp.float32), seq_lens,
                     page_indices, cu_q_lens, cu_kv_lens, distribution), k=k, k_name="k",
                    pages_per_seq=pages_per_seq, one_token_per_seq=False, num_segments=0,
                    fill="tail", refuse_full_overwrite=False,
                    recall_target=selection.DEFAULT_RECALL_TARGET, exact=True,
                    compression_ratio=compression_ratio)
    chip, blocks = entry_blocks(chip, None, block_rows, block_pages, one_token_per_seq=False,
                                pages_per_seq=pages_per_seq, page_size=cache.page_size,
                                page_mode=False, interpret=interpret)
    check_kernel_knobs(score_chunk_bytes, vmem_limit_bytes)
    b = batch.RaggedBatch.of(cache, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                             distribution, pages_per_seq=pages_per_seq,
                             compression_ratio=compression_ratio)

    def finish(scores, row_ok, *_):
        idx, vals = selection.select_topk_scored(scores, k, exact=True)
        bits = jax.lax.bitcast_convert_type(vals.astype(jnp.float32), jnp.int32)
        neg = jax.lax.bitcast_convert_type(jnp.float32(-jnp.inf), jnp.int32)
        return jnp.concatenate([jnp.where(row_ok[:, None], idx, -1),
                                jnp.where(row_ok[:, None], bits, neg)], axis=1)

    out = score_and_select(q, weights, cache, b, one_token_per_seq=False, page_mode=False,
                           blocks=blocks, chunk_bytes=score_chunk_bytes,
                           vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
                           out_width=2 * k, out_dtype=jnp.int32, finish=finish, chip=chip,
                           causal_rule=causal_rule)
    return out[:, :k], out[:, k:]
