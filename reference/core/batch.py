"""The ragged paged batch: ``RaggedBatch``, the one type that carries a batch's metadata and
the one place that turns it into per-row, per-page and per-token facts.

Every op builds one from its arguments (the seed-compatible signatures stay) and asks it:
capacity (``capacity_tokens``), active sequences (``num_active`` / ``active``), row facts
(``rows``), and the token -> page slot -> page id rule with its validity (``page_ids``,
``token_slots``, ``seq_pages``). The rule's last step, ``lookup_page``, is also what the Pallas
kernels run on the scalar core against the page table in SMEM (it works on an array and on a
ref), so the rule is written once.

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
- Compressed keys (DeepSeek-V4's indexer, ``compression_ratio = r > 1``): the cache holds one
  *entry* per group of ``r`` tokens, so the cache, ``page_indices``, ``cu_kv_lens``,
  ``page_size`` and the capacity all count entries, while ``kv_lens`` and the rows' positions
  stay in tokens. The two units meet in two functions only: ``entries_of_tokens`` (a sequence
  of ``kv_len`` tokens holds ``kv_len // r`` complete entries) and ``last_visible_key`` (entry
  ``j`` is visible to a query at token position ``p`` iff ``j < (p + 1) // r``: an entry exists
  once its group's last token has arrived). ``r = 1`` is the token case, both identities. A page
  of ``page_size`` entries spans ``page_size * r`` tokens: whole groups by construction, so in
  entry units no page size is refused for not being a multiple of ``r``.

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

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


def entries_of_tokens(tokens, compression_ratio: int):
    """Tokens -> compressed entries: the complete groups of ``r = compression_ratio`` tokens
    among ``tokens`` (i32, any shape), ``tokens // r`` (floor). ``r = 1``: ``tokens`` itself."""
    if compression_ratio == 1:
        return tokens
    return tokens // compression_ratio


def last_visible_key(abs_pos, compression_ratio: int):
    """The highest key index a query at absolute token position ``abs_pos`` (i32, any shape) may
    see: ``abs_pos`` itself for tokens (``r = 1``, causal ``s <= p``), else the entry rule
    ``j < (p + 1) // r``, i.e. ``entries_of_tokens(p + 1) - 1`` (``-1``: none yet). Every
    causal mask and candidate count of the indexer reads a row's position through this."""
    if compression_ratio == 1:
        return abs_pos
    return entries_of_tokens(abs_pos + 1, compression_ratio) - 1


def capacity_tokens(page_size: int, pages_per_seq: int) -> int:
    """Per-sequence capacity in tokens: pages times tokens per page."""
    return pages_per_seq * page_size


def num_active_seqs(distribution: jax.Array, num_seqs: int) -> jax.Array:
    """Active sequence count: ``distribution[2]`` clipped to ``[0, S]`` (i32 scalar)."""
    return jnp.clip(distribution[2], 0, num_seqs).astype(jnp.int32)


def lookup_page(table, slot, num_pages: int):
    """The page id at ``table[slot]`` and whether it is valid: the slot lies inside the table and
    the id inside ``[0, num_pages)``. ``table``: ``i32[N]`` (an array, or the page table as a
    Pallas SMEM ref read with a scalar ``slot`` on the scalar core); ``slot``: i32 (any shape).
    Returns ``(page_id, ok)``; ``page_id`` is a real table entry or -1 where not ``ok``."""
    n = table.shape[0]
    if n == 0:
        return jnp.full(jnp.shape(slot), -1, jnp.int32), jnp.zeros(jnp.shape(slot), bool)
    in_table = (slot >= 0) & (slot < n)
    pid = table[jnp.clip(slot, 0, n - 1)]
    return pid, in_table & (pid >= 0) & (pid < num_pages)


class SeqPages(NamedTuple):
    """One sequence's pages. ``page_ids i32[pages_per_seq]`` (``num_pages`` where invalid, so a
    ``mode="fill"`` gather reads nothing), ``token_ok bool[capacity_tokens]``, ``kv_len`` the
    effective length ``min(kv_len, capacity_tokens)`` (i32 scalar)."""

    page_ids: jax.Array
    token_ok: jax.Array
    kv_len: jax.Array


