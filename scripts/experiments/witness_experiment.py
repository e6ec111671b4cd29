"""Segment-witness experiment: coverage and attention-mass recall at equal budget k.

Four selections of exactly ``k`` valid tokens per row over a context of ``L`` tokens:

- ``learned``: a learned top-k (a density rule: the ``k`` highest scores, descending);
- ``learned+witnesses``: ``scatter_topology_witnesses`` on that row (same width ``k``: the last
  ``S`` slots, i.e. the lowest-scored learned entries, are overwritten by the left edges of the
  segments the *whole* learned row misses);
- ``random_null``: ``k`` distinct tokens drawn uniformly from ``[0, L)`` (seeded per row);
- ``locality_null``: the last ``k`` tokens ``[L - k, L)``.

Metrics (``reference.witnesses``): ``segment_coverage`` (share of the ``S`` segments that hold a
selected token) and ``attention_mass_recall`` (share of a dense attention row's mass selected),
averaged over rows, on a grid of ``k`` and ``S`` (``S <= k``), for two sources:

(a) ``synthetic``: SYNTHETIC attention rows, ``softmax`` of logits with an attention sink (token
    0), a recency window (the last tokens, ramped) and scattered retrieval spikes (short runs at
    random positions) over Gaussian background. The "learned" top-k is the top-k of those logits
    plus Gaussian noise: a noisy density rule that can miss whole segments.
(b) ``indexer``: the jnp lightning indexer (``reference.streamindex_topk_ref``, decode rows) on
    RANDOM keys and queries. Learned top-k = the indexer's own top-k. The attention row is a
    PROXY: ``softmax(beta * z)`` of the row's standardised indexer scores ``z``; random keys have
    no positional structure at all.

Nothing here measures model quality: the attention rows are synthetic or a proxy, and the
numbers only say how the selections cover segments and mass on these rows.

Usage: ``python -m scripts.experiments.witness_experiment [--quick | --tiny] [--out DIR]
[--write-notebook]``
Writes ``DIR/witness.md``, ``DIR/witness.json`` and ``DIR/witness_<source>.png``;
``DIR/witness_synthetic.png`` is also copied to ``docs/witness_coverage.png`` (unless
``--no-docs``). ``--write-notebook`` regenerates ``scripts/experiments/witness_experiment.ipynb``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from reference import streamindex_topk_ref  # noqa: E402
from reference.index_scores import index_scores  # noqa: E402
from reference.synthetic import make_ragged_batch  # noqa: E402
from reference.witnesses import (  # noqa: E402
    attention_mass_recall,
    locality_null,
    random_null,
    scatter_topology_witnesses,
    segment_coverage,
    topology_witness_indices,
)
from scripts.experiments.notebooks import setup_cells, write_notebook  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SELECTIONS = ("learned", "learned+witnesses", "random_null", "locality_null")
SOURCES = ("synthetic", "indexer")
SOURCE_LABELS = {
    "synthetic": "(a) synthetic attention rows (sink + local window + spikes)",
    "indexer": "(b) jnp indexer on random keys; attention = softmax proxy of its scores",
}
COLORS = {"learned": "C0", "learned+witnesses": "C3", "random_null": "C7",
          "locality_null": "C2"}
STYLES = {"learned": "-o", "learned+witnesses": "-s", "random_null": "--^",
          "locality_null": ":v"}


@dataclasses.dataclass(frozen=True)
class Config:
    """One experiment grid. ``S > k`` cells are skipped (the serving merge would replace the
    whole row)."""

    context_len: int = 2048
    ks: tuple[int, ...] = (32, 64, 128, 256)
    segments: tuple[int, ...] = (8, 16, 32, 64)
    synthetic_rows: int = 64
    indexer_rows: int = 16
    # (a) synthetic attention rows
    background_std: float = 0.5
    sink_logit: float = 7.0
    window: int = 64
    window_logit: tuple[float, float] = (2.0, 4.0)  # ramp from oldest to newest token
    num_spikes: int = 6
    spike_width: tuple[int, int] = (1, 8)  # run length, inclusive range
    spike_logit: float = 5.0
    learned_noise_std: float = 1.0
    # (b) indexer on random keys
    heads: int = 8
    dim: int = 32
    page_size: int = 64
    proxy_beta: float = 2.0
    seed: int = 0


def quick_config() -> Config:
    return Config()


def full_config() -> Config:
    return Config(context_len=8192, ks=(64, 128, 256, 512, 1024, 2048),
                  segments=(8, 16, 32, 64), synthetic_rows=256, indexer_rows=64, window=256)


def tiny_config() -> Config:
    """Seconds: for tests and the notebook's smoke run."""
    return Config(context_len=256, ks=(16, 32), segments=(4, 8), synthetic_rows=8,
                  indexer_rows=4, window=16, page_size=32)


