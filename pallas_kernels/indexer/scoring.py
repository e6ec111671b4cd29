"""Row chunks of the indexer: score ``C`` rows per kernel call and hand each chunk's scores to
the entry's selection (``score_and_select``), so peak score memory is bounded whatever ``T``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import tpu
from pallas_kernels.indexer.blocks import IndexerBlocks
from pallas_kernels.indexer.kernel import NEG_INF, make_configs, score_call
from pallas_kernels.indexer.work_list import work_list
from reference.core import batch
from reference.formats import stacked
from reference.indexer import scores as index_scores
from reference.indexer import selection
from reference.indexer.page_topk import causal_page_count
from reference.quant.bf16 import round_bf16

# ----------------------------------------------------------------------------- row chunks

# Long-prefill bound: one call's f32 token scores [C, capacity] stay <= this many bytes (the
# reference's 64 MiB window), so a 2048-row prefill at 32K runs as 4 calls of 512 rows.
SCORE_CHUNK_BYTES = index_scores.SCORE_BLOCK_BYTES  # the reference's documented bound


def chunk_rows(total_rows: int, width: int, block_rows: int, chunk_bytes: int) -> int:
    """Rows per kernel call: ``f32[C, width] <= chunk_bytes``, at least one row block, and
    balanced over the calls (572 rows at a 512-row bound run as 2 x 286, not 512 + 512 with 452
    rows scored twice by the clamped last chunk)."""
    c_max = max(1, min(total_rows, max(block_rows, chunk_bytes // (4 * width))))
    n_chunks = -(-total_rows // c_max)
    return -(-total_rows // n_chunks)


def select_rows(q, weights, cache_kv, meta, *, k: int, page_mode: bool, pages_per_seq: int,
                one_token_per_seq: bool, num_segments: int, fill: str, recall_target: float,
                exact: bool,
                blocks: IndexerBlocks, chip: str | None, chunk_bytes: int,
                vmem_limit_bytes: int | None, interpret, layer=None,
                compression_ratio: int = 1, index_quant: str | None = None,
                precision: str = "f32") -> jax.Array:
    """The token and page top-k entries after their checks: score in chunks, then select ``k``
    per row with the row's causal context (keys, or pages in page mode) as the witnesses'
    context length; rows outside every sequence all ``-1``. ``meta``: the five batch arrays;
    ``layer``: the layer of a stacked ``cache_kv`` to read (``reference.stacked``);
    ``compression_ratio``: keys are entries of that many tokens (``reference.batch``);
    ``index_quant``, ``precision``: as ``score_and_select``."""
    b = batch.RaggedBatch.of(cache_kv, *meta, pages_per_seq=pages_per_seq,
                             compression_ratio=compression_ratio)

    def finish(scores, row_ok, key_pos, kv_eff, _row0):  # keys: work_list's per-row facts
        context = (causal_page_count(key_pos, kv_eff, b.page_size) if page_mode
                   else selection.causal_token_count(key_pos, kv_eff))
        idx = selection.select_and_merge(scores, k, jnp.where(row_ok, context, 0),
                                         recall_target=recall_target, exact=exact,
                                         num_segments=num_segments, fill=fill)
        return jnp.where(row_ok[:, None], idx, -1)

    return score_and_select(q, weights, cache_kv, b, one_token_per_seq=one_token_per_seq,
                            page_mode=page_mode, blocks=blocks, chunk_bytes=chunk_bytes,
                            vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, chip=chip,
                            out_width=k, out_dtype=jnp.int32, finish=finish, layer=layer,
                            index_quant=index_quant, precision=precision)


def score_and_select(q, weights, cache_kv, b: batch.RaggedBatch, *, one_token_per_seq: bool,
                     page_mode: bool, blocks: IndexerBlocks, chunk_bytes: int,
                     vmem_limit_bytes: int | None, interpret, out_width: int, out_dtype,
                     finish, chip: str | None = None, layer=None,
                     index_quant: str | None = None, precision: str = "f32",
                     causal_rule: str = "official", mask_rows: bool = True) -> jax.Array:
    """Score the rows in chunks of ``C`` rows (one kernel call each, inside a ``fori_loop``) and
    hand each chunk to ``finish(scores f32[C, N], row_ok bool[C], key_pos i32[C],
    kv_eff i32[C], row0 i32[]) -> [C, out_width]`` (``key_pos``: the row's last visible key, its
    absolute position for tokens; ``kv_eff``: its sequence's keys; ``work_list``; ``row0``: the
    chunk's first row, its rows ``row0 .. row0 + C - 1``). Rows outside every
    sequence get ``-inf`` scores.
    ``cache_kv`` is one layer, or a stacked cache read in place at ``layer``
    (``reference.stacked``: the kernel gets the stack and the layer as a scalar).
    ``index_quant`` (checked by the entry): q ``[T, H, D]`` goes through the reference's map
    here (``reference.index_scores.INDEX_QUANT_MAPS``), the keys through the same rule in the
    kernel, tile by tile after their DMA (``pallas_kernels.indexer.fp4``). ``precision``
    (checked by the entry): ``"bf16"`` casts q to bf16 and rounds the weights to bf16 here, the
    kernel casts the key tiles and rounds as ``reference.indexer.scores.index_scores``.
    ``causal_rule``: ``"official"`` (``j < (p + 1) // r``) or ``"tpu_inference"`` (``j <= p //
    r``, tokamax's; ``records``). ``mask_rows=False``: the rows outside every sequence reach
    ``finish`` as the kernel left them (unwritten), for a ``finish`` that masks its output by
    ``row_ok`` itself and reads only part of the scores (where the ``-inf`` select would not
    fuse into its reads: a copy of the chunk)."""
    read = stacked.resolve("cache_kv", cache_kv, layer)
    cache_kv = read.stacked
    total_rows, pages_per_seq = q.shape[0], b.pages_per_seq
    width = pages_per_seq if page_mode else b.capacity_tokens
    c = chunk_rows(total_rows, width, blocks.block_rows, chunk_bytes)
    cfgs = make_configs(q, cache_kv, rows=c, num_seqs=b.num_seqs, pages_per_seq=pages_per_seq,
                        blocks=blocks, page_mode=page_mode,
                        one_token_per_seq=one_token_per_seq, chip=chip,
                        compression_ratio=b.compression_ratio, index_quant=index_quant,
                        precision=precision, causal_rule=causal_rule)
    q_map = index_scores.INDEX_QUANT_MAPS[index_quant]
    if q_map is not None:
        q = q_map(q)
    table = tpu.smem_page_table(b.page_indices)
    q_in = q.astype(cfgs[0].compute_dtype)  # a no-op unless q and keys differ in dtype
    wcol = weights.astype(jnp.float32)
    if precision == "bf16":
        wcol = round_bf16(wcol)
    wcol = wcol.reshape(total_rows, 1, q.shape[1])  # lane-dense (tpu.lanes_to_column)

    def one_chunk(row0):
        items, row_slot, abs_pos, kv_eff = work_list(b, row0=row0, cfgs=cfgs,
                                                     one_token_per_seq=one_token_per_seq)
        scores = None
        for cfg, its in zip(cfgs, items, strict=True):  # each level DMAs its rows in place
            scores = score_call(cfg, q_in, wcol, cache_kv, read.layer, its, table, scores,
                                vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
        scores = scores[:, :width]
        row_ok = row_slot >= 0
        if mask_rows:
            scores = jnp.where(row_ok[:, None], scores, NEG_INF)
        return finish(scores, row_ok, abs_pos, kv_eff, row0)

    n_chunks = -(-total_rows // c)
    if n_chunks == 1:
        return one_chunk(jnp.int32(0))

    def body(i, out):
        row0 = jnp.minimum(i * c, total_rows - c).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(out, one_chunk(row0), row0, 0)

    out = jnp.zeros((total_rows, out_width), out_dtype)
    return jax.lax.fori_loop(0, n_chunks, body, out)

