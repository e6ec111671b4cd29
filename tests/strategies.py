"""Hypothesis strategies for ragged paged batches and for top-k index rows full of junk.

A batch is drawn as a *description* (``BatchSpec``: query and KV lengths, page size, padding
rows, inactive sequence slots, spare pages, tail padding of the page table, page shuffling, a
seed) and built with ``reference.synthetic.make_ragged_batch``: every cache slot that no
sequence owns, and every slot of a page past a sequence's ``kv_len``, is NaN, so a stray read
shows. Query rows outside every sequence can be NaN too.

Two uses:

- ``batch_specs(...)`` with free shapes: small batches of every kind for the reference ops.
- ``batch_specs(..., rows=R, seqs=S, table_len=N, num_pages=P)``: every batch padded to the
  same array shapes (padding rows, inactive sequence slots, tail / spare pages), so a jitted
  kernel compiles once per test and only values vary.

``token_selections`` / ``page_selections`` draw ``i32[T, k]`` rows mixing valid entries
(duplicates included) with every class of ``INVALID_CLASSES``; rows outside every sequence get
valid-looking entries that must be ignored.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st
from oracle import row_sequences

from reference.synthetic import SyntheticBatch, make_ragged_batch

INT32_MIN = int(np.iinfo(np.int32).min)
INT32_MAX = int(np.iinfo(np.int32).max)
KINDS = ("decode", "mtp", "prefill", "mixed")

# Invalid top-k entry classes. Token offsets: "past_kv" is kv_len <= x < capacity (a slot of a
# page the sequence may own, holding NaN, or of a page it does not own); "past_capacity" is
# capacity <= x < INT32_MAX. Page numbers: the same with pages (a "past_kv" page holds no token
# below kv_len; "past_capacity" is >= pages_per_seq).
INVALID_CLASSES = ("minus_one", "negative", "int32_min", "int32_max", "past_kv",
                   "past_capacity")


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Description of one ragged paged batch; ``build()`` makes the arrays.

    Attributes:
      q_lens, kv_lens: per active sequence (``q_len <= kv_len <= capacity``).
      page_size, pages_per_seq: the paged layout (capacity = their product).
      pad_rows: query rows appended outside every sequence.
      pad_seqs: inactive sequence slots appended (``distribution[2]`` excludes them; their
        ``kv_len`` is random, their page-table range is the tail).
      spare_pages: cache pages no sequence owns (all NaN).
      tail_pages: page-table entries after the last sequence's pages (0: no tail padding).
      shuffle_pages: physical page ids permuted (else in order).
      nan_pad_rows: q and weights of the padding rows are NaN.
      bad_slots: ``(slot, kind)`` pairs: page-table slot ``slot % used_pages`` (a used page)
        gets an out-of-range page id, ``-1``, ``-2`` (kind 0, 1) or ``num_pages + kind`` (2, 3).
      num_heads, dim: q/cache head count and head dim.
      seed: the NumPy generator seed for every value.
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int
    pages_per_seq: int
    pad_rows: int
    pad_seqs: int
    spare_pages: int
    tail_pages: int
    shuffle_pages: bool
    nan_pad_rows: bool
    bad_slots: tuple[tuple[int, int], ...]
    num_heads: int
    dim: int
    seed: int

    @property
    def capacity(self) -> int:
        """Tokens per sequence: ``pages_per_seq * page_size``."""
        return self.pages_per_seq * self.page_size

    @property
    def num_rows(self) -> int:
        """``T``: query rows, padding included."""
        return sum(self.q_lens) + self.pad_rows

    @property
    def used_pages(self) -> int:
        """Pages owned by the active sequences."""
        return sum(_pages(kl, self.page_size) for kl in self.kv_lens)

    @property
    def is_decode(self) -> bool:
        """Every active sequence has one query row."""
        return all(ql == 1 for ql in self.q_lens)

    @property
    def one_token_per_seq_ok(self) -> bool:
        """``one_token_per_seq=True`` applies: pure decode and ``T == S`` (row ``i`` is
        sequence ``i``; rows of inactive slots are the padding rows)."""
        return self.is_decode and self.pad_rows == self.pad_seqs

    def build(self) -> SyntheticBatch:
        """The arrays (``make_ragged_batch`` with NaN fill), then the NaN padding rows and the
        corrupted page-table slots."""
        rng = np.random.default_rng(self.seed)
        b = make_ragged_batch(rng, q_lens=self.q_lens, kv_lens=self.kv_lens,
                              page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                              num_heads=self.num_heads, dim=self.dim, pad_rows=self.pad_rows,
                              pad_seqs=self.pad_seqs, spare_pages=self.spare_pages,
                              tail_pages=self.tail_pages, shuffle_pages=self.shuffle_pages)
        q, w, table = b.q.copy(), b.weights.copy(), b.page_indices.copy()
        if self.nan_pad_rows and self.pad_rows:
            q[-self.pad_rows:] = np.nan
            w[-self.pad_rows:] = np.nan
        num_pages = b.cache.shape[0]
        for slot, kind in self.bad_slots:
            table[slot % max(self.used_pages, 1)] = -1 - kind if kind < 2 else num_pages + kind
        return dataclasses.replace(b, q=q, weights=w, page_indices=table)


def _pages(kv_len: int, page_size: int) -> int:
    return -(-kv_len // page_size)


def _q_lens(draw: st.DrawFn, kind: str, n: int, rows: int, capacity: int) -> list[int]:
    """Query lengths of ``n`` active sequences of ``kind``, ``sum <= rows``."""
    longest = min(capacity, rows)
    if kind == "decode":
        return [1] * n
    if kind == "mtp":
        lens = [draw(st.integers(2, 4)) for _ in range(n)]
    elif kind == "prefill":
        lens = [draw(st.integers(1, longest)) for _ in range(n)]
    else:  # decode rows first (distribution[0] ends them), then MTP and prefill chunks
        decode = draw(st.integers(0, n - 1))
        lens = [1] * decode + [draw(st.sampled_from([2, 3, 4, 1, longest]))
                               for _ in range(n - decode)]
    out, left = [], rows
    for ql in lens:  # keep the row budget: later sequences get what is left (at least one)
        ql = max(min(ql, left - (n - len(out) - 1)), 1)
        out.append(ql)
        left -= ql
    return out


def _kv_lens(draw: st.DrawFn, q_lens: list[int], capacity: int, page_size: int) -> list[int]:
    """KV lengths ``q_len <= kv_len <= capacity``: short (often below any k), page-aligned,
    full, or anywhere."""
    out = []
    for ql in q_lens:
        how = draw(st.sampled_from(["short", "aligned", "full", "any", "any"]))
        if how == "short":
            kl = draw(st.integers(ql, min(capacity, ql + 3)))
        elif how == "aligned":
            kl = page_size * draw(st.integers(_pages(ql, page_size), capacity // page_size))
        elif how == "full":
            kl = capacity
        else:
            kl = draw(st.integers(ql, capacity))
        out.append(kl)
    return out


def _fit_table(kv_lens: list[int], q_lens: list[int], page_size: int, capacity: int,
               budget: int, fill: bool) -> list[int]:
    """Shrink kv_lens (never below q_len) until the used pages fit ``budget``; with ``fill``,
    grow them (never past capacity) until the used pages equal ``budget`` when they can."""
    kv = list(kv_lens)
    used = lambda: sum(_pages(x, page_size) for x in kv)
    while used() > budget:
        i = max(range(len(kv)), key=lambda j: (_pages(kv[j], page_size)
                                               - _pages(q_lens[j], page_size), j))
        if _pages(kv[i], page_size) == _pages(q_lens[i], page_size):
            raise ValueError(f"q_lens {q_lens} need more than {budget} pages")
        kv[i] = max(q_lens[i], (_pages(kv[i], page_size) - 1) * page_size)
    i = len(kv) - 1
    while fill and used() < budget and i >= 0:
        if kv[i] + page_size <= capacity:
            kv[i] = (_pages(kv[i], page_size) + 1) * page_size
        elif kv[i] < capacity:
            kv[i] = capacity
        else:
            i -= 1
    return kv


@st.composite
def batch_specs(draw: st.DrawFn, *, page_sizes: tuple[int, ...] = (1, 4, 8, 16),
                capacity: int = 64, num_heads: int = 3, dim: int = 16,
                kinds: tuple[str, ...] = KINDS, rows: int | None = None,
                seqs: int | None = None, table_len: int | None = None,
                num_pages: int | None = None, max_rows: int = 24, max_seqs: int = 5,
                decode_rows_equal_seqs: bool = False) -> BatchSpec:
    """Draw a ``BatchSpec``.

    Free shapes by default (``max_rows`` / ``max_seqs`` bound them). Fixed shapes: with
    ``rows`` / ``seqs`` / ``table_len`` / ``num_pages`` given, every spec builds arrays of
    exactly ``T = rows``, ``S = seqs``, ``len(page_indices) = table_len`` and ``num_pages``
    cache pages (``capacity`` tokens per sequence for every page size). ``table_len`` tells
    apart "no tail padding" (kv_lens grown until the used pages fill the table) from tail
    padding. ``decode_rows_equal_seqs`` draws pure decode batches with ``T == S`` (the
    ``one_token_per_seq`` layout; needs ``rows == seqs`` when fixed).
    """
    if decode_rows_equal_seqs and rows != seqs:
        raise ValueError(f"decode_rows_equal_seqs needs rows == seqs, got {rows} and {seqs}")
    if None not in (table_len, num_pages) and num_pages < table_len:
        raise ValueError(f"num_pages={num_pages} < table_len={table_len}: a shuffled table "
                         "needs a distinct page per used slot")
    page_size = draw(st.sampled_from(page_sizes))
    pages_per_seq = capacity // page_size
    kind = "decode" if decode_rows_equal_seqs else draw(st.sampled_from(kinds))
    seq_cap = seqs if seqs is not None else max_seqs
    row_cap = rows if rows is not None else max_rows
    n = draw(st.integers(1, min(seq_cap, row_cap)))
    q_lens = _q_lens(draw, kind, n, row_cap, capacity)
    kv_lens = _kv_lens(draw, q_lens, capacity, page_size)
    no_tail = draw(st.booleans())
    if table_len is not None:
        kv_lens = _fit_table(kv_lens, q_lens, page_size, capacity, table_len, no_tail)
    used = sum(_pages(kl, page_size) for kl in kv_lens)
    if table_len is not None:
        tail = table_len - used
    else:
        tail = 0 if no_tail else draw(st.integers(1, 4))
    spare = num_pages - used if num_pages is not None else draw(st.integers(0, 4))
    pad_seqs = seqs - n if seqs is not None else draw(st.integers(0, 2))
    if decode_rows_equal_seqs:
        pad_rows = pad_seqs
    else:
        pad_rows = rows - sum(q_lens) if rows is not None else draw(st.integers(0, 3))
    bad = draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3)), max_size=2))
    return BatchSpec(q_lens=tuple(q_lens), kv_lens=tuple(kv_lens), page_size=page_size,
                     pages_per_seq=pages_per_seq, pad_rows=pad_rows, pad_seqs=pad_seqs,
                     spare_pages=spare, tail_pages=tail, shuffle_pages=draw(st.booleans()),
                     nan_pad_rows=draw(st.booleans()), bad_slots=tuple(bad),
                     num_heads=num_heads, dim=dim, seed=draw(st.integers(0, 2**32 - 1)))


def _invalid(rng: np.random.Generator, cls: str, kv_len: int, limit: int) -> int:
    """One entry of invalid class ``cls`` for a row with ``kv_len`` units (tokens or pages)
    out of ``limit`` (capacity or pages_per_seq)."""
    if cls == "minus_one":
        return -1
    if cls == "negative":
        return int(rng.choice([-2, -7, -limit, int(rng.integers(-2**30, -1))]))
    if cls == "int32_min":
        return INT32_MIN
    if cls == "int32_max":
        return INT32_MAX
    if cls == "past_kv":
        return int(rng.integers(kv_len, limit)) if kv_len < limit else kv_len
    return limit + int(rng.integers(0, 4 * limit))  # past_capacity


def _selection(draw: st.DrawFn, k: int, *, units: list[int], limit: int) -> np.ndarray:
    """Rows of ``k`` entries: valid ones in ``[0, units[r])``, the rest of an invalid class;
    every invalid class placed at least once when there is room. ``units[r] < 0`` marks a row
    outside every sequence (valid-looking entries in ``[0, limit)``)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p_valid = draw(st.sampled_from([0.0, 0.3, 0.7, 0.9, 1.0]))
    classes = draw(st.lists(st.sampled_from(INVALID_CLASSES), min_size=1, unique=True))
    out = np.empty((len(units), k), np.int64)
    for r, n in enumerate(units):
        for j in range(k):
            if n < 0:
                out[r, j] = rng.integers(0, limit)
            elif n > 0 and rng.random() < p_valid:
                out[r, j] = rng.integers(0, n)  # with replacement: duplicates happen
            else:
                out[r, j] = _invalid(rng, str(rng.choice(classes)), n, limit)
    live = [r for r, n in enumerate(units) if n >= 0]
    if draw(st.booleans()) and live:  # every invalid class at least once, at random places
        for cls in INVALID_CLASSES:
            r = int(rng.choice(live))
            out[r, rng.integers(0, k)] = _invalid(rng, cls, units[r], limit)
    return out.astype(np.int32)


