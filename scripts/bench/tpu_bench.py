"""Wall-clock timings on a TPU of every Pallas kernel at its decode gate shape, ``lax.top_k`` vs
``lax.approx_max_k`` vs ``reference.select_topk`` at the V4 selection shapes, and the two steps
(``dsa_jax.measure.tpu_bench``: the cases, the inputs, the timing; the same as
``python -m dsa_jax tpu-bench``). Off a TPU it times nothing and exits 2, unless
``--allow-cpu`` (tiny shapes, kernels interpreted: plumbing, not timings).

Usage: ``python -m scripts.bench.tpu_bench [--quick] [--iters N] [--warmup N] [--only NAMES]
[--out DIR] [--allow-cpu]``
"""

from __future__ import annotations

import sys

from pallas_kernels import tpu


def main(argv=None) -> int:
    tpu.skip_tpu_probe_without_tpu()  # no libtpu error block on a machine without a TPU
    from dsa_jax.measure import tpu_bench

    return tpu_bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
