"""The measurements behind ``reference.v4_cache``'s TPU layout (AOT via libtpu on CPU, no
TPU): prints one line per probe and chip (``pallas_kernels.measure.v4_layout_probe``: what
each probe is, ``probe(chip)``).

Usage: ``python -m scripts.probes.v4_layout_probe [--chips v5e,v6e,tpu7x]``
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels.measure.v4_layout_probe import probe  # noqa: E402
from scripts.probes import run  # noqa: E402


def main(argv=None) -> int:
    return run(probe, __doc__.split("\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
