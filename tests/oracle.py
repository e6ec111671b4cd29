"""Float64 NumPy oracle of the definitions in SPEC.md (written from the math, not from the
implementation): per-row candidate sets and scores, the top-k contract checked by score with tie
forgiveness, and sparse MLA.

The packed page table is decoded here from its definition: sequence ``i``'s ``j``-th page is
``page_indices[cu_kv_lens[i] // page_size + j]``, for ``j < ceil(min(kv_len, capacity) /
page_size)``; an entry past the table or a page id outside the cache is not a page.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def _f64(x) -> np.ndarray:
    return np.asarray(np.asarray(x, dtype=np.float32), dtype=np.float64)


def row_sequences(num_rows, cu_q_lens, kv_lens, distribution):
    """Per row: ``(seq, abs_pos)`` or None when the row belongs to no active sequence."""
    cu_q = np.asarray(cu_q_lens)
    kv = np.asarray(kv_lens)
    active = min(max(int(np.asarray(distribution)[2]), 0), len(kv))
    out = [None] * num_rows
    for i in range(active):
        q_start, q_end = int(cu_q[i]), int(cu_q[i + 1])
        for r in range(max(q_start, 0), min(q_end, num_rows)):
            if out[r] is None:
                out[r] = (i, int(kv[i]) - (q_end - q_start) + (r - q_start))
    return out


def token_keys(seq, cache, kv_lens, page_indices, cu_kv_lens, pages_per_seq):
    """``{offset: key row f64}`` of every existing token of sequence ``seq``."""
    cache = _f64(cache)
    num_pages, page_size, _ = cache.shape
    table = np.asarray(page_indices)
    kv_len = min(max(int(np.asarray(kv_lens)[seq]), 0), pages_per_seq * page_size)
    base = int(np.asarray(cu_kv_lens)[seq]) // page_size
    keys = {}
    for s in range(kv_len):
        slot = base + s // page_size
        if not 0 <= slot < len(table):
            continue
        pid = int(table[slot])
        if 0 <= pid < num_pages:
            keys[s] = cache[pid, s % page_size]
    return keys


def token_candidates(q, weights, cache, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution, pages_per_seq, compression_ratio=1):
    """Per row: ``{offset: f64 score}`` of its causal candidates, or None outside sequences.

    ``compression_ratio = r > 1`` (DeepSeek-V4's indexer, SPEC "DeepSeek-V4 attention"): the
    cache, page table and ``cu_kv_lens`` hold compressed entries, one per group of ``r`` tokens;
    ``seq_lens`` stays in tokens. A sequence of ``L`` tokens has ``L // r`` complete entries and
    entry ``j`` is a candidate of the row at token position ``p`` iff ``j < (p + 1) // r`` (an
    entry exists once its group's last token has arrived). ``r = 1``: tokens, ``s <= p``."""
    q, w = _f64(q), _f64(weights)
    rows = row_sequences(q.shape[0], cu_q_lens, seq_lens, distribution)
    r_ = int(compression_ratio)
    entry_lens = [max(int(x), 0) // r_ for x in np.asarray(seq_lens)]
    cached = {}
    out = []
    for r, rs in enumerate(rows):
        if rs is None:
            out.append(None)
            continue
        seq, abs_pos = rs
        if seq not in cached:
            cached[seq] = token_keys(seq, cache, entry_lens, page_indices, cu_kv_lens,
                                     pages_per_seq)
        keys = cached[seq]
        visible = (abs_pos + 1) // r_  # keys 0 .. visible - 1 (r = 1: s <= abs_pos)
        cand = {}
        for s, key in keys.items():
            if s < visible:
                cand[s] = float(np.sum(w[r] * np.maximum(q[r] @ key, 0.0)))
        out.append(cand)
    return out


def page_candidates(token_cands, page_size):
    """Per row: ``{page: max token score}`` over the page's candidates."""
    out = []
    for cand in token_cands:
        if cand is None:
            out.append(None)
            continue
        pages = {}
        for s, v in cand.items():
            p = s // page_size
            pages[p] = max(pages.get(p, -np.inf), v)
        out.append(pages)
    return out


def check_topk_rows(idx, cands, k, *, rtol=1e-4, what="row"):
    """Assert the top-k contract for every row against ``cands`` (``{id: score}`` or None).

    Selected ids are distinct candidates, ``-1`` only in the tail, exactly ``min(n, k)`` of them,
    in descending score order, and every selected score >= every unselected score (ties within
    ``rtol * scale`` forgiven).
    """
    idx = np.asarray(idx)
    if idx.shape != (len(cands), k):
        raise AssertionError(f"shape {idx.shape} != {(len(cands), k)}")
    for r, cand in enumerate(cands):
        row = idx[r]
        if cand is None:
            if not np.all(row == -1):
                raise AssertionError(f"{what} {r} is outside every sequence but got {row}")
            continue
        n_sel = int(np.sum(row >= 0))
        if np.any(row[:n_sel] < 0) or np.any(row[n_sel:] != -1):
            raise AssertionError(f"{what} {r}: -1 not only in the tail: {row}")
        sel = [int(x) for x in row[:n_sel]]
        if len(set(sel)) != n_sel:
            raise AssertionError(f"{what} {r}: duplicate entries {row}")
        bad = [x for x in sel if x not in cand]
        if bad:
            raise AssertionError(f"{what} {r}: selected non-candidates {bad}")
        if n_sel != min(len(cand), k):
            raise AssertionError(f"{what} {r}: selected {n_sel}, expected min(n={len(cand)}, "
                                 f"k={k})")
        if not cand:
            continue
        scale = max(1.0, max(abs(v) for v in cand.values()))
        tol = rtol * scale
        vals = [cand[x] for x in sel]
        if any(b > a + tol for a, b in zip(vals, vals[1:], strict=False)):
            raise AssertionError(f"{what} {r}: not in descending score order: {vals}")
        unsel = [v for x, v in cand.items() if x not in set(sel)]
        if unsel and vals and max(unsel) > min(vals) + tol:
            raise AssertionError(f"{what} {r}: an unselected candidate scores {max(unsel)} > "
                                 f"selected minimum {min(vals)}")


def check_token_topk(idx, batch, k, *, rtol=1e-4, compression_ratio=1, **overrides):
    """Check a token top-k result against ``batch`` (a ``SyntheticBatch``; any field, e.g.
    ``q`` cast to bf16 or a corrupted ``page_indices``, may be overridden by keyword);
    ``compression_ratio`` as ``token_candidates`` (the batch's cache then holds entries)."""
    b = dataclasses.replace(batch, **overrides)
    cands = token_candidates(*b.args(), b.pages_per_seq, compression_ratio)
    check_topk_rows(idx, cands, k, rtol=rtol, what="token row")


def check_page_topk(idx, batch, k_pages, *, rtol=1e-4, **overrides):
    """Check a page top-k result against ``batch`` (overrides as in ``check_token_topk``)."""
    b = dataclasses.replace(batch, **overrides)
    cands = page_candidates(token_candidates(*b.args(), b.pages_per_seq), b.cache.shape[1])
    check_topk_rows(idx, cands, k_pages, rtol=rtol, what="page row")


def mla_oracle(q, cache, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens, distribution,
               *, sm_scale, v_dim, pages_per_seq, page=False, attn_sink=None):
    """Sparse absorbed MLA in float64. ``selected`` holds token offsets (``page=False``) or page
    numbers (``page=True``: every existing, causal token of each listed page). Invalid entries
    are skipped; duplicates count once per occurrence; an empty row gives zeros and lse -inf.

    ``attn_sink`` (optional, one logit per head; SPEC.md "DeepSeek-V4 attention"): the sink
    enters the denominator only, ``o = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) +
    e^(sink - m))`` with ``m`` the max over the real scores; ``lse`` stays the real scores'.

    Returns (out f64[T, H, v_dim], lse f64[T, H]).
    """
    q = _f64(q)
    sel = np.asarray(selected)
    page_size = np.shape(cache)[1]
    num_rows, heads, _ = q.shape
    out = np.zeros((num_rows, heads, v_dim))
    lse = np.full((num_rows, heads), -np.inf)
    rows = row_sequences(num_rows, cu_q_lens, kv_lens, distribution)
    cached = {}
    for r, rs in enumerate(rows):
        if rs is None:
            continue
        seq, abs_pos = rs
        if seq not in cached:
            cached[seq] = token_keys(seq, cache, kv_lens, page_indices, cu_kv_lens,
                                     pages_per_seq)
        keys = cached[seq]
        toks = []
        for e in sel[r]:
            e = int(e)
            if page:
                if 0 <= e < pages_per_seq:
                    toks += [s for s in range(e * page_size, (e + 1) * page_size)
                             if s in keys and s <= abs_pos]
            elif e in keys:
                toks.append(e)
        if not toks:
            continue
        c = np.stack([keys[s] for s in toks])  # [n, D]
        logits = sm_scale * np.einsum("hd,nd->hn", q[r], c)
        m = logits.max(axis=-1, keepdims=True)
        p = np.exp(logits - m)
        denom = p.sum(axis=-1, keepdims=True)
        full = denom
        if attn_sink is not None:  # exp(-inf - m) = 0: no sink
            with np.errstate(over="ignore"):  # a huge sink: inf, the row's output 0
                full = denom + np.exp(_f64(attn_sink)[:, None] - m)
        out[r] = (p / full) @ c[:, :v_dim]
        lse[r] = (m + np.log(denom))[:, 0]
    return out, lse


def v4_oracle(q, kv_lens, cu_q_lens, distribution, *, sm_scale, window_size, compress_ratio,
              window_cache, window_table, window_cu, window_pages_per_seq, comp_cache=None,
              comp_table=None, comp_cu=None, comp_pages_per_seq=0, comp_indices=None,
              attn_sink=None):
    """DeepSeek-V4 attention in float64, from the definition (SPEC "DeepSeek-V4 attention").

    Row ``r`` of sequence ``i`` at position ``p`` attends, in ONE softmax (no dedup), the window
    tokens ``max(0, p - window_size + 1) <= s <= p`` that exist in the window cache (``s <
    min(kv_len, capacity)``, page slot in the table, page id in range) and the compressed
    entries ``j < (p + 1) // compress_ratio`` that exist in the compressed cache (its length is
    ``kv_len // compress_ratio`` entries): ratio 4 those listed in ``comp_indices[r]`` (each
    occurrence counts), ratio 128 all of them, ratio 0 none. K = V = the whole row. With a sink
    ``z_h``: ``o = sum_x e^(s_x - m) v_x / (sum_x e^(s_x - m) + e^(z_h - m))``. Caches are plain
    (pass a packed cache unpacked).

    Returns (out f64[T, H, D], lse f64[T, H]); the lse excludes the sink; an empty row gives
    zeros and ``-inf``.
    """
    q = _f64(q)
    num_rows, heads, dim = q.shape
    kv = np.asarray(kv_lens)
    sink = None if attn_sink is None else _f64(attn_sink)
    out = np.zeros((num_rows, heads, dim))
    lse = np.full((num_rows, heads), -np.inf)
    rows = row_sequences(num_rows, cu_q_lens, kv, distribution)
    for r, rs in enumerate(rows):
        if rs is None:
            continue
        seq, p = rs
        wkeys = token_keys(seq, window_cache, kv, window_table, window_cu, window_pages_per_seq)
        vals = [wkeys[s] for s in range(max(0, p - window_size + 1), p + 1) if s in wkeys]
        if compress_ratio:
            ckeys = token_keys(seq, comp_cache, np.maximum(kv, 0) // compress_ratio, comp_table,
                               comp_cu, comp_pages_per_seq)
            visible = (p + 1) // compress_ratio
            listed = ([int(j) for j in np.asarray(comp_indices)[r]] if compress_ratio == 4
                      else range(visible))
            vals += [ckeys[j] for j in listed if 0 <= j < visible and j in ckeys]
        if not vals:
            continue
        c = np.stack(vals)  # [n, D]: keys and values
        logits = sm_scale * np.einsum("hd,nd->hn", q[r], c)
        m = logits.max(axis=-1)
        e = np.exp(logits - m[:, None])
        den = e.sum(axis=-1)
        lse[r] = m + np.log(den)
        if sink is not None:
            with np.errstate(over="ignore"):
                den = den + np.exp(sink - m)  # e^(z - m): the sink in the denominator only
        out[r] = (e @ c) / den[:, None]
    return out, lse
