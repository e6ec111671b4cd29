"""Kernel x chip x shape: AOT Mosaic compile result, VMEM, HBM bytes vs minimum, roofline.

Every number here is either a compile result (compiled or not, Mosaic's message) or a model
(``pallas_kernels.aot.Traffic``: bytes the kernel moves for its blocks, the minimum, and the
roofline ``max(bytes / HBM bandwidth, flops / peak bf16)`` from ``pltpu.get_tpu_info_for_chip``).
No TPU is used. The cases come from each kernel module's ``compile_cases(quick)``, the same list
the compile-gate tests use.

Usage: ``python -m scripts.cost.tpu_compile_report [--quick] [--chips v5e,v6e,tpu7x] [--out DIR]
[--limit N] [--kernels NAME,...]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels import chips as chip_specs  # noqa: E402

KERNEL_MODULES = ("pallas_kernels.indexer.compile_cases", "pallas_kernels.mla.compile_cases")
# Published number to put beside our model (a measurement on a real TPU, not ours).
ANCHORS = {("streamindex_topk", "64x4096"):
           ("tpu-inference indexer, 64 decode rows x 4096, real TPU", 138.86)}


def collect_cases(quick: bool):
    cases, missing = [], []
    for name in KERNEL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
            continue
        if hasattr(mod, "compile_cases"):
            cases.extend(mod.compile_cases(quick))
        else:
            missing.append(f"{name}: no compile_cases")
    return cases, missing


def run(quick: bool, chips: list[str], limit: int | None = None,
        kernels: list[str] | None = None) -> tuple[list[dict], list[str]]:
    from pallas_kernels.aot import CompileError

    cases, missing = collect_cases(quick)
    if kernels:  # only these kernels (a smoke run of the report)
        unknown = sorted(set(kernels) - {c.kernel for c in cases})
        if unknown:
            raise ValueError(f"--kernels: no case of {unknown}")
        cases = [c for c in cases if c.kernel in kernels]
    if limit is not None:  # the first ``limit`` cases of each kernel
        kept: dict[str, list] = {}
        for c in cases:
            kept.setdefault(c.kernel, [])
            if len(kept[c.kernel]) < limit:
                kept[c.kernel].append(c)
        cases = [c for group in kept.values() for c in group]
    rows = []
    for case in cases:
        for chip in chips:
            t0 = time.perf_counter()
            try:
                case.compile(chip)
                status, msg = "compiled", ""
            except CompileError as e:
                status, msg = "FAILED", e.message.splitlines()[0][:200]
            tr = case.traffic(chip)
            rows.append({"kernel": case.kernel, "shape": case.shape, "chip": chip,
                         "status": status, "error": msg,
                         "compile_s": round(time.perf_counter() - t0, 2),
                         "vmem_MiB": tr.vmem_bytes / 2**20,
                         "bytes_moved": tr.bytes_moved, "bytes_min": tr.bytes_min,
                         "ratio": tr.ratio, "roofline_us": 1e6 * tr.roofline_seconds(chip)})
            print(f"  {chip:6s} {case.kernel:28s} {case.shape:34s} {status}", flush=True)
    return rows, missing


def markdown(rows: list[dict], missing: list[str]) -> str:
    from pallas_kernels.aot import chip_info

    lines = ["| kernel | shape | chip | compile | VMEM MiB (model) / chip | bytes moved / min "
             "(model) | roofline us (model) |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        cap = chip_info(r["chip"]).vmem_capacity_bytes / 2**20
        status = r["status"] + (f": {r['error']}" if r["error"] else "")
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['chip']} | {status} | "
                     f"{r['vmem_MiB']:.1f} / {cap:.0f} | {r['ratio']:.3f} | "
                     f"{r['roofline_us']:.2f} |")
    for (kernel, shape), (what, us) in ANCHORS.items():
        ours = [r for r in rows if r["kernel"] == kernel and shape in r["shape"].replace(" ", "")]
        model = ", ".join(f"{r['chip']} {r['roofline_us']:.1f} us ({r['shape']})"
                          for r in ours) or "n/a"
        lines.append(f"\nAnchor: {what}: {us} us (measured by them). Our modelled roofline at "
                     f"that shape: {model} (a model, not a measurement).")
    if missing:
        lines.append("\nNot reported (kernel module missing): " + "; ".join(missing))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick subset of shapes")
    p.add_argument("--chips", default=",".join(chip_specs.NAMES), help="comma-separated chips")
    p.add_argument("--out", default="out/tpu_compile_report", help="folder for .md and .json")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N cases of each kernel (a smoke run of the report)")
    p.add_argument("--kernels", default="",
                   help="comma-separated kernel names: only their cases (default: every kernel)")
    a = p.parse_args(argv)
    if a.limit is not None and a.limit < 1:
        p.error(f"--limit must be >= 1, got {a.limit}")
    chips = chip_specs.parse(a.chips)
    kernels = [k.strip() for k in a.kernels.split(",") if k.strip()]
    rows, missing = run(a.quick, chips, a.limit, kernels)
    md = markdown(rows, missing)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tpu_compile_report.md").write_text(md)
    (out / "tpu_compile_report.json").write_text(json.dumps(rows, indent=1))
    print(md)
    return 1 if any(r["status"] != "compiled" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
