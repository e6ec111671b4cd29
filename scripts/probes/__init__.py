"""Layout probes: what the TPU compiler accepts for the cache layouts (AOT via libtpu).

Each script is ``main(argv)`` = ``run(probe, description, argv)``: one line per probe and chip,
``--chips`` picking the chips (default every chip of ``pallas_kernels.chips.NAMES``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def run(probe: Callable[[str], dict], description: str, argv=None,
        extra: Callable[[], dict] | None = None) -> int:
    """Print ``probe(chip)``'s ``{form: outcome}`` for each chip of ``--chips`` (then
    ``extra()``'s chip-free facts as ``cpu`` lines); return 0."""
    from pallas_kernels import chips

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--chips", default=",".join(chips.NAMES),
                    help="comma-separated chips (default: all of pallas_kernels.chips.NAMES)")
    args = ap.parse_args(argv)
    for chip in chips.parse(args.chips):
        for what, got in probe(chip).items():
            print(f"{chip:6s} {what}: {got}")
    for what, got in (extra() if extra else {}).items():
        print(f"{'cpu':6s} {what}: {got}")
    return 0
