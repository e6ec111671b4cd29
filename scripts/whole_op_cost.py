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
- ``dsa_jax.dsa_step`` (its body, caches donated, as ``dsa_step`` jits it): 2 and 8 layers
  (IndexShare pattern of ``python -m dsa_jax run``: ``glm_index_share_pattern(layers,
  leading_full=1)``), decode 64x4096, H=128, token and page granularity, packed bf16 latent +
  bf16 index caches and fp8 caches, backends ``"pallas"`` and ``"reference"`` (``--quick``: the
  2-layer fp8 token Pallas row*), with the cache rows it writes and the XLA-side gate
  (``XLA <= 0.10 x kernels + rows written``), temp memory, and 8 / 2 layers;
- the real-size step (``--real-size``; in the full report): 61 layers (16 full), fp8 caches,
  decode 64x4096, H=128, Pallas, token: bytes against the sum of its kernels' traffic models
  (modelled and minimum, ``step_kernel_traffic``), temp memory.

Caveats (printed with the report): a ``while`` body is counted once whatever its trip count, so
a program flagged ``loop`` reports a lower bound (bounds are asserted only on decode programs
whose loops carry <= 64 KiB, e.g. a ``searchsorted``); ``optimal_seconds`` is shown only when
XLA reports it non-negative (it is negative for some programs on every chip); a Pallas call
without ``pl.CostEstimate`` counts 0 in XLA's total, so its bytes then appear in no column.

The report opens with the issue-13 acceptance table per chip (ratio, ``ok`` only within the
bound with no per-element gather/scatter and negligible loops).

Usage: ``python scripts/whole_op_cost.py [--quick | --step | --real-size] [--chips
v5e,v6e,tpu7x] [--markdown PATH] [--json PATH]`` (``--step`` / ``--real-size``: only those
rows; together: both).
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
from reference import fp8, fp8_cache, selection  # noqa: E402
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


# The step rows: 64 decode rows x 4096 tokens, H=128, V3.2 dims (qk 576 padded 640, v_dim 512,
# index 64 heads x 128), pages of 64; IndexShare pattern of ``python -m dsa_jax run``
# (``glm_index_share_pattern(layers, leading_full=1)``: one full layer, then shared x3 + full).
STEP_SEQS, STEP_CTX, STEP_PAGE, STEP_HEADS = 64, 4096, 64, 128
STEP_LAYERS, REAL_LAYERS = (2, 8), 61  # 61: DeepSeek-V3.2's layer count
STEP_FORMATS = {  # cache format name -> PagedLayout keywords
    "packed": dict(packed_latent=True),  # packed bf16 latent words, bf16 index keys
    "fp8": dict(index_cache_format="fp8", latent_cache_format="fp8"),
}
STEP_BACKENDS = ("pallas", "reference")


def step_types(layers: int) -> tuple[str, ...]:
    """The CLI's IndexShare pattern (``dsa_jax/__main__.py``): 2 -> full, shared; 8 -> 2 full;
    61 -> 16 full."""
    return tuple(dsa_jax.glm_index_share_pattern(layers, leading_full=1))


def step_layout(fmt: str) -> dsa_jax.PagedLayout:
    return dsa_jax.PagedLayout(page_size=STEP_PAGE, pages_per_seq=STEP_CTX // STEP_PAGE,
                               **STEP_FORMATS[fmt])


def step_rows_written(layers: int, fmt: str) -> int:
    """Bytes of the cache rows one decode step writes, in the stored format: per layer
    ``STEP_SEQS`` latent rows (packed 1536 B, fp8 1024 B), per full layer ``STEP_SEQS`` index
    rows (bf16 256 B; fp8 128 B of e4m3 keys + one f32 scale)."""
    layout, types = step_layout(fmt), step_types(layers)
    latent_row = 4 * layout.latent_cache_width  # u32 words either way
    index_row = (fp8.INDEX_HEAD_DIM + 4 if layout.index_cache_format == "fp8"
                 else 2 * layout.index_dim)
    return STEP_SEQS * (layers * latent_row + types.count("full") * index_row)


