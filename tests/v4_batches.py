"""DeepSeek-V4 attention test batches: a ragged batch with a window cache (raw tokens, pages
that fell out of every row's window released) and a compressed cache (one entry per
``ratio`` tokens). Every slot that must not be read is NaN: free slots, pages past a sequence's
length, a released page's old contents, compressed entries past ``kv_len // ratio``."""

from __future__ import annotations

import dataclasses

import numpy as np

from reference.v4_attention import HEAD_DIM, PagedKV


@dataclasses.dataclass
class V4Batch:
    """NumPy arrays of one V4 batch; ``args``/``kwargs`` give the op's arguments."""

    q: np.ndarray  # f32[T, H, D]
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    distribution: np.ndarray
    window: tuple  # (cache f32[P, ps, D], table i32[N], cu_lens i32[S+1])
    compressed: tuple | None
    compressed_indices: np.ndarray | None
    window_size: int
    ratio: int
    window_pages_per_seq: int
    comp_pages_per_seq: int

    def kwargs(self, *, cast=None, sink=None):
        """The op's keyword arguments (``cast`` maps each cache array, e.g. to packed)."""
        cast = cast or (lambda x: x)
        comp = None
        if self.compressed is not None:
            comp = PagedKV(cast(self.compressed[0]), *self.compressed[1:])
        return dict(window_size=self.window_size, compress_ratio=self.ratio,
                    window_pages_per_seq=self.window_pages_per_seq,
                    compressed_pages_per_seq=self.comp_pages_per_seq, compressed=comp,
                    compressed_indices=self.compressed_indices, attn_sink=sink)

    def args(self, q=None, *, cast=None):
        cast = cast or (lambda x: x)
        return (self.q if q is None else q, PagedKV(cast(self.window[0]), *self.window[1:]),
                self.kv_lens, self.cu_q_lens, self.distribution)

    def oracle_kwargs(self):
        kw = dict(window_size=self.window_size, compress_ratio=self.ratio,
                  window_cache=self.window[0], window_table=self.window[1],
                  window_cu=self.window[2], window_pages_per_seq=self.window_pages_per_seq)
        if self.compressed is not None:
            kw.update(comp_cache=self.compressed[0], comp_table=self.compressed[1],
                      comp_cu=self.compressed[2], comp_pages_per_seq=self.comp_pages_per_seq,
                      comp_indices=self.compressed_indices)
        return kw


