"""The whole-op cost report's programs and runner (``scripts/cost/whole_op_cost.py`` prints the
report; ``tests/test_whole_op_cost.py`` asserts its gates): every public op's program at the
compile gates' DeepSeek-V3.2 shapes, each built for a chip (``Program.build``), AOT-compiled
through libtpu on CPU and read with ``pallas_kernels.xla_cost.analyze`` (``run_chip``), and the
step's gates (``STEP_XLA_BOUND``, ``STEP_SCALING_BOUND``, ``REAL_TEMP_BOUND``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

import dsa_jax
from dsa_jax import step as dsa_step_mod
from pallas_kernels import aot, xla_cost
from pallas_kernels.indexer import blocks as iblocks
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.indexer import scoring, work_list
from pallas_kernels.indexer import traffic as itraffic
from pallas_kernels.mla import compile_cases as mcases
from reference.formats import fp8_cache
from reference.indexer import selection
from reference.quant import fp8
from reference.witnesses import scatter_topology_witnesses

I32, F32, BF16, U32 = jnp.int32, jnp.float32, jnp.bfloat16, jnp.uint32
K, K_PAGES, SEGMENTS, RECALL = 2048, 32, 64, selection.DEFAULT_RECALL_TARGET
MTP = ([4] * 16, [4096] * 16, False)  # 16 sequences x 4 rows (MTP draft rows) at 4096

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
        # --quick: the copy and the donated tail fill (the gated serving call); the other two
        # (12-15 s a compile each) are compiled by tests/test_whole_op_cost.py's witness gate
        Program("witness", "witness merge", "scatter_topology_witnesses", shape,
                _fixed(merge, buf + [_s((rows,), I32)]), rows, _xla_of("copy", "copy")),
        # As its docstring says serving calls it: buffer donated, updated in place (the gate).
        Program("witness_donated", "witness merge", "scatter_topology_witnesses (donated)",
                shape, _fixed(merge, buf + [_s((rows,), I32)], (0,)), rows,
                _xla_of("copy", "copy"), quick=True),
        Program("witness_lowest_donated", "witness merge",
                'scatter_topology_witnesses(fill="lowest") (donated)', shape,
                _fixed(functools.partial(merge, fill="lowest"), buf + [_s((rows,), I32)], (0,)),
                rows, _xla_of("copy", "copy")),
    ]


def selection_programs() -> list[Program]:
    out = []
    for n in (4096, 131072):
        # not in --quick: XLA's TPU top-k at k = 2048 compiles for 15-40 s a program, and
        # tests/test_whole_op_cost.py's test_selection_gate compiles these programs already
        spec, shape, q = [_s((64, n), F32)], f"f32[64,{n}] k={K}", False
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
        is_quick = name == "decode 64x4096"  # --quick: page_topk only (below)
        if quick and not is_quick:
            continue
        specs, pps = icases.gate_specs(q_lens, kv_lens)
        rows = max(sum(q_lens), len(q_lens))
        for op, page_mode in (("indexer_topk", False), ("page_topk", True)):
            k = min(K_PAGES, pps) if page_mode else K
            cols = pps if page_mode else pps * icases.GATE_PAGE
            # --quick keeps the page top-k (its stage selects 32 of 64 pages: a quick compile);
            # the token top-k's stage is a k = 2048 top-k of 4096 columns (XLA's TPU top-k:
            # 20-30 s a compile), gated by tests/test_whole_op_cost.py's test_indexer_gate
            op_quick = is_quick and page_mode
            stage = stage_program(sum(q_lens), cols, k, op_quick)
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
                                   quick=op_quick and backend == "pallas"))
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
    2-layer Pallas page fp8 row (the token row's indexer stage is a k = 2048 top-k of 4096
    columns, 20-30 s of XLA compile; tests/test_whole_op_cost.py gates both rows)."""
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
                        quick=(layers, fmt, gran, backend) == (2, "fp8", "page", "pallas")))
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


# The step's gates (tests/test_whole_op_cost.py asserts them on v6e): the Pallas step's XLA
# side <= STEP_XLA_BOUND x its kernels' bytes + the cache rows it writes; 8 layers <=
# STEP_SCALING_BOUND x 2 layers (total bytes); the 61-layer fp8 step's temp < REAL_TEMP_BOUND.
STEP_XLA_BOUND, STEP_SCALING_BOUND, REAL_TEMP_BOUND = 0.10, 4.2, 64 << 20


def step_xla_allowance(kernel_bytes: float, layers: int, fmt: str) -> float:
    """The XLA-side bytes the step may spend: ``STEP_XLA_BOUND`` x its kernels' bytes plus the
    cache rows it writes (``step_rows_written``)."""
    return STEP_XLA_BOUND * kernel_bytes + step_rows_written(layers, fmt)