def _step_cache_specs(layout: dsa_jax.PagedLayout, n: int, f: int, pages: int):
    """Flat leaf specs of the stacked (latent, index) caches and a function rebuilding the two
    caches from those leaves (an fp8 cache is a pytree of several arrays)."""
    if layout.latent_cache_format == "fp8":
        latent = [_s((n, pages, layout.page_size, fp8_cache.LATENT_WORDS), U32)]
        as_latent = lambda leaves: fp8_cache.Fp8LatentCache(*leaves)  # noqa: E731
    else:
        latent = [_s((n, *layout.latent_cache_shape(pages)), U32)]
        as_latent = lambda leaves: leaves[0]  # noqa: E731
    if layout.index_cache_format == "fp8":
        index = [_s((f, *layout.index_cache_shape(pages)), fp8.FP8_DTYPE),
                 _s((f, pages, fp8_cache.scale_lanes(layout.page_size)), F32)]
        as_index = lambda leaves: fp8_cache.Fp8IndexCache(*leaves)  # noqa: E731
    else:
        index = [_s((f, *layout.index_cache_shape(pages)), BF16)]
        as_index = lambda leaves: leaves[0]  # noqa: E731
    return latent, index, as_latent, as_index


def step_build(layers: int, gran: str, backend: str, fmt: str):
    """``build(chip)`` of ``dsa_step``'s body (as ``dsa_step`` jits it, caches donated) over
    ``layers`` layers (``step_types``), decode ``STEP_SEQS`` x ``STEP_CTX``, H=``STEP_HEADS``,
    granularity ``gran`` (k = 2048 tokens or 32 pages), cache format ``fmt``
    (``STEP_FORMATS``). Arguments are ``ShapeDtypeStruct`` leaves (no arrays: the 61-layer
    caches are many GB); q is ``padded_dim`` wide for the packed cache, ``qk_dim`` for fp8
    (the fp8 MLA entry lays q out itself)."""
    layout, types = step_layout(fmt), step_types(layers)
    seqs, pages = STEP_SEQS, STEP_SEQS * layout.pages_per_seq
    n, f = len(types), types.count("full")
    hi, di = icases.GATE_HEADS, layout.index_dim
    q_dim = layout.padded_dim  # 640: a 576-wide bf16 q is laid out H-minor by XLA (a relayout copy)
    latent, index, as_latent, as_index = _step_cache_specs(layout, n, f, pages)
    inputs = [_s((n, seqs, STEP_HEADS, q_dim), BF16), _s((n, seqs, layout.qk_dim), BF16),
              _s((f, seqs, hi, di), BF16), _s((f, seqs, hi), F32), _s((f, seqs, di), BF16)]
    specs = inputs + latent + index + _meta_specs(seqs, pages)
    i0, i1 = len(inputs), len(inputs) + len(latent)
    i2 = i1 + len(index)
    body = functools.partial(
        dsa_step_mod.step_body, layout=layout, indexer_types=types,
        k=K if gran == "token" else K_PAGES, sm_scale=mcases.MLA_SCALE, num_segments=0,
        granularity=gran, one_token_per_seq=True, recall_target=RECALL, exact=False,
        backend=backend, kernel_options=(("interpret", False),) if backend == "pallas" else ())

    def fn(*a):
        return body(dsa_jax.StepInputs(*a[:i0]), as_latent(a[i0:i1]), as_index(a[i1:i2]),
                    dsa_jax.BatchMeta(*a[i2:]))

    return _fixed(fn, specs, tuple(range(i0, i2)))


def step_kernel_traffic(chip: str, layers: int, gran: str, fmt: str) -> aot.Traffic:
    """The step's kernels by the existing traffic models, summed over its layers: per layer
    the sparse MLA call (``mcases.mla_case`` at 64 x 4096, H=128: the compile cases' model),
    per full layer the indexer call (the ``decode 64x4096`` case of ``icases``, bf16 or
    ``fp8 keys``). ``bytes_moved``: what the kernels move; ``bytes_min``: each input read
    once, each output written once."""
    types = step_types(layers)
    mode = "token" if gran == "token" else "page"
    mla = mcases.mla_case(mode, f"step {fmt}", STEP_SEQS, STEP_SEQS, STEP_CTX, STEP_HEADS,
                          fmt, U32).traffic(chip)
    name = "decode 64x4096" + (" fp8 keys" if fmt == "fp8" else "")
    cases = icases.token_cases(quick=True) if gran == "token" else icases.page_cases(quick=True)
    idx = next(c for c in cases if c.shape == name).traffic(chip)
    n, f = len(types), types.count("full")
    return aot.Traffic(n * mla.bytes_moved + f * idx.bytes_moved,
                       n * mla.bytes_min + f * idx.bytes_min, n * mla.flops + f * idx.flops,
                       max(mla.vmem_bytes, idx.vmem_bytes))