def paged(rng, lens, page_size, pages_per_seq, dim, *, spare=2, keep_from=None, scale=1.0):
    """A paged cache holding ``lens[i]`` rows of sequence ``i`` (NaN elsewhere), shuffled pages.
    ``keep_from[i]``: rows below it are no longer needed; their whole pages are released (the
    slot gets an id outside ``[0, P)``, the old page is NaN). Returns (cache, table, cu_lens)."""
    used = [-(-int(n) // page_size) for n in lens]
    num_pages = sum(used) + spare
    phys = rng.permutation(num_pages).astype(np.int32)
    cache = np.full((num_pages, page_size, dim), np.nan, np.float32)
    table, off = [], 0
    for i, (n, u) in enumerate(zip(lens, used, strict=True)):
        pages = phys[off:off + u].copy()
        off += u
        for j, pid in enumerate(pages):
            live = min(page_size, int(n) - j * page_size)
            cache[pid, :live] = scale * rng.standard_normal((live, dim))
            if keep_from is not None and (j + 1) * page_size <= keep_from[i]:
                cache[pid] = np.nan  # released: what used to be there is garbage
                pages[j] = num_pages + j if j % 2 else -1 - j  # both kinds of "no page"
        table.append(pages)
    table = np.concatenate(table + [np.zeros(0, np.int32)]).astype(np.int32)
    assert all(u <= pages_per_seq for u in used), (used, pages_per_seq)
    cu = np.concatenate([[0], np.cumsum([u * page_size for u in used])]).astype(np.int32)
    return cache, table, cu


def compressed_topk(rng, rows, kv_lens, ratio: int, k: int):
    """``i32[T, k]`` ratio-4 selections: visible entries (duplicates possible) mixed with every
    invalid kind: -1, negative, entries not yet visible (existing, finite rows), past the
    sequence's entries, huge."""
    sel = np.full((len(rows), k), -1, np.int32)
    for r, rs in enumerate(rows):
        if rs is None:
            sel[r] = rng.integers(0, 8, k)  # rows outside every sequence: ignored
            continue
        seq, p = rs
        vis, n = (p + 1) // ratio, int(kv_lens[seq]) // ratio
        for c in range(k):
            kind = rng.integers(0, 8)
            if kind < 4 and vis:
                sel[r, c] = rng.integers(0, vis)
            elif kind == 4 and n > vis:
                sel[r, c] = rng.integers(vis, n)
            elif kind == 5:
                sel[r, c] = rng.integers(-5, 0)
            elif kind == 6:
                sel[r, c] = n + rng.integers(0, 100)
            elif kind == 7:
                sel[r, c] = np.iinfo(np.int32).max
    return sel


def _pad_cu(cu, pad_seqs):
    """``cu_lens`` extended over the inactive sequence slots (they own no pages)."""
    return np.concatenate([cu, np.full(pad_seqs, cu[-1])]).astype(np.int32)


def make_v4_batch(seed, *, q_lens, kv_lens, heads=4, ratio=4, window_size=16,
                  window_page_size=4, window_pages_per_seq=None, comp_page_size=4,
                  comp_pages_per_seq=None, k=6, pad_rows=0, pad_seqs=0, release=True,
                  dim=HEAD_DIM, scale=1.0):
    """A V4 batch (module docstring). ``release``: free the window pages no row can see."""
    from oracle import row_sequences

    rng = np.random.default_rng(seed)
    cap = max(kv_lens + [1])
    wpp = window_pages_per_seq or -(-cap // window_page_size)
    num_rows = sum(q_lens) + pad_rows
    cu_q = np.concatenate([[0], np.cumsum(list(q_lens) + [0] * pad_seqs)]).astype(np.int32)
    kv = np.array(list(kv_lens) + list(rng.integers(1, cap + 1, pad_seqs)), np.int32)
    n_act = len(q_lens)
    decode_end = next((i for i, ql in enumerate(q_lens) if ql != 1), n_act)
    dist = np.array([decode_end, n_act, n_act], np.int32)
    # the first row of a sequence sees the oldest token: kv_len - q_len - window_size + 1
    keep = [max(0, kl - ql - window_size + 1) for ql, kl in zip(q_lens, kv_lens, strict=True)]
    window = paged(rng, kv_lens, window_page_size, wpp, dim, keep_from=keep if release else None,
                   scale=scale)
    window = (window[0], window[1], _pad_cu(window[2], pad_seqs))
    comp, sel, cpp = None, None, 0
    if ratio:
        entries = [kl // ratio for kl in kv_lens]
        cpp = comp_pages_per_seq or max(1, -(-max(entries + [1]) // comp_page_size))
        comp = paged(rng, entries, comp_page_size, cpp, dim, scale=scale)
        comp = (comp[0], comp[1], _pad_cu(comp[2], pad_seqs))
    q = rng.standard_normal((num_rows, heads, dim)).astype(np.float32)
    if pad_rows:
        q[-pad_rows:] = np.nan
    rows = row_sequences(num_rows, cu_q, kv, dist)
    if ratio == 4:
        sel = compressed_topk(rng, rows, kv, ratio, k)
    return V4Batch(q, kv, cu_q, dist, window, comp, sel, window_size, ratio, wpp, cpp)


NAN_WORD = 0xFFFFFFFF  # every byte 0xFF: e4m3 NaN codes, ue8m0 NaN scales, bf16 NaN rope halves


PAD_WORDS = slice(71, 128)  # record bytes 455..511: byte 3 of words 71..127 (zero by format)


def to_fp8(x):
    """``f32[..., P, ps, 512]`` -> ``Fp8V4Cache`` quantized by ``quantize_v4_rows``, with NaN
    bit patterns in every byte the kernels must not read: every word of a token that holds a
    NaN (a slot that must not be read), every quarter of the rope array no token owns
    (``NAN_WORD``), and the pad bytes of every record (0xFF: an e4m3 NaN code, on the lanes the
    kernel replaces by the rope). Deterministic, and values are idempotent
    (``to_fp8(dequantized(to_fp8(x)))`` holds the same values), so a cast of the dequantized
    batch reproduces the cache."""
    from reference import v4_cache as vc

    x = np.asarray(x, np.float32)
    words = np.array(vc.quantize_v4_rows(x))  # u32[..., P, ps, 160]
    words[..., PAD_WORDS] |= np.uint32(0xFF000000)
    words[np.isnan(x).any(axis=-1)] = NAN_WORD
    *lead, ps, _ = words.shape
    rope = np.full((*lead, vc.rope_rows(ps) * vc.ROPE_TOKENS_PER_ROW, vc.ROPE_WORDS), NAN_WORD,
                   np.uint32)
    rope[..., :ps, :] = words[..., vc.NOPE_WORDS:]
    return vc.Fp8V4Cache(words[..., :vc.NOPE_WORDS].copy(),
                         rope.reshape(*lead, vc.rope_rows(ps), vc.LANES))


def dequantized(x):
    """The f32 values ``to_fp8(x)`` holds (NaN where it wrote NaN words): the oracle's view."""
    from reference import v4_cache as vc

    return np.asarray(vc.dequantize_v4_cache(to_fp8(x)).astype(np.float32))


def fp8_view(b, which=("window", "compressed")):
    """``b`` with the named caches replaced by their dequantized values (pass ``cast=`` a cast
    that applies ``to_fp8`` to those caches)."""
    kw = {}
    for name in which:
        part = getattr(b, name)
        if part is not None:
            kw[name] = (dequantized(part[0]), *part[1:])
    return dataclasses.replace(b, **kw)
