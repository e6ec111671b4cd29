"""Segment witnesses on REAL attention (issue 12): a byte-level causal LM trained here on the
Python standard library's own sources, a lightning indexer distilled from its attention, and
the witness policies measured on held-out text, down to the model's bits per byte.

Pipeline (helpers in ``experiments/``, see their docstrings for every definition):

1. data (``experiments.data``): every stdlib ``*.py`` file shipped with this interpreter; held
   out iff ``crc32(relative path) % 10 == 0``; byte tokens.
2. LM (``experiments.model``): pre-norm causal transformer with RoPE, trained from scratch with
   the hand-written Adam for a fixed number of steps (or until ``--lm-seconds`` runs out; the
   tokens actually trained are recorded); checkpoint ``DIR/lm.npz``; held-out bits per byte.
3. Indexer: one lightning indexer per chosen layer (``reference.index_scores`` score), trained by
   KL(head-averaged dense attention || softmax of indexer scores over causal positions) with the
   LM frozen; checkpoint ``DIR/indexer.npz``.
4. Measurements (``experiments.measure``) on held-out windows, per chosen layer, per k and S:
   recall, coverage and bits per byte of indexer top-k, +witnesses (serving fill from slot
   ``k - S``), +witnesses over the lowest-scored slots, random and locality nulls, and the
   oracle top-k of the true attention.

Usage: ``python -m scripts.experiments.real_attention_experiment [--quick] --out DIR [--seed
N]``; ``--write-notebook`` regenerates ``scripts/experiments/real_attention_experiment.ipynb``
(which runs this script with the quick or the full settings and shows its tables and plots) and
exits. Writes ``DIR/real_attention.json``, ``DIR/real_attention.md``,
``DIR/recall_coverage_L<l>.png``, ``DIR/bits_per_byte_L<l>.png``, ``DIR/lm.npz`` and
``DIR/indexer.npz``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[2]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scripts.experiments.byte_lm import data as D  # noqa: E402
from scripts.experiments.byte_lm import measure as X  # noqa: E402
from scripts.experiments.byte_lm import model as M  # noqa: E402
from scripts.experiments.byte_lm import train as TR  # noqa: E402
from scripts.experiments.notebooks import setup_cells, write_notebook  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    lm: M.LMConfig = M.LMConfig(n_layers=4, d_model=128, n_heads=4, context=1024)
    indexer: M.IndexerConfig = M.IndexerConfig(heads=4, head_dim=32)
    layers: tuple[int, ...] = (1, 3)  # layers with an indexer (0-based)
    lm_steps: int = 400
    lm_batch: int = 4
    lm_lr: float = 3e-3
    lm_seconds: float = 780.0  # wall-clock cap of LM training (the steps done are recorded)
    idx_steps: int = 300
    idx_batch: int = 2
    idx_lr: float = 3e-3
    idx_seconds: float = 200.0
    eval_windows: int = 8
    ks: tuple[int, ...] = (32, 64, 128, 256, 512)
    segments: tuple[int, ...] = (4, 8, 16, 32, 64)
    max_files: int | None = None  # None: every stdlib file
    # Check the serving merge against indexer_topk(num_segments=S) in every (k, S) cell (one
    # compile each); False: in the first cell of each layer only.
    api_merge_every_cell: bool = True
    seed: int = 0


def full_config(seed: int = 0) -> Config:
    return Config(seed=seed)


def quick_config(seed: int = 0) -> Config:
    return Config(lm=M.LMConfig(n_layers=2, d_model=64, n_heads=4, context=256),
                  indexer=M.IndexerConfig(heads=4, head_dim=16), layers=(1,), lm_steps=30,
                  lm_batch=8, lm_seconds=8.0, idx_steps=12, idx_batch=4, idx_seconds=4.0,
                  eval_windows=4, ks=(32, 64), segments=(4, 16), max_files=200,
                  api_merge_every_cell=False, seed=seed)


def _save_npz(path: Path, tree) -> None:
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    np.savez(path, **flat)


def _window_means(values: np.ndarray, rows_ok: np.ndarray, n: int) -> np.ndarray:
    """Per-window means of per-row values over the rows in ``rows_ok`` (``[n * T]``)."""
    v = values.reshape(n, -1)
    ok = rows_ok.reshape(n, -1)
    return np.array([v[i][ok[i]].mean() for i in range(n)])


def measure_layer(lm_params, ip, windows, cfg: Config, layer: int, log=print) -> dict:
    """Every (k, S, selection) record of one layer, and its dense reference numbers."""
    n, t = windows.shape[0], windows.shape[1] - 1
    nll, aux = TR.eval_nll_aux(lm_params, jnp.asarray(windows), cfg.lm, layer)
    dense_bits = np.asarray(nll, np.float64) / np.log(2.0)
    h, attn = aux
    attn = np.asarray(attn, np.float64)
    q, w, keys = M.indexer_qwk(ip, h, cfg.indexer)
    args, pps = X.paged_args(q, w, keys)
    ctx = np.tile(np.arange(1, t + 1), n)
    attn_rows = attn.reshape(n * t, t)
    late = np.arange(t) >= max(cfg.ks)  # positions where every budget binds
    dense = {"bpb_all": float(dense_bits.mean()), "bpb_late": float(dense_bits[:, late].mean())}
    # Indexer held-out KL (the distillation objective) on these windows.
    dense["indexer_kl_nats"] = float(M.indexer_kl(ip, h, jnp.asarray(attn, jnp.float32),
                                                  cfg.indexer))
    rng = np.random.default_rng([cfg.seed, 99, layer])
    records, bits_cache = [], {}

    def bits_of(key, sel):
        if key not in bits_cache:
            b = X.restricted_bits(lm_params, windows, sel, cfg.lm, layer)
            bits_cache[key] = (float(b.mean()), float(b[:, late].mean()), b.mean(axis=1))
        return bits_cache[key]

    for k in cfg.ks:
        tk = time.perf_counter()
        base = X.base_selections(args, pps, attn, k, cfg.seed)
        rows_ok = ctx > k
        base_rec = {name: X.recall_rows(sel, attn_rows, ctx) for name, sel in base.items()}
        for s in cfg.segments:
            if s > k:
                continue
            via = cfg.api_merge_every_cell or (k, s) == (cfg.ks[0], cfg.segments[0])
            wit = X.witness_selections(args, pps, base["indexer"], ctx, k, s,
                                       via_indexer_topk=via)
            sels = {**base, **wit}
            for name in X.SELECTIONS:
                sel = sels[name]
                rec = base_rec[name] if name in base_rec else X.recall_rows(sel, attn_rows, ctx)
                cov = X.coverage_rows(sel, ctx, s)
                X.crosscheck(sel, attn_rows, ctx, s, rec, cov, rng)
                bud = X.budgets(sel, ctx)
                key = (name, k) if name in base else (name, k, s)
                bpb_all, bpb_late, bpb_win = bits_of(key, sel)
                records.append({
                    "layer": layer, "k": k, "S": s, "selection": name,
                    "recall": float(rec[rows_ok].mean()),
                    "coverage": float(cov[rows_ok].mean()),
                    "rows_full_coverage": float(np.mean(cov[rows_ok] == 1.0)),
                    "budget": sorted({int(x) for x in bud[rows_ok]}),
                    "budget_short_rows": sorted({int(x) for x in bud[~rows_ok]}) or [],
                    "rows": int(rows_ok.sum()),
                    "recall_per_window": _window_means(rec, rows_ok, n).tolist(),
                    "bpb_all": bpb_all, "bpb_late": bpb_late,
                    "bpb_per_window": bpb_win.tolist(),
                    # Rows whose reserved tail [k - S, k) is padding (context <= k - S): the
                    # seed's contract says the serving merge covers every segment there.
                    "coverage_padded_tail_rows": (float(cov[ctx <= k - s].mean())
                                                  if np.any(ctx <= k - s) else None),
                })
        log(f"    layer {layer} k={k}: {time.perf_counter() - tk:.1f}s")
    return {"dense": dense, "records": records}


def run(cfg: Config, out: Path, log=print) -> dict:
    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    corpus = D.load_corpus(max_files=cfg.max_files)
    log(f"  data: {corpus.describe()}")
    key = jax.random.PRNGKey(cfg.seed)
    params = M.init_lm(key, cfg.lm)
    n_params = M.param_count(params)
    log(f"  LM: {cfg.lm} ({n_params} parameters)")
    params, lm_info = TR.train_lm(params, corpus.train, cfg.lm, steps=cfg.lm_steps,
                                  batch=cfg.lm_batch, lr=cfg.lm_lr, seed=cfg.seed,
                                  max_seconds=cfg.lm_seconds, log=log)
    _save_npz(out / "lm.npz", params)
    windows = D.eval_windows(corpus.held_out, cfg.eval_windows, cfg.lm.context + 1, cfg.seed)
    dense_bits = TR.bits_per_byte(params, windows, cfg.lm)
    lm_info.update(parameters=n_params, held_out_bits_per_byte=float(dense_bits.mean()),
                   held_out_tokens_scored=int(dense_bits.size))
    log(f"  LM held-out bits/byte {dense_bits.mean():.3f} after {lm_info['tokens_trained']} "
        f"tokens ({lm_info['seconds']:.0f}s)")
    ips, idx_info = TR.train_indexers(params, corpus.train, cfg.lm, cfg.indexer, cfg.layers,
                                      steps=cfg.idx_steps, batch=cfg.idx_batch, lr=cfg.idx_lr,
                                      seed=cfg.seed, max_seconds=cfg.idx_seconds, log=log)
    idx_info["parameters_per_layer"] = M.param_count(next(iter(ips.values())))
    _save_npz(out / "indexer.npz", ips)
    layers, records = {}, []
    for layer in cfg.layers:
        t0 = time.perf_counter()
        res = measure_layer(params, ips[str(layer)], windows, cfg, layer, log=log)
        layers[str(layer)] = res["dense"]
        records += res["records"]
        log(f"  layer {layer} measured in {time.perf_counter() - t0:.0f}s; dense "
            f"{res['dense']}")
    result = {
        "what": "real attention of a byte-level LM trained here; held-out stdlib files",
        "config": dataclasses.asdict(cfg), "data": corpus.describe(), "lm": lm_info,
        "indexer": idx_info, "layers": layers, "records": records,
        "eval": {"windows": int(windows.shape[0]), "tokens_per_window": int(windows.shape[1]
                                                                             - 1),
                 "rows_metric": "query rows with context L = t + 1 > k"},
        "jax": jax.__version__, "platform": jax.default_backend(),
    }
    result["seconds"] = time.perf_counter() - t_start
    paths = write_outputs(result, out)
    result["seconds"] = time.perf_counter() - t_start
    (out / "real_attention.json").write_text(json.dumps(result, indent=1))
    log(f"  wrote {', '.join(str(p) for p in paths.values())} ({result['seconds']:.0f}s)")
    return result


# --------------------------------------------------------------------------------------------
# Tables, verdicts and plots
# --------------------------------------------------------------------------------------------

SHORT = {"indexer": "indexer", "indexer+wit_tail": "+wit tail", "indexer+wit_lowest":
         "+wit lowest", "random": "random", "local": "local", "oracle": "oracle"}
COLORS = {"indexer": "C0", "indexer+wit_tail": "C3", "indexer+wit_lowest": "C1",
          "random": "C7", "local": "C2", "oracle": "k"}
STYLES = {"indexer": "-o", "indexer+wit_tail": "-s", "indexer+wit_lowest": "-D",
          "random": "--^", "local": ":v", "oracle": "-."}


def paired(a: list, b: list) -> tuple[float, float]:
    """Mean and standard error of the per-window difference ``a - b``."""
    d = np.asarray(a) - np.asarray(b)
    se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("inf")
    return float(d.mean()), se


def verdict(by, layer, k, s, metric: str) -> str:
    """Which of indexer / +wit tail / +wit lowest is best in ``metric``, by paired per-window
    differences: "no difference" when every pairwise difference is within 2 standard errors."""
    names = ("indexer", "indexer+wit_tail", "indexer+wit_lowest")
    win_key = "recall_per_window" if metric == "recall" else "bpb_per_window"
    sign = 1.0 if metric == "recall" else -1.0  # recall: higher wins; bits: lower wins
    vals = {n: by[(layer, k, s, n)][win_key] for n in names}
    means = {n: sign * float(np.mean(v)) for n, v in vals.items()}
    best = max(names, key=lambda n: means[n])
    beaten = [n for n in names if n != best
              and abs(paired(vals[best], vals[n])[0]) > 2 * paired(vals[best], vals[n])[1]]
    if not beaten:
        return "no difference"
    return f"{SHORT[best]} > {', '.join(SHORT[n] for n in beaten)}"


def summary_table(result: dict, segments=(8, 32)) -> list[str]:
    """Compact table: per layer, k and S in ``segments`` (S <= k): recall, coverage and bits/byte
    minus dense (milli-bits per byte) of every selection."""
    cfg = result["config"]
    by = {(r["layer"], r["k"], r["S"], r["selection"]): r for r in result["records"]}
    names = X.SELECTIONS
    head = ("| layer | k | S | " + " | ".join(f"recall {SHORT[n]}" for n in names) + " | "
            + " | ".join(f"cov {SHORT[n]}" for n in names[:3]) + " | "
            + " | ".join(f"mbpb {SHORT[n]}" for n in names) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * len(names) + 3)]
    for layer in cfg["layers"]:
        dense = result["layers"][str(layer)]["bpb_all"]
        for k in cfg["ks"]:
            for s in segments:
                if (layer, k, s, "indexer") not in by:
                    continue
                rec = [f"{by[(layer, k, s, n)]['recall']:.3f}" for n in names]
                cov = [f"{by[(layer, k, s, n)]['coverage']:.3f}" for n in names[:3]]
                bpb = [f"{1000 * (by[(layer, k, s, n)]['bpb_all'] - dense):+.1f}" for n in names]
                lines.append(f"| {layer} | {k} | {s} | " + " | ".join(rec + cov + bpb) + " |")
    return lines


def markdown(result: dict) -> str:
    cfg, lm, ix = result["config"], result["lm"], result["indexer"]
    by = {(r["layer"], r["k"], r["S"], r["selection"]): r for r in result["records"]}
    d = result["data"]
    ev = result["eval"]
    lines = [
        "# Segment witnesses on real attention (byte-level LM trained here)",
        "",
        f"- Data: {d['train_files']} training / {d['held_out_files']} held-out stdlib files "
        f"({d['train_bytes']} / {d['held_out_bytes']} bytes, sha256 {d['sha256']}); split "
        f"{d['split']}.",
        f"- LM: {cfg['lm']['n_layers']} layers, d_model {cfg['lm']['d_model']}, "
        f"{cfg['lm']['n_heads']} heads, context {cfg['lm']['context']}, {lm['parameters']} "
        f"parameters; {lm['steps']} steps x {lm['batch']} windows = {lm['tokens_trained']} "
        f"tokens trained ({lm['seconds']:.0f}s); seed {cfg['seed']}. Held-out bits/byte "
        f"{lm['held_out_bits_per_byte']:.3f} over {lm['held_out_tokens_scored']} tokens "
        f"({ev['windows']} windows of {ev['tokens_per_window']}).",
        f"- Indexer per layer {cfg['layers']}: {cfg['indexer']['heads']} heads x dim "
        f"{cfg['indexer']['head_dim']} ({ix['parameters_per_layer']} parameters), "
        f"{ix['steps']} steps x {ix['batch']} windows ({ix['seconds']:.0f}s), LM frozen.",
        f"- Metrics on {ev['rows_metric']} (every selection: exactly k distinct valid tokens "
        "there); recall = share of the layer's head-averaged attention mass; coverage = share "
        "of the S segments met. bits/byte: the layer attends only to the selection (other "
        f"layers dense), all {ev['windows'] * ev['tokens_per_window']} held-out positions.",
        f"- Run time {result['seconds']:.0f}s on {result['platform']} (jax {result['jax']}).",
    ]
    lines += ["", "## Summary (S in {8, 32})", "",
              "recall: attention-mass recall; cov: segment coverage; mbpb: held-out bits per "
              "byte minus dense, x1000, with that layer restricted to the selection.", ""]
    lines += summary_table(result)
    for layer, dn in result["layers"].items():
        layer = int(layer)
        lines += ["", f"## Layer {layer}", "",
                  f"Dense: bits/byte {dn['bpb_all']:.4f} (positions >= {max(cfg['ks'])}: "
                  f"{dn['bpb_late']:.4f}); indexer held-out KL {dn['indexer_kl_nats']:.3f} "
                  "nats/row.", ""]
        for metric, label, fmt in (("recall", "attention-mass recall", "{:.3f}"),
                                   ("coverage", "segment coverage", "{:.3f}"),
                                   ("bpb_all", "held-out bits/byte (this layer restricted)",
                                    "{:.4f}")):
            lines += [f"### {label}", "",
                      "| k | S | " + " | ".join(SHORT[n] for n in X.SELECTIONS) +
                      (" | verdict (indexer vs +wit) |" if metric != "coverage" else " |"),
                      "|---|---|" + "---|" * len(X.SELECTIONS) +
                      ("---|" if metric != "coverage" else "")]
            for k in cfg["ks"]:
                for s in cfg["segments"]:
                    if (layer, k, s, "indexer") not in by:
                        continue
                    cells = [fmt.format(by[(layer, k, s, n)][metric]) for n in X.SELECTIONS]
                    row = f"| {k} | {s} | " + " | ".join(cells) + " |"
                    if metric != "coverage":
                        row += " " + verdict(by, layer, k, s,
                                             "recall" if metric == "recall" else "bpb") + " |"
                    lines.append(row)
            lines.append("")
    lines += ["Verdict: among indexer, +wit tail, +wit lowest, the best by mean; it beats the "
              "ones listed by more than 2 standard errors of the paired per-window difference; "
              "\"no difference\" when it beats none."]
    return "\n".join(lines) + "\n"


def plots(result: dict, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    by = {(r["layer"], r["k"], r["S"], r["selection"]): r for r in result["records"]}
    paths = {}
    label = (f"{cfg['lm']['n_layers']}L d{cfg['lm']['d_model']} ctx {cfg['lm']['context']}, "
             f"{result['lm']['tokens_trained']} tokens, seed {cfg['seed']}")
    for layer in cfg["layers"]:
        segs = cfg["segments"]
        fig, axes = plt.subplots(3, len(segs), figsize=(3.2 * len(segs), 8.5), squeeze=False)
        dn = result["layers"][str(layer)]
        for j, s in enumerate(segs):
            ks = [k for k in cfg["ks"] if (layer, k, s, "indexer") in by]
            for i, metric in enumerate(("recall", "coverage", "bpb_all")):
                ax = axes[i, j]
                for n in X.SELECTIONS:
                    ax.plot(ks, [by[(layer, k, s, n)][metric] for k in ks], STYLES[n],
                            color=COLORS[n], label=SHORT[n], ms=4)
                if metric == "bpb_all":
                    ax.axhline(dn["bpb_all"], color="m", lw=0.8, label="dense")
                ax.set_xscale("log", base=2)
                ax.set_title(f"S={s}", fontsize=9)
                if j == 0:
                    ax.set_ylabel({"recall": "attention-mass recall",
                                   "coverage": "segment coverage",
                                   "bpb_all": "held-out bits/byte"}[metric])
                if i == 2:
                    ax.set_xlabel("k")
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"Layer {layer}: real attention ({label})", fontsize=10)
        fig.tight_layout()
        p = out / f"recall_coverage_L{layer}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths[f"L{layer}"] = p
        # bits per byte per selection, one panel: the witness policies at the largest S <= k
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in X.SELECTIONS:
            ks, ys = [], []
            for k in cfg["ks"]:
                s = max(x for x in segs if x <= k)
                ks.append(k)
                ys.append(by[(layer, k, s, n)]["bpb_all"] - dn["bpb_all"])
            ax.plot(ks, ys, STYLES[n], color=COLORS[n], label=SHORT[n], ms=4)
        ax.axhline(0.0, color="m", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("k (witness policies at the largest S <= k)")
        ax.set_ylabel("bits/byte minus dense")
        ax.set_title(f"Layer {layer} restricted to each selection\n({label})", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"bits_per_byte_L{layer}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths[f"bpb_L{layer}"] = p
    return paths


def write_outputs(result: dict, out: Path) -> dict:
    md = out / "real_attention.md"
    md.write_text(markdown(result))
    js = out / "real_attention.json"
    js.write_text(json.dumps(result, indent=1))
    return {"md": md, "json": js, **plots(result, out)}


# --------------------------------------------------------------------------------------------
# Notebook
# --------------------------------------------------------------------------------------------

NOTEBOOK = Path(__file__).with_suffix(".ipynb")

_NB_INTRO = """\
# Segment witnesses on real attention: recall, coverage and bits per byte

