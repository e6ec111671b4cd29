"""Wall-clock timings on a TPU: every Pallas kernel at its decode compile-gate shape, the top-k
selection at the V4 shapes, and the two steps at a small decode (``python -m dsa_jax tpu-bench``,
``python -m scripts.bench.tpu_bench``).

Cases (``cases(chip, quick)``), each one row of the table:

- ``kernel``: the decode case of each compile gate (``pallas_kernels.*.compile_cases``: its
  function for the chip, its argument shapes, its traffic model): the indexer's token and page
  entries (V3.2, 64 x 4096), sparse MLA token and page (64 x 8192, H=128), the fused V4
  attention (V4-Flash CSA and HCA, packed and fp8 caches) and the V4 compressor (CSA, HCA and
  indexer decode). Inputs are a valid decode batch (``fill``: every row a sequence at its full
  context, permuted page tables, distinct selected entries); float caches hold random bf16
  values (an fp8 cache's words are bf16 bit patterns too: a timing input, not a model input).
- ``selection``: f32 scores ``[64, N]`` (``SELECTION_COLUMNS``), k = ``SELECTION_K``:
  ``lax.top_k``, ``lax.approx_max_k(recall_target=0.95)`` and ``reference.select_topk`` (the
  package's selection, its default recall target).
- ``step``: ``dsa_jax.dsa_step`` (V3.2, ``python -m dsa_jax run --quick``'s sizes) and
  ``dsa_jax.v4_step`` (V4-Flash, ``--model v4-flash --quick``'s sizes), Pallas backend, decode
  rows only.

Each case's inputs are built on the device once, its function jitted, compiled and warmed up,
then timed ``iters`` times with ``block_until_ready``: median, p10 and p90 in microseconds. The
``model bytes`` column is the compile case's traffic model (``aot.Traffic.bytes_moved`` for the
chip) and ``model GB/s`` that over the median: a model's bytes over a measured time.

Off a TPU it times nothing and exits 2 (``NEEDS_TPU``), unless ``--allow-cpu``: then every case
runs at tiny shapes (``--quick`` implied), the kernels in the Pallas interpreter, so that CI can
test the plumbing; such times are not TPU times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

NEEDS_TPU = "needs a TPU: found {backend}; nothing timed"
SELECTION_COLUMNS = (2048, 8192, 131072)  # V4 index entries: 8K, 32K and 512K-token contexts
SELECTION_ROWS, SELECTION_K, APPROX_RECALL = 64, 512, 0.95
# the decode case of each compile gate: (module, cases function, its kwargs, shape names)
GATE_DECODE = (
    ("pallas_kernels.indexer.compile_cases", "token_cases", {"quick": True}, ("decode 64x4096",)),
    ("pallas_kernels.indexer.compile_cases", "page_cases", {"quick": True}, ("decode 64x4096",)),
    ("pallas_kernels.mla.compile_cases", "token_cases", {}, ("decode64x8192_h128_k2048_packed",)),
    ("pallas_kernels.mla.compile_cases", "page_cases", {}, ("decode64x8192_h128_p32x64_bf16",)),
    ("pallas_kernels.v4_attention.compile_cases", "compile_cases",
     {"fused": True, "fmt": "packed"}, ("flash_csa_decode64x8192_h64_k512",
                                        "flash_hca_decode64x8192_h64")),
    ("pallas_kernels.v4_attention.compile_cases", "compile_cases",
     {"fused": True, "fmt": "fp8"}, ("flash_csa_decode64x8192_h64_k512",
                                     "flash_hca_decode64x8192_h64")),
    ("pallas_kernels.v4_compressor.compile_cases", "compile_cases", {},
     ("csa_d512_decode64", "hca_d512_decode64", "index_d128_decode64")),
)


@dataclass(frozen=True)
class Case:
    """One table row: ``build() -> (fn, args)`` (host arguments; placed on the device once)."""

    group: str
    name: str
    shape: str
    build: Callable[[], tuple[Callable, tuple]]
    model_bytes: int | None = None


# ------------------------------------------------------------------------------------ inputs

def _rand(rng, spec, scale: float = 1.0):
    """Random values of ``spec`` (a float array, or u32 words holding two bf16 values each)."""
    shape, dt = spec.shape, jnp.dtype(spec.dtype)
    if dt == jnp.uint32:
        halves = (rng.standard_normal((*shape, 2), np.float32) * scale).astype(jnp.bfloat16)
        return np.asarray(halves).view(np.uint32).reshape(shape)
    if jnp.issubdtype(dt, jnp.floating):
        return np.asarray((rng.standard_normal(shape, np.float32) * scale).astype(dt))
    raise TypeError(f"no random filler for dtype {dt} (shape {shape})")


def _floats(rng, tree, scale: float = 1.0):
    return jax.tree.map(lambda s: _rand(rng, s, scale), tree)


def _table(rng, seqs: int, pages_per_seq: int, page_size: int, num_pages: int):
    """``(page_indices, cu_lens)``: each sequence's pages a random distinct set of the cache's."""
    ids = rng.permutation(num_pages)[:seqs * pages_per_seq].astype(np.int32)
    return ids, (np.arange(seqs + 1) * pages_per_seq * page_size).astype(np.int32)


def _distinct(rng, rows: int, k: int, n: int) -> np.ndarray:
    """``i32[rows, k]``: k distinct entries of ``[0, n)`` per row."""
    return np.argsort(rng.random((rows, n)), axis=1)[:, :k].astype(np.int32)


def _decode_meta(seqs: int):
    """``(cu_q_lens, distribution)`` of ``seqs`` decode rows, one per sequence."""
    return np.arange(seqs + 1, dtype=np.int32), np.asarray([seqs, seqs, seqs], np.int32)


def fill_indexer(specs, rng) -> tuple:
    """A decode batch for ``streamindex_(page_)topk``: ``(q, weights, cache, seq_lens,
    page_indices, cu_q_lens, cu_kv_lens, distribution)``, every sequence at its capacity."""
    q, w, cache, lens, table = specs[:5]
    seqs, ps = lens.shape[0], cache.shape[1]
    pps = table.shape[0] // seqs
    ids, cu_kv = _table(rng, seqs, pps, ps, cache.shape[0])
    cu_q, dist = _decode_meta(seqs)
    return (_rand(rng, q), _rand(rng, w, 1 / 8), _rand(rng, cache),
            np.full((seqs,), pps * ps, np.int32), ids, cu_q, cu_kv, dist)


def fill_mla(specs, rng, *, token: bool) -> tuple:
    """A decode batch for ``sparse_mla`` / ``page_sparse_mla``: ``(q, cache, kv_lens,
    selected, page_indices, cu_q_lens, cu_kv_lens, distribution)``."""
    q, cache, lens, sel, table = specs[:5]
    seqs, ps = lens.shape[0], _cache_arr(cache).shape[1]
    pps = table.shape[0] // seqs
    ids, cu_kv = _table(rng, seqs, pps, ps, _cache_arr(cache).shape[0])
    cu_q, dist = _decode_meta(seqs)
    picked = _distinct(rng, sel.shape[0], sel.shape[1], pps * ps if token else pps)
    return (_rand(rng, q), _floats(rng, cache), np.full((seqs,), pps * ps, np.int32), picked,
            ids, cu_q, cu_kv, dist)


def _cache_arr(cache):
    return jax.tree.leaves(cache)[0]


def fill_v4(specs, rng, *, ratio: int) -> tuple:
    """A decode batch for ``v4_attention``: ``(q, window, kv_lens, cu_q_lens, distribution,
    compressed, compressed_indices)``, every row a sequence at ``window pages x page`` tokens."""
    from reference.v4_attention import PagedKV

    q, window, lens, _, _, comp, idx = specs
    seqs = lens.shape[0]

    def paged(p):
        arr = _cache_arr(p.cache)
        pps = p.page_indices.shape[0] // seqs
        return PagedKV(_floats(rng, p.cache), *_table(rng, seqs, pps, arr.shape[1],
                                                      arr.shape[0])), pps * arr.shape[1]

    win, context = paged(window)
    cu_q, dist = _decode_meta(seqs)
    comp_kv = paged(comp)[0] if comp is not None else None
    picked = (_distinct(rng, idx.shape[0], idx.shape[1], context // ratio)
              if idx is not None else None)
    return (_rand(rng, q, 1 / 8), win, np.full((seqs,), context, np.int32), cu_q, dist,
            comp_kv, picked)


def fill_compressor(specs, rng, *, ratio: int) -> tuple:
    """A decode step for ``compress_step`` where every sequence completes an entry: ``(kv,
    score, ape, weight, cos, sin, state kv, state score, slots, kv_lens, cu_q_lens,
    distribution[, rope_rows])``."""
    seqs = specs[8].shape[0]
    cu_q, dist = _decode_meta(seqs)
    floats = [_rand(rng, s, 1 / 8) for s in specs[:8]]
    rows = [_rand(rng, s, 1 / 8) for s in specs[12:]]  # rope_rows (values do not matter here)
    return (*floats, np.arange(seqs, dtype=np.int32), np.full((seqs,), 8 * ratio, np.int32),
            cu_q, dist, *rows)


# ------------------------------------------------------------------------------------- cases

def _filler(case):
    """The ``fill_*`` of a compile case's kernel."""
    if case.kernel.startswith("streamindex"):
        return fill_indexer
    if case.kernel in ("sparse_mla", "page_sparse_mla"):
        return functools.partial(fill_mla, token=case.kernel == "sparse_mla")
    if case.kernel.startswith("v4_attention"):
        return functools.partial(fill_v4, ratio=4 if "csa" in case.shape else 128)
    return functools.partial(fill_compressor, ratio=4 if not case.shape.startswith("hca")
                             else 128)


