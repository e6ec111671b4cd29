"""The DeepSeek-V4.1 step against its statement in lock-step, for either implementation and any
number of decodes (issue 31): the suite's driver (``tests/test_v41_step.py``, ``_lockstep``:
the tiny config with every mode, a prefill of 23 and chunks of 7 + 13 in one ragged batch, then
one-token decodes of both sequences; 0xFF caches, NaN states, permuted pages, released window
pages; every step each sequence's top-k on every FULL / REINDEX layer and candidate blocks
identical to the statement's, outputs within ``dsa_jax.v41_cli.OUT_ULPS``).

The suite runs the jnp step over 260 decodes and the Pallas step (strict interpreter) over 5:
the interpreter costs about 6 s a Pallas step on 2 cores (the index scores' kernel DMAs one
page of 4 entries at a time), too long for the suite's budget at 260. This runs the long one:

    python -m scripts.experiments.v41_lockstep --implementation pallas --decodes 260

(about 30 minutes on 2 cores; prints the largest error and the time). CPU only."""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--implementation", choices=("xla", "pallas"), default="pallas")
    ap.add_argument("--decodes", type=int, default=260)
    args = ap.parse_args(argv)
    from tests.test_v41_step import _lockstep

    kw = {"implementation": args.implementation}
    if args.implementation == "pallas":
        kw["kernel_options"] = {"interpret": True}  # the strict interpreter
    t0 = time.time()
    _lockstep(args.decodes, **kw)  # asserts every step; prints the largest errors
    print(f"{args.implementation}: {args.decodes} decodes passed in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
