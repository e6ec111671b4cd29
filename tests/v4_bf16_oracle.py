"""A float64 NumPy oracle of the DeepSeek-V4 attention layer in the official bf16 regime (the
released ``inference/model.py`` run with bf16 activations; ``shared/SPEC.md``, "The official
precision regime"), one whole sequence at a time, one loop per query / group as the definition
reads. Every value is float64 between the official code's bf16 roundings, which it applies with
``bf`` (round to nearest even, ``ml_dtypes``); the official f32 arithmetic between them is exact
here. QAT (``qat=True``): the fp8 (block 64, nope dims) and Hadamard + fp4 (block 32) simulations
of the official tilelang kernels, written from SPEC.md's words.

It does not use the package; its inputs are the float parameters, the sequence and the RoPE
``cos`` / ``sin`` tables (the official model's are f32, computed from an f32 angle; the caller
passes them, so the oracle does not restate how they are built)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

# The official model's bf16 Linear weights; every other parameter is f32 there.
BF16_WEIGHTS = ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                "indexer.wq_b.weight", "indexer.weights_proj.weight")


def bf(x):
    """Each value rounded to the nearest bf16 (ties to even), as float64."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _pow2_ceil(y):
    """``2**ceil(log2(y))`` for ``y > 0``, exactly."""
    m, e = np.frexp(y)  # y = m 2**e, m in [0.5, 1)
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def _block_quant(x, block, floor, qmax, fmt):
    blocks = x.reshape(*x.shape[:-1], -1, block)
    s = _pow2_ceil(np.maximum(np.abs(blocks).max(-1, keepdims=True), floor) / qmax)
    y = np.clip(blocks / s, -qmax, qmax).astype(fmt).astype(np.float64)
    return (y * s).reshape(x.shape)


def fp8_sim(x):
    """SPEC.md's fp8 QAT: block 64, ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, e4m3 of
    ``clamp(x / s, +-448)`` times ``s``."""
    return _block_quant(x, 64, 1e-4, 448.0, ml_dtypes.float8_e4m3fn)


def fp4_sim(x):
    """SPEC.md's fp4 QAT: block 32, ``s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))``, e2m1 of
    ``clamp(x / s, +-6)`` times ``s``."""
    return _block_quant(x, 32, 6 * 2.0 ** -126, 6.0, ml_dtypes.float4_e2m1fn)


def hadamard(x):
    """``x H / sqrt(n)`` over the last dim, ``H`` the Sylvester matrix ``[[H, H], [H, -H]]``."""
    n = x.shape[-1]
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return x @ h / math.sqrt(n)


def rope(x, cos, sin):
    """Interleaved pairs of the last ``2 cos.shape[-1]`` dims rotated: ``(a, b) -> (a cos - b
    sin, a sin + b cos)``; ``cos``/``sin`` broadcast against ``x[..., :half]``."""
    rd = 2 * cos.shape[-1]
    out = np.array(x, np.float64)
    a, b = x[..., -rd::2], x[..., -rd + 1::2]
    out[..., -rd::2] = a * cos - b * sin
    out[..., -rd + 1::2] = a * sin + b * cos
    return out


def rms(x, weight, eps):
    """The official RMSNorm: f32 math (exact here), the weight multiply before the one bf16
    rounding."""
    return bf(weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)))


def head_norm(q, eps):
    """The weightless per-head norm as five bf16 tensor ops."""
    sq = bf(q * q)
    v = bf(bf(sq.sum(-1, keepdims=True) / q.shape[-1]) + np.float32(eps))
    return bf(q * bf(1.0 / np.sqrt(v)))


