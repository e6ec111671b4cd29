"""Token top-k and scores of the Pallas indexer over fp8 index pages (``fp8_pages``): the
``Fp8IndexCache`` entry (``token.streamindex_topk`` with an fp8 cache), the cache read as one
``u8[G, 4, 128]`` array per page. Same checks, same selection, same scores bit for bit: the
pages hold the same codes and f32 scales, and the kernel multiplies the same operands in the
same order (``fp8_pages``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import aot
from pallas_kernels.indexer import fp8_pages
from pallas_kernels.indexer import traffic as itraffic
from pallas_kernels.indexer.blocks import IndexerBlocks, check_kernel_knobs, entry_blocks
from pallas_kernels.indexer.scoring import (
    SCORE_CHUNK_BYTES,
    score_and_select,
    select_rows,
)
from reference.core import batch
from reference.formats import fp8_cache, stacked
from reference.indexer import selection
from reference.indexer.args import check_topk_args
from reference.quant import fp8


def _checked(q, weights, cache_kv, meta, *, layer, k: int, k_name: str, pages_per_seq: int,
             one_token_per_seq: bool, num_segments: int, fill: str,
             refuse_full_overwrite: bool, recall_target: float, exact: bool,
             compression_ratio: int) -> fp8_pages.PagesCache:
    """The pages as a ``PagesCache`` after the ``Fp8IndexCache`` entry's checks (run on a
    shape-only ``Fp8IndexCache`` of the same keys: the same refusals, page sizes multiples of
    32 among them)."""
    cache = fp8_pages.wrap(cache_kv)
    one = fp8_pages.stand_in(stacked.resolve("cache_kv", cache, layer).one)
    check_topk_args((q, weights, one, *meta), k=k, k_name=k_name,
                    pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                    num_segments=num_segments, fill=fill,
                    refuse_full_overwrite=refuse_full_overwrite, recall_target=recall_target,
                    exact=exact, compression_ratio=compression_ratio)
    return cache


_STATICS = ("k", "pages_per_seq", "one_token_per_seq", "num_segments", "fill",
            "refuse_full_overwrite", "recall_target", "exact", "block_rows", "block_pages",
            "blocks", "chip", "score_chunk_bytes", "vmem_limit_bytes", "interpret",
            "compression_ratio")


def _checks_layer(fn):
    """``reference.formats.stacked.checks_layer`` for pages: a Python-int ``layer=`` is checked
    against the stack (``u8[L, P, G, 4, 128]``) before tracing; jit's attributes stay
    reachable (``lower``...)."""
    @functools.wraps(fn)
    def call(q, weights, cache_kv, *args, layer=None, **kwargs):
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            stacked.resolve("cache_kv", fp8_pages.wrap(cache_kv), int(layer))
        return fn(q, weights, cache_kv, *args, layer=layer, **kwargs)

    call.lower = fn.lower
    return call


@_checks_layer
@functools.partial(jax.jit, static_argnames=_STATICS)
def streamindex_topk_fp8_pages(q: jax.Array, weights: jax.Array, cache_kv: jax.Array,
                               seq_lens: jax.Array, page_indices: jax.Array,
                               cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                               distribution: jax.Array, *, k: int, pages_per_seq: int,
                               one_token_per_seq: bool = False, num_segments: int = 0,
                               fill: str = "tail", refuse_full_overwrite: bool = False,
                               recall_target: float = selection.DEFAULT_RECALL_TARGET,
                               exact: bool = False, block_rows: int | None = None,
                               block_pages: int | None = None,
                               blocks: IndexerBlocks | None = None, chip: str | None = None,
                               score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                               vmem_limit_bytes: int | None = None, interpret=False,
                               compression_ratio: int = 1, layer=None) -> jax.Array:
    """Token top-k of the lightning indexer over fp8 index pages (Pallas scores): the result of
    ``token.streamindex_topk`` with the ``Fp8IndexCache`` these pages hold
    (``reference.formats.fp8_index_pages.to_index_cache``), the same arrays bit for bit.

    Args:
      q: ``f32|bf16|float8_e4m3fn[T, H, 128]`` (fp8: tpu7x's fp8 MXU path, as the fp8 cache);
        weights: ``f32|bf16[T, H]``.
      cache_kv: ``u8[P, G, 4, 128]`` pages (``reference.formats.fp8_index_pages``; ``G = ps //
        4 + ceil(ps / 128)``, ``ps`` a multiple of 32), or a stack ``u8[L, P, G, 4, 128]`` read
        in place at ``layer``.
      seq_lens ... distribution, k ... compression_ratio, layer: as ``streamindex_topk``.

    Returns:
      ``i32[T, k]`` sequence-local token (entry) offsets by descending score, ``-1`` padding.
    """
    meta = (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    cache = _checked(q, weights, cache_kv, meta, layer=layer, k=k, k_name="k",
                     pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                     num_segments=num_segments, fill=fill,
                     refuse_full_overwrite=refuse_full_overwrite, recall_target=recall_target,
                     exact=exact, compression_ratio=compression_ratio)
    chip, blocks = entry_blocks(chip, blocks, block_rows, block_pages,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pages_per_seq,
                                page_size=cache.page_size, page_mode=False, interpret=interpret)
    check_kernel_knobs(score_chunk_bytes, vmem_limit_bytes)
    return select_rows(q, weights, cache, meta, k=k, page_mode=False,
                       pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                       num_segments=num_segments, fill=fill, recall_target=recall_target,
                       exact=exact, blocks=blocks, chip=chip, chunk_bytes=score_chunk_bytes,
                       vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, layer=layer,
                       compression_ratio=compression_ratio)


@functools.partial(jax.jit, static_argnames=("pages_per_seq", "one_token_per_seq",
                                             "block_rows", "block_pages", "chip", "interpret",
                                             "compression_ratio"))
def streamindex_scores_fp8_pages(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens,
                                 cu_kv_lens, distribution, *, pages_per_seq: int,
                                 one_token_per_seq: bool = False, block_rows: int | None = None,
                                 block_pages: int | None = None, chip: str | None = None,
                                 interpret=False, compression_ratio: int = 1) -> jax.Array:
    """The kernel's token scores alone over fp8 index pages (tests): ``f32[T, pages_per_seq *
    ps]``, ``token.streamindex_scores``' array for the ``Fp8IndexCache`` the pages hold (one
    layer ``u8[P, G, 4, 128]``; ``-inf`` for non-candidates and rows outside every
    sequence)."""
    meta = (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    cache = _checked(q, weights, cache_kv, meta, layer=None, k=1, k_name="k",
                     pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                     num_segments=0, fill="tail", refuse_full_overwrite=False,
                     recall_target=selection.DEFAULT_RECALL_TARGET, exact=True,
                     compression_ratio=compression_ratio)
    chip, blocks = entry_blocks(chip, None, block_rows, block_pages,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pages_per_seq,
                                page_size=cache.page_size, page_mode=False, interpret=interpret)
    width = pages_per_seq * cache.page_size
    b = batch.RaggedBatch.of(cache, *meta, pages_per_seq=pages_per_seq,
                             compression_ratio=compression_ratio)
    return score_and_select(q, weights, cache, b, one_token_per_seq=one_token_per_seq,
                            page_mode=False, blocks=blocks, chunk_bytes=q.shape[0] * width * 4,
                            vmem_limit_bytes=None, interpret=interpret, chip=chip,
                            out_width=width, out_dtype=jnp.float32, finish=lambda s, *_: s)


def traffic(q_lens, kv_lens, *, heads: int, page_size: int, pages_per_seq: int,
            q_itemsize: int, blocks: IndexerBlocks, one_token_per_seq: bool,
            chunk_bytes: int = SCORE_CHUNK_BYTES, compression_ratio: int = 1) -> aot.Traffic:
    """HBM bytes, MXU flops, VMEM and DMA descriptors of ``streamindex_topk_fp8_pages``' score
    kernel for a batch of sequences ``(q_lens[i], kv_lens[i])`` (tokens; ``page_size`` in
    entries): ``indexer.traffic.traffic``'s fp8-cache model, but one DMA per fetched page.

    Bytes are the fp8 cache's: a fetched page moves ``page_groups(ps) * 512 = ps * 128 + 4 *
    scale_lanes(ps)`` bytes, its keys and scale rows in one DMA (the ``Fp8IndexCache``: the same
    bytes in two). ``dmas``: the fp8 model's descriptors less one per fetched page (its scale
    row's own DMA): per decode row ``pages needed + 1 + 2`` (pages, the score row, the q block
    and weight column)."""
    model = itraffic.traffic(q_lens, kv_lens, heads=heads, dim=fp8.INDEX_HEAD_DIM,
                             page_size=page_size, pages_per_seq=pages_per_seq, key_itemsize=1,
                             q_itemsize=q_itemsize, blocks=blocks, page_mode=False,
                             one_token_per_seq=one_token_per_seq, chunk_bytes=chunk_bytes,
                             scale_lanes=fp8_cache.scale_lanes(page_size),
                             compression_ratio=compression_ratio)
    pages = itraffic.fetched_pages(q_lens, kv_lens, page_size=page_size,
                                   pages_per_seq=pages_per_seq, blocks=blocks,
                                   one_token_per_seq=one_token_per_seq, chunk_bytes=chunk_bytes,
                                   compression_ratio=compression_ratio)
    return dataclasses.replace(model, dmas=model.dmas - pages)
