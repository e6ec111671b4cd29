"""Bytes and DMA descriptors per decode row of every Pallas kernel's decode compile case, from
the kernels' own traffic models (``aot.Traffic``: ``bytes_moved``, ``bytes_min``, ``dmas``; the
models equal the Pallas TPU interpreter's counts at the small shapes of
``tests/test_hbm_traffic.py`` and the V4 page-run tests). A MODEL, not a TPU measurement; the
issue-30 table of BENCHMARKS.md ("Kernels at the hardware's grain").

Usage: ``python -m scripts.cost.per_row [--chip v6e]``
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels import chips  # noqa: E402
from pallas_kernels.indexer import compile_cases as indexer_cases  # noqa: E402
from pallas_kernels.mla import compile_cases as mla_cases  # noqa: E402
from pallas_kernels.v4_attention import compile_cases as v4_cases  # noqa: E402
from pallas_kernels.v4_compressor import compile_cases as compressor_cases  # noqa: E402

_ROWS = re.compile(r"decode ?(\d+)")


def decode_cases():
    """Every family's compile cases whose shape is a decode batch, with its row count."""
    cases = (indexer_cases.compile_cases(True) + mla_cases.compile_cases(True)
             + v4_cases.compile_cases(fused=True, fmt="packed")
             + v4_cases.compile_cases(fused=True, fmt="fp8") + v4_cases.compile_cases()
             + compressor_cases.compile_cases())
    for case in cases:
        m = _ROWS.search(case.shape)
        if m and "mixed" not in case.shape:
            yield case, int(m.group(1))


def table(chip: str) -> str:
    """The markdown table for ``chip``."""
    lines = ["| kernel | shape | bytes / row | min / row | moved / min | DMA descriptors / row |",
             "|---|---|---:|---:|---:|---:|"]
    for case, rows in decode_cases():
        t = case.traffic(chip)
        lines.append(f"| {case.kernel} | {case.shape} | {t.bytes_moved / rows:,.0f} | "
                     f"{t.bytes_min / rows:,.0f} | {t.ratio:.2f} | {t.dmas / rows:,.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chip", default=chips.NAMES[1], help=f"one of {', '.join(chips.NAMES)}")
    a = p.parse_args(argv)
    chips.check(a.chip)
    print(f"per decode row, {a.chip} (model; nothing here is a TPU time)\n")
    print(table(a.chip))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
