"""Accuracy of the fp8 caches vs bf16, measured against float64 on synthetic decode batches.

Issue 10 item 6. DeepSeek-V3.2 dims: indexer H=64 heads, D=128, page 64, k=2048; sparse MLA
latent 576 (512 nope + 64 rope), v_dim 512, H=128 heads. Every row is a decode row (one query
token per sequence, its whole context causal), so each row's candidates are all ``L`` tokens.

1. Indexer top-k. Per row the selection (``streamindex_topk_ref``, ``exact=True``) with:

   - ``f32 / f32``: the original f32 keys and q (the harness floor: f32 arithmetic only);
   - ``bf16 / bf16``: keys and q cast to bf16 (the baseline);
   - ``fp8 / bf16``: keys in ``quantize_index_cache`` (ue8m0 scales, one per token), q bf16;
   - ``fp8 / fp8``: fp8 keys and q quantized per (token, head) by ``quantize_fp8`` (ue8m0),
     its scale folded into the head weights (``w' = w * q_scale``), as the model does.

   The head weights stay f32 in every variant. Truth: the float64 scores of the ORIGINAL f32 q,
   weights and keys, ``sum_h w_h relu(q_h . k)``, computed here in NumPy. Metrics per row:
   ``ties forgiven`` = share of the selected tokens whose true score is ``>=`` the row's k-th
   largest true score (a selection that swaps tokens tied at the threshold loses nothing);
   ``plain vs f64`` = ``|A & T| / k`` with ``T`` the f64 top-k set (stable order on ties);
   ``plain vs bf16`` = ``|A & B| / k`` with ``B`` the bf16 selection; ``worst rank`` = the
   largest 1-based true rank of any selected token over all rows (``k`` when every selection
   is exact); ``max shortfall`` = the largest ``(threshold - true score of a selected token)``
   over all rows, in units of that row's true-score standard deviation (0 when exact). Also
   ``keys rel RMS``: the RMS over key tokens of ``||stored - k|| / ||k||`` for that key format.

2. Sparse MLA (``sparse_mla_ref``) over a fixed selection, the f64 top-k of step 1, with the
   latent cache stored as ``f32`` (harness floor), ``bf16`` (a plain bf16 cache) and ``fp8``
   (``quantize_latent_cache``: 4 power-of-two scales per token, rope kept in bf16). q is the
   same for all three: drawn in f32 and rounded to bf16, passed as f32 holding those bf16 values
   (the reference upcasts q to f32 anyway; passing bf16 would also round the OUTPUT to bf16,
   which is not a property of the cache). Truth: float64 attention (NumPy, here) of that q
   over the ORIGINAL f32 latent rows. Relative error per row: ``||out - out64||_F /
   ||out64||_F`` over ``[H, v_dim]``; mean and max over rows. Also fp8 vs bf16 directly, the
   cache's own per-token relative RMS error over the selected rows (as for the keys) and
   ``logit sd``, the f64 logits' standard deviation over the selected tokens (mean over rows
   and heads). sm_scale: 576**-0.5 and DeepSeek-V3.2's 0.1352 (192**-0.5 * mscale**2).

Synthetic draws (``--dists``; one "vector" = a key token, a latent token, or one (token, head)
query vector; weights are N(0, 1) per (token, head) in every distribution):

- ``normal``: every element iid N(0, 1);
- ``scaled``: N(0, 1) elements times a per-vector magnitude ``exp(N(0, 1))`` (lognormal,
  sigma 1: per-token scaling matters when token magnitudes vary);
- ``heavy``: Student-t (3 dof, rescaled to unit variance) elements times the same per-vector
  lognormal magnitude (outliers inside a vector set its fp8 scale).

Random keys and queries have no structure: indexer scores crowd around the top-k threshold
(no gap between "relevant" and "irrelevant" tokens), which is the hard case for overlap. Not
model quality.

Full run: contexts 4096, 16384, 65536 x 8 decode rows x 3 draws (about 2.5 minutes and 5 GB
on a 2-core CPU); ``--quick``: 2 rows x 2048 tokens, k=256, 8 MLA heads (seconds).

Usage: ``python -m scripts.experiments.fp8_accuracy [--quick] [--out DIR] [--seed N] [--seqs N]
[--contexts L ...] [--dists NAME ...]``. Prints markdown tables; with ``--out`` also writes
``DIR/fp8_accuracy.md`` and ``DIR/fp8_accuracy.json``. ``main(argv)`` returns the result dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from reference import sparse_mla_ref, streamindex_topk_ref  # noqa: E402
from reference.fp8 import quantize_fp8  # noqa: E402
from reference.fp8_cache import (  # noqa: E402
    dequantize_index_cache,
    dequantize_latent_words,
    quantize_index_cache,
    quantize_latent_cache,
)
from reference.synthetic import make_ragged_batch  # noqa: E402

SM_SCALE_V32 = 192**-0.5 * (0.1 * np.log(40) + 1.0) ** 2  # DeepSeek-V3.2 (about 0.1352)
LATENT_DIM = 576
INDEX_DIM = 128
DISTRIBUTIONS = {
    "normal": "iid N(0,1) elements",
    "scaled": "iid N(0,1) elements x per-vector exp(N(0,1)) magnitude",
    "heavy": "iid Student-t(3)/sqrt(3) elements x per-vector exp(N(0,1)) magnitude",
}
INDEX_VARIANTS = (("f32", "f32"), ("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8"))
LATENT_CACHES = ("f32", "bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class Config:
    """One run: every (distribution, context) cell gets ``seqs`` decode rows."""

    contexts: tuple[int, ...] = (4096, 16384, 65536)
    seqs: int = 8
    dists: tuple[str, ...] = ("normal", "scaled", "heavy")
    index_heads: int = 64
    page_size: int = 64
    k: int = 2048
    mla_heads: int = 128
    v_dim: int = 512
    sm_scales: tuple[float, ...] = (LATENT_DIM**-0.5, SM_SCALE_V32)
    heavy_df: float = 3.0
    log_sigma: float = 1.0
    seed: int = 0


def full_config() -> Config:
    return Config()


def quick_config() -> Config:
    """Seconds: 2 sequences x 2048 tokens, k=256, 8 MLA heads."""
    return Config(contexts=(2048,), seqs=2, k=256, mla_heads=8)


# --------------------------------------------------------------------------------------------
# Synthetic draws
# --------------------------------------------------------------------------------------------


def draw(rng: np.random.Generator, shape, dist: str, cfg: Config) -> np.ndarray:
    """f32 samples of ``shape``; the per-vector magnitude is shared along the last axis.
    Student-t is drawn from its definition, ``z / sqrt(chi2_df / df)``."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if dist == "normal":
        return x
    if dist == "heavy":
        df = cfg.heavy_df
        chi2 = 2.0 * rng.standard_gamma(df / 2.0, shape, dtype=np.float32)
        x *= np.sqrt(np.float32((df - 2.0) / df) / (chi2 / np.float32(df)))
    elif dist != "scaled":
        raise ValueError(f"unknown distribution {dist!r}; known: {sorted(DISTRIBUTIONS)}")
    x *= np.exp(cfg.log_sigma * rng.standard_normal((*shape[:-1], 1), dtype=np.float32))
    return x


