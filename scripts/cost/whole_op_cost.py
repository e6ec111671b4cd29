"""Whole-op cost report: XLA's TPU cost model of every public op, kernels and XLA glue apart.

For each chip (AOT compiles through libtpu on CPU; no TPU runs) and each program below, the
report gives XLA's ``bytes accessed`` split into the Pallas kernels' declared estimates and the
XLA ops (``pallas_kernels.xla_cost.analyze``), XLA's ``optimal_seconds``, whether the program
has a ``while`` loop, the XLA bytes over a reference quantity, and every gather / scatter HLO op
left in the program with its shapes, index count and verdict.

Programs (DeepSeek-V3.2 shapes of the compile gates; ``--quick`` keeps the starred ones: one
program per part, none with a k = 2048 top-k, which XLA's TPU compile takes 15-40 s over):

- loop-free XLA parts: the witness merge (``scatter_topology_witnesses``, i32[512, 2048],
  S = 64) beside a plain copy of the buffer*, and donated (in place, as serving calls it: the
  tail fill*); the selection (``select_topk``, default and exact) on f32[64, N], N = 4096 and
  131072, beside ``approx_max_k(aggregate_to_topk=True)`` alone and ``lax.top_k`` alone; the
  indexers' selection stage (``select_and_merge``) at their decode score shapes (page
  top-k's*); the cache write ``dsa_jax.update_kv_cache`` (donated)*;
- ``dsa_jax.indexer_topk`` / ``page_topk`` (backend ``"pallas"`` and ``"reference"``) at
  decode 64x4096 (``page_topk``*), decode 8x131072, MTP 16x4@4096, prefill 2048@32768, mixed
  60x1@4096 + 512@32768 (``pallas_kernels.indexer.compile_cases.GATE_SHAPES`` plus MTP); the
  reference is the kernel's modelled key bytes, and "net" subtracts the selection stage's XLA bytes;
- ``dsa_jax.sparse_mla`` / ``page_sparse_mla`` at decode 64x8192 H=128 and H=16*, MTP 16x4@4096
  H=128, prefill 1024@32768 (``sparse_mla.COMPILE_SHAPES`` plus MTP), k = 2048 tokens or 32
  pages of 64; the reference is the kernel's modelled bytes (``compile_cases`` traffic);
- ``dsa_jax.dsa_step`` (its body, caches donated, as ``dsa_step`` jits it): 2 and 8 layers
  (IndexShare pattern of ``python -m dsa_jax run``: ``glm_index_share_pattern(layers,
  leading_full=1)``), decode 64x4096, H=128, token and page granularity, packed bf16 latent +
  bf16 index caches and fp8 caches, backends ``"pallas"`` and ``"reference"`` (``--quick``: the
  2-layer fp8 page Pallas row*), with the cache rows it writes and the XLA-side gate
  (``XLA <= 0.10 x kernels + rows written``), temp memory, and 8 / 2 layers;
- the real-size step (``--real-size``; in the full report): 61 layers (16 full), fp8 caches,
  decode 64x4096, H=128, Pallas, token: bytes against the sum of its kernels' traffic models
  (modelled and minimum, ``step_kernel_traffic``), temp memory.

Caveats (printed with the report): a ``while`` body is counted once whatever its trip count, so
a program flagged ``loop`` reports a lower bound (bounds are asserted only on decode programs
whose loops carry <= 64 KiB, e.g. a ``searchsorted``); ``optimal_seconds`` is shown only when
XLA reports it non-negative (it is negative for some programs on every chip); a Pallas call
without ``pl.CostEstimate`` counts 0 in XLA's total, so its bytes then appear in no column.

The report opens with the issue-13 acceptance table per chip (ratio, ``ok`` only within the
bound with no per-element gather/scatter and negligible loops).

Usage: ``python -m scripts.cost.whole_op_cost [--quick | --step | --real-size] [--chips
v5e,v6e,tpu7x] [--markdown PATH] [--json PATH]`` (``--step`` / ``--real-size``: only those
rows; together: both).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

from dsa_jax.measure.whole_op import (  # noqa: E402
    REAL_LAYERS,
    REAL_TEMP_BOUND,
    STEP_CTX,
    STEP_HEADS,
    STEP_LAYERS,
    STEP_SCALING_BOUND,
    STEP_SEQS,
    STEP_XLA_BOUND,
    Row,
    programs,
    run_chip,
    step_kernel_traffic,
    step_rows_written,
    step_types,
    step_xla_allowance,
)
from pallas_kernels import chips as chip_specs  # noqa: E402
from pallas_kernels import xla_cost  # noqa: E402

CAVEATS = """Caveats (XLA's model, not a measurement):
- A while loop's body is counted ONCE whatever its trip count: a program flagged `loop` reports
  a lower bound. The bounds (acceptance table, tests/test_whole_op_cost.py) are asserted only
  on decode programs whose loops are negligible (none, or state <= 64 KiB).
- optimal_seconds is shown only when non-negative: XLA reports it negative for some programs on
  every chip (e.g. select_topk at 64x131072 on the default chip: -0.9995), so it is never used
  as a time.
- A Pallas call counts only its pl.CostEstimate (0 without one): "kernel" is the sum of the
  declared estimates; "XLA" = total - kernel. "net" subtracts the selection stage's XLA bytes.
- Gathers/scatters: `per-element` = a slice under 128 elements and more indices than the
  program's rows (query rows or sequences); `row` = a slice of >= 128 elements; `metadata` =
  at most one index per row; `allowed` = matched xla_cost.HOT_PATH_ALLOWED (reason shown).
- `loop`: the number of while loops and the largest carried state; one uncounted iteration
  touches on the order of that state (a searchsorted over S+1 offsets carries < 1 KB). Where a
  loop carries more than 64 KiB the ratio is marked `>=` (a lower bound) and no "net" is
  computed.
- source `~file:line`: XLA dropped the op's own metadata; read off its fusion or that fusion's
  first user."""


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _loop_names(c: xla_cost.XlaCost) -> str:
    """Short JAX names of the loops: the last ``jit(name)`` of each op_name not starting
    with ``_`` (``searchsorted``, ``fori_loop`` bodies show their function)."""
    names = []
    for lp in c.loops:
        jits = [n for n in re.findall(r"jit\(([^)]*)\)", lp.op_name) if not n.startswith("_")]
        names.append(jits[-1] if jits else lp.name)
    return ", ".join(sorted(set(names)))


def table(chip: str, rows: list[Row]) -> str:
    lines = [f"### {chip}", "",
             "| part | op | shape | total MB | kernel MB (est.) | XLA MB | XLA net MB | "
             "reference | XLA / ref | optimal us | loop | gathers / scatters |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        p, c = r.prog, r.cost
        if c is None:
            lines.append(f"| {p.part} | {p.name} | {p.shape} | FAILED: {r.error} "
                         "| | | | | | | | |")
            continue
        verdicts = [xla_cost.classify(op, row_limit=p.rows, allowed=p.allowed)
                    for op in c.indexed_ops]
        counts = {s: sum(v.status == s for v in verdicts)
                  for s in ("per-element", "allowed", "row", "metadata")}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "none"
        # A program with a material loop reports a lower bound (its body counted once).
        ratio = "-" if r.ratio is None else \
            f"{'' if c.loops_negligible else '>= '}{r.ratio:.2f}"
        secs = "-" if c.optimal_seconds is None else f"{1e6 * c.optimal_seconds:.1f}"
        loop = (f"{len(c.loops)} ({_loop_names(c)}; state <= {c.loop_state_bytes} B)"
                if c.has_loop else "")
        ref = f"{r.ref_label} {_mb(r.ref_bytes)} MB" if r.ref_bytes is not None else "-"
        lines.append(f"| {p.part} | {p.name} | {p.shape} | {_mb(c.total_bytes)} | "
                     f"{_mb(c.kernel_bytes)} | {_mb(c.xla_bytes)} | {_mb(r.net_bytes)} | {ref} | "
                     f"{ratio} | {secs} | {loop} | {summary} |")
    return "\n".join(lines)


def _source(op: xla_cost.IndexedOp) -> str:
    if not op.source:
        return "-"
    return ("~" if op.source_inferred else "") + op.source


def op_table(chip: str, rows: list[Row]) -> str:
    """Every gather/scatter of every program; a program's per-row metadata ops (at most one
    index per row each) are folded into one line with their count and source functions."""
    lines = [f"#### {chip}: gathers and scatters", "",
             "| part | op | shape | kind | result <- operands | indices | elems / index | "
             "verdict | source |", "|---|---|---|---|---|---:|---:|---|---|"]
    for r in rows:
        head = f"| {r.prog.part} | {r.prog.name} | {r.prog.shape} |"
        meta = []
        for op in (r.cost.indexed_ops if r.cost else ()):
            v = xla_cost.classify(op, row_limit=r.prog.rows, allowed=r.prog.allowed)
            if v.status == "metadata":
                meta.append(op)
                continue
            lines.append(f"{head} {op.kind} | {op.result_shape} <- "
                         f"{', '.join(op.operand_shapes)} | {op.num_indices} | "
                         f"{op.slice_elems} | **{v.status}**: {v.reason} | {_source(op)} |")
        if meta:
            kinds = "/".join(sorted({op.kind for op in meta}))
            funcs = sorted({op.functions[0].rsplit(".", 1)[-1] if op.functions else "?"
                            for op in meta})
            lines.append(f"{head} {len(meta)} x {kinds} | (folded) | <= {r.prog.rows} each | "
                         f"<= {max(op.slice_elems for op in meta)} | **metadata**: at most one "
                         f"index per row | {', '.join(funcs)} |")
    return "\n".join(lines)


# Issue 13 acceptance in XLA's model: (label, program key prefix, bound on "XLA / ref").
GATES = (
    ("witness merge i32[512,2048] S=64, donated (as served) / copy", "witness_donated", 2.0),
    ("witness merge i32[512,2048] S=64, new buffer / copy (regression bound)", "witness", 5.0),
    ("witness merge, lowest fill, donated / copy", "witness_lowest_donated", 2.0),
    ("select_topk default 64x4096 / approx_max_k", "sel4096", 1.5),
    ("select_topk default 64x131072 / approx_max_k", "sel131072", 1.5),
    ("select_topk exact 64x4096 / top_k", "selx4096", 1.5),
    ("select_topk exact 64x131072 / top_k", "selx131072", 1.5),
    ("sparse_mla 64x8192 H=128: XLA / kernel model", "sparse_mla/pallas/decode64x8192_h128_", .25),
    ("sparse_mla 64x8192 H=16: XLA / kernel model", "sparse_mla/pallas/decode64x8192_h16_", .25),
    ("page_sparse_mla 64x8192 H=128: XLA / kernel model",
     "page_sparse_mla/pallas/decode64x8192_h128_", .25),
    ("page_sparse_mla 64x8192 H=16: XLA / kernel model",
     "page_sparse_mla/pallas/decode64x8192_h16_", .25),
    ("indexer_topk decode 64x4096: XLA net / key bytes", "indexer_topk/pallas/decode 64x4096",
     .25),
    ("indexer_topk decode 8x131072: XLA net / key bytes",
     "indexer_topk/pallas/decode 8x131072", .25),
    ("page_topk decode 64x4096: XLA net / key bytes", "page_topk/pallas/decode 64x4096", .25),
    ("page_topk decode 8x131072: XLA net / key bytes", "page_topk/pallas/decode 8x131072", .25),
)


# Every op at its minimum, not only at decode: fp8 caches and MTP rows, XLA side <= 0.10x.
# Where a row is not yet within its bound, the label says the figure's cause (v6e figures).
OPMIN_GATES = (
    ("sparse_mla fp8 64x8192 H=128: XLA / kernel model (0.16: XLA stores a 576-wide q "
     "parameter {1,2,0}; the kernel's row-major read copies it)",
     "sparse_mla/pallas/decode64x8192_h128_k2048_fp8", .10),
    ("page_sparse_mla fp8 64x8192 H=128: XLA / kernel model (0.15: the same q layout copy)",
     "page_sparse_mla/pallas/decode64x8192_h128_p32x64_fp8", .10),
    ("indexer_topk MTP 16x4@4096: XLA net / key bytes (1.19: three ladder-level calls, "
     "row-slot scatter)", "indexer_topk/pallas/MTP 16x4@4096", .10),
    ("page_topk MTP 16x4@4096: XLA net / key bytes", "page_topk/pallas/MTP 16x4@4096", .10),
    ("sparse_mla MTP 16x4@4096 H=128: XLA / kernel model",
     "sparse_mla/pallas/mtp16x4@4096_h128_", .10),
    ("page_sparse_mla MTP 16x4@4096 H=128: XLA / kernel model",
     "page_sparse_mla/pallas/mtp16x4@4096_h128_", .10),
)


def _gate_cell(rows: list[Row], prefix: str, bound: float) -> str:
    row = next((r for r in rows if r.prog.key.startswith(prefix)), None)
    if row is None or row.cost is None or row.ratio is None:
        return "not run" if row is None else "FAILED"
    bad = sum(not xla_cost.classify(op, row_limit=row.prog.rows, allowed=row.prog.allowed).ok
              for op in row.cost.indexed_ops)
    ok = row.ratio <= bound and bad == 0 and row.cost.loops_negligible
    extra = f", {bad} per-element" if bad else ""
    return f"{'ok' if ok else 'FAIL'} {row.ratio:.2f}{extra}"


def gate_table(all_rows: dict[str, list[Row]]) -> str:
    """The issue's acceptance per chip: the ratio, and ok only when it is within the bound,
    the program has no per-element gather/scatter and its loops are negligible."""
    chips = list(all_rows)
    lines = ["### Issue 13 acceptance (XLA's TPU cost model)", "",
             "| gate | bound | " + " | ".join(chips) + " |",
             "|---|---:|" + "---|" * len(chips)]
    for label, prefix, bound in GATES + OPMIN_GATES:
        cells = [_gate_cell(all_rows[c], prefix, bound) for c in chips]
        lines.append(f"| {label} | <= {bound:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_json(all_rows: dict[str, list[Row]]) -> list[dict]:
    """Every row as plain numbers (for ``--json``)."""
    out = []
    for chip, rows in all_rows.items():
        for r in rows:
            c = r.cost
            out.append({
                "chip": chip, "key": r.prog.key, "part": r.prog.part, "op": r.prog.name,
                "shape": r.prog.shape, "error": r.error, "compile_s": round(r.seconds, 2),
                "total_bytes": c and c.total_bytes, "kernel_bytes": c and c.kernel_bytes,
                "xla_bytes": c and c.xla_bytes, "net_bytes": r.net_bytes,
                "ref_label": r.ref_label, "ref_bytes": r.ref_bytes, "ratio": r.ratio,
                "temp_bytes": r.temp_bytes,
                "optimal_seconds": c and c.optimal_seconds,
                "loops": [(lp.op_name, lp.state_bytes) for lp in c.loops] if c else None,
                "indexed_ops": [
                    {"op": op.describe(), "verdict": xla_cost.classify(
                        op, row_limit=r.prog.rows, allowed=r.prog.allowed).status}
                    for op in c.indexed_ops] if c else None})
    return out


def large_table(chip: str, rows: list[Row]) -> str:
    """Entry-computation XLA results >= 64 MiB: where the big XLA bytes are made."""
    lines = [f"#### {chip}: XLA results >= {xla_cost.LARGE_RESULT_BYTES >> 20} MiB (entry "
             "computation)", "",
             "A scatter or dynamic-update-slice into a donated buffer is an in-place update (its "
             "result is the buffer, not a copy); a slice, squeeze or copy-done is a copy.", "",
             "| part | op | shape | XLA op | result | MB | JAX op |",
             "|---|---|---|---|---|---:|---|"]
    for r in rows:
        for big in (r.cost.large_results if r.cost else ()):
            lines.append(f"| {r.prog.part} | {r.prog.name} | {r.prog.shape} | {big.opcode} | "
                         f"{big.shape} | {_mb(big.bytes)} | {big.op_name or '-'} |")
    return "\n".join(lines)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _step_rows(all_rows: dict[str, list[Row]], prefix: str = "step/"):
    for chip, rows in all_rows.items():
        for r in rows:
            if r.prog.key.startswith(prefix):
                _, layers, fmt, gran, backend = r.prog.key.split("/")
                yield chip, int(layers.removesuffix("L")), fmt, gran, backend, r


def step_table(all_rows: dict[str, list[Row]]) -> str:
    """The step rows: total / kernel / XLA bytes, XLA / kernel, the cache rows written and the
    XLA-side gate (Pallas rows), temp memory; then the 8-layer / 2-layer total bytes."""
    lines = [f"### dsa_step, decode {STEP_SEQS}x{STEP_CTX}, H={STEP_HEADS} (V3.2 dims; "
             "IndexShare pattern of `python -m dsa_jax run`: glm_index_share_pattern(layers, "
             "leading_full=1): 2 layers = full, shared; 8 layers = 2 full + 6 shared)", "",
             f"Gate (Pallas): XLA MB <= {STEP_XLA_BOUND:g} x kernel MB + rows written MB "
             "(rows written: per layer 64 latent rows of the stored format, packed 1536 B / fp8 "
             "1024 B, per full layer 64 index rows, bf16 256 B / fp8 132 B). The reference "
             "backend has no kernels: its XLA MB is the whole step.", "",
             "| chip | layers | cache | granularity | backend | total MB | kernel MB (est.) | "
             "XLA MB | XLA / kernel | rows written MB | XLA bound MB | gate | temp MiB |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    totals = {}
    for chip, layers, fmt, gran, backend, r in _step_rows(all_rows):
        head = f"| {chip} | {layers} | {fmt} | {gran} | {backend} |"
        c = r.cost
        if c is None:
            lines.append(f"{head} FAILED: {r.error} | | | | | | | |")
            continue
        totals[chip, layers, fmt, gran, backend] = c.total_bytes
        written = step_rows_written(layers, fmt)
        ratio = f"{c.xla_bytes / c.kernel_bytes:.2f}" if c.kernel_bytes else "-"
        bound, gate = "-", "-"
        if backend == "pallas" and layers in STEP_LAYERS:
            allowance = step_xla_allowance(c.kernel_bytes, layers, fmt)
            bound = _mb(allowance)
            gate = "ok" if c.kernels and c.xla_bytes <= allowance else "FAIL"
        lines.append(f"{head} {_mb(c.total_bytes)} | {_mb(c.kernel_bytes)} | "
                     f"{_mb(c.xla_bytes)} | {ratio} | {_mb(written)} | {bound} | {gate} | "
                     f"{_mib(r.temp_bytes)} |")
    lo, hi = STEP_LAYERS
    scaling = [f"| {chip} | {fmt} | {gran} | {backend} | {_mb(t)} | {_mb(t8)} | {t8 / t:.2f} | "
               + (("ok" if t8 <= STEP_SCALING_BOUND * t else "FAIL") if backend == "pallas"
                  else "-") + " |"
               for (chip, layers, fmt, gran, backend), t in totals.items() if layers == lo
               for t8 in [totals.get((chip, hi, fmt, gran, backend))] if t8 is not None]
    if scaling:
        lines += ["", f"{hi} layers / {lo} layers (total bytes; gate for Pallas: <= "
                  f"{STEP_SCALING_BOUND:g}; kernels alone scale by "
                  f"{len(step_types(hi))}/{len(step_types(lo))} MLA calls and "
                  f"{step_types(hi).count('full')}/{step_types(lo).count('full')} indexer "
                  "calls)", "",
                  f"| chip | cache | granularity | backend | {lo}L total MB | {hi}L total MB | "
                  f"{hi}L / {lo}L | gate |", "|---|---|---|---|---:|---:|---:|---|", *scaling]
    return "\n".join(lines)


def real_size_table(all_rows: dict[str, list[Row]]) -> str:
    """The 61-layer step per chip: XLA's bytes against its kernels' traffic models, temp."""
    lines = [f"### Real-size step: {REAL_LAYERS} layers ({step_types(REAL_LAYERS).count('full')} "
             f"full), fp8 caches, decode {STEP_SEQS}x{STEP_CTX}, H={STEP_HEADS}, Pallas, token",
             "", "Kernels' modelled / minimum: `pallas_kernels.mla.traffic` per layer and "
             "`pallas_kernels.indexer.traffic` per full layer (the compile cases' models, "
             "`step_kernel_traffic`); minimum = each input read once, each output written once. "
             f"Temp gate ({chip_specs.DEFAULT}): < {REAL_TEMP_BOUND >> 20} MiB.", "",
             "| chip | total MB | kernel MB (est.) | XLA MB | kernels' modelled MB | "
             "kernels' minimum MB | total / minimum | temp MiB | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for chip, layers, fmt, gran, _, r in _step_rows(all_rows):
        if layers != REAL_LAYERS:
            continue
        if r.cost is None:
            lines.append(f"| {chip} | FAILED: {r.error} | | | | | | | |")
            continue
        t, c = step_kernel_traffic(chip, layers, gran, fmt), r.cost
        lines.append(f"| {chip} | {_mb(c.total_bytes)} | {_mb(c.kernel_bytes)} | "
                     f"{_mb(c.xla_bytes)} | {_mb(t.bytes_moved)} | {_mb(t.bytes_min)} | "
                     f"{c.total_bytes / t.bytes_min:.2f} | {_mib(r.temp_bytes)} | "
                     f"{r.seconds:.0f} |")
    return "\n".join(lines)


def measured_tree() -> str:
    """The source tree measured (where ``reference`` was imported from) and its git commit,
    ``+dirty`` when it has uncommitted changes."""
    import reference

    root = Path(reference.__file__).resolve().parents[1]
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return f"{root} @ {head}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return f"{root} (not a git checkout)"


def report(all_rows: dict[str, list[Row]], quick: bool, seconds: float) -> str:
    head = [f"Whole-op XLA cost ({'--quick' if quick else 'full'}; tree {measured_tree()}; "
            f"jax {jax.__version__}; {seconds:.0f} s). Bytes in MB (1e6).", "", CAVEATS, ""]
    keys = {r.prog.key for rows in all_rows.values() for r in rows}
    body = [gate_table(all_rows), ""] if any(not k.startswith("step/") for k in keys) else []
    if any(k.startswith("step/") and not k.startswith(f"step/{REAL_LAYERS}L/") for k in keys):
        body += [step_table(all_rows), ""]
    if any(k.startswith(f"step/{REAL_LAYERS}L/") for k in keys):
        body += [real_size_table(all_rows), ""]
    for chip, rows in all_rows.items():
        body += [table(chip, rows), "", op_table(chip, rows), "", large_table(chip, rows), ""]
    return "\n".join(head + body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the starred subset (CI smoke run)")
    p.add_argument("--step", action="store_true",
                   help="only the dsa_step rows (2 and 8 layers, packed and fp8 caches, token "
                        "and page, pallas and reference) and their tables")
    p.add_argument("--real-size", action="store_true",
                   help=f"only the {REAL_LAYERS}-layer fp8 Pallas step (with --step: both); "
                        "several minutes per chip")
    p.add_argument("--chips", default=",".join(chip_specs.NAMES), help="comma-separated chips")
    p.add_argument("--markdown", default=None, help="write the tables as Markdown here")
    p.add_argument("--json", default=None, help="write every row as JSON here")
    a = p.parse_args(argv)
    chips = chip_specs.parse(a.chips)
    progs = programs(a.quick, step=a.step, real_size=a.real_size)
    t0 = time.perf_counter()
    all_rows = {chip: run_chip(chip, progs) for chip in chips}
    md = report(all_rows, a.quick, time.perf_counter() - t0)
    print(md)
    for path, text in ((a.markdown, md), (a.json, a.json and json.dumps(
            rows_json(all_rows), indent=1))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    return 1 if any(r.cost is None for rows in all_rows.values() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
