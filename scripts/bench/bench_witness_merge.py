"""Microbenchmark: the segment-witness merge against a plain copy of the same buffer.

Times ``jax.jit(scatter_topology_witnesses)`` (the serving entry: witnesses computed from the
whole row and written into the last ``S`` slots), the same with ``fill="lowest"`` (a row's
``w`` witnesses over its last ``w`` slots) and ``jax.jit(jnp.copy)`` on the same
``i32[rows, topk]`` buffer, interleaved in one run, median of N after warm-up, each call ended
by ``block_until_ready``. Upstream (vllm#47942, fused Triton kernel, RTX 4060 Laptop) reports
1.12x to 1.62x a copy at 512..32 rows x topk 2048, S = 64.

    python -m scripts.bench.bench_witness_merge            # 512 x 2048, S = 64, N = 50
    python -m scripts.bench.bench_witness_merge --quick    # N = 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tpu  # noqa: E402
from reference.witnesses import scatter_topology_witnesses  # noqa: E402


def make_case(rows: int, topk: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learned rows shaped like a real top-k: context lengths log-uniform in [256, 128K]; a row
    holds ``min(topk, L)`` distinct tokens, concentrated as a learned density rule is: sink
    tokens at the start, a recent window, and a few hot clusters, in score (random) order, so
    long rows miss most segments and short rows miss none. ``-1`` pads short rows."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.uniform(np.log(256), np.log(131_072), rows)).astype(np.int64)
    learned = np.full((rows, topk), -1, np.int32)
    for r, length in enumerate(lens.tolist()):
        n = min(topk, length)
        if n == length:
            picked = rng.permutation(length)
        else:
            sinks = np.arange(min(16, n))
            recent = np.arange(length - n // 2, length)
            centers = rng.integers(0, length, 4)
            clusters = (centers[:, None] + rng.integers(-n // 4, n // 4, (4, n))).reshape(-1)
            pool = np.unique(np.clip(np.concatenate([sinks, recent, clusters]), 0, length - 1))
            picked = rng.permutation(pool)[:n]
        learned[r, : len(picked)] = picked
    return learned, lens.astype(np.int32)


def time_calls(fns: dict, args: dict, reps: int) -> dict[str, list[float]]:
    """Interleaved timings (seconds) so both see the same machine load."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            out[name].append(time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    tpu.skip_tpu_probe_without_tpu()  # times the default backend; no libtpu noise without a TPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--segments", type=int, default=64)
    parser.add_argument("-n", "--reps", type=int, default=50, help="timed calls per op")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N = 10, warm-up 1")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    reps, warmup = (10, 1) if opts.quick else (opts.reps, opts.warmup)

    learned_np, lens_np = make_case(opts.rows, opts.topk, opts.seed)
    learned, lens = jnp.asarray(learned_np), jnp.asarray(lens_np)
    merge = jax.jit(scatter_topology_witnesses, static_argnums=2, static_argnames="fill")
    copy = jax.jit(jnp.copy)
    fns = {
        "copy": copy,
        "scatter_topology_witnesses": lambda x, c: merge(x, c, opts.segments),
        'scatter_topology_witnesses(fill="lowest")':
            lambda x, c: merge(x, c, opts.segments, fill="lowest"),
    }
    args = {name: (learned, lens) for name in fns}
    args["copy"] = (learned,)
    time_calls(fns, args, warmup)  # compile + warm caches
    times = time_calls(fns, args, reps)
    med = {name: statistics.median(t) for name, t in times.items()}

    changed = int((np.asarray(merge(learned, lens, opts.segments)) != learned_np).sum())
    print(
        f"rows={opts.rows} topk={opts.topk} S={opts.segments} N={reps} "
        f"backend={jax.default_backend()} ({jax.devices()[0].device_kind}); "
        f"{changed} slots changed by the merge"
    )
    print()
    print("| op | median (us) | min (us) | x copy |")
    print("|---|---:|---:|---:|")
    for name in fns:
        print(
            f"| {name} | {med[name] * 1e6:.1f} | {min(times[name]) * 1e6:.1f} | "
            f"{med[name] / med['copy']:.2f} |"
        )
    print()
    ratio = med["scatter_topology_witnesses"] / med["copy"]
    print(f"ratio (median merge / median copy): {ratio:.2f}x")
    low = med['scatter_topology_witnesses(fill="lowest")'] / med["copy"]
    print(f"ratio (median lowest-fill merge / median copy): {low:.2f}x")


if __name__ == "__main__":
    main()