def compressed(x, p, prefix, ratio, cos, sin, eps, finish):
    """The entries ``[n // ratio, d]`` of one sequence: projections of the bf16 ``x`` by the f32
    weights, per-channel softmax pooling of each group's slots (ratio 4: the previous group's
    first half, then this group's second half; group 0 has no previous), the pooled row
    rounded, the norm, RoPE at the group's first token rounded, then ``finish``."""
    kv, score = x @ p[f"{prefix}.wkv.weight"].T, x @ p[f"{prefix}.wgate.weight"].T
    ape = p[f"{prefix}.ape"]
    d = p[f"{prefix}.norm.weight"].shape[0]
    rows = []
    for j in range(x.shape[0] // ratio):
        slots = []
        if ratio == 4:
            slots += [(4 * (j - 1) + k, k, slice(0, d)) for k in range(4) if j > 0]
            slots += [(4 * j + k, k, slice(d, 2 * d)) for k in range(4)]
        else:
            slots += [(ratio * j + k, k, slice(0, d)) for k in range(ratio)]
        g = np.array([score[t, h] + ape[k, h] for t, k, h in slots])
        v = np.array([kv[t, h] for t, _, h in slots])
        w = np.exp(g - g.max(0))
        pooled = (w / w.sum(0) * v).sum(0)
        normed = rms(bf(pooled), p[f"{prefix}.norm.weight"], eps)
        rows.append(finish(bf(rope(normed, cos[ratio * j], sin[ratio * j]))))
    return np.array(rows).reshape(-1, d)


def _indexer(p, x, qr, c, cos, sin, qat):
    """``(keys [E, d], scores [n, E])``: the bf16 index scores, ``-inf`` on invisible entries."""
    n = x.shape[0]

    def rot_fp4(v):
        return fp4_sim(bf(hadamard(v))) if qat else v
    keys = compressed(x, p, "indexer.compressor", 4, cos, sin, c.norm_eps, rot_fp4)
    q = bf(qr @ p["indexer.wq_b.weight"].T).reshape(n, c.index_n_heads, c.index_head_dim)
    q = rot_fp4(bf(rope(q, cos[:n, None], sin[:n, None])))
    scale = np.float32(c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5)
    w = bf(bf(x @ p["indexer.weights_proj.weight"].T) * np.float64(scale))  # [n, H]
    dots = bf(np.einsum("shd,jd->shj", q, keys))
    scores = bf((bf(np.maximum(dots, 0) * w[:, :, None])).sum(1))
    visible = np.arange(keys.shape[0])[None, :] < ((np.arange(n) + 1) // 4)[:, None]
    return keys, np.where(visible, scores, -np.inf)


def attend_row(q, keys, sink, head_dim):
    """One query row ``q [H, D]`` over ``keys [N, D]`` (K = V) with the sink: f64 logits times
    ``head_dim**-0.5``, the probabilities rounded before ``P @ V``, the output rounded."""
    logits = q @ keys.T * head_dim ** -0.5
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)
    den = e.sum(-1, keepdims=True) + np.exp(sink[:, None] - m)
    return bf(bf(e) @ keys / den)


def _out_row(o, t, p, c, cos, sin):
    o = bf(rope(o, cos[t], -sin[t])).reshape(c.o_groups, -1)
    wo_a = p["wo_a.weight"].reshape(c.o_groups, c.o_lora_rank, -1)
    return bf(bf(np.einsum("gd,grd->gr", o, wo_a)).reshape(-1) @ p["wo_b.weight"].T)


def layer(params, x, c, cos, sin, *, qat, picks=None):
    """One sequence ``x [n, dim]`` through the layer of config ``c`` (the statement's
    ``V4AttentionConfig``, read for its dims). ``picks``: per query row, the compressed entries
    a CSA row attends (default: the oracle's own top-k, ties to the lower entry number).
    Returns a dict: ``out [n, dim]``, the window rows ``kv [n, head_dim]``, ``comp [n // r,
    head_dim]``, and on CSA ``index_keys``, ``scores [n, E]``, ``picks``."""
    p = {k: bf(v) if k in BF16_WEIGHTS else np.asarray(v, np.float64)
         for k, v in params.items()}
    x, n, r, eps = bf(x), x.shape[0], c.compress_ratio, c.norm_eps
    cs, sn = cos[:n, None], sin[:n, None]
    qr = rms(bf(x @ p["wq_a.weight"].T), p["q_norm.weight"], eps)
    q = bf(qr @ p["wq_b.weight"].T).reshape(n, c.n_heads, c.head_dim)
    q = bf(rope(head_norm(q, eps), cs, sn))
    nope = c.head_dim - c.rope_head_dim

    def fp8_nope(v):
        return np.concatenate([fp8_sim(v[..., :nope]), v[..., nope:]], -1) if qat else v
    kv = fp8_nope(bf(rope(rms(bf(x @ p["wkv.weight"].T), p["kv_norm.weight"], eps), cos[:n],
                          sin[:n])))
    res = {"kv": kv, "comp": np.zeros((0, c.head_dim))}
    if r:
        res["comp"] = compressed(x, p, "compressor", r, cos, sin, eps, fp8_nope)
    if r == 4:
        res["index_keys"], res["scores"] = _indexer(p, x, qr, c, cos, sin, qat)
        if picks is None:
            picks = [sorted(np.flatnonzero(np.isfinite(s)), key=lambda j, s=s: (-s[j], j))
                     [:c.index_topk] for s in res["scores"]]
        res["picks"] = picks
    out = []
    for t in range(n):
        pick = list(picks[t]) if r == 4 else list(range((t + 1) // r if r else 0))
        keys = np.concatenate([kv[max(0, t - c.window_size + 1):t + 1], res["comp"][pick]])
        out.append(_out_row(attend_row(q[t], keys, p["attn_sink"], c.head_dim), t, p, c, cos,
                            sin))
    res["out"] = np.array(out)
    return res


# ---------------------------------------------------------------------------------------------
# Comparing a result with the oracle's (the bounds are each test's).


def ulp(m):
    """The bf16 ulp at magnitude ``m > 0``."""
    return 2.0 ** (np.floor(np.log2(m)) - 7)


def out_error(got, want):
    """``(max, mean, fraction >= 1)`` of the error of ``got [n, dim]`` in bf16 ulps of each
    row's largest ``|want|``."""
    err = np.abs(np.asarray(got, np.float64) - want) / ulp(np.abs(want).max(axis=-1,
                                                                           keepdims=True))
    return err.max(), err.mean(), (err >= 1).mean()


def picks_score_as_the_oracle(topk, want_scores, want_picks, index_topk):
    """Per row ``t`` of ``topk i32[n, k]`` (a sequence's picks, ``-1`` after): whether the
    oracle's scores of the picks, sorted, equal the oracle's top-k scores within one ulp of the
    row's best (ties at a bf16 score are common), and whether the sets are identical. Returns
    ``(ok bool[n], same bool[n])``; the number of picks must be the visible entries up to
    ``index_topk``."""
    ok, same = [], []
    for t, row in enumerate(topk):
        pick = row[row >= 0]
        mine, ref = np.sort(want_scores[t, pick]), np.sort(want_scores[t, want_picks[t]])
        assert len(mine) == len(ref) == min(index_topk, (t + 1) // 4), t
        ok.append(not len(ref) or bool(np.all(np.abs(mine - ref)
                                              <= ulp(np.abs(ref).max()))))
        same.append(set(pick) == set(want_picks[t]))
    return np.array(ok, bool), np.array(same, bool)


def same_selection_by_score(topk, want_scores, want_picks, index_topk):
    """``picks_score_as_the_oracle`` on every row (a failing row's scores shown); returns the
    number of rows whose sets are identical."""
    ok, same = picks_score_as_the_oracle(topk, want_scores, want_picks, index_topk)
    for t in np.flatnonzero(~ok):
        row = topk[t]
        np.testing.assert_allclose(np.sort(want_scores[t, row[row >= 0]]),
                                   np.sort(want_scores[t, want_picks[t]]), rtol=0,
                                   atol=ulp(np.abs(want_scores[t, want_picks[t]]).max()),
                                   err_msg=f"row {t}")
    return int(same.sum())