class RowFacts(NamedTuple):
    """Per query row: ``seq i32[T]`` (its sequence, clipped to ``[0, S)``), ``in_seq bool[T]``,
    ``abs_pos i32[T]`` (absolute position of the row's token in its sequence; only meaningful
    where ``in_seq``)."""

    seq: jax.Array
    in_seq: jax.Array
    abs_pos: jax.Array


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """A ragged paged batch (a pytree: the five arrays are leaves, the three sizes static).

    ``kv_lens i32[S]``, ``page_indices i32[N]``, ``cu_q_lens i32[S+1]``, ``cu_kv_lens i32[S+1]``,
    ``distribution i32[3]`` as in the module docstring; ``page_size`` (tokens per page, read from
    the cache's dim 1 by ``of``), ``pages_per_seq``, ``num_pages`` (the cache's dim 0);
    ``compression_ratio`` (static, default 1): tokens per key; above 1 the cache side counts
    entries (module docstring) and ``kv_eff`` / ``key_pos`` convert."""

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    cu_kv_lens: jax.Array
    distribution: jax.Array
    page_size: int
    pages_per_seq: int
    num_pages: int
    compression_ratio: int = 1

    @classmethod
    def of(cls, cache, kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, *,
           pages_per_seq: int, compression_ratio: int = 1) -> RaggedBatch:
        """The batch of a cache ``[num_pages, page_size, W]`` (or a stacked ``[L, num_pages,
        page_size, W]``, ``reference.formats.stacked``) and the seed's metadata arrays."""
        num_pages, page_size = cache.shape[-3], cache.shape[-2]
        return cls(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
                   page_size=int(page_size), pages_per_seq=int(pages_per_seq),
                   num_pages=int(num_pages), compression_ratio=int(compression_ratio))

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        """``(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)``: the seed's order."""
        return (self.kv_lens, self.page_indices, self.cu_q_lens, self.cu_kv_lens,
                self.distribution)

    @property
    def capacity_tokens(self) -> int:
        """Per-sequence capacity in keys (``pages_per_seq * page_size``): tokens, or entries
        when ``compression_ratio > 1``."""
        return capacity_tokens(self.page_size, self.pages_per_seq)

    @property
    def num_seqs(self) -> int:
        """``S``: sequence slots, active or not (static)."""
        return self.kv_lens.shape[0]

    def num_active(self) -> jax.Array:
        """Active sequences (``distribution[2]`` clipped to ``[0, S]``), i32 scalar."""
        return num_active_seqs(self.distribution, self.num_seqs)

    def active(self) -> jax.Array:
        """``bool[S]``: which sequence slots are active."""
        return jnp.arange(self.num_seqs) < self.num_active()

    def kv_eff(self, seq) -> jax.Array:
        """Effective kv length ``min(kv_len, capacity_tokens)`` (at least 0) of ``seq``, in keys:
        ``kv_len`` tokens hold ``entries_of_tokens(kv_len)`` keys."""
        keys = entries_of_tokens(self.kv_lens[seq], self.compression_ratio)
        return jnp.clip(keys, 0, self.capacity_tokens)

    def key_pos(self, abs_pos) -> jax.Array:
        """The last key a row at token position ``abs_pos`` may see (``last_visible_key``)."""
        return last_visible_key(abs_pos, self.compression_ratio)

    def first_slot(self, seq) -> jax.Array:
        """The page-table slot of ``seq``'s first page: ``cu_kv_lens[seq] // page_size`` (a
        token count divided by tokens per page is a count of slots)."""
        return self.cu_kv_lens[seq] // self.page_size

    def page_ids(self, seq, page, ok):
        """Page ids of sequence-local ``page`` numbers of ``seq`` where ``ok`` (broadcasting):
        the slot rule ``slot = first_slot(seq) + page`` then ``lookup_page``. Returns
        ``(page_id, ok)``; a page not ``ok`` on entry is never looked up (slot of page 0)."""
        slot = self.first_slot(seq) + jnp.where(ok, page, 0)
        pid, found = lookup_page(self.page_indices, slot, self.num_pages)
        return pid, ok & found

    def token_slots(self, seq, pos, ok):
        """Where token ``pos`` of ``seq`` lives, for ``ok`` tokens the caller has checked
        against ``kv_len`` / capacity: ``(page_id, offset, ok)`` with ``offset = pos %
        page_size`` and ``ok`` false where the page slot or id is out of range."""
        safe = jnp.where(ok, pos, 0)
        pid, ok = self.page_ids(seq, safe // self.page_size, ok)
        return pid, safe % self.page_size, ok

    def seq_pages(self, seq) -> SeqPages:
        """Page ids and token validity of sequence ``seq`` (traced scalar): its
        ``ceil(kv_eff / page_size)`` used pages, looked up by the slot rule."""
        kv_len = self.kv_eff(seq)
        used_pages = (kv_len + self.page_size - 1) // self.page_size
        j = jnp.arange(self.pages_per_seq, dtype=jnp.int32)
        pid, page_ok = self.page_ids(seq, j, j < used_pages)
        pos = jnp.arange(self.capacity_tokens, dtype=jnp.int32)
        token_ok = jnp.repeat(page_ok, self.page_size) & (pos < kv_len)
        return SeqPages(jnp.where(page_ok, pid, self.num_pages).astype(jnp.int32), token_ok,
                        kv_len)

    def rows(self, num_rows: int, *, one_token_per_seq: bool = False) -> RowFacts:
        """Each of ``num_rows`` query rows' sequence, membership and absolute position.

        Token ``j`` of sequence ``i`` sits at ``kv_len - (q_end - q_start) + (j - q_start)``;
        with ``one_token_per_seq`` row ``i`` is the last token of sequence ``i``."""
        if one_token_per_seq:
            return decode_row_facts(num_rows, self.kv_lens, self.distribution)
        return row_facts(num_rows, self.kv_lens, self.cu_q_lens, self.distribution)


jax.tree_util.register_dataclass(
    RaggedBatch, data_fields=["kv_lens", "page_indices", "cu_q_lens", "cu_kv_lens",
                              "distribution"],
    meta_fields=["page_size", "pages_per_seq", "num_pages", "compression_ratio"])


def gather_pages(cache: jax.Array, page_ids: jax.Array) -> jax.Array:
    """``cache[page_ids]`` flattened to tokens, zeros (no read) for ids ``== num_pages``.

    cache: ``[num_pages, page_size, D]``; page_ids: ``i32[n]`` -> ``[n * page_size, D]``.
    """
    pages = jnp.take(cache, page_ids, axis=0, mode="fill", fill_value=0)
    return pages.reshape(-1, cache.shape[-1])


def row_facts(num_rows: int, kv_lens, cu_q_lens, distribution) -> RowFacts:
    """Map each of ``num_rows`` query rows to its sequence and absolute position
    (``RaggedBatch.rows``)."""
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