# --------------------------------------------------------------------------------------------
# Sources: (attention rows f64[R, L], learned top-k i32[R, k] for each k)
# --------------------------------------------------------------------------------------------


def synthetic_logits(cfg: Config, rng: np.random.Generator) -> np.ndarray:
    """f64[R, L] attention logits: background + sink + recency window + retrieval spikes."""
    rows, length = cfg.synthetic_rows, cfg.context_len
    logits = cfg.background_std * rng.standard_normal((rows, length))
    logits[:, 0] += cfg.sink_logit
    w = min(cfg.window, length)
    logits[:, length - w:] += np.linspace(*cfg.window_logit, w)[None, :]
    lo, hi = cfg.spike_width
    for r in range(rows):
        for _ in range(cfg.num_spikes):
            width = int(rng.integers(lo, hi + 1))
            start = int(rng.integers(1, max(length - w - width, 2)))
            logits[r, start:start + width] += cfg.spike_logit + 0.5 * rng.standard_normal()
    return logits


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """i32[R, k] column indices of the k highest scores, descending (ties: lowest index)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    return order[:, :k].astype(np.int32)


def synthetic_source(cfg: Config):
    """(a): attention rows and a noisy learned top-k per k (``top-k(logits + noise)``)."""
    rng = np.random.default_rng([cfg.seed, 1])
    logits = synthetic_logits(cfg, rng)
    noisy = logits + cfg.learned_noise_std * rng.standard_normal(logits.shape)
    learned = {k: topk_desc(noisy, k) for k in cfg.ks}
    return softmax_rows(logits), learned, {}


def indexer_batch(cfg: Config):
    rng = np.random.default_rng([cfg.seed, 2])
    pages = -(-cfg.context_len // cfg.page_size)
    return make_ragged_batch(rng, q_lens=[1] * cfg.indexer_rows,
                             kv_lens=[cfg.context_len] * cfg.indexer_rows,
                             page_size=cfg.page_size, pages_per_seq=pages,
                             num_heads=cfg.heads, dim=cfg.dim, fill=0.0)


def indexer_source(cfg: Config):
    """(b): the reference indexer's top-k per k; attention = softmax proxy of its raw scores.

    Also returns ``topk_agreement``: the mean share of the indexer's top-k that lies in the
    exact top-k of ``index_scores`` (a consistency check of the proxy, 1.0 when they agree)."""
    b = indexer_batch(cfg)
    length = cfg.context_len
    scores = np.zeros((cfg.indexer_rows, length), np.float64)
    for i, pages in enumerate(b.seq_pages):
        keys = b.cache[pages].reshape(-1, cfg.dim)[:length]
        s = index_scores(jnp.asarray(b.q[i:i + 1]), jnp.asarray(b.weights[i:i + 1]),
                         jnp.asarray(keys))
        scores[i] = np.asarray(s[0], np.float64)
    args = [jnp.asarray(x) for x in b.args()]
    learned, agree = {}, {}
    for k in cfg.ks:
        idx = streamindex_topk_ref(*args, k=k, pages_per_seq=b.pages_per_seq,
                                   one_token_per_seq=True)
        learned[k] = np.asarray(idx, np.int32)
        exact = topk_desc(scores, k)
        agree[k] = float(np.mean([len(np.intersect1d(a, e)) / k
                                  for a, e in zip(learned[k], exact, strict=True)]))
    z = (scores - scores.mean(axis=1, keepdims=True)) / scores.std(axis=1, keepdims=True)
    return softmax_rows(cfg.proxy_beta * z), learned, {"topk_agreement": agree}


# --------------------------------------------------------------------------------------------
# Selections and metrics
# --------------------------------------------------------------------------------------------


def selections(learned: np.ndarray, context_len: int, num_segments: int, seed: int):
    """The four selections (``{name: i32[R, k]}``) at the budget ``k = learned.shape[1]``."""
    rows, k = learned.shape
    ctx = jnp.full((rows,), context_len, jnp.int32)
    merged = np.asarray(scatter_topology_witnesses(jnp.asarray(learned), ctx, num_segments))
    rand = np.stack([random_null(context_len, k, seed + r) for r in range(rows)])
    local = np.stack([locality_null(context_len, k)] * rows)
    return {"learned": learned, "learned+witnesses": merged, "random_null": rand,
            "locality_null": local}


def witnesses_at_row_end(learned: np.ndarray, context_len: int, num_segments: int):
    """Counterfactual merge for comparison only: the policy's witnesses (ascending) written into
    the last ``m`` slots of each row (``m`` = its witness count), i.e. over the ``m``
    lowest-scored learned entries rather than from slot ``k - S`` onwards."""
    ctx = jnp.full((learned.shape[0],), context_len, jnp.int32)
    wit = np.asarray(topology_witness_indices(jnp.asarray(learned), ctx, num_segments))
    out = learned.copy()
    for r, w in enumerate(wit):
        w = w[w >= 0]
        if w.size:
            out[r, out.shape[1] - w.size:] = w
    return out


def valid_budget(row: np.ndarray, context_len: int) -> int:
    """Number of valid output slots: distinct entries inside ``[0, L)``."""
    return int(np.unique(row[(row >= 0) & (row < context_len)]).size)


def evaluate(source: str, attn: np.ndarray, learned: dict, cfg: Config) -> list[dict]:
    """One record per (k, S, selection): row means of coverage and recall, and the budget."""
    length = attn.shape[1]
    records = []
    for k in cfg.ks:
        recall_cache = {}
        for s in cfg.segments:
            if s > k:
                continue
            sel = selections(learned[k], length, s, cfg.seed)
            for name, rows in sel.items():
                cov = np.array([segment_coverage(r, length, s) for r in rows])
                # Only the merged row depends on S; the others' recall is computed once per k.
                if name == "learned+witnesses" or name not in recall_cache:
                    recall_cache[name] = np.array(
                        [attention_mass_recall(r, a) for r, a in zip(rows, attn, strict=True)])
                rec = recall_cache[name]
                budgets = {valid_budget(r, length) for r in rows}
                rec_d = {"source": source, "k": k, "S": s, "selection": name,
                         "coverage": float(cov.mean()), "recall": float(rec.mean()),
                         "budget": sorted(budgets), "rows": int(rows.shape[0]),
                         "rows_full_coverage": float(np.mean(cov == 1.0))}
                if name == "learned+witnesses":
                    changed = rows[:, k - s:] != learned[k][:, k - s:]
                    rec_d["witness_slots"] = float(changed.sum(axis=1).mean())
                    # The source's caveat: a segment whose sole learned token sat in an
                    # overwritten slot ends up uncovered (coverage < 1 although S <= k).
                    rec_d["rows_uncovered_by_merge"] = float(np.mean(cov < 1.0))
                    # Counterfactual (not the policy): the same witnesses written into the
                    # lowest-scored slots (row end) instead of from slot k - S onwards.
                    end = witnesses_at_row_end(learned[k], length, s)
                    rec_d["coverage_at_row_end"] = float(np.mean(
                        [segment_coverage(r, length, s) for r in end]))
                    rec_d["recall_at_row_end"] = float(np.mean(
                        [attention_mass_recall(r, a) for r, a in zip(end, attn, strict=True)]))
                records.append(rec_d)
    return records


def run_experiment(cfg: Config, sources=SOURCES, log=print) -> dict:
    """Runs the grid; returns ``{"config", "records", "extra", "seconds"}``."""
    t0 = time.perf_counter()
    builders = {"synthetic": synthetic_source, "indexer": indexer_source}
    records, extra = [], {}
    for src in sources:
        t = time.perf_counter()
        attn, learned, info = builders[src](cfg)
        records += evaluate(src, attn, learned, cfg)
        extra[src] = {str(k): v for k, v in info.items()}
        log(f"  {src}: {time.perf_counter() - t:.1f}s")
    what = ("simulation on synthetic attention rows (a) and on a softmax proxy of the jnp "
            "indexer's scores on random keys (b); not model quality")
    return {"what": what, "config": dataclasses.asdict(cfg), "records": records, "extra": extra,
            "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------------
# Tables and plots
# --------------------------------------------------------------------------------------------

_SHORT = {"learned": "learned", "learned+witnesses": "+wit", "random_null": "random",
          "locality_null": "local"}


def markdown_table(result: dict) -> str:
    """One table per source: coverage and recall of the four selections for each (k, S)."""
    cfg = result["config"]
    by = {(r["source"], r["k"], r["S"], r["selection"]): r for r in result["records"]}
    lines = [
        "# Segment witnesses at equal budget k (synthetic / proxy measurements)",
        "",
        f"Context L = {cfg['context_len']}; row means; every selection has exactly k valid "
        "slots. Coverage = share of the S segments holding a selected token; recall = share "
        "of the attention row's mass selected. Not model quality: the attention rows are "
        "synthetic (a) or a softmax proxy of indexer scores on random keys (b).",
        "`+wit <1` = share of learned+witnesses rows left below full coverage (a segment's "
        "sole learned token sat in an overwritten slot: the source's caveat). `end` columns: "
        "a counterfactual, NOT the policy: the same witnesses written over the lowest-scored "
        "slots (row end) instead of from slot k - S on.",
    ]
    for src in dict.fromkeys(r["source"] for r in result["records"]):
        lines += ["", f"## {SOURCE_LABELS[src]}", ""]
        if src == "indexer":
            agree = result["extra"].get("indexer", {}).get("topk_agreement", {})
            lines += [f"Indexer top-k vs exact top-k of `index_scores`: agreement "
                      f"{', '.join(f'k={k}: {v:.3f}' for k, v in agree.items())}; "
                      f"attention proxy = softmax({cfg['proxy_beta']} * z-scored scores).", ""]
        head = (["k", "S"] + [f"cov {_SHORT[n]}" for n in SELECTIONS]
                + [f"rec {_SHORT[n]}" for n in SELECTIONS]
                + ["+wit <1", "cov end", "rec end"])
        lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        cells = sorted({(r["k"], r["S"]) for r in result["records"] if r["source"] == src})
        for k, s in cells:
            rs = [by[(src, k, s, n)] for n in SELECTIONS]
            row = ([str(k), str(s)] + [f"{r['coverage']:.3f}" for r in rs]
                   + [f"{r['recall']:.3f}" for r in rs]
                   + [f"{rs[1]['rows_uncovered_by_merge']:.2f}",
                      f"{rs[1]['coverage_at_row_end']:.3f}", f"{rs[1]['recall_at_row_end']:.3f}"])
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _plot_cell(ax, records, metric, src, s):
    for name in SELECTIONS:
        rs = sorted((r for r in records if r["source"] == src and r["S"] == s
                     and r["selection"] == name), key=lambda r: r["k"])
        if rs:
            ax.plot([r["k"] for r in rs], [r[metric] for r in rs], STYLES[name],
                    color=COLORS[name], label=name, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def plot_source(result: dict, src: str):
    """Figure: coverage (top) and recall (bottom) vs k, one column per S."""
    from matplotlib.figure import Figure

    records = result["records"]
    ss = sorted({r["S"] for r in records if r["source"] == src})
    fig = Figure(figsize=(3.2 * len(ss), 6.0), layout="constrained")
    axes = fig.subplots(2, len(ss), squeeze=False, sharex=True)
    for j, s in enumerate(ss):
        for i, metric in enumerate(("coverage", "recall")):
            ax = axes[i, j]
            _plot_cell(ax, records, metric, src, s)
            if i == 0:
                ax.set_title(f"S = {s}")
            else:
                ax.set_xlabel("budget k (valid slots)")
            if j == 0:
                ax.set_ylabel("segment coverage" if i == 0 else "attention-mass recall")
    axes[0, 0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{SOURCE_LABELS[src]}, L = {result['config']['context_len']} "
                 "(synthetic/proxy, not model quality)", fontsize=9)
    return fig


def write_outputs(result: dict, out: Path, docs: bool = True) -> dict:
    """Writes the table, JSON and PNGs into ``out``; returns ``{name: path}``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "witness.md", "json": out / "witness.json"}
    paths["md"].write_text(markdown_table(result))
    paths["json"].write_text(json.dumps(result, indent=1))
    for src in dict.fromkeys(r["source"] for r in result["records"]):
        paths[src] = out / f"witness_{src}.png"
        plot_source(result, src).savefig(paths[src], dpi=110)
    if docs and "synthetic" in paths:  # the README plot: all S, source (a)
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(paths["synthetic"], ROOT / "docs" / "witness_coverage.png")
    return paths