def gate_cases(chip: str) -> list[Case]:
    """``GATE_DECODE``'s compile cases as timed cases (each compile case's own function,
    shapes and traffic model for ``chip``)."""
    import importlib

    out = []
    for module, fn, kw, shapes in GATE_DECODE:
        for case in getattr(importlib.import_module(module), fn)(**kw):
            if case.shape not in shapes:
                continue

            def build(case=case):
                return case.fn_for_chip(chip), _filler(case)(case.specs,
                                                            np.random.default_rng(0))
            out.append(Case("kernel", case.kernel, case.shape, build,
                            case.traffic(chip).bytes_moved))
    return out


def selection_cases(columns=SELECTION_COLUMNS, rows: int = SELECTION_ROWS,
                    k: int = SELECTION_K) -> list[Case]:
    """``lax.top_k``, ``lax.approx_max_k(recall_target=APPROX_RECALL)`` and
    ``reference.select_topk`` on f32 ``[rows, n]`` scores for each ``n`` of ``columns``."""
    from reference import select_topk

    ops = {"lax.top_k": lambda s: jax.lax.top_k(s, k),
           f"lax.approx_max_k(recall_target={APPROX_RECALL})":
               lambda s: jax.lax.approx_max_k(s, k, recall_target=APPROX_RECALL),
           "reference.select_topk": lambda s: select_topk(s, k)}
    out = []
    for n in columns:
        for name, op in ops.items():
            def build(op=op, n=n):
                return op, (np.random.default_rng(n).standard_normal((rows, n), np.float32),)
            out.append(Case("selection", name, f"f32[{rows},{n}] k={min(k, n)}", build,
                            4 * rows * n))
    return out


