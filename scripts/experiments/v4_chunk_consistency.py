"""The DeepSeek-V4 step's own chunk consistency in each precision regime (issue 27, deliverable
5): one sequence run as ONE prefill of ``N`` tokens, and as a prefill of ``P`` tokens then
``N - P`` one-token decodes; for every position after ``P`` the CSA layer's selected entries
(``V4StepResult.topk``, the official form) are compared as sets, and the layer outputs (after
``v4_output``) by their largest difference. The official code measured against itself the same
way agrees on 430 of 440 decode rows (issue 27: prefill 37 then 220 decodes, prefill 133 then 127
decodes; its own CPU top-k).

The tiny model of the step tests (``tests/v4_step_model.py``: head 512, 2 heads, index top-k 8,
window 128, random weights), QAT on, the reference backend (the Pallas backend equals it step
for step: ``tests/test_v4_step.py``). CPU only; about 2 minutes on 2 cores.

    python -m scripts.experiments.v4_chunk_consistency    (from the repository root)
"""

from __future__ import annotations

import argparse

import numpy as np

RATIOS = (0, 4, 128)
MAX_SEQ = 288


def run(schedule, precision: str, qat: bool, seed: int = 0):
    """Drive one sequence through ``schedule`` (new tokens per step); returns ``(picks, outs)``:
    per position the CSA row's picked entries (a sorted tuple) and the layers' outputs."""
    import jax.numpy as jnp

    from dsa_jax.v4_step import v4_step
    from reference import deepseek_v4 as dv4
    from tests import v4_step_model as vm

    cfgs = vm.configs(RATIOS)
    params = [dv4.init_params(c, seed=seed + i) for i, c in enumerate(cfgs)]
    total = int(sum(schedule))
    x = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(
        (total, cfgs[0].dim), dtype=np.float32))
    pm = vm.PagedModel(RATIOS, 1, MAX_SEQ)
    sp = vm.step_params(cfgs, params, MAX_SEQ)
    sink = jnp.stack([p["attn_sink"] for p in params])
    caches, states, done = pm.caches, pm.states, 0
    picks, outs = {}, {}
    for q in schedule:
        pos = jnp.arange(done, done + q, dtype=jnp.int32)
        per_layer = [vm.project(params[li], x[done:done + q], pos, c, MAX_SEQ, qat, precision)
                     for li, c in enumerate(cfgs)]
        meta = pm.meta(np.array([done + q]), np.array([q]), decode=q == 1)
        res = v4_step(vm.step_inputs(cfgs, per_layer, sink), sp, caches, states, meta,
                      layout=pm.layout, qat=qat, backend="reference", precision=precision)
        caches, states = res.caches, res.states
        topk = np.asarray(res.topk[0])
        layer_out = [np.asarray(vm.finish(params[li], res.out[li].astype(jnp.float32), pos, c,
                                          MAX_SEQ, precision), np.float64)
                     for li, c in enumerate(cfgs)]
        for r in range(q):
            picks[done + r] = tuple(sorted(int(e) for e in topk[r] if e >= 0))
            outs[done + r] = [o[r] for o in layer_out]
        done += q
    return picks, outs


def compare(prefill: int, decodes: int, precision: str, qat: bool) -> tuple[int, int, list]:
    """``(rows with equal CSA sets, rows, max |diff| per layer)`` over the decode positions."""
    one = run([prefill + decodes], precision, qat)
    split = run([prefill] + [1] * decodes, precision, qat)
    rows = range(prefill, prefill + decodes)
    same = sum(one[0][p] == split[0][p] for p in rows)
    diff = [max(float(np.abs(one[1][p][li] - split[1][p][li]).max()) for p in rows)
            for li in range(len(RATIOS))]
    return same, len(rows), diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="37:220,133:127",
                    help="prefill:decodes pairs (default: the issue's two runs)")
    ap.add_argument("--precisions", default="f32,bf16")
    ap.add_argument("--no-qat", action="store_true")
    args = ap.parse_args(argv)
    runs = [tuple(int(v) for v in r.split(":")) for r in args.runs.split(",")]
    print("| precision | run | CSA sets equal | max abs diff of outputs (SWA / CSA / HCA) |")
    print("|---|---|---|---|")
    for precision in args.precisions.split(","):
        tot_same = tot = 0
        for prefill, decodes in runs:
            same, n, diff = compare(prefill, decodes, precision, not args.no_qat)
            tot_same, tot = tot_same + same, tot + n
            print(f"| {precision} | {prefill} + {decodes} | {same} / {n} | "
                  f"{' / '.join(f'{d:.2g}' for d in diff)} |", flush=True)
        print(f"| {precision} | all | {tot_same} / {tot} | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
