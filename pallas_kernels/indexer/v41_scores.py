"""The Pallas indexer over DeepSeek-V4.1's fp4 index pages (``v41_pages``; issue 31): the scores
(``index_scores_v41``, what the V4.1 step's ``implementation="pallas"`` scores its index sources
with), the token top-k bounded by score chunks (``index_topk_v41``, the long rows), and their
traffic model (one DMA per page of ``512 * G`` bytes)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import aot
from pallas_kernels.indexer import traffic as itraffic
from pallas_kernels.indexer import v41_pages
from pallas_kernels.indexer.blocks import IndexerBlocks, check_kernel_knobs, entry_blocks
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, score_and_select, select_rows
from reference.core import batch, checks
from reference.formats import stacked
from reference.indexer.args import check_index_precision, check_indexer_args, check_topk_args
from reference.indexer.selection import DEFAULT_RECALL_TARGET, causal_token_count
from reference.v41.candidates import (
    candidate_blocks,
    candidate_mask,
    candidate_pages,
    restricted_topk,
)
from reference.v41.formats import index_fp4_bytes

_STATICS = ("pages_per_seq", "page_size", "dim", "one_token_per_seq", "block_rows",
            "block_pages", "chip", "interpret", "compression_ratio", "precision",
            "score_chunk_bytes", "vmem_limit_bytes")


def _prepare(check, cache_kv, layer, page_size, dim, precision, chunk_bytes, vmem_limit_bytes,
             chip, block_rows, block_pages, one_token_per_seq, pages_per_seq, interpret):
    """The entries' shared checks and blocks: the pages wrapped, ``check(keys)`` on a shape-only
    bf16 stand-in of one layer's keys, the precision and kernel knobs; returns ``(cache, one
    layer, chip, blocks)``."""
    cache = v41_pages.wrap(cache_kv, page_size, dim)
    one = stacked.resolve("cache_kv", cache, layer).one
    check(v41_pages.stand_in(one))
    check_index_precision(precision, None, one)
    check_kernel_knobs(chunk_bytes, vmem_limit_bytes)
    chip, blocks = entry_blocks(chip, None, block_rows, block_pages,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pages_per_seq,
                                page_size=page_size, page_mode=False, interpret=interpret)
    return cache, one, chip, blocks


def _prepare_topk(q, weights, cache_kv, meta, k, recall_target, exact, compression_ratio, layer,
                  page_size, dim, precision, chunk_bytes, vmem_limit_bytes, chip, block_rows,
                  block_pages, one_token_per_seq, pages_per_seq, interpret):
    """``_prepare`` for the top-k entries: their arguments checked by ``check_topk_args``."""
    return _prepare(
        lambda keys: check_topk_args(
            (q, weights, keys, *meta), k=k, k_name="k", pages_per_seq=pages_per_seq,
            one_token_per_seq=one_token_per_seq, num_segments=0, fill="tail",
            refuse_full_overwrite=False, recall_target=recall_target, exact=exact,
            compression_ratio=compression_ratio),
        cache_kv, layer, page_size, dim, precision, chunk_bytes, vmem_limit_bytes, chip,
        block_rows, block_pages, one_token_per_seq, pages_per_seq, interpret)


def _checks_layer(fn):
    """A Python-int ``layer=`` checked against the stack before tracing (as the fp8 pages'
    entry: ``reference.formats.stacked.resolve``'s ValueError naming the numbers)."""
    @functools.wraps(fn)
    def call(q, weights, cache_kv, *args, layer=None, page_size: int, dim: int, **kwargs):
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            stacked.resolve("cache_kv", v41_pages.wrap(cache_kv, page_size, dim), int(layer))
        return fn(q, weights, cache_kv, *args, layer=layer, page_size=page_size, dim=dim,
                  **kwargs)

    return call


def _candidate_table(candidates, candidate_block, q, meta, b, page_size, pages_per_seq,
                     one_token_per_seq):
    """The page table with every slot holding no row's candidate entry set to -1 (never
    fetched: ``reference.v41.candidates.candidate_pages``), after the argument checks."""
    checks.positive_int("candidate_block", candidate_block,
                        "index_scores_v41 (candidates given: entries per block)")
    checks.integer("candidates", candidates)
    checks.rank("candidates", candidates, 2)
    checks.dim("candidates", candidates, 0, q.shape[0], "q.shape[0] (rows)")
    rows = b.rows(q.shape[0], one_token_per_seq=one_token_per_seq)
    slot0 = jnp.where(rows.in_seq, b.first_slot(rows.seq), -1)
    table = meta[1]
    read = candidate_pages(candidates, slot0, table_len=table.shape[0], page_size=page_size,
                           pages_per_seq=pages_per_seq, block=candidate_block)
    return jnp.where(read, table, -1).astype(table.dtype)


@_checks_layer
@functools.partial(jax.jit, static_argnames=_STATICS + ("candidate_block",))
def index_scores_v41(q: jax.Array, weights: jax.Array, cache_kv, seq_lens: jax.Array,
                     page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                     distribution: jax.Array, *, pages_per_seq: int, page_size: int, dim: int,
                     one_token_per_seq: bool = False, compression_ratio: int = 1,
                     precision: str = "bf16", layer=None, block_rows: int | None = None,
                     block_pages: int | None = None, chip: str | None = None,
                     score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                     vmem_limit_bytes: int | None = None, interpret=False,
                     candidates: jax.Array | None = None,
                     candidate_block: int | None = None) -> jax.Array:
    """The lightning indexer's scores over V4.1 fp4 index pages, Pallas (the keys read in place,
    decoded in VMEM).

    Args:
      q: ``f32|bf16[T, H, D]`` (V4.1: the fp4-decoded index query); weights: ``f32|bf16[T, H]``.
      cache_kv: ``u8[P, G, 4, 128]`` pages or a stack ``u8[L, P, G, 4, 128]`` read at ``layer``
        (``reference.v41.index_pages``, ``G = page_groups(page_size, dim)``), or an
        ``IndexFp4Pages``.
      seq_lens ... distribution: the ragged batch (``seq_lens`` in tokens, ``cu_kv_lens`` in
        entries; ``reference.core.batch``).
      compression_ratio: tokens per entry (entry ``j`` visible to position ``p`` iff ``j < (p +
        1) // r``); precision: ``"bf16"`` (the official rounding) or ``"f32"``.
      candidates: optional ``i32[T, C]`` block ids per row (a V4.1 consumer's,
        ``reference.v41.candidate_blocks``; ``-1`` slots select nothing), blocks of
        ``candidate_block`` entries: the kernel then fetches only the pages holding a candidate
        entry of some row of the sequence (the others' table slots become -1,
        ``candidate_pages``), and each row's scores are ``-inf`` off its own candidate blocks
        (``candidate_mask``).

    Returns:
      ``f32[T, pages_per_seq * page_size]``: row ``t``'s score of each entry of its sequence,
      ``-inf`` off its visible entries (and its candidates, if given) and on rows outside every
      sequence (chunks of ``score_chunk_bytes``, one kernel call each)."""
    meta = (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    cache, one, chip, blocks = _prepare(
        lambda keys: check_indexer_args(q, weights, keys, *meta, pages_per_seq=pages_per_seq,
                                        one_token_per_seq=one_token_per_seq),
        cache_kv, layer, page_size, dim, precision, score_chunk_bytes, vmem_limit_bytes, chip,
        block_rows, block_pages, one_token_per_seq, pages_per_seq, interpret)
    width = pages_per_seq * page_size
    b = batch.RaggedBatch.of(one, *meta, pages_per_seq=pages_per_seq,
                             compression_ratio=compression_ratio)
    if candidates is not None:
        table = _candidate_table(candidates, candidate_block, q, meta, b, page_size,
                                 pages_per_seq, one_token_per_seq)
        b = batch.RaggedBatch.of(one, seq_lens, table, *meta[2:], pages_per_seq=pages_per_seq,
                                 compression_ratio=compression_ratio)
    out = score_and_select(q, weights, cache, b, one_token_per_seq=one_token_per_seq,
                           page_mode=False, blocks=blocks, chunk_bytes=score_chunk_bytes,
                           vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, chip=chip,
                           out_width=width, out_dtype=jnp.float32, finish=lambda s, *_: s,
                           layer=layer, precision=precision)
    if candidates is None:
        return out
    return jnp.where(candidate_mask(candidates, n=width, block=candidate_block), out, -jnp.inf)


def traffic(q_lens, kv_lens, *, heads: int, dim: int, page_size: int, pages_per_seq: int,
            q_itemsize: int, blocks: IndexerBlocks, one_token_per_seq: bool,
            chunk_bytes: int = SCORE_CHUNK_BYTES, compression_ratio: int = 1,
            read_pages=None) -> aot.Traffic:
    """HBM bytes, MXU flops, VMEM and DMA descriptors of ``index_scores_v41``'s kernel for a
    batch of sequences ``(q_lens[i], kv_lens[i])`` (tokens; ``page_size`` in entries):
    ``indexer.traffic.traffic``'s replay with a fetched page moving ``512 * G`` bytes in ONE
    DMA (``key_bytes``), the minimum each visible entry's ``index_fp4_bytes(D)`` (68 B at 128)
    once. VMEM: the kernel's estimate, a key counted as ``max(1, nibble bytes // D)`` bytes a
    feature. ``read_pages``: per sequence, the sequence-local pages a ``candidates=`` call
    reads (``reference.v41.candidate_pages``); then only they move, and the minimum counts the
    visible entries on them (a page-granular reader's minimum)."""
    nib, lanes = v41_pages.key_bytes(page_size, dim)
    itemsize = max(1, nib // dim)  # the kernel's VMEM estimate's (``kernel.score_call``)
    model = itraffic.traffic(q_lens, kv_lens, heads=heads, dim=dim, page_size=page_size,
                             pages_per_seq=pages_per_seq, key_itemsize=itemsize,
                             q_itemsize=q_itemsize, blocks=blocks, page_mode=False,
                             one_token_per_seq=one_token_per_seq, chunk_bytes=chunk_bytes,
                             scale_lanes=lanes, compression_ratio=compression_ratio,
                             read_pages=read_pages)
    pages = itraffic.fetched_pages(q_lens, kv_lens, page_size=page_size,
                                   pages_per_seq=pages_per_seq, blocks=blocks,
                                   one_token_per_seq=one_token_per_seq, chunk_bytes=chunk_bytes,
                                   compression_ratio=compression_ratio, read_pages=read_pages)
    moved = model.bytes_moved - pages * page_size * (dim * itemsize - nib)
    counts = [kl // compression_ratio for kl in kv_lens]
    entries = sum(counts)
    read = entries if read_pages is None else sum(
        sum(max(0, min(page_size, n - p * page_size)) for p in set(ps))
        for n, ps in zip(counts, read_pages, strict=True))
    bytes_min = (model.bytes_min - entries * (dim * itemsize + 4)
                 + read * index_fp4_bytes(dim))
    return dataclasses.replace(model, bytes_moved=moved, bytes_min=bytes_min,
                               dmas=model.dmas - pages)


@_checks_layer
@functools.partial(jax.jit, static_argnames=_STATICS + ("k", "recall_target", "exact",
                                                       "candidate_block"))
def index_topk_v41(q: jax.Array, weights: jax.Array, cache_kv, seq_lens: jax.Array,
                   page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                   distribution: jax.Array, *, k: int, pages_per_seq: int, page_size: int,
                   dim: int, one_token_per_seq: bool = False, compression_ratio: int = 1,
                   precision: str = "bf16", recall_target: float = DEFAULT_RECALL_TARGET,
                   exact: bool = False, layer=None, block_rows: int | None = None,
                   block_pages: int | None = None, chip: str | None = None,
                   score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                   vmem_limit_bytes: int | None = None, interpret=False,
                   candidates: jax.Array | None = None,
                   candidate_block: int | None = None) -> jax.Array:
    """Token (entry) top-``k`` over V4.1 fp4 index pages: ``index_scores_v41``' scores, one chunk
    of ``score_chunk_bytes`` rows at a time, each chunk reduced to its rows' top-``k`` before the
    next (``scoring.select_rows``: the package's token selection, ``exact`` ``lax.top_k`` or
    the approximate top-k at ``recall_target``), so the program's temporaries are bounded by the
    chunk and ``k``, not by rows x context (the long rows of ``scripts.cost.v41_long_rows``).
    Arguments as ``index_scores_v41``. ``candidates`` (a V4.1 consumer's ``i32[T, C]`` block
    ids of ``candidate_block`` entries): only the pages holding a candidate of some row of the
    sequence are fetched (as ``index_scores_v41``), and each chunk's rows take the top-``k``
    among their own candidate entries by ``reference.v41.restricted_topk`` (exact, the declared
    V4.1 tie rule: NaN first, value descending, lower index; ``recall_target`` and ``exact`` do
    not apply), which ranks only the ``C * candidate_block`` candidate entries where they are
    fewer than the row's. Returns ``i32[T, k]`` sequence-local entries by descending score,
    ``-1`` padding (and for rows outside every sequence)."""
    meta = (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    if candidates is not None:
        checks.positive_int("candidate_block", candidate_block,
                            "index_topk_v41 (candidates given: entries per block)")
        return index_select_v41(
            q, weights, cache_kv, *meta, k=k, pages_per_seq=pages_per_seq, page_size=page_size,
            dim=dim, one_token_per_seq=one_token_per_seq, compression_ratio=compression_ratio,
            precision=precision, layer=layer, block_rows=block_rows, block_pages=block_pages,
            chip=chip, score_chunk_bytes=score_chunk_bytes, vmem_limit_bytes=vmem_limit_bytes,
            interpret=interpret, candidates=candidates,
            candidate_block=candidate_block)[0]
    cache, _, chip, blocks = _prepare_topk(
        q, weights, cache_kv, meta, k, recall_target, exact, compression_ratio, layer, page_size,
        dim, precision, score_chunk_bytes, vmem_limit_bytes, chip, block_rows, block_pages,
        one_token_per_seq, pages_per_seq, interpret)
    return select_rows(q, weights, cache, meta, k=k, page_mode=False,
                       pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                       num_segments=0, fill="tail", recall_target=recall_target, exact=exact,
                       blocks=blocks, chip=chip, chunk_bytes=score_chunk_bytes,
                       vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, layer=layer,
                       compression_ratio=compression_ratio, precision=precision)


def _select_chunks(q, weights, cache, one, meta, *, k, candidates, candidate_block, num_blocks,
                   pages_per_seq, page_size, one_token_per_seq, compression_ratio, blocks, chip,
                   chunk_bytes, vmem_limit_bytes, interpret, layer, precision):
    """V4.1's selection (``deepseek_v41_layer.select``) a chunk of rows at a time: each chunk's
    scores, then its rows' ``restricted_topk`` (among their own ``candidates``, or every visible
    entry) and, given ``num_blocks``, their ``candidate_blocks``. Given ``candidates``, only the
    pages holding one are fetched. Returns ``i32[T, k + (num_blocks or 0)]``."""
    b = batch.RaggedBatch.of(one, *meta, pages_per_seq=pages_per_seq,
                             compression_ratio=compression_ratio)
    if candidates is not None:
        table = _candidate_table(candidates, candidate_block, q, meta, b, page_size,
                                 pages_per_seq, one_token_per_seq)
        b = batch.RaggedBatch.of(one, meta[0], table, *meta[2:], pages_per_seq=pages_per_seq,
                                 compression_ratio=compression_ratio)

    ids = None if candidates is None else candidates.astype(jnp.int32)  # cast once, not a chunk

    def finish(scores, row_ok, key_pos, kv_eff, row0):
        # rows outside every sequence: length 0, their (unwritten: mask_rows) scores never read
        lens = jnp.where(row_ok, causal_token_count(key_pos, kv_eff), 0)
        mine = None if ids is None else jax.lax.dynamic_slice_in_dim(ids, row0,
                                                                      scores.shape[0], 0)
        top = restricted_topk(scores, lens, mine, k=k, block=candidate_block)
        if not num_blocks:
            return top
        made = candidate_blocks(scores, lens, num_blocks=num_blocks, block=candidate_block)
        return jnp.concatenate([top, made], axis=1)

    return score_and_select(q, weights, cache, b, one_token_per_seq=one_token_per_seq,
                            page_mode=False, blocks=blocks, chunk_bytes=chunk_bytes,
                            vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, chip=chip,
                            out_width=k + (num_blocks or 0), out_dtype=jnp.int32, finish=finish,
                            layer=layer, precision=precision, mask_rows=False)


@_checks_layer
@functools.partial(jax.jit, static_argnames=_STATICS + ("k", "candidate_block", "num_blocks"))
def index_select_v41(q: jax.Array, weights: jax.Array, cache_kv, seq_lens: jax.Array,
                     page_indices: jax.Array, cu_q_lens: jax.Array, cu_kv_lens: jax.Array,
                     distribution: jax.Array, *, k: int, pages_per_seq: int, page_size: int,
                     dim: int, one_token_per_seq: bool = False, compression_ratio: int = 1,
                     precision: str = "bf16", layer=None, block_rows: int | None = None,
                     block_pages: int | None = None, chip: str | None = None,
                     score_chunk_bytes: int = SCORE_CHUNK_BYTES,
                     vmem_limit_bytes: int | None = None, interpret=False,
                     candidates: jax.Array | None = None, candidate_block: int | None = None,
                     num_blocks: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A V4.1 index source's whole selection over the fp4 index pages, bounded by the score
    chunk (``reference.statements.deepseek_v41_layer.select``'s result, no ``f32[T, E]``
    scores): each chunk of ``score_chunk_bytes`` rows is scored (``index_scores_v41``'s kernel)
    and reduced by ``reference.v41``'s exact selection, the declared tie rule (NaN first, value
    descending, lower index) before the next.

    Args (the rest as ``index_scores_v41``):
      k: ``index_topk``.
      candidates: a consumer's ``i32[T, C]`` block ids: its top-``k`` among them
        (``restricted_topk``; only the pages holding a candidate of some row of the sequence
        fetched). None: among every visible entry.
      num_blocks: the candidate source's ``candidate_topk_blocks``: also publish each row's
        ``candidate_blocks`` (its own top-``k`` unrestricted: not with ``candidates``).
      candidate_block: entries per block (``candidate_block_size``), needed by either.

    Returns:
      ``(topk i32[T, k], blocks i32[T, num_blocks] or None)``: sequence-local entries in the
      declared order, ``-1`` tail; block ids ascending, ``-1`` tail; rows outside every
      sequence all ``-1``."""
    if candidates is not None and num_blocks is not None:
        raise ValueError("index_select_v41: a candidate source (num_blocks=) takes its own top-k "
                         "unrestricted; got both candidates= and num_blocks=")
    if candidates is not None or num_blocks is not None:
        checks.positive_int("candidate_block", candidate_block,
                            "index_select_v41 (candidates or num_blocks given)")
    if num_blocks is not None:
        checks.positive_int("num_blocks", num_blocks, "index_select_v41")
    meta = (seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)
    cache, one, chip, blocks = _prepare_topk(
        q, weights, cache_kv, meta, k, DEFAULT_RECALL_TARGET, True, compression_ratio, layer,
        page_size, dim, precision, score_chunk_bytes, vmem_limit_bytes, chip, block_rows,
        block_pages, one_token_per_seq, pages_per_seq, interpret)
    out = _select_chunks(q, weights, cache, one, meta, k=k, candidates=candidates,
                         candidate_block=candidate_block or 1, num_blocks=num_blocks,
                         pages_per_seq=pages_per_seq, page_size=page_size,
                         one_token_per_seq=one_token_per_seq,
                         compression_ratio=compression_ratio, blocks=blocks, chip=chip,
                         chunk_bytes=score_chunk_bytes, vmem_limit_bytes=vmem_limit_bytes,
                         interpret=interpret, layer=layer, precision=precision)
    return out[:, :k], (out[:, k:] if num_blocks else None)