def step_key(layers: int, fmt: str, gran: str, backend: str) -> str:
    return f"step/{layers}L/{fmt}/{gran}/{backend}"


def _step_ref(chip, done, key):
    return ("its kernels' estimates", done[key].kernel_bytes) if key in done else None


def step_programs(quick: bool, layer_counts=STEP_LAYERS) -> list[Program]:
    """``dsa_step`` body at ``layer_counts`` layers x {packed, fp8} x {token, page} x
    {pallas, reference}, decode 64 x 4096, H=128, caches donated; the reference quantity is
    the kernels' own estimates (XLA / ref = XLA-side / kernel bytes). ``--quick`` keeps the
    2-layer Pallas token fp8 row."""
    out = []
    for layers in layer_counts:
        for fmt in STEP_FORMATS:
            for gran in ("token", "page"):
                for backend in STEP_BACKENDS:
                    key = step_key(layers, fmt, gran, backend)
                    out.append(Program(
                        key, "dsa_step", f"{layers} layers, {fmt}, {gran}, {backend}",
                        f"{layers} layers, decode {STEP_SEQS}x{STEP_CTX}, H={STEP_HEADS}",
                        step_build(layers, gran, backend, fmt), STEP_SEQS,
                        functools.partial(_step_ref, key=key),
                        quick=(layers, fmt, gran, backend) == (2, "fp8", "token", "pallas")))
    return out


def real_size_programs() -> list[Program]:
    """The 61-layer step (``step_types(61)``: 16 full layers), fp8 caches, decode 64 x 4096,
    H=128, Pallas: XLA's bytes and temp memory of a real-size step."""
    key = step_key(REAL_LAYERS, "fp8", "token", "pallas")
    return [Program(key, "dsa_step (real size)", f"{REAL_LAYERS} layers, fp8, token, pallas",
                    f"{REAL_LAYERS} layers, decode {STEP_SEQS}x{STEP_CTX}, H={STEP_HEADS}",
                    step_build(REAL_LAYERS, "token", "pallas", "fp8"), STEP_SEQS,
                    functools.partial(_step_ref, key=key))]


def programs(quick: bool, *, step: bool = False, real_size: bool = False) -> list[Program]:
    """The programs of the report, reference programs before the rows that divide by them:
    every one (``quick``: the starred subset), or with ``step`` / ``real_size`` only the step
    rows (2 and 8 layers) / the 61-layer step (the full report has both)."""
    if step or real_size:
        progs = (step_programs(False) if step else []) + (real_size_programs() if real_size
                                                         else [])
        return progs
    progs = witness_programs() + selection_programs() + [cache_write_program()]
    progs += indexer_programs(quick) + mla_programs(quick) + step_programs(quick)
    progs += [] if quick else real_size_programs()
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
    temp_bytes: int | None = None  # compiled.memory_analysis().temp_size_in_bytes

    @property
    def ratio(self) -> float | None:
        if self.cost is None or not self.ref_bytes:
            return None
        return (self.net_bytes if self.net_bytes is not None else self.cost.xla_bytes) / \
            self.ref_bytes