def fill_cache(rng, live: np.ndarray, dim: int, dist: str, cfg: Config) -> np.ndarray:
    """``f32[P, ps, dim]``: draws from ``dist`` where ``live[P, ps]``, NaN elsewhere (a stray
    read would show). Drawn in chunks of pages to bound the temporaries."""
    cache = np.full((*live.shape, dim), np.nan, np.float32)
    step = max(1, (1 << 16) // live.shape[1])
    for p0 in range(0, live.shape[0], step):
        m = live[p0:p0 + step]
        cache[p0:p0 + step][m] = draw(rng, (int(m.sum()), dim), dist, cfg)
    return cache


def decode_batch(rng, cfg: Config, context: int, heads: int, dim: int, dist: str):
    """A decode batch (``cfg.seqs`` rows, each at ``context``): the page table and N(0,1)
    weights of ``make_ragged_batch``, cache rows and q drawn from ``dist``."""
    b = make_ragged_batch(rng, q_lens=[1] * cfg.seqs, kv_lens=[context] * cfg.seqs,
                          page_size=cfg.page_size, pages_per_seq=-(-context // cfg.page_size),
                          num_heads=heads, dim=1)  # dim 1: only its layout and weights are used
    cache = fill_cache(rng, np.isfinite(b.cache[..., 0]), dim, dist, cfg)
    return dataclasses.replace(b, q=draw(rng, (cfg.seqs, heads, dim), dist, cfg), cache=cache)


def seq_rows(b, seq: int, context: int) -> np.ndarray:
    """f64[context, D]: sequence ``seq``'s cache rows in token order (from its page list)."""
    dim = b.cache.shape[-1]
    return b.cache[b.seq_pages[seq]].reshape(-1, dim)[:context].astype(np.float64)


def token_slots(b, seq: int, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(page ids, offsets)`` of sequence ``seq``'s token offsets ``tokens``."""
    ps = b.page_size
    return b.seq_pages[seq][tokens // ps], tokens % ps


def bf16_values(x) -> np.ndarray:
    """f32 array holding ``x`` rounded to bf16 (RNE)."""
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def stored_rel_rms(stored, original: np.ndarray) -> float:
    """RMS over rows of ``||stored - x|| / ||x||`` (``[N, D]`` arrays): the relative error a
    cache format puts on one token's vector."""
    x = np.asarray(original, np.float32)
    d = np.asarray(stored, np.float32) - x
    num = np.einsum("nd,nd->n", d, d, dtype=np.float64)
    return float(np.sqrt(np.mean(num / np.einsum("nd,nd->n", x, x, dtype=np.float64))))


# --------------------------------------------------------------------------------------------
# 1. Indexer top-k overlap
# --------------------------------------------------------------------------------------------


def true_scores(b, context: int) -> np.ndarray:
    """f64[S, L]: ``sum_h w_h relu(q_h . k_s)`` of each decode row over its whole context."""
    q = b.q.astype(np.float64)
    w = b.weights.astype(np.float64)
    out = np.empty((q.shape[0], context))
    for i in range(q.shape[0]):
        out[i] = w[i] @ np.maximum(q[i] @ seq_rows(b, i, context).T, 0.0)
    return out


def index_selections(b, cfg: Config) -> dict:
    """``{(keys, q): i32[S, k]}`` for every ``INDEX_VARIANTS`` entry."""
    meta = [jnp.asarray(x) for x in b.meta()]
    kw = dict(k=cfg.k, pages_per_seq=b.pages_per_seq, one_token_per_seq=True, exact=True)
    q32, w, cache32 = jnp.asarray(b.q), jnp.asarray(b.weights), jnp.asarray(b.cache)
    q16, cache16 = q32.astype(jnp.bfloat16), cache32.astype(jnp.bfloat16)
    fp8_cache = quantize_index_cache(cache32)
    q8, q_scale = quantize_fp8(q32, block_size=INDEX_DIM)
    args = {("f32", "f32"): (q32, w, cache32), ("bf16", "bf16"): (q16, w, cache16),
            ("fp8", "bf16"): (q16, w, fp8_cache), ("fp8", "fp8"): (q8, w * q_scale[..., 0],
                                                                   fp8_cache)}
    return {v: np.asarray(streamindex_topk_ref(*args[v], *meta, **kw)) for v in INDEX_VARIANTS}


def overlap_metrics(sel: np.ndarray, scores: np.ndarray, k: int, ref=None) -> dict:
    """Per-row metrics of ``sel i32[S, k]`` against ``scores f64[S, L]`` (module docstring);
    ``ref`` (another selection) adds the plain overlap with it."""
    forgiven, plain, vs_ref, worst, short = [], [], [], 0, 0.0
    for r, row in enumerate(sel):
        s = scores[r]
        n = min(k, s.size)
        order = np.argsort(-s, kind="stable")
        rank = np.empty(s.size, np.int64)
        rank[order] = np.arange(1, s.size + 1)
        chosen = row[row >= 0]
        if chosen.size != n or np.unique(chosen).size != n:
            raise AssertionError(f"row {r}: expected {n} distinct selected tokens, got {row}")
        thr = s[order[n - 1]]
        forgiven.append(float(np.sum(s[chosen] >= thr)) / n)
        plain.append(np.intersect1d(chosen, order[:n]).size / n)
        worst = max(worst, int(rank[chosen].max()))
        short = max(short, float(thr - s[chosen].min()) / float(s.std()))
        if ref is not None:
            vs_ref.append(np.intersect1d(chosen, ref[r][ref[r] >= 0]).size / n)
    out = {"forgiven_vs_f64_mean": float(np.mean(forgiven)),
           "forgiven_vs_f64_min": float(np.min(forgiven)),
           "plain_vs_f64_mean": float(np.mean(plain)), "plain_vs_f64_min": float(np.min(plain)),
           "worst_true_rank": worst, "max_shortfall_sd": short}
    if ref is not None:
        out["plain_vs_bf16_mean"] = float(np.mean(vs_ref))
        out["plain_vs_bf16_min"] = float(np.min(vs_ref))
    return out


def indexer_cell(cfg: Config, dist: str, context: int):
    """Records of one (distribution, context) cell, and the f64 top-k (for step 2)."""
    rng = np.random.default_rng([cfg.seed, list(DISTRIBUTIONS).index(dist), context, 0])
    b = decode_batch(rng, cfg, context, cfg.index_heads, INDEX_DIM, dist)
    scores = true_scores(b, context)
    sels = index_selections(b, cfg)
    bf16 = sels[("bf16", "bf16")]
    cache32 = jnp.asarray(b.cache)
    live = np.isfinite(b.cache[..., 0])
    keys = b.cache[live]
    key_err = {"f32": 0.0,
               "bf16": stored_rel_rms(bf16_values(cache32)[live], keys),
               "fp8": stored_rel_rms(np.asarray(dequantize_index_cache(
                   quantize_index_cache(cache32)))[live], keys)}
    records = []
    for keys, q in INDEX_VARIANTS:
        ref = None if (keys, q) in (("bf16", "bf16"), ("f32", "f32")) else bf16
        m = overlap_metrics(sels[(keys, q)], scores, cfg.k, ref)
        records.append({"distribution": dist, "context": context, "rows": cfg.seqs,
                        "keys": keys, "q": q, "keys_rel_rms": key_err[keys], **m})
    truth = np.argsort(-scores, axis=1, kind="stable")[:, :cfg.k].astype(np.int32)
    return records, truth


# --------------------------------------------------------------------------------------------
# 2. Sparse MLA relative error
# --------------------------------------------------------------------------------------------


def mla_f64(q: np.ndarray, rows: np.ndarray, sm_scale: float, v_dim: int):
    """``(out f64[H, v_dim], logit_sd f64[H])``: ``softmax(sm_scale q . c) @ c[:, :v_dim]`` over
    the rows ``c f64[n, 576]``, and each head's standard deviation of its logits over them."""
    logits = sm_scale * (q.astype(np.float64) @ rows.T)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ rows[:, :v_dim], logits.std(axis=-1)


def rel_err(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row ``||out - ref||_F / ||ref||_F`` over ``[H, v_dim]``."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    num = np.sqrt(np.sum((out - ref) ** 2, axis=(1, 2)))
    return num / np.sqrt(np.sum(ref**2, axis=(1, 2)))


def mla_cell(cfg: Config, dist: str, context: int, selection: np.ndarray) -> list[dict]:
    rng = np.random.default_rng([cfg.seed, list(DISTRIBUTIONS).index(dist), context, 1])
    b = decode_batch(rng, cfg, context, cfg.mla_heads, LATENT_DIM, dist)
    q = bf16_values(b.q)  # bf16 values, f32 dtype: the output is not rounded to bf16
    meta = [jnp.asarray(x) for x in b.meta()]
    cache32 = jnp.asarray(b.cache)
    caches = {"f32": cache32, "bf16": cache32.astype(jnp.bfloat16),
              "fp8": quantize_latent_cache(cache32)}
    sel = jnp.asarray(selection)
    # The selected rows of every sequence, [S * k, 576]: the f64 oracle's input (original f32
    # values) and, stored, the cache error over exactly the rows the attention reads.
    pages, offs = (np.concatenate(a) for a in zip(
        *(token_slots(b, i, selection[i]) for i in range(cfg.seqs)), strict=True))
    rows = b.cache[pages, offs]
    cache_err = {"f32": 0.0,
                 "bf16": stored_rel_rms(caches["bf16"][pages, offs], rows),
                 "fp8": stored_rel_rms(dequantize_latent_words(caches["fp8"].words[pages, offs]),
                                       rows)}
    rows = rows.astype(np.float64).reshape(cfg.seqs, cfg.k, LATENT_DIM)
    records = []
    for sm in cfg.sm_scales:
        kw = dict(sm_scale=float(sm), pages_per_seq=b.pages_per_seq, v_dim=cfg.v_dim)
        outs = {c: np.asarray(sparse_mla_ref(jnp.asarray(q), caches[c], meta[0], sel, *meta[1:],
                                             **kw)) for c in LATENT_CACHES}
        ref = [mla_f64(q[i], rows[i], sm, cfg.v_dim) for i in range(cfg.seqs)]
        truth = np.stack([o for o, _ in ref])
        logit_sd = float(np.mean([sd for _, sd in ref]))
        for c in LATENT_CACHES:
            e64 = rel_err(outs[c], truth)
            rec = {"distribution": dist, "context": context, "rows": cfg.seqs,
                   "sm_scale": float(sm), "logit_sd": logit_sd, "cache": c,
                   "cache_rel_rms": cache_err[c],
                   "rel_err_vs_f64_mean": float(e64.mean()),
                   "rel_err_vs_f64_max": float(e64.max())}
            if c == "fp8":
                e16 = rel_err(outs[c], outs["bf16"])
                rec["rel_err_vs_bf16_mean"] = float(e16.mean())
                rec["rel_err_vs_bf16_max"] = float(e16.max())
            records.append(rec)
    return records


# --------------------------------------------------------------------------------------------
# Driver and tables
# --------------------------------------------------------------------------------------------


def run_experiment(cfg: Config, log=None) -> dict:
    """Every (distribution, context) cell; returns ``{"what", "config", "distributions",
    "indexer", "mla", "seconds"}``."""
    for c in cfg.contexts:
        if c < cfg.k:
            raise ValueError(f"context {c} < k={cfg.k}: every row must have k candidates")
    log = log or (lambda msg: print(msg, flush=True))
    t0 = time.perf_counter()
    indexer, mla = [], []
    for dist in cfg.dists:
        for context in cfg.contexts:
            t = time.perf_counter()
            recs, truth = indexer_cell(cfg, dist, context)
            indexer += recs
            mla += mla_cell(cfg, dist, context, truth)
            log(f"  {dist} @ {context}: {time.perf_counter() - t:.1f}s")
    what = ("synthetic decode batches (random keys/queries/latents, see distributions); "
            "reference ops on CPU vs float64 NumPy; not model quality")
    return {"what": what, "config": dataclasses.asdict(cfg),
            "distributions": {d: DISTRIBUTIONS[d] for d in cfg.dists},
            "indexer": indexer, "mla": mla, "seconds": time.perf_counter() - t0,
            "backend": jax.default_backend()}


def _f(x, digits=4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _mm(r: dict, a: str, b: str, digits=4, fmt="f") -> str:
    return f"{r[a]:.{digits}{fmt}} / {r[b]:.{digits}{fmt}}"


def summary_tables(result: dict) -> list[str]:
    """The compact view: one row per (distribution, context) for the indexer and per
    (distribution, context, sm_scale) for MLA; the f32 harness floor in one line."""
    idx = {(r["distribution"], r["context"], r["keys"], r["q"]): r for r in result["indexer"]}
    mla = {(r["distribution"], r["context"], r["sm_scale"], r["cache"]): r
           for r in result["mla"]}
    floor_overlap = min(r["forgiven_vs_f64_min"] for r in result["indexer"] if r["keys"] == "f32")
    floor_err = max(r["rel_err_vs_f64_max"] for r in result["mla"] if r["cache"] == "f32")
    same = all(r["forgiven_vs_f64_mean"] == r["plain_vs_f64_mean"] for r in result["indexer"])
    lines = [
        "Indexer: ties-forgiven overlap with the f64 top-k (mean / min over rows) for each "
        "keys / q format, plain overlap |A & B| / k with the bf16 / bf16 selection, and for "
        "fp8 / fp8 the worst f64 rank selected and its shortfall below the k-th f64 score (in "
        "row score sds). "
        + ("The plain overlap with the f64 top-k set equals the ties-forgiven one in every "
           "cell (continuous draws have no ties). " if same else "")
        + f"Harness floor, f32 keys and q: min overlap {floor_overlap:.4f}.",
        "",
        "| dist | L | rows | bf16/bf16 vs f64 | fp8/bf16 vs f64 | fp8/fp8 vs f64 | "
        "fp8/bf16 vs bf16 | fp8/fp8 vs bf16 | fp8/fp8 worst rank (shortfall) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = list(dict.fromkeys((r["distribution"], r["context"]) for r in result["indexer"]))
    for d, c in cells:
        b16, f8b, f88 = (idx[(d, c, *v)] for v in INDEX_VARIANTS[1:])
        fv = ("forgiven_vs_f64_mean", "forgiven_vs_f64_min")
        pv = ("plain_vs_bf16_mean", "plain_vs_bf16_min")
        lines.append(f"| {d} | {c} | {b16['rows']} | {_mm(b16, *fv)} | {_mm(f8b, *fv)} | "
                     f"{_mm(f88, *fv)} | {_mm(f8b, *pv)} | {_mm(f88, *pv)} | "
                     f"{f88['worst_true_rank']} ({f88['max_shortfall_sd']:.2f} sd) |")
    lines += [
        "",
        "Sparse MLA: relative error ||out - ref||_F / ||ref||_F per row, mean / max over rows; "
        "q bf16 values for every cache; `logit sd` = the f64 logits' sd over the selected "
        f"tokens. Harness floor, f32 cache vs f64: max {floor_err:.1e}.",
        "",
        "| dist | L | rows | sm_scale | logit sd | bf16 vs f64 | fp8 vs f64 | fp8 vs bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = list(dict.fromkeys((r["distribution"], r["context"], r["sm_scale"])
                               for r in result["mla"]))
    for d, c, sm in cells:
        b16, f8 = mla[(d, c, sm, "bf16")], mla[(d, c, sm, "fp8")]
        ev = ("rel_err_vs_f64_mean", "rel_err_vs_f64_max")
        lines.append(f"| {d} | {c} | {b16['rows']} | {sm:.4f} | {b16['logit_sd']:.2f} | "
                     f"{_mm(b16, *ev, 1, 'e')} | {_mm(f8, *ev, 1, 'e')} | "
                     f"{_mm(f8, 'rel_err_vs_bf16_mean', 'rel_err_vs_bf16_max', 1, 'e')} |")
    return lines


def markdown_table(result: dict) -> str:
    cfg = result["config"]
    rows = cfg["seqs"]
    ctxs = ", ".join(str(c) for c in cfg["contexts"])
    lines = [
        "# fp8 caches: accuracy vs bf16, against float64 (synthetic decode batches)",
        "",
        f"Seed {cfg['seed']}; {rows} decode rows per (distribution, context) cell; contexts "
        f"{ctxs}. Distributions (per vector = key token, latent token or (token, head) query): "
        + "; ".join(f"`{d}` = {t}" for d, t in result["distributions"].items())
        + ". Weights N(0,1). Not model quality.",
        "",
        "## Summary",
        "",
        *summary_tables(result),
        "",
        f"## Indexer top-k overlap (H={cfg['index_heads']}, D={INDEX_DIM}, page "
        f"{cfg['page_size']}, k={cfg['k']}, exact top-k)",
        "",
        "`forgiven`: share of selected tokens whose f64 score >= the row's k-th largest f64 "
        "score; `plain`: |A & B| / k against the f64 top-k set or the bf16/bf16 selection; "
        "mean / min over rows; `worst rank`: largest f64 rank selected (k = exact); `shortfall`: "
        "largest (k-th f64 score - f64 score of a selected token) over rows, in units of the "
        "row's f64 score sd; `key err`: RMS over tokens of ||stored key - key|| / ||key||.",
        "",
        "| dist | L | rows | keys / q | key err | forgiven vs f64 mean / min "
        "| plain vs f64 mean / min | plain vs bf16 mean / min | worst rank | shortfall (sd) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["indexer"]:
        vs16 = ("—" if "plain_vs_bf16_mean" not in r else
                f"{_f(r['plain_vs_bf16_mean'])} / {_f(r['plain_vs_bf16_min'])}")
        lines.append(
            f"| {r['distribution']} | {r['context']} | {r['rows']} | {r['keys']} / {r['q']} | "
            f"{r['keys_rel_rms']:.2e} | "
            f"{_f(r['forgiven_vs_f64_mean'])} / {_f(r['forgiven_vs_f64_min'])} | "
            f"{_f(r['plain_vs_f64_mean'])} / {_f(r['plain_vs_f64_min'])} | {vs16} | "
            f"{r['worst_true_rank']} | {r['max_shortfall_sd']:.3f} |")
    lines += [
        "",
        f"## Sparse MLA relative error (H={cfg['mla_heads']}, latent {LATENT_DIM} = 512 + 64 "
        f"rope, v_dim {cfg['v_dim']}, k={cfg['k']} = the f64 top-k of the indexer step)",
        "",
        "q: bf16 values (same for every cache). Error per row ||out - ref||_F / ||ref||_F over "
        "[H, v_dim]; ref = float64 attention over the original f32 latent (`vs f64`) or the "
        "bf16-cache output (`vs bf16`); mean / max over rows. `logit sd`: the f64 logits' "
        "standard deviation over the selected tokens, mean over rows and heads (how peaked the "
        "softmax is; a logit error of e changes a weight by a factor exp(e)); `cache err`: RMS "
        "over tokens of ||stored row - row|| / ||row||.",
        "",
        "| dist | L | rows | sm_scale | logit sd | cache | cache err | vs f64 mean | vs f64 max | "
        "vs bf16 mean | vs bf16 max |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["mla"]:
        lines.append(
            f"| {r['distribution']} | {r['context']} | {r['rows']} | {r['sm_scale']:.4f} | "
            f"{r['logit_sd']:.2f} | {r['cache']} | {r['cache_rel_rms']:.2e} | "
            f"{r['rel_err_vs_f64_mean']:.2e} | "
            f"{r['rel_err_vs_f64_max']:.2e} | "
            + (f"{r['rel_err_vs_bf16_mean']:.2e} | {r['rel_err_vs_bf16_max']:.2e} |"
               if "rel_err_vs_bf16_mean" in r else "— | — |"))
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "fp8_accuracy.md", "json": out / "fp8_accuracy.json"}
    paths["md"].write_text(markdown_table(result))
    paths["json"].write_text(json.dumps(result, indent=1))
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 sequences x 2048 tokens, k=256, 8 MLA heads (seconds)")
    p.add_argument("--out", default=None, help="write fp8_accuracy.md/.json here (default: "
                   "print only)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--seqs", type=int, default=None, help="decode rows per cell")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--dists", nargs="+", choices=sorted(DISTRIBUTIONS), default=None)
    a = p.parse_args(argv)
    cfg = quick_config() if a.quick else full_config()
    over = {"seed": a.seed, "seqs": a.seqs,
            "contexts": tuple(a.contexts) if a.contexts else None,
            "dists": tuple(a.dists) if a.dists else None}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in over.items() if v is not None})
    print(f"fp8 accuracy ({'quick' if a.quick else 'full'}): contexts {list(cfg.contexts)} x "
          f"{cfg.seqs} decode rows, k={cfg.k}, dists {list(cfg.dists)}, seed {cfg.seed}, on "
          f"{jax.default_backend()}", flush=True)
    result = run_experiment(cfg)
    print(markdown_table(result))
    msg = f"total {result['seconds']:.1f}s"
    if a.out:
        paths = write_outputs(result, Path(a.out))
        msg += "; wrote " + ", ".join(str(v) for v in paths.values())
    print(msg)
    return result


if __name__ == "__main__":
    main()