# --------------------------------------------------------------------------------------------
# Notebook
# --------------------------------------------------------------------------------------------

NOTEBOOK = Path(__file__).with_suffix(".ipynb")

_NB_SETUP = setup_cells("witness_experiment.py")

_NB_RUN = '''\
import os
import tempfile

from scripts.experiments import witness_experiment as wx

# WITNESS_GRID=tiny is the test suite's smoke run; the default is the --quick grid.
cfg = wx.tiny_config() if os.environ.get("WITNESS_GRID") == "tiny" else wx.quick_config()
result = wx.run_experiment(cfg)
print(f"grid done in {result['seconds']:.1f}s")
'''

_NB_TABLE = '''\
from IPython.display import Markdown, display

display(Markdown(wx.markdown_table(result)))
'''

_NB_PLOTS = '''\
from IPython.display import Image

out = Path(os.environ.get("WITNESS_OUT") or tempfile.mkdtemp(prefix="witness_"))
paths = wx.write_outputs(result, out, docs=False)
for name in ("synthetic", "indexer"):
    display(Image(filename=str(paths[name])))
'''

_NB_INTRO = """\
# Segment witnesses at equal budget: coverage and attention-mass recall

Runs `scripts/experiments/witness_experiment.py` (its `--quick` grid) and shows its table and
plots. It compares, at the same number `k` of valid slots per row, the learned top-k, the
learned top-k with segment witnesses (`scatter_topology_witnesses`), `random_null` and
`locality_null`.

**What these numbers are:** (a) SYNTHETIC attention rows (sink, local window, retrieval spikes)
with a noisy top-k standing in for the learned indexer; (b) the jnp indexer's own top-k on
RANDOM keys, with a softmax of its scores as a PROXY attention row. Neither is a model: nothing
here measures model quality. CPU only, no downloads, well under two minutes.
"""

