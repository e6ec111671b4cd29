"""Which DMA and strided-VMEM forms Mosaic compiles for a cache-row gather (AOT via libtpu on
CPU, no TPU): prints one line per form and chip, ``(accepted, detail)``
(``pallas_kernels.measure.dma_probe``: what each form is, ``probe(chip)``).

Usage: ``python -m scripts.probes.dma_probe [--chips v5e,v6e,tpu7x]``
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels import chips  # noqa: E402
from pallas_kernels.measure.dma_probe import interpreter_facts, probe  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default=",".join(chips.NAMES),
                    help="comma-separated chips (default: all of pallas_kernels.chips.NAMES)")
    args = ap.parse_args(argv)
    for chip in chips.parse(args.chips):
        for what, got in probe(chip).items():
            print(f"{chip:6s} {what}: {got}")
    for what, got in interpreter_facts().items():
        print(f"{'cpu':6s} {what}: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
