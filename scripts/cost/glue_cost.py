"""XLA glue per call of the compressed-key indexer and the Pallas V4 compressor at V4-Flash decode
(issue 30 deliverable 4), by XLA's TPU cost model of AOT compiles through libtpu on CPU (no TPU
runs): the program's bytes accessed, the Pallas kernels' declared estimates, and the glue (the
difference, ``pallas_kernels.measure.xla_cost.analyze``), with the largest XLA results.

Programs (64 decode rows x 8192 tokens): ``indexer``, ``streamindex_topk(compression_ratio=4)``
(heads 64 x 128, top-512; ``pallas_kernels.indexer.compile_cases``' Flash decode case); the
compressor's decode cases of ``pallas_kernels.v4_compressor.compile_cases`` (the pool donated).
The gate is ``tests/test_glue_cost.py`` (indexer <= 5 MB, the d-512 ratio-4 compressor <= 7.5
MB, every chip).

Usage: ``python -m scripts.cost.glue_cost [--chips v5e,v6e,tpu7x] [--top 6]``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels import chips as chip_specs  # noqa: E402
from pallas_kernels.indexer import compile_cases as icases  # noqa: E402
from pallas_kernels.measure import hlo, xla_cost  # noqa: E402
from pallas_kernels.v4_compressor import compile_cases as ccases  # noqa: E402

MB = 1e6
LISTED_BYTES = 64 * 1024  # XLA results at least this big are listed
INDEXER_FLASH = "V4-Flash decode 64x8192 (2048 entries) k=512"


def programs():
    """``(name, fn_for_chip, specs, donate_argnums)`` of every program the report compiles."""
    case = next(c for c in icases.v4_cases(quick=True) if c.shape == INDEXER_FLASH)
    out = [("indexer r=4 k=512", case.fn_for_chip, case.specs, ())]
    out += [(f"compressor {c.shape}", c.fn_for_chip, c.specs, (6, 7))
            for c in ccases.compile_cases() if "decode" in c.tags]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default=",".join(chip_specs.NAMES))
    ap.add_argument("--top", type=int, default=6, help="largest XLA results listed per program")
    args = ap.parse_args()
    print("| chip | program | XLA bytes (MB) | kernels (MB) | glue (MB) |\n"
          "|---|---|---:|---:|---:|")
    listed = []
    for chip in chip_specs.parse(args.chips):
        for name, fn_for_chip, specs, donate in programs():
            compiled = xla_cost.compile_program(fn_for_chip(chip), specs, chip,
                                                donate_argnums=donate, case=name)
            cost = xla_cost.analyze(compiled)
            print(f"| {chip} | {name} | {cost.total_bytes / MB:.2f} | "
                  f"{cost.kernel_bytes / MB:.2f} | {cost.xla_bytes / MB:.2f} |", flush=True)
            big = hlo.parse_large_results(compiled.as_text(), LISTED_BYTES)
            listed.append((chip, name, big[:args.top]))
    for chip, name, results in listed:
        print(f"\n{chip} {name}: largest XLA results")
        for r in results:
            print(f"  {r.bytes / MB:8.3f} MB  {r.opcode:10s} {r.shape:32s} {r.op_name[-70:]}")


if __name__ == "__main__":
    main()