Runs `scripts/experiments/real_attention_experiment.py` top to bottom and shows its table and
plots: a byte-level causal LM trained here on the Python standard library's own sources, one
lightning indexer per chosen layer distilled from that layer's attention (LM frozen), and, on
held-out files, every selection policy at the same budget of `k` tokens per query row.

**Size.** `RAE_SIZE=quick` (the default) uses the script's `--quick` settings (2-layer LM,
context 256, k in {32, 64}): about a minute on a CPU. `RAE_SIZE=full` uses the full settings
(4-layer LM, context 1024, k up to 512, about 13 minutes of LM training plus the indexers and
the measurements); meant for a Colab TPU/GPU runtime. Set the environment variable before
starting the kernel, or edit `SIZE` in the run cell. `RAE_OUT` names the output folder (default:
a fresh temporary folder). No downloads besides the optional clone/install in the install cell.
"""

_NB_SETUP = setup_cells("real_attention_experiment.py")

_NB_RUN = '''\
import os
import tempfile

# "quick": the script's --quick settings (CPU, about a minute); "full": the full run (Colab
# TPU/GPU). Set RAE_SIZE before starting the kernel, or edit this line.
SIZE = os.environ.get("RAE_SIZE", "quick")
if SIZE not in ("quick", "full"):
    raise ValueError(f"RAE_SIZE must be 'quick' or 'full', not {SIZE!r}")
OUT = Path(os.environ.get("RAE_OUT") or tempfile.mkdtemp(prefix="real_attention_"))
# The script pins JAX to the CPU unless JAX_PLATFORMS is set; the full run lets JAX pick the
# accelerator (this must happen before jax is first imported in this kernel).
if SIZE == "full":
    os.environ.setdefault("JAX_PLATFORMS", "")

from scripts.experiments import real_attention_experiment as rae  # noqa: E402

result = rae.main((["--quick"] if SIZE == "quick" else []) + ["--out", str(OUT)])
LAYERS = result["config"]["layers"]
print(f"{SIZE} run on {result['platform']} in {result['seconds']:.0f}s; outputs in {OUT}")
'''

_NB_TABLE = '''\
from IPython.display import Image, Markdown, display

display(Markdown((OUT / "real_attention.md").read_text()))
'''

_NB_PLOTS_RECALL = '''\
# Recall, coverage and held-out bits per byte vs k, one column per S, every policy.
for layer in LAYERS:
    display(Image(filename=str(OUT / f"recall_coverage_L{layer}.png")))
'''

_NB_PLOTS_BPB = '''\
# Held-out bits per byte minus dense, with that layer restricted to each selection.
for layer in LAYERS:
    display(Image(filename=str(OUT / f"bits_per_byte_L{layer}.png")))
'''

_NB_NOTES = """\
## Reading the plots