def _row_units(b: SyntheticBatch, per_seq) -> list[int]:
    rows = row_sequences(b.q.shape[0], b.cu_q_lens, b.seq_lens, b.distribution)
    return [-1 if rs is None else per_seq(int(b.seq_lens[rs[0]])) for rs in rows]


@st.composite
def token_selections(draw: st.DrawFn, b: SyntheticBatch, k: int) -> np.ndarray:
    """``i32[T, k]`` token offsets for sparse MLA: valid offsets ``< kv_len`` (duplicates
    included, future tokens too: the token-sparse op is not causal) mixed with every invalid
    class; rows outside every sequence hold valid-looking offsets."""
    cap = b.pages_per_seq * b.page_size
    return _selection(draw, k, units=_row_units(b, lambda kv: min(kv, cap)), limit=cap)


@st.composite
def page_selections(draw: st.DrawFn, b: SyntheticBatch, k_pages: int) -> np.ndarray:
    """``i32[T, k_pages]`` page numbers for page-sparse MLA, as ``token_selections`` with
    pages: valid pages hold at least one token ``< kv_len``; ``past_kv`` pages hold none."""
    ps, pps = b.page_size, b.pages_per_seq
    units = _row_units(b, lambda kv: _pages(min(kv, ps * pps), ps))
    return _selection(draw, k_pages, units=units, limit=pps)
