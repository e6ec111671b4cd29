"""Whole-op cost report: XLA's TPU cost model of every public op, kernels and XLA glue apart.

For each chip (AOT compiles through libtpu on CPU; no TPU runs) and each program below, the
report gives XLA's ``bytes accessed`` split into the Pallas kernels' declared estimates and the
XLA ops (``pallas_kernels.xla_cost.analyze``), XLA's ``optimal_seconds``, whether the program
has a ``while`` loop, the XLA bytes over a reference quantity, and every gather / scatter HLO op
left in the program with its shapes, index count and verdict.

Programs (DeepSeek-V3.2 shapes of the compile gates; ``--quick`` keeps the starred ones):

- loop-free XLA parts: the witness merge (``scatter_topology_witnesses``, i32[512, 2048],
  S = 64)* beside a plain copy of the buffer*, and donated (in place, as serving calls it); the
  selection (``select_topk``, default and exact) on f32[64, N], N = 4096* and 131072, beside
  ``approx_max_k(aggregate_to_topk=True)`` alone and ``lax.top_k`` alone; the indexers'
  selection stage (``select_and_merge``) at their decode score shapes*; the cache write
  ``dsa_jax.update_kv_cache`` (donated)*;
- ``dsa_jax.indexer_topk`` / ``page_topk`` (backend ``"pallas"`` and ``"reference"``) at
  decode 64x4096*, decode 8x131072, MTP 16x4@4096, prefill 2048@32768, mixed
  60x1@4096 + 512@32768 (``pallas_kernels.indexer.compile_cases.GATE_SHAPES`` plus MTP); the
  reference is the kernel's modelled key bytes, and "net" subtracts the selection stage's XLA bytes;
- ``dsa_jax.sparse_mla`` / ``page_sparse_mla`` at decode 64x8192 H=128 and H=16*, MTP 16x4@4096
  H=128, prefill 1024@32768 (``sparse_mla.COMPILE_SHAPES`` plus MTP), k = 2048 tokens or 32
  pages of 64; the reference is the kernel's modelled bytes (``compile_cases`` traffic);
- ``dsa_jax.dsa_step``: two layers (full, shared), decode 64x4096, token and page granularity.

Caveats (printed with the report): a ``while`` body is counted once whatever its trip count, so
a program flagged ``loop`` reports a lower bound (bounds are asserted only on decode programs
whose loops carry <= 64 KiB, e.g. a ``searchsorted``); ``optimal_seconds`` is shown only when
XLA reports it non-negative (it is negative for some programs on every chip); a Pallas call
without ``pl.CostEstimate`` counts 0 in XLA's total, so its bytes then appear in no column.

The report opens with the issue-13 acceptance table per chip (ratio, ``ok`` only within the
bound with no per-element gather/scatter and negligible loops).

Usage: ``python scripts/whole_op_cost.py [--quick] [--chips v5e,v6e,tpu7x] [--markdown PATH]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Appended, so a PYTHONPATH tree (e.g. a worktree of an older commit) is measured instead.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dsa_jax  # noqa: E402
from dsa_jax import step as dsa_step_mod  # noqa: E402
from pallas_kernels import aot, xla_cost  # noqa: E402
from pallas_kernels.indexer import blocks as iblocks  # noqa: E402
from pallas_kernels.indexer import compile_cases as icases  # noqa: E402
from pallas_kernels.indexer import scoring, work_list  # noqa: E402
from pallas_kernels.indexer import traffic as itraffic  # noqa: E402
from pallas_kernels.mla import compile_cases as mcases  # noqa: E402
from reference import selection  # noqa: E402
from reference.witnesses import scatter_topology_witnesses  # noqa: E402

I32, F32, BF16, U32 = jnp.int32, jnp.float32, jnp.bfloat16, jnp.uint32
K, K_PAGES, SEGMENTS, RECALL = 2048, 32, 64, selection.DEFAULT_RECALL_TARGET
MTP = ([4] * 16, [4096] * 16, False)  # 16 sequences x 4 rows (MTP draft rows) at 4096

CAVEATS = """Caveats (XLA's model, not a measurement):
- A while loop's body is counted ONCE whatever its trip count: a program flagged `loop` reports
  a lower bound. The bounds (acceptance table, tests/test_whole_op_cost.py) are asserted only
  on decode programs whose loops are negligible (none, or state <= 64 KiB).
- optimal_seconds is shown only when non-negative: XLA reports it negative for some programs on
  every chip (e.g. select_topk at 64x131072 on v6e: -0.9995), so it is never used as a time.
- A Pallas call counts only its pl.CostEstimate (0 without one): "kernel" is the sum of the
  declared estimates; "XLA" = total - kernel. "net" subtracts the selection stage's XLA bytes.
- Gathers/scatters: `per-element` = a slice under 128 elements and more indices than the
  program's rows (query rows or sequences); `row` = a slice of >= 128 elements; `metadata` =
  at most one index per row; `allowed` = matched xla_cost.HOT_PATH_ALLOWED (reason shown).
- `loop`: the number of while loops and the largest carried state; one uncounted iteration
  touches on the order of that state (a searchsorted over S+1 offsets carries < 1 KB). Where a
  loop carries more than 64 KiB the ratio is marked `>=` (a lower bound) and no "net" is
  computed.
- source `~file:line`: XLA dropped the op's own metadata; read off its fusion or that fusion's
  first user."""


def _s(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


@dataclass(frozen=True)
class Program:
    """One row of the report.

    ``build(chip) -> (fn, specs, donate_argnums)``; ``rows``: the program's row limit for the
    per-element verdict; ``ref(chip, xla_by_key) -> (label, bytes) | None``: the quantity the
    XLA bytes are divided by; ``minus``: key of a program whose XLA bytes are subtracted."""

    key: str
    part: str
    name: str
    shape: str
    build: Callable
    rows: int
    ref: Callable | None = None
    minus: str | None = None
    quick: bool = False
    allowed: tuple[xla_cost.Allowed, ...] = xla_cost.HOT_PATH_ALLOWED


def _fixed(fn, specs, donate=()):
    return lambda chip: (fn, specs, donate)


def _xla_of(key: str, label: str):
    return lambda chip, done: (label, done[key].xla_bytes) if key in done else None


# ----------------------------------------------------------------------------- XLA parts


def witness_programs() -> list[Program]:
    rows, topk = 512, 2048
    buf = [_s((rows, topk), I32)]
    merge = functools.partial(scatter_topology_witnesses, num_segments=SEGMENTS)
    shape = f"i32[{rows},{topk}] S={SEGMENTS}"
    return [
        Program("copy", "witness merge", "copy of the buffer [reference]", f"i32[{rows},{topk}]",
                _fixed(jnp.copy, buf), rows, quick=True),
        Program("witness", "witness merge", "scatter_topology_witnesses", shape,
                _fixed(merge, buf + [_s((rows,), I32)]), rows, _xla_of("copy", "copy"),
                quick=True),
        # As its docstring says serving calls it: buffer donated, updated in place (the gate).
        Program("witness_donated", "witness merge", "scatter_topology_witnesses (donated)",
                shape, _fixed(merge, buf + [_s((rows,), I32)], (0,)), rows,
                _xla_of("copy", "copy"), quick=True),
        Program("witness_lowest_donated", "witness merge",
                'scatter_topology_witnesses(fill="lowest") (donated)', shape,
                _fixed(functools.partial(merge, fill="lowest"), buf + [_s((rows,), I32)], (0,)),
                rows, _xla_of("copy", "copy"), quick=True),
    ]


def selection_programs() -> list[Program]:
    out = []
    for n in (4096, 131072):
        spec, shape, q = [_s((64, n), F32)], f"f32[64,{n}] k={K}", n == 4096
        amk = functools.partial(jax.lax.approx_max_k, k=K, recall_target=RECALL,
                                aggregate_to_topk=True)
        out += [
            Program(f"amk{n}", "selection", "approx_max_k(aggregate_to_topk=True) [reference]",
                    shape, _fixed(amk, spec), 64, quick=q),
            Program(f"topk{n}", "selection", "lax.top_k [reference]", shape,
                    _fixed(functools.partial(jax.lax.top_k, k=K), spec), 64, quick=q),
            Program(f"sel{n}", "selection", "select_topk (default)", shape,
                    _fixed(functools.partial(selection.select_topk, k=K), spec), 64,
                    _xla_of(f"amk{n}", "approx_max_k"), quick=q),
            Program(f"selx{n}", "selection", "select_topk (exact)", shape,
                    _fixed(functools.partial(selection.select_topk, k=K, exact=True), spec), 64,
                    _xla_of(f"topk{n}", "top_k"), quick=q),
        ]
    def merge(scores, context_lens):
        return selection.select_and_merge(scores, K, context_lens, recall_target=RECALL,
                                          exact=False, num_segments=SEGMENTS)

    out.append(Program("selw4096", "selection", f"select_and_merge (default, S={SEGMENTS})",
                       f"f32[64,4096] k={K}", _fixed(merge, [_s((64, 4096), F32),
                                                             _s((64,), I32)]), 64,
                       _xla_of("amk4096", "approx_max_k")))
    return out


def stage_program(rows: int, cols: int, k: int, quick: bool) -> Program:
    """The indexers' selection stage at their score shape f32[rows, cols] (no witnesses)."""
    def fn(scores, context_lens):
        return selection.select_and_merge(scores, k, context_lens, recall_target=RECALL,
                                          exact=False, num_segments=0)

    return Program(f"stage{rows}x{cols}k{k}", "selection stage", "select_and_merge (default)",
                   f"f32[{rows},{cols}] k={k}",
                   _fixed(fn, [_s((rows, cols), F32), _s((rows,), I32)]), rows, quick=quick)


# ----------------------------------------------------------------------------- indexers


def _meta_specs(seqs: int, pages: int) -> list[jax.ShapeDtypeStruct]:
    return [_s((seqs,), I32), _s((pages,), I32), _s((seqs + 1,), I32), _s((seqs + 1,), I32),
            _s((3,), I32)]


def indexer_key_bytes(q_lens, kv_lens, *, page_mode: bool, one_token_per_seq: bool,
                      chip: str) -> int:
    """The score kernel's modelled key bytes (the ``keys`` term of ``itraffic.traffic``: pages
    needed per work item, replayed with ``itraffic.replay_items``), bf16 keys, gate dims."""
    ps, pps = icases.GATE_PAGE, -(-max(kv_lens) // icases.GATE_PAGE)
    blocks = iblocks.resolve_blocks(None, block_rows=None, block_pages=None, chip=chip,
                                one_token_per_seq=one_token_per_seq, pages_per_seq=pps)
    total = sum(q_lens)
    c = scoring.chunk_rows(total, pps if page_mode else pps * ps, blocks.block_rows,
                       scoring.SCORE_CHUNK_BYTES)
    ladder = work_list.row_ladder(blocks.block_rows, c, one_token_per_seq)
    pages = 0
    for row0 in sorted({min(i * c, total - c) for i in range(-(-total // c))}):
        for items in itraffic.replay_items(q_lens, kv_lens, row0=row0, rows=c, total_rows=total,
                                      ladder=ladder, page_size=ps, capacity=pps * ps):
            pages += sum(p for _, _, p in items)
    return pages * ps * icases.GATE_DIM * jnp.dtype(BF16).itemsize


def indexer_programs(quick: bool) -> list[Program]:
    shapes = dict(icases.GATE_SHAPES)
    shapes["MTP 16x4@4096"] = MTP
    out = []
    for name, (q_lens, kv_lens, otp) in shapes.items():
        is_quick = name == "decode 64x4096"
        if quick and not is_quick:
            continue
        specs, pps = icases.gate_specs(q_lens, kv_lens)
        rows = max(sum(q_lens), len(q_lens))
        for op, page_mode in (("indexer_topk", False), ("page_topk", True)):
            k = min(K_PAGES, pps) if page_mode else K
            cols = pps if page_mode else pps * icases.GATE_PAGE
            stage = stage_program(sum(q_lens), cols, k, is_quick)
            loop_free = otp or name.startswith("MTP")
            if loop_free:
                out.append(stage)

            def ref(chip, done, q_lens=q_lens, kv_lens=kv_lens, page_mode=page_mode, otp=otp):
                return "key bytes (model)", indexer_key_bytes(
                    q_lens, kv_lens, page_mode=page_mode, one_token_per_seq=otp, chip=chip)

            for backend in ("pallas", "reference"):
                def build(chip, op=op, k=k, pps=pps, otp=otp, backend=backend, specs=specs,
                          page_mode=page_mode):
                    opts = {"chip": chip, "interpret": False} if backend == "pallas" else None
                    fn = functools.partial(getattr(dsa_jax, op), **{
                        "k_pages" if page_mode else "k": k}, pages_per_seq=pps,
                        one_token_per_seq=otp, backend=backend, kernel_options=opts)
                    return fn, specs, ()

                out.append(Program(f"{op}/{backend}/{name}", op, backend, name, build, rows, ref,
                                   stage.key if loop_free else None,
                                   quick=is_quick and backend == "pallas"))
    return out


# ----------------------------------------------------------------------------- sparse MLA


def _mla_cases() -> list[tuple[str, object, str, int]]:
    """``(op, CompileCase, shape name, rows)`` for the MLA kernels' compile shapes plus MTP."""
    out = []
    for op, cases in (("sparse_mla", mcases.token_cases), ("page_sparse_mla",
                                                           mcases.page_cases)):
        for case in cases(quick=True):
            rows = next(r for n, r, *_ in mcases.COMPILE_SHAPES if case.shape.startswith(n))
            out.append((op, case, case.shape, rows))
    mtp = ("mtp16x4@4096_h128", 64, 16, 4096, 128)
    out.append(("sparse_mla", mcases.mla_case("token", f"{mtp[0]}_k{K}_packed", *mtp[1:],
                                              "packed", U32), f"{mtp[0]}_k{K}_packed", 64))
    out.append(("page_sparse_mla", mcases.mla_case("page", f"{mtp[0]}_p{K_PAGES}x64_bf16",
                                                   *mtp[1:], "bf16", BF16),
                f"{mtp[0]}_p{K_PAGES}x64_bf16", 64))
    return out


_MLA_STATICS = ("sm_scale", "pages_per_seq", "v_dim", "return_lse")


def mla_programs(quick: bool) -> list[Program]:
    out = []
    for op, case, shape, rows in _mla_cases():
        is_quick = shape.startswith("decode64x8192_h16")
        if quick and not is_quick:
            continue

        def ref(chip, done, case=case):
            return "kernel bytes (model)", case.traffic(chip).bytes_moved

        for backend in ("pallas", "reference"):
            def build(chip, case=case, backend=backend, op=op):
                kernel = case.fn_for_chip(chip)  # functools.partial of the Pallas entry
                statics = {k: v for k, v in kernel.keywords.items() if k in _MLA_STATICS}
                opts = {k: v for k, v in kernel.keywords.items() if k not in _MLA_STATICS}
                opts = {**opts, "interpret": False} if backend == "pallas" else None
                fn = functools.partial(getattr(dsa_jax, op), **statics, backend=backend,
                                       kernel_options=opts)
                return fn, case.specs, ()

            out.append(Program(f"{op}/{backend}/{shape}", op, backend, shape, build, rows, ref,
                               quick=is_quick and backend == "pallas"))
    return out


# ----------------------------------------------------------------------------- cache + step


def cache_write_program() -> Program:
    """``update_kv_cache`` for 64 decode rows into packed-latent + bf16 index caches of 64
    sequences x 8192 tokens, caches donated (as ``dsa_step`` and serving do)."""
    seqs, ctx, ps = 64, 8192, 64
    layout = dsa_jax.PagedLayout(page_size=ps, pages_per_seq=ctx // ps, packed_latent=True)
    pages = seqs * layout.pages_per_seq
    specs = [_s(layout.latent_cache_shape(pages), U32), _s(layout.index_cache_shape(pages), BF16),
             _s((seqs, layout.qk_dim), BF16), _s((seqs, layout.index_dim), BF16),
             *_meta_specs(seqs, pages)]
    row_bytes = 4 * layout.latent_cache_width + 2 * layout.index_dim
    fn = functools.partial(dsa_jax.update_kv_cache, layout=layout)
    return Program("cache_write", "cache write", "update_kv_cache (donated)",
                   f"{seqs} rows -> u32[{pages},{ps},{layout.latent_cache_width}] + "
                   f"bf16[{pages},{ps},{layout.index_dim}]", _fixed(fn, specs, (0, 1)), seqs,
                   lambda chip, done: ("new rows read+written", 2 * seqs * row_bytes), quick=True)


def step_programs(quick: bool) -> list[Program]:
    """``dsa_step`` body, layers (full, shared), 64 decode rows x 4096, H=128, caches donated."""
    seqs, ctx, ps, heads, layers = 64, 4096, 64, 128, ("full", "shared")
    layout = dsa_jax.PagedLayout(page_size=ps, pages_per_seq=ctx // ps, packed_latent=True)
    pages, n, f = seqs * layout.pages_per_seq, len(layers), 1
    hi, di = icases.GATE_HEADS, layout.index_dim
    specs = [_s((n, seqs, heads, layout.padded_dim), BF16), _s((n, seqs, layout.qk_dim), BF16),
             _s((f, seqs, hi, di), BF16), _s((f, seqs, hi), F32), _s((f, seqs, di), BF16),
             _s((n, *layout.latent_cache_shape(pages)), U32),
             _s((f, *layout.index_cache_shape(pages)), BF16), *_meta_specs(seqs, pages)]
    out = []
    for gran in ("token", "page"):
        for backend in ("pallas", "reference"):
            if quick:
                continue
            body = functools.partial(
                dsa_step_mod.step_body, layout=layout, indexer_types=layers,
                k=K if gran == "token" else K_PAGES, sm_scale=mcases.MLA_SCALE, num_segments=0,
                granularity=gran, one_token_per_seq=True, recall_target=RECALL, exact=False,
                backend=backend,
                kernel_options=(("interpret", False),) if backend == "pallas" else ())

            def fn(*a, body=body):
                return body(dsa_jax.StepInputs(*a[:5]), a[5], a[6], dsa_jax.BatchMeta(*a[7:]))

            out.append(Program(f"step/{gran}/{backend}", "dsa_step", f"{gran}, {backend}",
                               f"2 layers, decode {seqs}x{ctx}, H={heads}",
                               _fixed(fn, specs, (5, 6)), seqs,
                               lambda chip, done, k=f"step/{gran}/{backend}":
                               ("its kernels' estimates", done[k].kernel_bytes)
                               if k in done else None))
    return out


def programs(quick: bool) -> list[Program]:
    """Every program of the report, reference programs before the rows that divide by them."""
    progs = witness_programs() + selection_programs() + [cache_write_program()]
    progs += indexer_programs(quick) + mla_programs(quick) + step_programs(quick)
    seen, out = set(), []
    for p in progs:
        if (quick and not p.quick) or p.key in seen:
            continue
        seen.add(p.key)
        out.append(p)
    return out


# ----------------------------------------------------------------------------- run + print


@dataclass
class Row:
    prog: Program
    chip: str
    cost: xla_cost.XlaCost | None
    error: str
    seconds: float
    ref_label: str = ""
    ref_bytes: float | None = None
    net_bytes: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.cost is None or not self.ref_bytes:
            return None
        return (self.net_bytes if self.net_bytes is not None else self.cost.xla_bytes) / \
            self.ref_bytes


def run_chip(chip: str, progs: list[Program]) -> list[Row]:
    done: dict[str, xla_cost.XlaCost] = {}
    rows = []
    for p in progs:
        t0 = time.perf_counter()
        try:
            fn, specs, donate = p.build(chip)
            cost = xla_cost.analyze(xla_cost.compile_program(fn, specs, chip,
                                                             donate_argnums=donate,
                                                             case=p.key))
            err = ""
            done[p.key] = cost
        except Exception as e:  # report it, keep going: one failing op must not hide the rest
            cost, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row = Row(p, chip, cost, err, time.perf_counter() - t0)
        ref = p.ref(chip, done) if (p.ref and cost is not None) else None
        if ref is not None:
            row.ref_label, row.ref_bytes = ref
        if cost is not None and p.minus in done and cost.loops_negligible:
            row.net_bytes = cost.xla_bytes - done[p.minus].xla_bytes
        rows.append(row)
        print(f"  {chip:6s} {p.part:16s} {p.name:34s} {p.shape:30s} "
              f"{'FAILED ' + err if err else 'ok'} ({row.seconds:.1f} s)", flush=True)
    return rows


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _loop_names(c: xla_cost.XlaCost) -> str:
    """Short JAX names of the loops: the last ``jit(name)`` of each op_name not starting
    with ``_`` (``searchsorted``, ``fori_loop`` bodies show their function)."""
    names = []
    for lp in c.loops:
        jits = [n for n in re.findall(r"jit\(([^)]*)\)", lp.op_name) if not n.startswith("_")]
        names.append(jits[-1] if jits else lp.name)
    return ", ".join(sorted(set(names)))


def table(chip: str, rows: list[Row]) -> str:
    lines = [f"### {chip}", "",
             "| part | op | shape | total MB | kernel MB (est.) | XLA MB | XLA net MB | "
             "reference | XLA / ref | optimal us | loop | gathers / scatters |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        p, c = r.prog, r.cost
        if c is None:
            lines.append(f"| {p.part} | {p.name} | {p.shape} | FAILED: {r.error} "
                         "| | | | | | | | |")
            continue
        verdicts = [xla_cost.classify(op, row_limit=p.rows, allowed=p.allowed)
                    for op in c.indexed_ops]
        counts = {s: sum(v.status == s for v in verdicts)
                  for s in ("per-element", "allowed", "row", "metadata")}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "none"
        # A program with a material loop reports a lower bound (its body counted once).
        ratio = "-" if r.ratio is None else \
            f"{'' if c.loops_negligible else '>= '}{r.ratio:.2f}"
        secs = "-" if c.optimal_seconds is None else f"{1e6 * c.optimal_seconds:.1f}"
        loop = (f"{len(c.loops)} ({_loop_names(c)}; state <= {c.loop_state_bytes} B)"
                if c.has_loop else "")
        ref = f"{r.ref_label} {_mb(r.ref_bytes)} MB" if r.ref_bytes is not None else "-"
        lines.append(f"| {p.part} | {p.name} | {p.shape} | {_mb(c.total_bytes)} | "
                     f"{_mb(c.kernel_bytes)} | {_mb(c.xla_bytes)} | {_mb(r.net_bytes)} | {ref} | "
                     f"{ratio} | {secs} | {loop} | {summary} |")
    return "\n".join(lines)


def _source(op: xla_cost.IndexedOp) -> str:
    if not op.source:
        return "-"
    return ("~" if op.source_inferred else "") + op.source


def op_table(chip: str, rows: list[Row]) -> str:
    """Every gather/scatter of every program; a program's per-row metadata ops (at most one
    index per row each) are folded into one line with their count and source functions."""
    lines = [f"#### {chip}: gathers and scatters", "",
             "| part | op | shape | kind | result <- operands | indices | elems / index | "
             "verdict | source |", "|---|---|---|---|---|---:|---:|---|---|"]
    for r in rows:
        head = f"| {r.prog.part} | {r.prog.name} | {r.prog.shape} |"
        meta = []
        for op in (r.cost.indexed_ops if r.cost else ()):
            v = xla_cost.classify(op, row_limit=r.prog.rows, allowed=r.prog.allowed)
            if v.status == "metadata":
                meta.append(op)
                continue
            lines.append(f"{head} {op.kind} | {op.result_shape} <- "
                         f"{', '.join(op.operand_shapes)} | {op.num_indices} | "
                         f"{op.slice_elems} | **{v.status}**: {v.reason} | {_source(op)} |")
        if meta:
            kinds = "/".join(sorted({op.kind for op in meta}))
            funcs = sorted({op.functions[0].rsplit(".", 1)[-1] if op.functions else "?"
                            for op in meta})
            lines.append(f"{head} {len(meta)} x {kinds} | (folded) | <= {r.prog.rows} each | "
                         f"<= {max(op.slice_elems for op in meta)} | **metadata**: at most one "
                         f"index per row | {', '.join(funcs)} |")
    return "\n".join(lines)


# Issue 13 acceptance in XLA's model: (label, program key prefix, bound on "XLA / ref").
GATES = (
    ("witness merge i32[512,2048] S=64, donated (as served) / copy", "witness_donated", 2.0),
    ("witness merge i32[512,2048] S=64, new buffer / copy (regression bound)", "witness", 5.0),
    ("witness merge, lowest fill, donated / copy", "witness_lowest_donated", 2.0),
    ("select_topk default 64x4096 / approx_max_k", "sel4096", 1.5),
    ("select_topk default 64x131072 / approx_max_k", "sel131072", 1.5),
    ("select_topk exact 64x4096 / top_k", "selx4096", 1.5),
    ("select_topk exact 64x131072 / top_k", "selx131072", 1.5),
    ("sparse_mla 64x8192 H=128: XLA / kernel model", "sparse_mla/pallas/decode64x8192_h128_", .25),
    ("sparse_mla 64x8192 H=16: XLA / kernel model", "sparse_mla/pallas/decode64x8192_h16_", .25),
    ("page_sparse_mla 64x8192 H=128: XLA / kernel model",
     "page_sparse_mla/pallas/decode64x8192_h128_", .25),
    ("page_sparse_mla 64x8192 H=16: XLA / kernel model",
     "page_sparse_mla/pallas/decode64x8192_h16_", .25),
    ("indexer_topk decode 64x4096: XLA net / key bytes", "indexer_topk/pallas/decode 64x4096",
     .25),
    ("indexer_topk decode 8x131072: XLA net / key bytes",
     "indexer_topk/pallas/decode 8x131072", .25),
    ("page_topk decode 64x4096: XLA net / key bytes", "page_topk/pallas/decode 64x4096", .25),
    ("page_topk decode 8x131072: XLA net / key bytes", "page_topk/pallas/decode 8x131072", .25),
)


# Every op at its minimum, not only at decode: fp8 caches and MTP rows, XLA side <= 0.10x.
# Where a row is not yet within its bound, the label says the figure's cause (v6e figures).
OPMIN_GATES = (
    ("sparse_mla fp8 64x8192 H=128: XLA / kernel model (0.16: XLA stores a 576-wide q "
     "parameter {1,2,0}; the kernel's row-major read copies it)",
     "sparse_mla/pallas/decode64x8192_h128_k2048_fp8", .10),
    ("page_sparse_mla fp8 64x8192 H=128: XLA / kernel model (0.15: the same q layout copy)",
     "page_sparse_mla/pallas/decode64x8192_h128_p32x64_fp8", .10),
    ("indexer_topk MTP 16x4@4096: XLA net / key bytes (1.19: three ladder-level calls, "
     "row-slot scatter)", "indexer_topk/pallas/MTP 16x4@4096", .10),
    ("page_topk MTP 16x4@4096: XLA net / key bytes", "page_topk/pallas/MTP 16x4@4096", .10),
    ("sparse_mla MTP 16x4@4096 H=128: XLA / kernel model",
     "sparse_mla/pallas/mtp16x4@4096_h128_", .10),
    ("page_sparse_mla MTP 16x4@4096 H=128: XLA / kernel model",
     "page_sparse_mla/pallas/mtp16x4@4096_h128_", .10),
)


def _gate_cell(rows: list[Row], prefix: str, bound: float) -> str:
    row = next((r for r in rows if r.prog.key.startswith(prefix)), None)
    if row is None or row.cost is None or row.ratio is None:
        return "not run" if row is None else "FAILED"
    bad = sum(not xla_cost.classify(op, row_limit=row.prog.rows, allowed=row.prog.allowed).ok
              for op in row.cost.indexed_ops)
    ok = row.ratio <= bound and bad == 0 and row.cost.loops_negligible
    extra = f", {bad} per-element" if bad else ""
    return f"{'ok' if ok else 'FAIL'} {row.ratio:.2f}{extra}"


def gate_table(all_rows: dict[str, list[Row]]) -> str:
    """The issue's acceptance per chip: the ratio, and ok only when it is within the bound,
    the program has no per-element gather/scatter and its loops are negligible."""
    chips = list(all_rows)
    lines = ["### Issue 13 acceptance (XLA's TPU cost model)", "",
             "| gate | bound | " + " | ".join(chips) + " |",
             "|---|---:|" + "---|" * len(chips)]
    for label, prefix, bound in GATES + OPMIN_GATES:
        cells = [_gate_cell(all_rows[c], prefix, bound) for c in chips]
        lines.append(f"| {label} | <= {bound:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_json(all_rows: dict[str, list[Row]]) -> list[dict]:
    """Every row as plain numbers (for ``--json``)."""
    out = []
    for chip, rows in all_rows.items():
        for r in rows:
            c = r.cost
            out.append({
                "chip": chip, "key": r.prog.key, "part": r.prog.part, "op": r.prog.name,
                "shape": r.prog.shape, "error": r.error, "compile_s": round(r.seconds, 2),
                "total_bytes": c and c.total_bytes, "kernel_bytes": c and c.kernel_bytes,
                "xla_bytes": c and c.xla_bytes, "net_bytes": r.net_bytes,
                "ref_label": r.ref_label, "ref_bytes": r.ref_bytes, "ratio": r.ratio,
                "optimal_seconds": c and c.optimal_seconds,
                "loops": [(lp.op_name, lp.state_bytes) for lp in c.loops] if c else None,
                "indexed_ops": [
                    {"op": op.describe(), "verdict": xla_cost.classify(
                        op, row_limit=r.prog.rows, allowed=r.prog.allowed).status}
                    for op in c.indexed_ops] if c else None})
    return out


def large_table(chip: str, rows: list[Row]) -> str:
    """Entry-computation XLA results >= 64 MiB: where the big XLA bytes are made."""
    lines = [f"#### {chip}: XLA results >= {xla_cost.LARGE_RESULT_BYTES >> 20} MiB (entry "
             "computation)", "",
             "A scatter or dynamic-update-slice into a donated buffer is an in-place update (its "
             "result is the buffer, not a copy); a slice, squeeze or copy-done is a copy.", "",
             "| part | op | shape | XLA op | result | MB | JAX op |",
             "|---|---|---|---|---|---:|---|"]
    for r in rows:
        for big in (r.cost.large_results if r.cost else ()):
            lines.append(f"| {r.prog.part} | {r.prog.name} | {r.prog.shape} | {big.opcode} | "
                         f"{big.shape} | {_mb(big.bytes)} | {big.op_name or '-'} |")
    return "\n".join(lines)


def measured_tree() -> str:
    """The source tree measured (where ``reference`` was imported from) and its git commit,
    ``+dirty`` when it has uncommitted changes."""
    import reference

    root = Path(reference.__file__).resolve().parents[1]
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return f"{root} @ {head}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return f"{root} (not a git checkout)"


def report(all_rows: dict[str, list[Row]], quick: bool, seconds: float) -> str:
    head = [f"Whole-op XLA cost ({'--quick' if quick else 'full'}; tree {measured_tree()}; "
            f"jax {jax.__version__}; {seconds:.0f} s). Bytes in MB (1e6).", "", CAVEATS, ""]
    body = [gate_table(all_rows), ""]
    for chip, rows in all_rows.items():
        body += [table(chip, rows), "", op_table(chip, rows), "", large_table(chip, rows), ""]
    return "\n".join(head + body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the starred subset (CI smoke run)")
    p.add_argument("--chips", default=",".join(aot.CHIPS), help="comma-separated chips")
    p.add_argument("--markdown", default=None, help="write the tables as Markdown here")
    p.add_argument("--json", default=None, help="write every row as JSON here")
    a = p.parse_args(argv)
    chips = [aot.check_chip(c.strip()) for c in a.chips.split(",") if c.strip()]
    progs = programs(a.quick)
    t0 = time.perf_counter()
    all_rows = {chip: run_chip(chip, progs) for chip in chips}
    md = report(all_rows, a.quick, time.perf_counter() - t0)
    print(md)
    for path, text in ((a.markdown, md), (a.json, a.json and json.dumps(
            rows_json(all_rows), indent=1))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    return 1 if any(r.cost is None for rows in all_rows.values() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
