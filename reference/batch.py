"""The ragged paged batch: the one place that turns its metadata into per-row and per-page facts.

Conventions (the seed's; see ``shared/SPEC.md``):

- ``cu_q_lens i32[S+1]``: rows ``[cu_q_lens[i], cu_q_lens[i+1])`` of the ``T`` query rows belong
  to sequence ``i``. ``seq_lens``/``kv_lens i32[S]``: the sequence's KV length in tokens,
  including this step's tokens.
- ``distribution i32[3] = (decode_end, prefill_end, num_seqs)``: only sequences
  ``i < num_seqs`` are active; the rest of the ``S`` slots are padding and their rows belong to
  no sequence.
- Cache ``[num_pages, page_size, D]``: ``page_size`` (tokens per page) is read from the cache's
  dim 1 and nowhere else. ``pages_per_seq`` is static; the per-sequence capacity in tokens is
  ``capacity_tokens = pages_per_seq * page_size``.
- ``page_indices`` is packed: sequence ``i``'s page *slots* start at
  ``cu_kv_lens[i] // page_size`` (a token count divided by tokens per page gives a slot).

Masking rules for runtime values jit cannot refuse (documented once, here):

- A sequence uses ``ceil(min(kv_len, capacity_tokens) / page_size)`` pages; tokens at or past
  ``min(kv_len, capacity_tokens)`` do not exist.
- A page slot past the end of ``page_indices``, or a page id outside ``[0, num_pages)``, makes
  that page's tokens invalid. Invalid pages are never gathered (``mode="fill"`` gives zeros).
- Nothing past a sequence's own used pages is read from ``page_indices`` or the cache.
- A row belongs to a sequence only if that sequence is active and the row lies in its
  ``cu_q_lens`` range; other rows are "outside every sequence".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def capacity_tokens(page_size: int, pages_per_seq: int) -> int:
    """Per-sequence capacity in tokens: pages times tokens per page."""
    return pages_per_seq * page_size


def num_active_seqs(distribution: jax.Array, num_seqs: int) -> jax.Array:
    """Active sequence count: ``distribution[2]`` clipped to ``[0, S]`` (i32 scalar)."""
    return jnp.clip(distribution[2], 0, num_seqs).astype(jnp.int32)


class SeqPages(NamedTuple):
    """One sequence's pages. ``page_ids i32[pages_per_seq]`` (``num_pages`` where invalid, so a
    ``mode="fill"`` gather reads nothing), ``token_ok bool[capacity_tokens]``, ``kv_len`` the
    effective length ``min(kv_len, capacity_tokens)`` (i32 scalar)."""

    page_ids: jax.Array
    token_ok: jax.Array
    kv_len: jax.Array


def seq_pages(seq_id, kv_lens, page_indices, cu_kv_lens, *, page_size: int,
              pages_per_seq: int, num_pages: int) -> SeqPages:
    """Page ids and token validity of sequence ``seq_id`` (traced scalar)."""
    cap = capacity_tokens(page_size, pages_per_seq)
    kv_len = jnp.clip(kv_lens[seq_id], 0, cap)
    used_pages = (kv_len + page_size - 1) // page_size
    j = jnp.arange(pages_per_seq, dtype=jnp.int32)
    slot = cu_kv_lens[seq_id] // page_size + j
    in_table = (j < used_pages) & (slot >= 0) & (slot < page_indices.shape[0])
    pid = jnp.take(page_indices, jnp.where(in_table, slot, 0), axis=0)
    page_ok = in_table & (pid >= 0) & (pid < num_pages)
    pos = jnp.arange(cap, dtype=jnp.int32)
    token_ok = jnp.repeat(page_ok, page_size) & (pos < kv_len)
    return SeqPages(jnp.where(page_ok, pid, num_pages).astype(jnp.int32), token_ok, kv_len)


def gather_pages(cache: jax.Array, page_ids: jax.Array) -> jax.Array:
    """``cache[page_ids]`` flattened to tokens, zeros (no read) for ids ``== num_pages``.

    cache: ``[num_pages, page_size, D]``; page_ids: ``i32[n]`` -> ``[n * page_size, D]``.
    """
    pages = jnp.take(cache, page_ids, axis=0, mode="fill", fill_value=0)
    return pages.reshape(-1, cache.shape[-1])


class RowFacts(NamedTuple):
    """Per query row: ``seq i32[T]`` (its sequence, clipped to ``[0, S)``), ``in_seq bool[T]``,
    ``abs_pos i32[T]`` (absolute position of the row's token in its sequence; only meaningful
    where ``in_seq``)."""

    seq: jax.Array
    in_seq: jax.Array
    abs_pos: jax.Array


def row_facts(num_rows: int, kv_lens, cu_q_lens, distribution) -> RowFacts:
    """Map each of ``num_rows`` query rows to its sequence and absolute position.

    Token ``j`` of sequence ``i`` sits at ``kv_len - (q_end - q_start) + (j - q_start)``.
    """
    num_seqs = kv_lens.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # compare_all: one [T, S] compare-and-count, loop- and gather-free (the default "scan"
    # method is a while loop of gathers, and XLA's cost model counts a loop body once).
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right", method="compare_all")
    seq = seq.astype(jnp.int32)
    seq = jnp.clip(seq, 0, max(num_seqs - 1, 0))
    q_start, q_end = cu_q_lens[seq], cu_q_lens[seq + 1]
    active = seq < num_active_seqs(distribution, num_seqs)
    in_seq = active & (rows >= q_start) & (rows < q_end)
    abs_pos = kv_lens[seq] - (q_end - q_start) + (rows - q_start)
    return RowFacts(seq, in_seq, abs_pos.astype(jnp.int32))


def decode_row_facts(num_rows: int, kv_lens, distribution) -> RowFacts:
    """Row facts for ``one_token_per_seq`` batches: row ``i`` is the last token of sequence i."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    in_seq = rows < num_active_seqs(distribution, kv_lens.shape[0])
    return RowFacts(rows, in_seq, (kv_lens - 1).astype(jnp.int32))
