"""Float64 NumPy oracle of the DeepSeek-V4 compressor, written from the definition
(``shared/SPEC.md``, "DeepSeek-V4 attention"): a whole sequence at once, one loop per group."""

from __future__ import annotations

import math

import numpy as np


def inv_freq(rope_dim, theta, factor, original_seq_len, beta_fast, beta_slow):
    """YaRN inverse frequencies in float64, from the official recipe's words."""
    base = theta ** (-np.arange(0, rope_dim, 2) / rope_dim)
    if original_seq_len <= 0:
        return base

    def correction_dim(rotations):
        return rope_dim * math.log(original_seq_len / (2 * math.pi * rotations)) / (
            2 * math.log(theta))

    lo = max(math.floor(correction_dim(beta_fast)), 0)
    hi = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i, f in enumerate(base):
        keep = 1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 1: unscaled, 0: f / factor
        out.append(f * keep + f / factor * (1.0 - keep))
    return np.array(out)


def compress_sequence(kv, score, ape, weight, cos, sin, *, ratio, eps=1e-6):
    """Entries ``f64[n // ratio, d]`` of one whole sequence ``kv, score [n, coff * d]``."""
    kv, score, ape = (np.asarray(x, np.float64) for x in (kv, score, ape))
    weight, cos, sin = (np.asarray(x, np.float64) for x in (weight, cos, sin))
    d = weight.shape[0]
    n = kv.shape[0]
    out = []
    for j in range(n // ratio):
        gates, vals = [], []
        if ratio == 4:  # previous group, first half; then this group, second half
            for k in range(4):
                q = 4 * (j - 1) + k
                if q >= 0:
                    gates.append(score[q, :d] + ape[k, :d])
                    vals.append(kv[q, :d])
            for k in range(4):
                q = 4 * j + k
                gates.append(score[q, d:] + ape[k, d:])
                vals.append(kv[q, d:])
        else:
            for k in range(ratio):
                q = ratio * j + k
                gates.append(score[q] + ape[k])
                vals.append(kv[q])
        g, v = np.array(gates), np.array(vals)
        w = np.exp(g - g.max(axis=0))
        w /= w.sum(axis=0)
        pooled = (w * v).sum(axis=0)
        normed = pooled / np.sqrt(np.mean(pooled ** 2) + eps) * weight
        rd = 2 * cos.shape[1]
        p = ratio * j
        head, tail = normed[:d - rd], normed[d - rd:].copy()
        a, b = tail[0::2].copy(), tail[1::2].copy()
        tail[0::2] = a * cos[p] - b * sin[p]
        tail[1::2] = a * sin[p] + b * cos[p]
        out.append(np.concatenate([head, tail]))
    return np.array(out).reshape(-1, d)


def ring_state(kv, score, ape, *, ratio, slot_kv=None, slot_score=None):
    """The state contract: row ``k`` holds the latest token ``t % R == k`` (kv, and score +
    ape[t % r] rounded to f32); rows without a token keep ``slot_kv`` / ``slot_score``."""
    coff = 2 if ratio == 4 else 1
    rows = coff * ratio
    n, width = kv.shape
    out_kv = np.zeros((rows, width), np.float32) if slot_kv is None else slot_kv.copy()
    out_score = (np.full((rows, width), -np.inf, np.float32) if slot_score is None
                 else slot_score.copy())
    for t in range(max(0, n - rows), n):
        out_kv[t % rows] = kv[t]
        out_score[t % rows] = (np.float64(score[t]) + ape[t % ratio]).astype(np.float32)
    return out_kv, out_score