def step_cases(decode: int = 4) -> list[Case]:
    """The V3.2 ``dsa_step`` and V4-Flash ``v4_step`` on ``decode`` decode rows at the CLI's
    ``--quick`` sizes, Pallas backend (interpreted off a TPU)."""
    return [Case("step", "dsa_jax.dsa_step", f"V3.2 {decode} decode rows (run --quick sizes)",
                 functools.partial(_v32_step, decode)),
            Case("step", "dsa_jax.v4_step",
                 f"V4-Flash {decode} decode rows (run --model v4-flash --quick sizes)",
                 functools.partial(_v4_step, decode))]


def _cli_args() -> argparse.Namespace:
    """``python -m dsa_jax run --quick``'s arguments (its sizes: the steps' shapes)."""
    from dsa_jax import __main__ as cli

    return cli._run_parser(cli._parser()).parse_args(["--quick"])


def _v32_step(decode: int):
    import dsa_jax
    from dsa_jax import __main__ as cli

    args = _cli_args()
    s = cli._sizes(args)
    layout = cli._layout(args, s)
    types = tuple(dsa_jax.glm_index_share_pattern(s["layers"], leading_full=1))
    rng = np.random.default_rng(0)
    kv = [int(rng.integers(1, layout.capacity_tokens + 1)) for _ in range(decode)]
    inputs, latent, index, meta = cli._local_batch(rng, s, layout, types, [1] * decode, kv)
    kw = dict(layout=layout, indexer_types=types, k=s["k"], sm_scale=float(cli.SM_SCALE),
              backend="pallas")
    return (lambda i, lat, idx, m: dsa_jax.dsa_step(i, lat, idx, m, **kw).out,
            (inputs, latent, index, meta))


