"""The V4.1 step's row chunking (``in_row_chunks``, shared by its selection and attention) and,
under ``implementation="pallas"``, a candidate consumer's top-k reading only its candidate
blocks (``pallas_consume``): the candidate-block kernel
(``pallas_kernels.indexer.v41_candidates.candidate_topk_v41``) over the candidate source's keys
in the block layout (``V41Caches.cand``, kept where ``V41StepLayout.block_keys``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, chunk_rows
from reference.core import batch

# A consumer's chunk of rows (``consume_rows``): its compact scores, entries and sort keys at
# most this (the Pallas selection's bound).
CONSUME_CHUNK_BYTES = SCORE_CHUNK_BYTES
_PER_ENTRY = 4  # i32 / f32 words a compact entry holds at once: score, entry, key, index


def in_row_chunks(fn, t: int, n: int):
    """``fn(row0, n)`` (rows ``row0 .. row0 + n - 1``' array ``[n, ...]``) for every row
    ``[T, ...]``: one call if ``n >= T``, else a ``fori_loop`` over chunks of ``n`` rows, the
    last clamped to end at row ``T`` (its overlap recomputed to the same values)."""
    n = min(n, t)
    chunks = -(-t // max(n, 1))
    if chunks <= 1:
        return fn(0, t)
    part = jax.eval_shape(lambda: fn(0, n))

    def body(i, acc):
        row0 = jnp.minimum(i * n, t - n)
        return jax.lax.dynamic_update_slice_in_dim(acc, fn(row0, n), row0, axis=0)

    return jax.lax.fori_loop(0, chunks, body, jnp.zeros((t, *part.shape[1:]), part.dtype))


def consume_rows(num_rows: int, entries: int) -> int:
    """Rows per chunk of ``pallas_consume``: the most whose ``entries`` compact candidate
    entries (``_PER_ENTRY`` words each: scores, entries, sort keys) fit
    ``CONSUME_CHUNK_BYTES``, at least 1, balanced over the chunks (``chunk_rows``)."""
    return chunk_rows(max(num_rows, 1), max(_PER_ENTRY * entries, 1), 1, CONSUME_CHUNK_BYTES)


def pallas_consume(kernel, iq, w, cand, b, rows, precision, config, cands):
    """A candidate consumer's ``i32[T, index_topk]`` (``deepseek_v41_layer.select``'s top-k
    among each row's ``cands i32[T, C]``) from ``kernel`` (``candidate_topk_v41`` with the kernel
    options) over ``cand`` (stack row 0, pages on ``b``'s table, looked up in the kernel from
    each row's first slot: ``-1`` outside every sequence), a chunk of ``consume_rows`` rows at a
    time; each row's visible entries ``(p + 1) // r`` (0 outside every sequence)."""
    def chunk(row0, n):
        cut = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=row0, slice_size=n)
        mine = batch.RowFacts(*map(cut, rows))
        first = jnp.where(mine.in_seq, b.first_slot(mine.seq), -1)
        lens = jnp.where(mine.in_seq, (mine.abs_pos + 1) // b.compression_ratio, 0)
        return kernel(cut(iq), cut(w), cand, cut(cands), b.page_indices, first, lens,
                      k=config.index_topk, pages_per_seq=b.pages_per_seq,
                      page_size=b.page_size, layer=0, precision=precision)

    t = iq.shape[0]
    return in_row_chunks(chunk, t, consume_rows(t, cands.shape[1] * config.candidate_block_size))
