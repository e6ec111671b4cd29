"""Synthetic ragged paged batches for tests, benchmarks, the CLI and notebooks (NumPy, host).

Layout rules it follows (``reference.core.batch``): sequence ``i`` uses
``ceil(kv_len_i / page_size)`` pages, ``cu_kv_lens`` is the cumsum of page-aligned lengths
(tokens), ``page_indices`` packs the used pages (shuffled physical ids by default) with
``tail_pages`` extra entries at the end (0 = no tail padding). Every cache slot that no sequence
owns, and every slot of a page past a sequence's ``kv_len``, is filled with ``fill`` (NaN by
default) so a stray read shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyntheticBatch:
    """Host arrays of one synthetic batch (see module docstring)."""

    q: np.ndarray  # f32[T, H, D]
    weights: np.ndarray  # f32[T, H]
    cache: np.ndarray  # f32[num_pages, page_size, D]
    seq_lens: np.ndarray  # i32[S]
    page_indices: np.ndarray  # i32[N]
    cu_q_lens: np.ndarray  # i32[S+1]
    cu_kv_lens: np.ndarray  # i32[S+1]
    distribution: np.ndarray  # i32[3]
    pages_per_seq: int
    seq_pages: tuple  # per sequence: i32[n_used] physical page ids (oracle's view)

    @property
    def page_size(self) -> int:
        return self.cache.shape[1]

    def args(self):
        """The positional arguments of the indexer ops (q, weights, cache, metadata...)."""
        return (self.q, self.weights, self.cache, self.seq_lens, self.page_indices,
                self.cu_q_lens, self.cu_kv_lens, self.distribution)

    def meta(self):
        """``(seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)``."""
        return (self.seq_lens, self.page_indices, self.cu_q_lens, self.cu_kv_lens,
                self.distribution)


def make_ragged_batch(rng: np.random.Generator, *, q_lens, kv_lens, page_size: int,
                      pages_per_seq: int, num_heads: int, dim: int, pad_rows: int = 0,
                      pad_seqs: int = 0, spare_pages: int = 3, tail_pages: int = 0,
                      shuffle_pages: bool = True, fill: float = float("nan")) -> SyntheticBatch:
    """Build a ragged paged batch with ``len(q_lens)`` active sequences.

    ``q_lens[i] <= kv_lens[i] <= pages_per_seq * page_size`` is required (the batch is valid;
    tests corrupt it deliberately afterwards). ``pad_seqs`` inactive sequence slots and
    ``pad_rows`` query rows outside every sequence are appended.
    """
    q_lens = [int(x) for x in q_lens]
    kv_lens = [int(x) for x in kv_lens]
    cap = pages_per_seq * page_size
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if not 0 <= ql <= kl <= cap:
            raise ValueError(f"sequence {i}: need 0 <= q_len <= kv_len <= capacity, got "
                             f"q_len={ql} kv_len={kl} capacity={cap}")
    used = [-(-kl // page_size) for kl in kv_lens]
    total_used = sum(used)
    num_pages = total_used + spare_pages
    phys = rng.permutation(num_pages) if shuffle_pages else np.arange(num_pages)
    cache = np.full((num_pages, page_size, dim), fill, np.float32)
    seq_pages, offset = [], 0
    for kl, n in zip(kv_lens, used, strict=True):
        pages = phys[offset:offset + n].astype(np.int32)
        offset += n
        seq_pages.append(pages)
        for j, p in enumerate(pages):
            live = min(page_size, kl - j * page_size)
            cache[p, :live] = rng.standard_normal((live, dim))
    page_indices = np.concatenate(
        [np.concatenate(seq_pages) if seq_pages else np.zeros(0, np.int32),
         phys[total_used:total_used + tail_pages] if tail_pages <= spare_pages
         else np.zeros(tail_pages, np.int32)]).astype(np.int32)
    aligned = [n * page_size for n in used] + [0] * pad_seqs
    cu_kv = np.concatenate([[0], np.cumsum(aligned)]).astype(np.int32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens + [0] * pad_seqs)]).astype(np.int32)
    seq_lens = np.array(kv_lens + list(rng.integers(1, cap + 1, pad_seqs)), np.int32)
    num_rows = sum(q_lens) + pad_rows
    decode_end = next((i for i, ql in enumerate(q_lens) if ql != 1), len(q_lens))
    distribution = np.array([decode_end, len(q_lens), len(q_lens)], np.int32)
    q = rng.standard_normal((num_rows, num_heads, dim)).astype(np.float32)
    weights = rng.standard_normal((num_rows, num_heads)).astype(np.float32)
    return SyntheticBatch(q, weights, cache, seq_lens, page_indices, cu_q, cu_kv, distribution,
                       pages_per_seq, tuple(seq_pages))