Every policy gets exactly `k` distinct valid tokens on each measured query row (context > `k`):

- **indexer**: the distilled indexer's top-k.
- **+wit tail**: the indexer's top-k with segment witnesses as served
  (`scatter_topology_witnesses`): witnesses fill slots `k - S` upward.
- **+wit lowest**: the same `w` witnesses written over the row's last `w` slots (padding
  first, then the lowest-scored indexer entries), the slots before them unchanged
  (`scatter_topology_witnesses(..., fill="lowest")`).
- **random** and **local**: nulls (`k` random causal tokens; the `k` most recent tokens).
- **oracle**: the top-k of the layer's true head-averaged attention, an upper bound on recall.

Recall is the share of the layer's attention mass the selection holds; coverage is the share of
the `S` segments it meets; bits per byte is the held-out loss with that one layer attending only
to the selection (other layers dense). The verdict columns of the table say whether the
differences among indexer, +wit tail and +wit lowest exceed two standard errors of the paired
per-window difference. The quick run is a small model on few windows: its numbers are a smoke
test of the pipeline, not a result.
"""


def build_notebook(path: Path = NOTEBOOK) -> Path:
    """Writes the notebook (no outputs; ``notebooks.write_notebook``)."""
    cells = [("markdown", _NB_INTRO), *_NB_SETUP, ("code", _NB_RUN),
             ("code", _NB_TABLE), ("code", _NB_PLOTS_RECALL), ("code", _NB_PLOTS_BPB),
             ("markdown", _NB_NOTES)]
    return write_notebook(path, cells, "real-attention")


# --------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and grid (~a minute)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (required)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-render the tables and plots of a saved real_attention.json")
    ap.add_argument("--write-notebook", action="store_true",
                    help=f"regenerate {NOTEBOOK.name} and exit")
    a = ap.parse_args(argv)
    if a.write_notebook:
        print(build_notebook())
        return {}
    if a.out is None:
        ap.error("--out is required")
    if a.from_json is not None:
        result = json.loads(a.from_json.read_text())
        a.out.mkdir(parents=True, exist_ok=True)
        write_outputs(result, a.out)
        return result
    cfg = quick_config(a.seed) if a.quick else full_config(a.seed)
    print(f"real attention experiment ({'quick' if a.quick else 'full'}) -> {a.out}")
    return run(cfg, a.out)


if __name__ == "__main__":
    main()