def _v4_step(decode: int):
    from dsa_jax import v4_cli
    from dsa_jax.v4_step import v4_step

    s = v4_cli.sizes(_cli_args())
    rng = np.random.default_rng(0)
    kv = [int(rng.integers(1, s["context"] + 1)) for _ in range(decode)]
    layout, inputs, params, caches, states, meta = v4_cli.build(rng, s, [1] * decode, kv)
    return (lambda *a: v4_step(*a, layout=layout, backend="pallas").out,
            (inputs, params, caches, states, meta))


def quick_kernel_cases(interpret: bool = True) -> list[Case]:
    """The ``gate_cases`` kernels at tiny decode shapes (2 sequences), in the Pallas interpreter
    when ``interpret`` (the ``--allow-cpu`` plumbing check); no traffic model."""
    from pallas_kernels.indexer import compile_cases as icases
    from pallas_kernels.indexer.page import streamindex_page_topk
    from pallas_kernels.indexer.token import streamindex_topk
    from pallas_kernels.mla import compile_cases as mcases
    from pallas_kernels.mla.page import page_sparse_mla
    from pallas_kernels.mla.token import sparse_mla
    from pallas_kernels.v4_attention import compile_cases as vcases
    from pallas_kernels.v4_attention.entry import v4_attention
    from pallas_kernels.v4_compressor import compile_cases as ccases
    from pallas_kernels.v4_compressor.kernel import compress_step
    from reference import v4_compressor as vc

    rng = np.random.default_rng(0)
    out = []
    ispecs, ipps = icases.gate_specs([1, 1], [128, 128], heads=4, page_size=16)
    for name, fn in (("streamindex_topk", functools.partial(streamindex_topk, k=32)),
                     ("streamindex_page_topk", functools.partial(streamindex_page_topk,
                                                                 k_pages=2))):
        f = functools.partial(fn, pages_per_seq=ipps, one_token_per_seq=True, interpret=interpret)
        out.append(Case("kernel", name, "decode 2x128 h4", lambda f=f: (f, fill_indexer(
            ispecs, rng))))
    for name, fn, sel, dt in (("sparse_mla", sparse_mla, 16, jnp.uint32),
                              ("page_sparse_mla", page_sparse_mla, 2, jnp.bfloat16)):
        specs = mcases.batch_specs(rows=2, heads=4, dim=mcases.MLA_DIM, seqs=2, context=128,
                                   page_size=16, selected=sel, cache_dtype=dt)
        f = functools.partial(fn, sm_scale=mcases.MLA_SCALE, pages_per_seq=8,
                              v_dim=mcases.MLA_V_DIM, interpret=interpret)
        out.append(Case("kernel", name, "decode 2x128 h4", lambda f=f, specs=specs, n=name: (
            f, fill_mla(specs, rng, token=n == "sparse_mla"))))
    context = 2 * vcases.WINDOW
    for fmt in vcases.FORMATS:
        for ratio, k in ((4, 16), (128, None)):
            specs = vcases.specs(rows=2, context=context, heads=8, ratio=ratio, k=k, fmt=fmt)
            f = functools.partial(
                v4_attention, sm_scale=vcases.SCALE, window_size=vcases.WINDOW,
                compress_ratio=ratio, window_pages_per_seq=context // vcases.PAGE,
                compressed_pages_per_seq=-(-(context // ratio) // vcases.PAGE), fused=True,
                interpret=interpret)
            g = (lambda q, w, kv, cu, d, c, i, f=f: f(q, w, kv, cu, d, compressed=c,
                                                      compressed_indices=i))
            out.append(Case("kernel", f"v4_attention_fused_{fmt}",
                            f"{'csa' if ratio == 4 else 'hca'} decode 2x{context} h8",
                            lambda g=g, specs=specs, r=ratio: (g, fill_v4(specs, rng, ratio=r))))
    specs = ccases.specs(d=128, ratio=4, rows=2, seqs=2)

    def comp(kv, score, ape, weight, cos, sin, skv, sscore, slots, kv_lens, cu, dist,
             rope_rows=None):
        return compress_step(kv, score, ape, weight, cos, sin,
                             vc.CompressorState(skv, sscore), slots, kv_lens, cu, dist,
                             ratio=4, interpret=interpret, rope_rows=rope_rows)
    out.append(Case("kernel", "v4_compressor", "index d128 decode 2",
                    lambda: (comp, fill_compressor(specs, rng, ratio=4))))
    return out


def cases(chip: str | None, quick: bool, interpret: bool = True) -> list[Case]:
    """Every row: kernels (``gate_cases(chip)``, or ``quick_kernel_cases(interpret)``),
    selection, steps."""
    kernels = quick_kernel_cases(interpret) if quick else gate_cases(chip)
    sel = selection_cases((256, 1024), rows=8, k=64) if quick else selection_cases()
    return kernels + sel + step_cases(decode=2 if quick else 4)


# ------------------------------------------------------------------------------------ timing

def time_case(case: Case, iters: int, warmup: int) -> dict:
    """Build on the device, compile, warm up, then ``iters`` timed calls: the table row."""
    fn, args = case.build()
    args = jax.device_put(args)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - t) * 1e6)
    p10, med, p90 = (float(x) for x in np.percentile(times, [10, 50, 90]))
    gbs = case.model_bytes / (med * 1e3) if case.model_bytes else None  # bytes / ns = GB/s
    return dict(group=case.group, name=case.name, shape=case.shape, median_us=med,
                p10_us=p10, p90_us=p90, iters=iters, compile_s=compile_s,
                model_bytes=case.model_bytes, model_gb_per_s=gbs)


