"""Which DMA and strided-VMEM forms Mosaic compiles for a cache-row gather (AOT via libtpu on
CPU, no TPU): prints one line per form and chip, ``(accepted, detail)``
(``pallas_kernels.measure.dma_probe``: what each form is, ``probe(chip)``).

Usage: ``python -m scripts.probes.dma_probe [--chips v5e,v6e,tpu7x]``
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels.measure.dma_probe import interpreter_facts, probe  # noqa: E402
from scripts.probes import run  # noqa: E402


def main(argv=None) -> int:
    return run(probe, __doc__.split("\n")[0], argv, extra=interpreter_facts)


if __name__ == "__main__":
    sys.exit(main())
