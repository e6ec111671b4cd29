"""V4.1's stored caches paged and stacked, read and written in place by row: the flag-off path
of the V4.1 step (``dsa_jax.v41_step``).

A cache is ``u8[L, P, page_size, W]``: ``L`` layers (or KV sources) stacked, each row one token
or entry in its stored format (``reference.v41.formats``): the window kv ``W =
window_kv_bytes(D)`` (528 at ``D = 512``), the compressed kv ``compressed_kv_bytes(D)`` (288),
the index keys ``index_fp4_bytes(Di)`` (68). ``PagedBytes`` pairs it with its page table and
``cu_lens`` in the cache's own unit (window: tokens; pool and keys: entries of ratio ``r``), and
the package's one slot rule places every row (``reference.core.batch.RaggedBatch``,
``reference.mla.attend.token_slots``; ``reference.v4_compressor.entry_slots`` for entries).

Reads gather whole stored rows of one layer straight from the stacked buffer (a flat row gather
at ``layer * P * page_size + slot``: no layer is copied out) and decode them after the gather
(exact: the decoded values are bf16 values); a row not valid (past its sequence's length, a
page slot or id out of range, a row outside every sequence) is never gathered and reads as
zeros, so NaN in any slot that must not be read cannot reach a result. Writes drop a row whose
slot is out of range (``mode="drop"``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.mla import attend


class PagedBytes(NamedTuple):
    """A stacked byte cache and its page table (a pytree): ``cache u8[L, P, ps, W]``,
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


def read_rows(kv: PagedBytes, layer: int, idx, b: batch.RaggedBatch, rows: batch.RowFacts,
              decode):
    """Rows ``idx i32[T, n]`` (sequence-local, this cache's unit; ``-1`` none) of each query
    row's sequence from layer ``layer`` of ``kv``, decoded by ``decode`` (``u8[R, W] -> f32[R,
    D]``). Returns ``(rows f32[T, n, D], valid bool[T, n])``; invalid rows are zeros, never
    gathered."""
    num_layers, num_pages, page_size, width = np.shape(kv.cache)
    per_layer = num_pages * page_size
    slots, valid = attend.token_slots(idx, rows, b, causal=False)
    flat = kv.cache.reshape(-1, width)  # [L * P * ps, W]: a reshape, no copy
    at = jnp.where(valid, layer * per_layer + slots, num_layers * per_layer)
    got = jnp.take(flat, at.reshape(-1), axis=0, mode="fill", fill_value=0)
    vals = decode(got).reshape(*idx.shape, -1)
    return jnp.where(valid[..., None], vals, 0.0), valid


def write_rows(cache, layer: int, page_id, offset, rows_u8):
    """``cache u8[L, P, ps, W]`` with ``rows_u8 u8[R, W]`` stored at ``(layer, page_id,
    offset)``; ``page_id`` out of ``[0, P)`` (the slot rules' ``num_pages``) drops the row."""
    return cache.at[layer, page_id, offset].set(rows_u8, mode="drop")


def token_write_slots(b: batch.RaggedBatch, rows: batch.RowFacts):
    """``(page_id, offset) i32[T]`` of each query row's own token in a token-unit cache
    (``dsa_jax.cache.batch_write_slots``' rule: rows outside every sequence, past the capacity
    or on a missing page get ``page_id = num_pages``, dropped)."""
    pos = rows.abs_pos
    ok = rows.in_seq & (pos >= 0) & (pos < b.capacity_tokens)
    page_id, offset, ok = b.token_slots(rows.seq, pos, ok)
    return (jnp.where(ok, page_id, b.num_pages).astype(jnp.int32),
            jnp.where(ok, offset, 0).astype(jnp.int32))
