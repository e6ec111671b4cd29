"""The DeepSeek-V4.1 step against its statement in lock-step, for either implementation and any
number of decodes (issue 31): the suite's driver (``tests/test_v41_step.py``, ``_lockstep``:
the tiny config with every mode, a prefill of 23 and chunks of 7 + 13 in one ragged batch, then
one-token decodes of both sequences; 0xFF caches, NaN states, permuted pages, released window
pages; every step each sequence's top-k on every FULL / REINDEX layer and candidate blocks
identical to the statement's, outputs within ``dsa_jax.v41_cli.OUT_ULPS``).

The suite runs the jnp step over 260 decodes and the Pallas step (strict interpreter: the
compressor, the index scores and the attention on their kernels) over 10 at pages of 16: the
step shapes' interpreted compiles cost ~55 s, a decode ~1.2 s at pages of 16 (more at pages of
4: the kernels DMA one page or segment at a time). This runs the long one:

    python -m scripts.experiments.v41_lockstep --implementation pallas --decodes 260

(prints the largest error and the time; BENCHMARKS.md has the runs). CPU
only. ``--page-size`` sets the layout's pages (the suite's Pallas case runs at 16);
``--config blocks`` runs the suite's Pallas config (``tests/test_v41_step.py::C_BLOCKS``: the
tiny config with V4.1-Flash's index geometry, so the consumer reads its candidate blocks through
``pallas_kernels.indexer.v41_candidates``), ``tiny`` (the default) ``v41_tiny`` itself (its
consumer reads whole pages holding candidates)."""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--implementation", choices=("xla", "pallas"), default="pallas")
    ap.add_argument("--decodes", type=int, default=260)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--config", choices=("tiny", "blocks"), default="tiny")
    args = ap.parse_args(argv)
    from dsa_jax.v41_step import V41StepLayout
    from tests.test_v41_step import C_BLOCKS, MAX_SEQ, C, _lockstep

    kw = {"implementation": args.implementation}
    if args.implementation == "pallas":
        kw["kernel_options"] = {"interpret": True}  # the strict interpreter
    t0 = time.time()
    # asserts every step; prints the largest errors
    config = C_BLOCKS if args.config == "blocks" else C
    _lockstep(args.decodes, V41StepLayout(config, args.page_size, MAX_SEQ), **kw)
    print(f"{args.implementation}: {args.decodes} decodes passed in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
