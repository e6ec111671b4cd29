"""HBM bytes and DMA descriptors each Pallas kernel moves / issues, counted in the Pallas TPU
interpreter (a simulation), against the kernel's traffic model and the minimum: the report of
``pallas_kernels.measure.hbm_traffic``'s cases (what is counted and modelled: its docstring).
Exits 1 if a count differs from the model's kernel side (bytes) or the model's descriptors.

Usage: ``python -m scripts.cost.hbm_traffic [--quick] [--out DIR] [--kernels NAME,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from pallas_kernels import _interpret_counter as counter  # noqa: E402
from pallas_kernels.measure.hbm_traffic import LABEL, all_cases, count, row  # noqa: E402


def markdown(rows: list[dict]) -> str:
    lines = [f"All \"counted\" bytes: {LABEL}; HBM<->VMEM copies with the minor dim padded "
             "to 128 lanes as TPU tiles are (logical bytes in the JSON), HBM->SMEM logical, an "
             "HBM->HBM copy twice (read and written; in the total only). "
             "\"model\": the kernel module's traffic function at the same shapes and blocks (a "
             "model); its XLA side (work outside the pallas_call) is not a kernel copy and is "
             "subtracted before comparing. \"min\": the model's minimum (each input once, "
             "output once). \"DMAs\": DMA descriptors, every pipeline block copy and "
             "every started manual DMA (counted) and the model's ``Traffic.dmas``.",
             "",
             "| kernel | shape | blocks | HBM->VMEM | VMEM->HBM | HBM->SMEM | counted total | "
             "model total | model XLA side | model kernel side | counted - model kernel | min | "
             "counted / model kernel | counted / min | counted DMAs | model DMAs |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['blocks']} | {r['counted_hbm_to_vmem']} | "
            f"{r['counted_vmem_to_hbm']} | {r['counted_hbm_to_smem']} | {r['counted_total']} | "
            f"{r['model_bytes_moved']} | {r['model_xla_side']} | {r['model_kernel_side']} | "
            f"{r['counted_total'] - r['model_kernel_side']} | "
            f"{r['bytes_min']} | {r['counted_over_model_kernel']:.3f} | "
            f"{r['counted_over_min']:.3f} | {r['counted_dmas']} | {r['model_dmas']} |")
    lines += ["", f"Copies by kind ({LABEL}):", "",
              "| kernel | shape | kind | src -> dst | copy shape | dtype | copies | bytes | "
              "lane-padded bytes |", "|---|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        for c in r["copies"]:
            lines.append(f"| {r['kernel']} | {r['shape']} | {c['kind']} | {c['src']} -> "
                         f"{c['dst']} | {tuple(c['shape'])} | {c['dtype']} | {c['copies']} | "
                         f"{c['bytes']} | {c['lane_padded_bytes']} |")
    return "\n".join(lines) + "\n"


def main(argv=None, count_case=count) -> int:
    """``count_case``: the counter of one case (tests pass the counts their fixtures made)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="decode shapes only (CI)")
    p.add_argument("--out", default="out/hbm_traffic", help="folder for .md and .json")
    p.add_argument("--kernels", default="",
                   help="comma-separated kernel names: only their cases (default: every kernel)")
    a = p.parse_args(argv)
    cases = all_cases(a.quick)
    kernels = {k.strip() for k in a.kernels.split(",") if k.strip()}
    if kernels:  # a smoke run of the script
        unknown = sorted(kernels - {c.kernel for c in cases})
        if unknown:
            p.error(f"--kernels: no case of {unknown}")
        cases = [c for c in cases if c.kernel in kernels]
    counter.self_test()
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        counted = count_case(case)
        rows.append(row(case, counted, time.perf_counter() - t0))
        print(f"  {case.kernel:24s} {case.shape:48s} {rows[-1]['seconds']:6.1f} s", flush=True)
    md = markdown(rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hbm_traffic.md").write_text(md)
    (out / "hbm_traffic.json").write_text(json.dumps(
        {"label": LABEL, "jax": jax.__version__, "rows": rows}, indent=1))
    print(md)
    mismatched = [r for r in rows if r["counted_total"] != r["model_kernel_side"]
                  or r["counted_dmas"] != r["model_dmas"]]
    for r in mismatched:
        print(f"MISMATCH {r['kernel']} {r['shape']}: counted {r['counted_total']} B, "
              f"{r['counted_dmas']} DMAs; model kernel side {r['model_kernel_side']} B, "
              f"{r['model_dmas']} DMAs", file=sys.stderr)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