_NB_NOTES = """\
## Reading the plots

- Witnesses overwrite the last `S` slots, which hold the *lowest-scored* learned entries, so a
  witness trades learned mass for a segment edge; recall can only move by what those slots held.
- Occupancy is read from the whole learned row, including the slots the merge overwrites
  (the source's behaviour): a segment whose only learned token sat in an overwritten slot ends
  up uncovered, so `learned+witnesses` coverage can stay *below* 1 (column `+wit <1`). It is
  never below the learned row's own coverage while `S <= k` (every missing segment gains a
  witness, and each overwritten slot uncovers at most one segment).
- The merge is positional: witnesses fill slots `k - S, k - S + 1, ...`, so when fewer than
  `S` segments are missing they overwrite the *higher*-scored part of the reserved tail, and
  at `S = k` (`keep = 0`) they overwrite the row's top entries (the recall cliff at `S = k`).
  The `end` columns show the same witnesses written over the lowest-scored slots instead.
"""


def build_notebook(path: Path = NOTEBOOK) -> Path:
    """Writes the notebook (no outputs; ``notebooks.write_notebook``)."""
    cells = [("markdown", _NB_INTRO), *_NB_SETUP, ("code", _NB_RUN),
             ("code", _NB_TABLE), ("code", _NB_PLOTS), ("markdown", _NB_NOTES)]
    return write_notebook(path, cells, "witness")


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="L=2048, k<=256 (about a minute)")
    p.add_argument("--tiny", action="store_true",
                   help="L=256, k<=32: the tests' seconds-long grid (tiny_config), every output")
    p.add_argument("--out", default="out/witness", help="output folder")
    p.add_argument("--no-docs", action="store_true", help="do not copy docs/witness_coverage.png")
    p.add_argument("--write-notebook", action="store_true",
                   help=f"regenerate {NOTEBOOK.name} and exit")
    a = p.parse_args(argv)
    if a.write_notebook:
        print(build_notebook())
        return 0
    cfg = tiny_config() if a.tiny else quick_config() if a.quick else full_config()
    size = "tiny" if a.tiny else "quick" if a.quick else "full"
    print(f"witness experiment ({size}): L={cfg.context_len} "
          f"k={list(cfg.ks)} S={list(cfg.segments)} on {jax.default_backend()}", flush=True)
    result = run_experiment(cfg)
    paths = write_outputs(result, Path(a.out), docs=not a.no_docs)
    print(markdown_table(result))
    print(f"total {result['seconds']:.1f}s; wrote " + ", ".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
