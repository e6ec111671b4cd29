"""Side-by-side benchmarks of the jnp references against the seed algorithm (labelled baseline).

What each number is:
- CPU timings: median of N wall-clock runs of the jitted op on this machine, all rows measured in
  one run (the machine is shared and noisy: compare ratios within a run, not across runs).
- TPU temp memory: ``compiled.memory_analysis().temp_size_in_bytes`` of an AOT compile for a real
  TPU generation through libtpu on CPU (a compile result, not a run).

Usage: ``python -m scripts.bench.bench [--quick] [--reps N] [--context N] [--out DIR] [--skip-aot]
[--aot-op TEXT]``
(``--context`` sets the CPU rows' context, 8192 by default; the test suite's smoke run takes a
smaller one: the seed's general paths are O(S * T * context); ``--aot-op`` keeps the AOT rows
whose op label contains TEXT: the smoke run compiles one, each is 10-25 s of XLA's TPU top-k).
Writes ``DIR/bench.md`` and ``DIR/bench.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import chips as chip_specs  # noqa: E402
from reference import (  # noqa: E402
    page_sparse_mla_ref,
    sparse_mla_ref,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
)
from reference.synthetic import make_ragged_batch  # noqa: E402
from scripts.bench.seed_baseline import seed_page_topk, seed_sparse_mla, seed_topk  # noqa: E402

SM_SCALE = 192**-0.5 * (0.1 * np.log(40) + 1.0) ** 2  # DeepSeek-V3.2 (about 0.1352)


def median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def indexer_batch(q_lens, kv_len, *, heads=64, dim=128, page_size=64, seed=0):
    cap_pages = -(-kv_len // page_size)
    rng = np.random.default_rng(seed)
    return make_ragged_batch(rng, q_lens=q_lens, kv_lens=[kv_len] * len(q_lens),
                             page_size=page_size, pages_per_seq=cap_pages, num_heads=heads,
                             dim=dim, fill=0.0, tail_pages=0)


CONTEXT = 8192  # the CPU rows' context (tokens) unless --context says otherwise
TOPK = 2048  # token top-k and sparse MLA's selected tokens (at most half the context)


def _ctx(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def decode_label(context: int) -> str:
    return f"decode 16x{_ctx(context)}"


def _shapes(quick: bool, context: int) -> dict[str, list[int]]:
    prefill = 256 if quick else 1024
    return {decode_label(context): [1] * 16, f"MTP 4x4 @{_ctx(context)}": [4] * 4,
            f"chunked prefill {prefill} @{_ctx(context)}": [prefill]}


def cpu_rows(quick: bool, reps: int, context: int = CONTEXT) -> list[dict]:
    """Every reference op vs its seed counterpart at decode, MTP and chunked-prefill shapes,
    ``context`` tokens per sequence."""
    rows = []
    for label, q_lens in _shapes(quick, context).items():
        rows += indexer_rows(label, q_lens, reps, context) + mla_rows(label, q_lens, reps,
                                                                      context)
        print(f"  {label}: done", flush=True)
    return rows


def indexer_rows(label: str, q_lens: list[int], reps: int,
                 context: int = CONTEXT) -> list[dict]:
    b = indexer_batch(q_lens, context)
    dev = [jnp.asarray(x) for x in b.args()]
    kw = dict(k=min(TOPK, context // 2), pages_per_seq=b.pages_per_seq)
    pkw = dict(k_pages=32, pages_per_seq=b.pages_per_seq)
    p = functools.partial
    ops = {"token top-k (ours, general)": p(streamindex_topk_ref, *dev, **kw),
           "token top-k (seed, general) [baseline]": p(seed_topk, *dev, **kw),
           "page top-k (ours, general)": p(streamindex_page_topk_ref, *dev, **pkw),
           "page top-k (seed, general) [baseline]": p(seed_page_topk, *dev, **pkw)}
    if all(x == 1 for x in q_lens):
        ops["token top-k (ours, decode fast path)"] = p(streamindex_topk_ref, *dev,
                                                        one_token_per_seq=True, **kw)
        ops["token top-k (seed, decode fast path) [baseline]"] = p(seed_topk, *dev,
                                                                   one_token_per_seq=True, **kw)
    return [{"shape": label, "op": name, "cpu_ms": median_ms(fn, reps)}
            for name, fn in ops.items()]


def mla_rows(label: str, q_lens: list[int], reps: int, context: int = CONTEXT) -> list[dict]:
    """Sparse MLA (token: ours vs seed) and page-sparse MLA (ours; the seed has none)."""
    kv, k, heads, dim, v_dim = context, min(TOPK, context // 2), 16, 640, 512
    rng = np.random.default_rng(1)
    b = make_ragged_batch(rng, q_lens=q_lens, kv_lens=[kv] * len(q_lens), page_size=64,
                          pages_per_seq=kv // 64, num_heads=heads, dim=dim, fill=0.0)
    num_rows = b.q.shape[0]
    idx = np.stack([rng.permutation(kv)[:k] for _ in range(num_rows)]).astype(np.int32)
    pages = np.stack([rng.permutation(kv // 64)[:32] for _ in range(num_rows)]).astype(np.int32)
    meta = [jnp.asarray(x) for x in b.meta()[1:]]
    q, cache, lens = jnp.asarray(b.q), jnp.asarray(b.cache), jnp.asarray(b.seq_lens)
    kw = dict(sm_scale=SM_SCALE, pages_per_seq=b.pages_per_seq, v_dim=v_dim)
    label = f"{label} (MLA H=16, k={k})"
    p = functools.partial
    ops = {"sparse_mla (ours)": p(sparse_mla_ref, q, cache, lens, jnp.asarray(idx), *meta, **kw),
           "sparse_mla (seed) [baseline]": p(seed_sparse_mla, q, cache, lens,
                                             jnp.asarray(idx), *meta, **kw),
           "page_sparse_mla, 32 pages (ours; no seed counterpart)": p(
               page_sparse_mla_ref, q, cache, lens, jnp.asarray(pages), *meta, **kw)}
    return [{"shape": label, "op": name, "cpu_ms": median_ms(fn, reps)}
            for name, fn in ops.items()]


def _indexer_specs(rows: int, num_seqs: int, cap: int, *, heads=64, dim=128, ps=64):
    S = jax.ShapeDtypeStruct
    pps = cap // ps
    return pps, [S((rows, heads, dim), jnp.bfloat16), S((rows, heads), jnp.bfloat16),
                 S((num_seqs * pps + 8, ps, dim), jnp.bfloat16), S((num_seqs,), jnp.int32),
                 S((num_seqs * pps,), jnp.int32), S((num_seqs + 1,), jnp.int32),
                 S((num_seqs + 1,), jnp.int32), S((3,), jnp.int32)]


def _mla_specs(rows: int, num_seqs: int, cap: int, *, heads=16, dim=640, k=2048, ps=64):
    S = jax.ShapeDtypeStruct
    pps = cap // ps
    return pps, [S((rows, heads, dim), jnp.bfloat16),
                 S((num_seqs * pps + 8, ps, dim), jnp.bfloat16), S((num_seqs,), jnp.int32),
                 S((rows, k), jnp.int32), S((num_seqs * pps,), jnp.int32),
                 S((num_seqs + 1,), jnp.int32), S((num_seqs + 1,), jnp.int32),
                 S((3,), jnp.int32)]


def aot_cases(quick: bool):
    """(shape label, op label, fn, specs): the CPU-timed ops at serving shapes, bf16."""
    cases = []
    shapes = [("decode 16x8K", 16, 16, 8192), ("chunked prefill 4096 @128K", 4096, 1, 131072)]
    for label, rows, seqs, cap in shapes:
        pps, specs = _indexer_specs(rows, seqs, cap)
        cases += [
            (label, "token top-k (ours)",
             functools.partial(streamindex_topk_ref, k=2048, pages_per_seq=pps), specs),
            (label, "page top-k (ours)",
             functools.partial(streamindex_page_topk_ref, k_pages=32, pages_per_seq=pps), specs),
            (label, "token top-k (seed) [baseline]",
             functools.partial(seed_topk, k=2048, pages_per_seq=pps), specs),
            (label, "page top-k (seed) [baseline]",
             functools.partial(seed_page_topk, k_pages=32, pages_per_seq=pps), specs)]
    mla_shapes = [("sparse MLA decode 16x8K H=16", 16, 16, 8192),
                  ("sparse MLA prefill 1024 @32K H=16", 1024, 1, 32768)]
    for label, rows, seqs, cap in mla_shapes:
        pps, specs = _mla_specs(rows, seqs, cap)
        kw = dict(sm_scale=float(SM_SCALE), pages_per_seq=pps, v_dim=512)
        cases += [(label, "sparse_mla (ours)", functools.partial(sparse_mla_ref, **kw), specs),
                  (label, "sparse_mla (seed) [baseline]",
                   functools.partial(seed_sparse_mla, **kw), specs)]
    if quick:  # the acceptance shape only
        cases = [c for c in cases if c[0].startswith("chunked prefill") and "ours" in c[1]]
    return cases


def aot_rows(quick: bool, op: str = "") -> list[dict]:
    """TPU temp memory of ``aot_cases(quick)`` whose op label contains ``op`` (all by default)."""
    from pallas_kernels.aot import aot_compile

    chips = [chip_specs.DEFAULT] if quick else list(chip_specs.NAMES)
    rows = []
    for chip in chips:
        for label, name, fn, specs in [c for c in aot_cases(quick) if op in c[1]]:
            t0 = time.perf_counter()
            mem = aot_compile(fn, specs, chip, name).memory_analysis()
            rows.append({"shape": label, "op": name, "chip": chip,
                         "temp_MiB": mem.temp_size_in_bytes / 2**20,
                         "compile_s": time.perf_counter() - t0})
            print(f"  {chip} {label} {name}: {rows[-1]['temp_MiB']:.0f} MiB", flush=True)
    return rows


def markdown(cpu: list[dict], aot: list[dict], context: int = CONTEXT) -> str:
    lines = ["| shape | op | CPU median ms |", "|---|---|---:|"]
    lines += [f"| {r['shape']} | {r['op']} | {r['cpu_ms']:.1f} |" for r in cpu]
    by = {(r["shape"], r["op"]): r["cpu_ms"] for r in cpu}
    d = decode_label(context)
    ratios = []
    if (d, "token top-k (ours, general)") in by:
        ratios.append((f"general / decode fast path (ours), {d}",
                       by[(d, "token top-k (ours, general)")]
                       / by[(d, "token top-k (ours, decode fast path)")]))
        for shape in [x for x in dict.fromkeys(r["shape"] for r in cpu) if "MLA" not in x]:
            for kind in ("token", "page"):
                ratios.append((f"seed / ours, {kind} top-k (general), {shape}",
                               by[(shape, f"{kind} top-k (seed, general) [baseline]")]
                               / by[(shape, f"{kind} top-k (ours, general)")]))
    m = f"{d} (MLA H=16, k={min(TOPK, context // 2)})"
    if (m, "sparse_mla (ours)") in by:
        ratios.append((f"seed sparse_mla / ours (speed-up), {d} H=16",
                       by[(m, "sparse_mla (seed) [baseline]")] / by[(m, "sparse_mla (ours)")]))
    for shape in [x for x in dict.fromkeys(r["shape"] for r in cpu) if "MLA" in x and x != m]:
        ratios.append((f"seed sparse_mla / ours, {shape}",
                       by[(shape, "sparse_mla (seed) [baseline]")]
                       / by[(shape, "sparse_mla (ours)")]))
    lines += ["", "| ratio (same run) | value |", "|---|---:|"]
    lines += [f"| {name} | {v:.2f}x |" for name, v in ratios]
    if aot:
        lines += ["", "| shape | op | chip | TPU temp MiB (AOT compile) |", "|---|---|---|---:|"]
        lines += [f"| {r['shape']} | {r['op']} | {r['chip']} | {r['temp_MiB']:.0f} |"
                  for r in aot]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"smaller prefill, {chip_specs.DEFAULT}-only AOT")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    p.add_argument("--context", type=int, default=CONTEXT,
                   help=f"the CPU rows' context in tokens (default {CONTEXT}; top-k "
                        f"min({TOPK}, context / 2))")
    p.add_argument("--out", default="out/bench", help="output folder for bench.md/bench.json")
    p.add_argument("--skip-aot", action="store_true", help="skip the TPU AOT memory rows")
    p.add_argument("--aot-op", default="",
                   help="only the AOT rows whose op label contains this text (default: all)")
    a = p.parse_args(argv)
    reps = a.reps or (3 if a.quick else 7)
    print(f"CPU timings (median of {reps}) ...", flush=True)
    if a.context < 128 or a.context % 64:
        p.error(f"--context must be a positive multiple of 64 (the page size) >= 128, "
                f"got {a.context}")
    cpu = cpu_rows(a.quick, reps, a.context)
    aot = [] if a.skip_aot else aot_rows(a.quick, a.aot_op)
    if not (aot or a.skip_aot):
        p.error(f"--aot-op {a.aot_op!r} matches no AOT row (op labels: "
                f"{sorted({c[1] for c in aot_cases(a.quick)})})")
    md = markdown(cpu, aot, a.context)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(md)
    (out / "bench.json").write_text(json.dumps({"cpu": cpu, "aot": aot}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
