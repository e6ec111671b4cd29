"""A float64 NumPy oracle of the DeepSeek-V4.1 attention stack in the official bf16 regime (the
release's ``inference/model.py`` with bf16 activations), one whole sequence (a prefill), one
loop per query row / entry / block as the definition reads. Values are float64 between the
official code's bf16 roundings (``bf``); V4.1's three cache quantizers are written here from the
rules in ``docs/v41.md`` (window fp8 / ue8m0 per 32, compressed fp4 / e4m3 per 16, index fp4 /
ue8m0 per 32), the candidate blocks and the top-k from the definition with the declared order
(NaN first, then value descending, then the lower number).

It reads the package for the layer map only (``reference.v41.resolve_layers``, tested on its
own); the RoPE tables are the caller's (``cos`` / ``sin`` per ratio: 0, or compressed). The
RoPE, RMSNorm and output stage are the V4 oracle's (``tests/v4_bf16_oracle.py``): V4.1 keeps
them."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from reference.v41 import Mode, resolve_layers
from tests.v4_bf16_oracle import _out_row, _pow2_ceil, attend_row, bf, rms, rope

# The release's bf16 (or fp8, bf16-exact) Linear weights; the ratio-1 compressor's wkv too.
BF16_WEIGHTS = ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                "indexer.wq_b.weight", "indexer.weights_proj.weight", "indexer.wk.weight")


def _blocks(x, block):
    return np.asarray(x, np.float64).reshape(*np.shape(x)[:-1], -1, block)


def _pow2_scale(amax, inv):
    """``2**ceil(log2(f32(amax) * f32(inv)))``: the f32 product, as the official kernels."""
    return _pow2_ceil((amax.astype(np.float32) * np.float32(inv)).astype(np.float64))


def _cast(y, fmt):
    return y.astype(np.float32).astype(fmt).astype(np.float64)


def window_fp8(x):
    """Per 32: ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, ``e4m3(clip(x / s, +-448)) s``."""
    b = _blocks(x, 32)
    s = _pow2_scale(np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4), 1 / 448)
    return (_cast(np.clip(b / s, -448, 448), ml_dtypes.float8_e4m3fn) * s).reshape(np.shape(x))


def compressed_fp4(x):
    """Per 16: ``s = e4m3(max(amax, 6 * 2**-9) / 6)`` (an f32 division, at most 448),
    ``e2m1(clip(x / s, +-6)) s`` (an f32 division)."""
    b = _blocks(x, 16)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -9)
    s = _cast(np.minimum(amax.astype(np.float32) / np.float32(6), 448), ml_dtypes.float8_e4m3fn)
    y = np.clip(b.astype(np.float32) / s.astype(np.float32), -6, 6)
    return (_cast(y, ml_dtypes.float4_e2m1fn) * s).reshape(np.shape(x))


def index_fp4(x):
    """Per 32: ``s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))``, ``e2m1(clip(x / s, +-6)) s``."""
    b = _blocks(x, 32)
    s = _pow2_scale(np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0 ** -126), 1 / 6)
    return (_cast(np.clip(b / s, -6, 6), ml_dtypes.float4_e2m1fn) * s).reshape(np.shape(x))


def order(values, ids):
    """``ids`` sorted by the declared order of their ``values``: NaN first, then value
    descending, then the lower id."""
    return sorted(ids, key=lambda j: (not np.isnan(values[j]), -np.nan_to_num(values[j]), j))


def candidate_blocks(scores, lens, num_blocks, block):
    """Per row: the kept blocks (a set). A block's score is the max of its visible entries (NaN
    if one is NaN, ``-inf`` if none is visible); the newest ``(len - 1) // block`` is ``+inf``;
    of the first ``num_blocks`` in the order, those neither NaN nor ``-inf`` are kept."""
    out = []
    for row, n in zip(scores, lens, strict=True):
        nb = -(-len(row) // block)
        bs = []
        for g in range(nb):
            vis = [row[j] for j in range(g * block, min((g + 1) * block, len(row))) if j < n]
            bs.append(np.nan if any(np.isnan(vis)) else max(vis, default=-np.inf))
        if n > 0:
            bs[(n - 1) // block] = np.inf
        top = order(bs, range(nb))[:num_blocks]
        out.append({g for g in top if not np.isnan(bs[g]) and bs[g] > -np.inf})
    return out


def topk(scores, lens, k, cands=None, block=1):
    """Per row: the first ``k`` visible entries (in a candidate block when ``cands``) whose
    score is not ``-inf``, in the order."""
    out = []
    for t, (row, n) in enumerate(zip(scores, lens, strict=True)):
        ok = [j for j in range(n) if row[j] != -np.inf
              and (cands is None or j // block in cands[t])]
        out.append(order(row, ok)[:k])
    return out


def _compress(p, x, r, c, cos, sin):
    """``(pool, index keys)`` of one KV source: the entries ``[n // r, ...]``."""
    eps = c.rms_norm_eps
    if r == 1:
        latent = rms(bf(x @ bf(p["compressor.wkv.weight"]).T), p["compressor.norm.weight"], eps)
    else:
        kv, score = x @ p["compressor.wkv.weight"].T, x @ p["compressor.wgate.weight"].T
        rows = []
        for j in range(x.shape[0] // 2):
            g = score[2 * j:2 * j + 2]
            w = np.exp(g - g.max(0))
            rows.append(rms(bf((w / w.sum(0) * kv[2 * j:2 * j + 2]).sum(0)),
                            p["compressor.norm.weight"], eps))
        latent = np.array(rows).reshape(-1, c.head_dim)
    at = np.arange(latent.shape[0]) * r
    pool = compressed_fp4(bf(rope(latent, cos[at], sin[at])))
    k = rms(bf(latent @ p["indexer.wk.weight"].T), p["indexer.k_norm.weight"], eps)
    return pool, index_fp4(bf(rope(k, cos[at], sin[at])))


def _scores(p, x, qr, keys, r, c, cos, sin):
    n = x.shape[0]
    q = bf(qr @ p["indexer.wq_b.weight"].T).reshape(n, c.index_n_heads, c.index_head_dim)
    q = index_fp4(bf(rope(q, cos[:n, None], sin[:n, None])))
    scale = np.float32(c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5)
    w = bf(bf(x @ p["indexer.weights_proj.weight"].T) * np.float64(scale))
    s = bf(bf(np.maximum(bf(np.einsum("shd,jd->shj", q, keys)), 0) * w[:, :, None]).sum(1))
    visible = np.arange(keys.shape[0])[None, :] < ((np.arange(n) + 1) // r)[:, None]
    return np.where(visible, s, -np.inf)


def stack(params, xs, c, tables):
    """One sequence ``xs [L, n, dim]`` through every layer of ``c`` (a ``V41Config``).
    ``tables[r]``: ``(cos, sin)`` f32 tables of ratio ``r`` (0: window-only layers). Returns one
    dict per layer: ``out [n, dim]``, and where the layer indexes ``scores [n, E]``, ``picks``
    (per row, the entries in the order); ``cands`` (per row, a set of blocks) on the candidate
    source."""
    pub, res = {}, []
    for plan in resolve_layers(c):
        p = {k: bf(v) if k in BF16_WEIGHTS else np.asarray(v, np.float64)
             for k, v in params[plan.layer].items()}
        x, r, eps = bf(xs[plan.layer]), plan.ratio, c.rms_norm_eps
        n = x.shape[0]
        cos, sin = tables[r]
        qr = rms(bf(x @ p["wq_a.weight"].T), p["q_norm.weight"], eps)
        q = bf(rope(bf(qr @ p["wq_b.weight"].T).reshape(n, c.n_heads, c.head_dim),
                    cos[:n, None], sin[:n, None]))
        kv = window_fp8(bf(rope(rms(bf(x @ p["wkv.weight"].T), p["kv_norm.weight"], eps),
                                cos[:n], sin[:n])))
        out = {}
        if plan.mode is Mode.FULL:
            pub["pool"], pub["keys"] = _compress(p, x, r, c, cos, sin)
        if plan.mode in (Mode.FULL, Mode.REINDEX):
            out["scores"] = _scores(p, x, qr, pub["keys"], r, c, cos, sin)
            lens = (np.arange(n) + 1) // r
            if plan.candidates.value == "produces":
                pub["cands"] = out["cands"] = candidate_blocks(
                    out["scores"], lens, c.candidate_topk_blocks, c.candidate_block_size)
            cands = pub["cands"] if plan.candidates.value == "consumes" else None
            pub["picks"] = out["picks"] = topk(out["scores"], lens, c.index_topk, cands,
                                               c.candidate_block_size)
        rows = []
        for t in range(n):
            keys = kv[max(0, t - c.window_size + 1):t + 1]
            if plan.mode is not Mode.SWA:
                keys = np.concatenate([keys, pub["pool"][list(pub["picks"][t])]])
            rows.append(_out_row(attend_row(q[t], keys, p["attn_sink"], c.head_dim), t, p, c,
                                 cos, sin))
        out["out"] = np.array(rows)
        res.append(out)
    return res