def temp_bytes(compiled) -> int | None:
    """XLA's temp buffer bytes of a compiled program (``memory_analysis``), if it says."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except (AttributeError, TypeError, ValueError):
        return None


def run_chip(chip: str, progs: list[Program]) -> list[Row]:
    done: dict[str, xla_cost.XlaCost] = {}
    rows = []
    for p in progs:
        t0 = time.perf_counter()
        try:
            fn, specs, donate = p.build(chip)
            compiled = xla_cost.compile_program(fn, specs, chip, donate_argnums=donate,
                                                case=p.key)
            cost, temp, err = xla_cost.analyze(compiled), temp_bytes(compiled), ""
            done[p.key] = cost
        except Exception as e:  # report it, keep going: one failing op must not hide the rest
            cost, temp = None, None
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row = Row(p, chip, cost, err, time.perf_counter() - t0, temp_bytes=temp)
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
                "temp_bytes": r.temp_bytes,
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


# The step's gates (tests/test_whole_op_cost.py asserts them on v6e): the Pallas step's XLA
# side <= STEP_XLA_BOUND x its kernels' bytes + the cache rows it writes; 8 layers <=
# STEP_SCALING_BOUND x 2 layers (total bytes); the 61-layer fp8 step's temp < REAL_TEMP_BOUND.
STEP_XLA_BOUND, STEP_SCALING_BOUND, REAL_TEMP_BOUND = 0.10, 4.2, 64 << 20


def step_xla_allowance(kernel_bytes: float, layers: int, fmt: str) -> float:
    """The XLA-side bytes the step may spend: ``STEP_XLA_BOUND`` x its kernels' bytes plus the
    cache rows it writes (``step_rows_written``)."""
    return STEP_XLA_BOUND * kernel_bytes + step_rows_written(layers, fmt)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _step_rows(all_rows: dict[str, list[Row]], prefix: str = "step/"):
    for chip, rows in all_rows.items():
        for r in rows:
            if r.prog.key.startswith(prefix):
                _, layers, fmt, gran, backend = r.prog.key.split("/")
                yield chip, int(layers.removesuffix("L")), fmt, gran, backend, r


def step_table(all_rows: dict[str, list[Row]]) -> str:
    """The step rows: total / kernel / XLA bytes, XLA / kernel, the cache rows written and the
    XLA-side gate (Pallas rows), temp memory; then the 8-layer / 2-layer total bytes."""
    lines = [f"### dsa_step, decode {STEP_SEQS}x{STEP_CTX}, H={STEP_HEADS} (V3.2 dims; "
             "IndexShare pattern of `python -m dsa_jax run`: glm_index_share_pattern(layers, "
             "leading_full=1): 2 layers = full, shared; 8 layers = 2 full + 6 shared)", "",
             f"Gate (Pallas): XLA MB <= {STEP_XLA_BOUND:g} x kernel MB + rows written MB "
             "(rows written: per layer 64 latent rows of the stored format, packed 1536 B / fp8 "
             "1024 B, per full layer 64 index rows, bf16 256 B / fp8 132 B). The reference "
             "backend has no kernels: its XLA MB is the whole step.", "",
             "| chip | layers | cache | granularity | backend | total MB | kernel MB (est.) | "
             "XLA MB | XLA / kernel | rows written MB | XLA bound MB | gate | temp MiB |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    totals = {}
    for chip, layers, fmt, gran, backend, r in _step_rows(all_rows):
        head = f"| {chip} | {layers} | {fmt} | {gran} | {backend} |"
        c = r.cost
        if c is None:
            lines.append(f"{head} FAILED: {r.error} | | | | | | | |")
            continue
        totals[chip, layers, fmt, gran, backend] = c.total_bytes
        written = step_rows_written(layers, fmt)
        ratio = f"{c.xla_bytes / c.kernel_bytes:.2f}" if c.kernel_bytes else "-"
        bound, gate = "-", "-"
        if backend == "pallas" and layers in STEP_LAYERS:
            allowance = step_xla_allowance(c.kernel_bytes, layers, fmt)
            bound = _mb(allowance)
            gate = "ok" if c.kernels and c.xla_bytes <= allowance else "FAIL"
        lines.append(f"{head} {_mb(c.total_bytes)} | {_mb(c.kernel_bytes)} | "
                     f"{_mb(c.xla_bytes)} | {ratio} | {_mb(written)} | {bound} | {gate} | "
                     f"{_mib(r.temp_bytes)} |")
    lo, hi = STEP_LAYERS
    scaling = [f"| {chip} | {fmt} | {gran} | {backend} | {_mb(t)} | {_mb(t8)} | {t8 / t:.2f} | "
               + (("ok" if t8 <= STEP_SCALING_BOUND * t else "FAIL") if backend == "pallas"
                  else "-") + " |"
               for (chip, layers, fmt, gran, backend), t in totals.items() if layers == lo
               for t8 in [totals.get((chip, hi, fmt, gran, backend))] if t8 is not None]
    if scaling:
        lines += ["", f"{hi} layers / {lo} layers (total bytes; gate for Pallas: <= "
                  f"{STEP_SCALING_BOUND:g}; kernels alone scale by "
                  f"{len(step_types(hi))}/{len(step_types(lo))} MLA calls and "
                  f"{step_types(hi).count('full')}/{step_types(lo).count('full')} indexer "
                  "calls)", "",
                  f"| chip | cache | granularity | backend | {lo}L total MB | {hi}L total MB | "
                  f"{hi}L / {lo}L | gate |", "|---|---|---|---|---:|---:|---:|---|", *scaling]
    return "\n".join(lines)


def real_size_table(all_rows: dict[str, list[Row]]) -> str:
    """The 61-layer step per chip: XLA's bytes against its kernels' traffic models, temp."""
    lines = [f"### Real-size step: {REAL_LAYERS} layers ({step_types(REAL_LAYERS).count('full')} "
             f"full), fp8 caches, decode {STEP_SEQS}x{STEP_CTX}, H={STEP_HEADS}, Pallas, token",
             "", "Kernels' modelled / minimum: `pallas_kernels.mla.traffic` per layer and "
             "`pallas_kernels.indexer.traffic` per full layer (the compile cases' models, "
             "`step_kernel_traffic`); minimum = each input read once, each output written once. "
             f"Temp gate (v6e): < {REAL_TEMP_BOUND >> 20} MiB.", "",
             "| chip | total MB | kernel MB (est.) | XLA MB | kernels' modelled MB | "
             "kernels' minimum MB | total / minimum | temp MiB | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for chip, layers, fmt, gran, _, r in _step_rows(all_rows):
        if layers != REAL_LAYERS:
            continue
        if r.cost is None:
            lines.append(f"| {chip} | FAILED: {r.error} | | | | | | | |")
            continue
        t, c = step_kernel_traffic(chip, layers, gran, fmt), r.cost
        lines.append(f"| {chip} | {_mb(c.total_bytes)} | {_mb(c.kernel_bytes)} | "
                     f"{_mb(c.xla_bytes)} | {_mb(t.bytes_moved)} | {_mb(t.bytes_min)} | "
                     f"{c.total_bytes / t.bytes_min:.2f} | {_mib(r.temp_bytes)} | "
                     f"{r.seconds:.0f} |")
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
    keys = {r.prog.key for rows in all_rows.values() for r in rows}
    body = [gate_table(all_rows), ""] if any(not k.startswith("step/") for k in keys) else []
    if any(k.startswith("step/") and not k.startswith(f"step/{REAL_LAYERS}L/") for k in keys):
        body += [step_table(all_rows), ""]
    if any(k.startswith(f"step/{REAL_LAYERS}L/") for k in keys):
        body += [real_size_table(all_rows), ""]
    for chip, rows in all_rows.items():
        body += [table(chip, rows), "", op_table(chip, rows), "", large_table(chip, rows), ""]
    return "\n".join(head + body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the starred subset (CI smoke run)")
    p.add_argument("--step", action="store_true",
                   help="only the dsa_step rows (2 and 8 layers, packed and fp8 caches, token "
                        "and page, pallas and reference) and their tables")
    p.add_argument("--real-size", action="store_true",
                   help=f"only the {REAL_LAYERS}-layer fp8 Pallas step (with --step: both); "
                        "several minutes per chip")
    p.add_argument("--chips", default=",".join(aot.CHIPS), help="comma-separated chips")
    p.add_argument("--markdown", default=None, help="write the tables as Markdown here")
    p.add_argument("--json", default=None, help="write every row as JSON here")
    a = p.parse_args(argv)
    chips = [aot.check_chip(c.strip()) for c in a.chips.split(",") if c.strip()]
    progs = programs(a.quick, step=a.step, real_size=a.real_size)
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