def markdown(rows: list[dict], header: str) -> str:
    """The table: one line per row."""
    lines = [header, "", "| group | op | shape | median us | p10 us | p90 us | model bytes | "
             "model GB/s |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mb = f"{r['model_bytes']:,}" if r["model_bytes"] else "-"
        gbs = f"{r['model_gb_per_s']:.1f}" if r["model_gb_per_s"] else "-"
        lines.append(f"| {r['group']} | {r['name']} | {r['shape']} | {r['median_us']:.1f} | "
                     f"{r['p10_us']:.1f} | {r['p90_us']:.1f} | {mb} | {gbs} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsa_jax tpu-bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (plumbing, not timings)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run off a TPU too, at --quick shapes, kernels interpreted")
    p.add_argument("--iters", type=int, default=50, help="timed calls per case (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--only", default="", metavar="NAMES",
                   help="comma-separated groups (kernel, selection, step) or op names "
                        "(e.g. lax.top_k, v4_compressor): time only the rows they name")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write DIR/tpu_bench.md and DIR/tpu_bench.json")
    return p


def main(argv=None) -> int:
    """0 timed, 2 not a TPU (without ``--allow-cpu``) or bad flags."""
    args = parser().parse_args(argv)
    backend = jax.default_backend()
    if backend != "tpu" and not args.allow_cpu:
        print(NEEDS_TPU.format(backend=backend), file=sys.stderr)
        return 2
    if args.iters < 1 or args.warmup < 0:
        print(f"tpu-bench: --iters must be >= 1 and --warmup >= 0, got {args.iters}, "
              f"{args.warmup}", file=sys.stderr)
        return 2
    from pallas_kernels import chips

    kind = jax.devices()[0].device_kind
    chip = chips.of_kind(kind) if backend == "tpu" else None
    if backend == "tpu" and chip is None:  # a TPU without a chips.py entry: the newest's blocks
        chip = chips.NAMES[-1]
        print(f"tpu-bench: {kind!r} is not in pallas_kernels.chips; blocks and models of "
              f"{chip}", file=sys.stderr)
    quick = args.quick or backend != "tpu"
    only = set(filter(None, args.only.split(",")))
    rows = []
    for case in cases(chip, quick, interpret=backend != "tpu"):
        if not only or only & {case.group, case.name}:
            rows.append(time_case(case, args.iters, args.warmup))
            r = rows[-1]
            print(f"{r['group']:9s} {r['name']} [{r['shape']}]: median {r['median_us']:.1f} us",
                  flush=True)
    header = (f"# tpu-bench on {kind} ({backend}{', chip ' + chip if chip else ''}), "
              f"{'quick shapes' if quick else 'gate shapes'}, {args.iters} timed calls"
              + ("" if backend == "tpu" else " -- NOT a TPU: interpreter times, plumbing only"))
    text = markdown(rows, header)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tpu_bench.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "tpu_bench.json"), "w") as f:
            json.dump(dict(device_kind=kind, backend=backend, chip=chip, quick=quick,
                           rows=rows), f, indent=1)
    return 0
