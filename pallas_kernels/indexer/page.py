"""Lightning-indexer page top-k with a Pallas TPU score kernel (per-page max fused).

    page scores (Pallas, ``pallas_kernels.indexer.kernel`` in page mode: each stage's token
    scores are max-pooled per page inside the kernel; only f32[C, pages_per_seq] leaves it)
    -> selection (XLA, ``reference.selection``)

Same arguments and result as ``reference.page_topk.streamindex_page_topk_ref``, plus kernel
knobs. Memory bound: token scores never reach HBM; one chunk's page scores ``f32[C,
pages_per_seq]`` stay ``<= score_chunk_bytes`` (default 64 MiB), which in practice is one chunk.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.indexer.blocks import IndexerBlocks, check_kernel_knobs, entry_blocks
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, select_rows
from reference.formats import fp8_index_pages, stacked
from reference.indexer import selection
from reference.indexer.args import (
    check_index_precision,
    check_index_quant,
    check_topk_args,
)

_STATICS = ("k_pages", "pages_per_seq", "one_token_per_seq", "num_segments", "fill",
            "refuse_full_overwrite", "recall_target", "exact", "block_rows", "block_pages",
            "blocks", "chip", "score_chunk_bytes", "vmem_limit_bytes", "interpret",
            "compression_ratio", "index_quant", "precision")


@stacked.checks_layer(cache_pos=2)
@functools.partial(jax.jit, static_argnames=_STATICS)
def streamindex_page_topk(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                          seq_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                          cu_kv_lens: jax.Array, distribution: jax.Array, *, k_pages: int,
                          pages_per_seq: int, one_token_per_seq: bool = False,
                          num_segments: int = 0, fill: str = "tail",
                          refuse_full_overwrite: bool = False,
                          recall_target: float = selection.DEFAULT_RECALL_TARGET,
                          exact: bool = False, block_rows: int | None = None,
                          block_pages: int | None = None, blocks: IndexerBlocks | None = None,
                          chip: str | None = None, score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                          vmem_limit_bytes: int | None = None, interpret=False,
                          compression_ratio: int = 1, index_quant: str | None = None,
                          layer=None, precision: str = "f32") -> jax.Array:
    """Page top-k of the lightning indexer over a ragged paged batch (Pallas page scores).

    Shapes: ``q``: f32|bf16[T, H, D] (fp8 with an fp8 cache); ``weights``: f32|bf16[T, H];
    ``cache_kv``: ``Fp8IndexCache`` or f32|bf16[num_pages, page_size, D]; the batch arrays as
    ``reference.batch``.

    Args: as ``pallas_kernels.streamindex_topk`` with ``k_pages`` for ``k``;
    witnesses use the row's causal page count as its context length; ``compression_ratio > 1``:
    pages of compressed entries, a page's score the max over its visible entries;
    ``index_quant="fp4_sim"``: q simulated in the glue, key tiles in the kernel, as
    ``streamindex_topk``; ``precision`` (``"f32"`` or ``"bf16"``) as ``streamindex_topk``, a
    page's score the max of its visible entries' bf16-valued scores.

    Returns: what ``reference.streamindex_page_topk_ref`` returns (``i32[T, k_pages]``).
    """
    # fp8 index pages: their Fp8IndexCache (an XLA bit move; the token top-k reads them as stored)
    cache_kv = fp8_index_pages.as_keys(cache_kv)
    one_layer = stacked.resolve("cache_kv", cache_kv, layer).one
    check_topk_args((q, weights, one_layer, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution), k=k_pages, k_name="k_pages", pages_per_seq=pages_per_seq,
                    one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                    fill=fill, refuse_full_overwrite=refuse_full_overwrite,
                    recall_target=recall_target, exact=exact,
                    compression_ratio=compression_ratio)
    check_index_quant(index_quant, int(q.shape[2]), one_layer)
    check_index_precision(precision, index_quant, one_layer)
    chip, blocks = entry_blocks(chip, blocks, block_rows, block_pages,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pages_per_seq,
                                page_size=cache_kv.shape[-2], page_mode=True, interpret=interpret)
    check_kernel_knobs(score_chunk_bytes, vmem_limit_bytes)
    return select_rows(q, weights, cache_kv, (seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                                              distribution),
                       k=k_pages, page_mode=True, pages_per_seq=pages_per_seq,
                       one_token_per_seq=one_token_per_seq, num_segments=num_segments,
                       fill=fill, recall_target=recall_target, exact=exact, blocks=blocks,
                       chip=chip,
                       chunk_bytes=score_chunk_bytes, vmem_limit_bytes=vmem_limit_bytes,
                       interpret=interpret, layer=layer,
                       compression_ratio=compression_ratio, index_quant=index_quant,
                       precision=precision)

