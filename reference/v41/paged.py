"""V4.1's stored caches paged and stacked, read and written in place by row. The V4.1 step
(``dsa_jax.v41_step``) takes its ``PagedBytes`` / ``ragged`` / ``row_slots`` from here and
stores its caches in the TPU page layouts (``window_pages``, ``pool_pages``, ``index_pages``);
``read_rows`` / ``write_rows`` keep the plain word-row form below (public, unchanged).

A cache is ``u32[L, P, page_size, ceil(W / 4)]``: ``L`` layers (or KV sources) stacked, each
row one token or entry in its stored format (``reference.v41.formats``) of ``W`` bytes held as
``ceil(W / 4)`` little-endian words (``to_words`` / ``to_bytes``, a bitcast: the bytes are the
format's, zero-padded to whole words): the window kv ``W = window_kv_bytes(D)`` (528 at ``D =
512``), the compressed kv ``compressed_kv_bytes(D)`` (288), the index keys
``index_fp4_bytes(Di)`` (68). Words, not bytes: XLA's TPU scatter of ``u8`` rows wants another
tiling than a ``u8`` array's, so every write copied the whole stack twice (measured at
V4.1-Flash dims, ``scripts/cost/v41_step_cost.py``); ``u32`` rows scatter in place.
``PagedBytes`` pairs a cache with its page table and ``cu_lens`` in the cache's own unit
(window: tokens; pool and keys: entries of ratio ``r``), and the package's one slot rule places
every row (``reference.core.batch.RaggedBatch``, ``reference.mla.attend.token_slots``;
``reference.v4_compressor.entry_slots`` for entries).

Reads gather whole stored rows of one layer straight from the stacked buffer (a ``(layer, page,
offset)`` gather on the stack's own layout: no layer is copied out) and decode them after the
gather (exact: the decoded values are bf16 values); a row not valid (past its sequence's
length, a page slot or id out of range, a row outside every sequence) is never gathered and
reads as zeros, so NaN in any slot that must not be read cannot reach a result. Writes drop a
row whose slot is out of range (``mode="drop"``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.mla import attend

WORD = 4  # bytes per stored word


def words_per_row(width: int) -> int:
    """Words holding a ``width``-byte row: ``ceil(width / 4)`` (zero bytes pad the last)."""
    return -(-width // WORD)


def to_words(rows_u8: jax.Array) -> jax.Array:
    """``u8[..., W] -> u32[..., words_per_row(W)]`` (little-endian: byte ``4i + j`` is bits
    ``8j .. 8j + 7`` of word ``i``; zero bytes pad a row to whole words)."""
    width = rows_u8.shape[-1]
    pad = words_per_row(width) * WORD - width
    if pad:
        rows_u8 = jnp.pad(rows_u8, [(0, 0)] * (rows_u8.ndim - 1) + [(0, pad)])
    w = rows_u8.reshape(*rows_u8.shape[:-1], rows_u8.shape[-1] // WORD, WORD)
    return jax.lax.bitcast_convert_type(w, jnp.uint32)


def to_bytes(words: jax.Array, width: int) -> jax.Array:
    """``u32[..., words_per_row(W)] -> u8[..., W]``, ``to_words``' inverse."""
    b = jax.lax.bitcast_convert_type(words, jnp.uint8)
    return b.reshape(*words.shape[:-1], words.shape[-1] * WORD)[..., :width]


class PagedBytes(NamedTuple):
    """A stacked byte cache and its page table (a pytree): ``cache u32[L, P, ps, words]``,
    ``page_indices i32[N]`` (sequence ``i``'s pages start at slot ``cu_lens[i] // ps``),
    ``cu_lens i32[S + 1]`` in this cache's unit."""

    cache: jax.Array
    page_indices: jax.Array
    cu_lens: jax.Array


def ragged(kv: PagedBytes, kv_lens, cu_q_lens, distribution, *, pages_per_seq: int,
           ratio: int = 1) -> batch.RaggedBatch:
    """The ``RaggedBatch`` of ``kv`` (``ratio``: tokens per row of this cache; 1 for tokens)."""
    return batch.RaggedBatch.of(kv.cache, kv_lens, kv.page_indices, cu_q_lens, kv.cu_lens,
                                distribution, pages_per_seq=pages_per_seq,
                                compression_ratio=ratio)


def row_slots(idx, b: batch.RaggedBatch, rows: batch.RowFacts):
    """``(page, offset, valid)`` of rows ``idx i32[T, n]`` (sequence-local, ``-1`` none) of each
    query row's sequence: ``page`` is ``b.num_pages`` (one past the end: never read) where not
    valid."""
    slots, valid = attend.token_slots(idx, rows, b, causal=False)
    return jnp.where(valid, slots // b.page_size, b.num_pages), slots % b.page_size, valid


def read_rows(kv: PagedBytes, layer: int, idx, b: batch.RaggedBatch, rows: batch.RowFacts,
              decode, width: int):
    """Rows ``idx i32[T, n]`` (sequence-local, this cache's unit; ``-1`` none) of each query
    row's sequence from layer ``layer`` of ``kv``, decoded by ``decode`` (``u8[R, W] -> f32[R,
    D]``, ``W = width`` bytes a row). Returns ``(rows f32[T, n, D], valid bool[T, n])``;
    invalid rows are zeros, never gathered."""
    words = np.shape(kv.cache)[-1]
    page, offset, valid = row_slots(idx, b, rows)
    # a (layer, page, offset) gather on the stack's own layout (flattening the stack to rows
    # first is a relayout copy of the whole stack on TPU: rows of W bytes are not whole tiles)
    got = kv.cache.at[layer, page, offset].get(mode="fill", fill_value=0)
    vals = decode(to_bytes(got.reshape(-1, words), width)).reshape(*idx.shape, -1)
    return jnp.where(valid[..., None], vals, 0.0), valid


def write_rows(cache, layer, page_id, offset, rows_u8):
    """``cache u32[L, P, ps, words]`` with ``rows_u8 u8[..., W]`` stored at ``(layer, page_id,
    offset)`` (an int or index arrays broadcasting against ``rows_u8``'s leading dims: several
    layers in one scatter); ``page_id`` out of ``[0, P)`` (the slot rules' ``num_pages``) drops
    the row."""
    return cache.at[layer, page_id, offset].set(to_words(rows_u8), mode="drop")
