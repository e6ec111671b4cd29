"""Issue 13: the XLA glue around the Pallas kernels stays gather/scatter-free and cheap in XLA's
TPU cost model (AOT compiles for v6e through libtpu; no TPU runs).

Unit tests of ``pallas_kernels.xla_cost`` on small programs whose answer is known, then the gate:

- HLO: no per-element gather or scatter (more indices than rows, a slice under one 128-lane
  row) in the hot paths at the gate shapes, except ``xla_cost.HOT_PATH_ALLOWED`` (each entry
  has a reason and a bound);
- bytes (XLA's model, loop-free decode programs; a program's only loops may carry tiny state,
  e.g. a ``searchsorted`` over S+1 offsets, checked by ``_loop_problems``):
  witness merge, serving entry, i32[512, 2048], S = 64: <= 2x a copy of the buffer;
  selection, k = 2048, 8 rows x N = 4096 and 64 rows x N = 131072: <= 1.5x
  ``approx_max_k(aggregate_to_topk=True)`` alone (default mode) and ``lax.top_k`` alone (exact
  mode);
  token and page sparse MLA (pallas), 64 x 8192, H = 128 and 16, k = 2048 / 32 pages of 64:
  XLA-side bytes <= 0.25x the kernel's modelled bytes;
  indexer token and page top-k (pallas), decode 64 x 4096 and 8 x 131072: XLA-side bytes other
  than the selection stage <= 0.25x the kernel's key bytes.
- the step (``dsa_step``'s body, Pallas, decode 64 x 4096, H = 128, V3.2 dims; programs from
  ``scripts/cost/whole_op_cost.py``): at 2 layers, token and page, packed and fp8 caches (plus fp8
  rows on tpu7x and v5e), XLA-side bytes <= 0.10x the kernels' bytes + the cache rows it
  writes; 8 layers <= 4.2x the total bytes of 2 layers (fp8, token); the 61-layer fp8 step's
  temp memory < 64 MiB (v6e and tpu7x).

Each gate test compiles its programs once (``_cost`` is cached per process; no two tests share
a program, so pytest-xdist workers do not compile one twice) and checks the HLO and the bound
together, reporting every problem it finds.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

import dsa_jax
from pallas_kernels import chips, xla_cost
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.measure import hlo
from pallas_kernels.mla import compile_cases as mcases
from reference import selection
from reference.witnesses import scatter_topology_witnesses

CHIP = chips.DEFAULT
ROOT = Path(__file__).resolve().parents[1]
from dsa_jax.measure import whole_op as report  # noqa: E402  (the report's step programs: one definition)

I32, F32 = jnp.int32, jnp.float32
K, K_PAGES, SEGMENTS = 2048, 32, 64
# Rows of the selection gate's programs, by N. Both modes' bytes are per row (8 and 64 rows of
# f32[., 4096] cost the same bytes per row in XLA's model, so the ratio to the baseline is the
# same); at N = 4096 the baseline top_k's TPU compile costs about half at 8 rows. At 131072
# the compile is about the same at 8 and 64 rows: the gate keeps its 64.
SELECTION_ROWS = {4096: 8, 131072: 64}



def _s(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _compile(fn, specs, donate=()):
    return xla_cost.compile_program(fn, specs, CHIP, donate_argnums=donate)


# ----------------------------------------------------------------------------- parser units


def test_take_along_axis_is_a_per_element_gather():
    c = xla_cost.analyze(_compile(lambda x, i: jnp.take_along_axis(x, i, axis=1),
                                  [_s((64, 512), F32), _s((64, 256), I32)]))
    gathers = [op for op in c.indexed_ops if op.kind == "gather"]
    assert len(gathers) == 1, c.indexed_ops
    g = gathers[0]
    assert (g.num_indices, g.slice_elems) == (64 * 256, 1)
    assert g.result_shape == "f32[64,256]" and g.operand_shapes[0] == "f32[64,512]"
    assert xla_cost.is_per_element(g, row_limit=64)
    assert not xla_cost.classify(g, row_limit=64).ok
    assert g.source.startswith("test_whole_op_cost.py:")
    assert g.functions[0].endswith("<lambda>")  # innermost frame first


def test_row_take_is_not_per_element():
    c = xla_cost.analyze(_compile(lambda cache, ids: jnp.take(cache, ids, axis=0),
                                  [_s((1024, 64, 128), F32), _s((300,), I32)]))
    (g,) = [op for op in c.indexed_ops if op.kind == "gather"]
    assert (g.num_indices, g.slice_elems) == (300, 64 * 128)
    assert not xla_cost.is_per_element(g, row_limit=1)
    assert xla_cost.classify(g, row_limit=1).status == "row"


def test_two_index_scatter_is_per_element_and_allowed_only_within_its_bound():
    c = xla_cost.analyze(_compile(lambda x, r, col, v: x.at[r, col].set(v),
                                  [_s((64, 512), F32), _s((64, 128), I32), _s((64, 128), I32),
                                   _s((64, 128), F32)]))
    (sc,) = [op for op in c.indexed_ops if op.kind == "scatter"]
    assert (sc.num_indices, sc.slice_elems) == (64 * 128, 1)
    assert xla_cost.is_per_element(sc, row_limit=64)
    assert not xla_cost.is_per_element(sc, row_limit=64 * 128)  # one index per "row"
    fits = xla_cost.Allowed("toy", "a test", "scatter", "<lambda>", max_indices=64 * 128)
    small = xla_cost.Allowed("toy", "a test", "scatter", "<lambda>", max_indices=64 * 128 - 1)
    other = xla_cost.Allowed("toy", "a test", "scatter", "a_function_not_in_the_stack")
    assert xla_cost.classify(sc, row_limit=64, allowed=[fits]).status == "allowed"
    assert xla_cost.classify(sc, row_limit=64, allowed=[small, other]).status == "per-element"


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _kernel(x, estimate: bool):
    est = pl.CostEstimate(flops=123, transcendentals=0, bytes_accessed=987654) if estimate else None
    return pl.pallas_call(_double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          cost_estimate=est)(x)


def test_kernel_bytes_are_the_pallas_cost_estimate():
    spec = [_s((256, 512), F32)]
    with_est = xla_cost.analyze(_compile(lambda x: _kernel(x + 1.0, True) * 3.0, spec))
    without = xla_cost.analyze(_compile(lambda x: _kernel(x + 1.0, False) * 3.0, spec))
    assert with_est.kernel_bytes == 987654 and without.kernel_bytes == 0
    assert [k.bytes_accessed for k in without.kernels] == [None]
    assert without.kernels_without_estimate == 1
    # Same XLA ops around the kernel: the split leaves the same XLA side in both programs.
    assert with_est.xla_bytes == without.xla_bytes > 0
    assert with_est.total_bytes == without.total_bytes + 987654


def test_estimated_cycles_sum_the_ops_and_grow_with_the_work():
    """``XlaCost.estimated_cycles`` sums XLA's per-op estimates of the TPU compile: positive, more
    for a matmul 4x the work (a 2x longer contraction and 2x the rows), none in text without
    them."""
    small = xla_cost.analyze(_compile(lambda a, b: a @ b, [_s((256, 512), F32),
                                                          _s((512, 512), F32)]))
    big = xla_cost.analyze(_compile(lambda a, b: a @ b, [_s((512, 1024), F32),
                                                        _s((1024, 512), F32)]))
    assert 0 < small.estimated_cycles < big.estimated_cycles
    assert hlo.estimated_cycles("ENTRY %main () -> f32[] { ROOT %c = f32[] constant(0) }") == 0


def test_loops_are_flagged_with_their_state():
    def looped(x):
        return jax.lax.fori_loop(0, 8, lambda i, y: y * 1.5 + i, x)

    c = xla_cost.analyze(_compile(looped, [_s((256, 512), F32)]))
    assert c.has_loop and c.loop_state_bytes >= 256 * 512 * 4
    assert not xla_cost.analyze(_compile(lambda x: x * 1.5, [_s((256, 512), F32)])).has_loop


def test_shape_strings():
    assert xla_cost.strip_layout("(f32[64,2048]{1,0:T(8,128)}, s32[]{:T(128)})") == \
        "(f32[64,2048], s32[])"
    assert xla_cost.dims("s32[64,2048,2]") == (64, 2048, 2) and xla_cost.dims("f32[]") == ()
    assert xla_cost.shape_bytes("(s32[], bf16[3,4], /*index=2*/pred[8])") == 4 + 24 + 8


def test_large_results_name_the_big_xla_buffers():
    c = xla_cost.analyze(_compile(lambda x: x * 2.0, [_s((4096, 8192), F32)]))
    assert [(r.shape, r.bytes) for r in c.large_results] == [("f32[4096,8192]", 4096 * 8192 * 4)]
    small = xla_cost.analyze(_compile(lambda x: x * 2.0, [_s((64, 128), F32)]))
    assert small.large_results == ()


class _FakeCompiled:
    def __init__(self, cost, text=""):
        self.cost, self.text = cost, text

    def cost_analysis(self):
        return self.cost

    def as_text(self):
        return self.text


def test_negative_or_missing_optimal_seconds_is_none_and_list_costs_are_read():
    neg = xla_cost.analyze(_FakeCompiled([{"bytes accessed": 10.0, "optimal_seconds": -2e-6}]))
    assert neg.optimal_seconds is None and neg.total_bytes == 10.0
    assert xla_cost.analyze(_FakeCompiled({"bytes accessed": 1.0})).optimal_seconds is None
    pos = xla_cost.analyze(_FakeCompiled({"bytes accessed": 1.0, "optimal_seconds": 3e-6}))
    assert pos.optimal_seconds == 3e-6
    only_kernel = xla_cost.analyze(_FakeCompiled({"bytes accessed0{}": 5.0}))
    assert not only_kernel.total_reported and only_kernel.xla_bytes == 0


# ----------------------------------------------------------------------------- gate programs


def _decode_key_bytes(kv_lens) -> int:
    """bf16 indexer keys a decode batch reads: each sequence's pages once."""
    pages = sum(-(-kv // icases.GATE_PAGE) for kv in kv_lens)
    return pages * icases.GATE_PAGE * icases.GATE_DIM * jnp.dtype(jnp.bfloat16).itemsize


def _indexer_program(op: str, q_lens, kv_lens, otp: bool):
    """(fn, specs, pages_per_seq, k) of a pallas indexer op compiled for ``CHIP``."""
    specs, pps = icases.gate_specs(q_lens, kv_lens)
    page_mode = op == "page_topk"
    k = min(K_PAGES, pps) if page_mode else K
    fn = functools.partial(getattr(dsa_jax, op), **{"k_pages" if page_mode else "k": k},
                           pages_per_seq=pps, one_token_per_seq=otp, backend="pallas",
                           kernel_options={"chip": CHIP, "interpret": False})
    return fn, specs, pps, k


def _indexer(op: str, shape: str):
    """(fn, specs, rows, score columns, k) of a pallas indexer op."""
    q_lens, kv_lens, otp = icases.GATE_SHAPES[shape]
    assert otp, shape  # the gate shapes are pure decode batches
    fn, specs, pps, k = _indexer_program(op, q_lens, kv_lens, otp)
    cols = pps if op == "page_topk" else pps * icases.GATE_PAGE
    return fn, specs, len(q_lens), cols, k


def _mla_case(op: str, heads: int):
    cases = mcases.token_cases if op == "sparse_mla" else mcases.page_cases
    (case,) = [c for c in cases(quick=True)
               if c.shape.startswith(f"decode64x8192_h{heads}_") and not c.shape.endswith("_fp8")]
    return case


def _mla(op: str, heads: int):
    """(fn, specs, rows) of a pallas MLA op at 64 x 8192, with the knobs of the kernel's own
    compile case."""
    case = _mla_case(op, heads)
    kernel = case.fn_for_chip(CHIP)  # functools.partial of the Pallas entry
    statics = ("sm_scale", "pages_per_seq", "v_dim")
    opts = {k: v for k, v in kernel.keywords.items() if k not in statics}
    fn = functools.partial(getattr(dsa_jax, op), **{k: kernel.keywords[k] for k in statics},
                           backend="pallas", kernel_options={**opts, "interpret": False})
    return fn, case.specs, case.specs[0].shape[0]


def _stage(rows: int, cols: int, k: int):
    def fn(scores, context_lens):
        return selection.select_and_merge(scores, k, context_lens,
                                          recall_target=selection.DEFAULT_RECALL_TARGET,
                                          exact=False, num_segments=0)

    return fn, [_s((rows, cols), F32), _s((rows,), I32)]


def _cache_write():
    seqs, ps = 64, 64
    layout = dsa_jax.PagedLayout(page_size=ps, pages_per_seq=8192 // ps, packed_latent=True)
    pages = seqs * layout.pages_per_seq
    specs = [_s(layout.latent_cache_shape(pages), jnp.uint32),
             _s(layout.index_cache_shape(pages), jnp.bfloat16),
             _s((seqs, layout.qk_dim), jnp.bfloat16), _s((seqs, layout.index_dim), jnp.bfloat16),
             _s((seqs,), I32), _s((pages,), I32), _s((seqs + 1,), I32), _s((seqs + 1,), I32),
             _s((3,), I32)]
    return functools.partial(dsa_jax.update_kv_cache, layout=layout), specs, seqs


def _program(key: str):
    """key -> (fn, specs, donate, rows): rows (query rows or sequences) bound the indices of a
    per-row metadata gather."""
    kind, _, arg = key.partition(":")
    amk = functools.partial(jax.lax.approx_max_k, k=K,
                            recall_target=selection.DEFAULT_RECALL_TARGET,
                            aggregate_to_topk=True)
    n = int(arg) if kind in ("amk", "topk", "select", "select_exact") else 0
    sel_rows = SELECTION_ROWS.get(n, 0)
    simple = {
        "copy": (jnp.copy, [_s((512, 2048), I32)], 512),
        "witness": (functools.partial(scatter_topology_witnesses, num_segments=SEGMENTS),
                    [_s((512, 2048), I32), _s((512,), I32)], 512),
        "witness_lowest": (functools.partial(scatter_topology_witnesses, num_segments=SEGMENTS,
                                             fill="lowest"),
                           [_s((512, 2048), I32), _s((512,), I32)], 512),
        "amk": (amk, [_s((sel_rows, n), F32)], sel_rows),
        "topk": (functools.partial(jax.lax.top_k, k=K), [_s((sel_rows, n), F32)], sel_rows),
        "select": (functools.partial(selection.select_topk, k=K), [_s((sel_rows, n), F32)],
                   sel_rows),
        "select_exact": (functools.partial(selection.select_topk, k=K, exact=True),
                         [_s((sel_rows, n), F32)], sel_rows),
    }
    if kind in simple:
        fn, specs, rows = simple[kind]
        return fn, specs, (), rows
    if kind in ("witness_donated", "witness_lowest_donated"):  # as served: updated in place
        fn, specs, rows = simple[kind.removesuffix("_donated")]
        return fn, specs, (0,), rows
    if kind in ("indexer_topk", "page_topk"):
        fn, specs, rows, _, _ = _indexer(kind, arg)
        return fn, specs, (), rows
    if kind == "stage":
        op, shape = arg.split("@")
        _, _, rows, cols, k = _indexer(op, shape)
        return *_stage(rows, cols, k), (), rows
    if kind in ("sparse_mla", "page_sparse_mla"):
        fn, specs, rows = _mla(kind, int(arg))
        return fn, specs, (), rows
    if kind == "cache_write":
        fn, specs, rows = _cache_write()
        return fn, specs, (0, 1), rows
    raise KeyError(key)


@functools.cache
def _cost(key: str) -> xla_cost.XlaCost:
    fn, specs, donate, _ = _program(key)
    return xla_cost.analyze(_compile(fn, specs, donate))


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


# ----------------------------------------------------------------------------- gate
# One test per gate item compiles its programs once (so pytest-xdist workers never compile the
# same program twice) and checks both the HLO and the bound, reporting both.

INDEXER_SHAPES = ("decode 64x4096", "decode 8x131072")


def _hlo_problems(key: str) -> list[str]:
    """The per-element gathers/scatters of program ``key`` not allowed on a hot path."""
    rows = _program(key)[3]
    return [f"{key} ({rows} rows) per-element {op.describe()} [{op.computation}]"
            for op in _cost(key).indexed_ops
            if not xla_cost.classify(op, row_limit=rows, allowed=xla_cost.HOT_PATH_ALLOWED).ok]


def _loop_problems(key: str) -> list[str]:
    c = _cost(key)
    if c.loops_negligible:
        return []
    return [f"{key}: a while loop carries {c.loop_state_bytes} B; XLA counts its body once, so "
            f"the program's bytes are not a total ({[lp.op_name for lp in c.loops]})"]


def _check(problems: list[str]):
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("key", ["witness", "witness_lowest"])
def test_witness_merge_gate(key):
    """Serving entry, i32[512, 2048], S = 64, both fills: no per-element op; <= 2x the bytes
    of a copy of the buffer when called as it serves (``scatter_topology_witnesses`` documents
    a donated buffer updated in place; inside the selection stage the buffer is an
    intermediate). Without donation the call must also allocate and fill a new buffer: XLA
    then prices it at ~4x a copy (the occupancy read plus an on-chip prefetch of the input);
    bounded at 5x so a regression to a per-element scatter (69x) still fails."""
    donated, fresh, copy = _cost(f"{key}_donated"), _cost(key), _cost("copy")
    ratio, fresh_ratio = donated.xla_bytes / copy.xla_bytes, fresh.xla_bytes / copy.xla_bytes
    problems = (_hlo_problems(key) + _hlo_problems(f"{key}_donated")
                + _loop_problems(key) + _loop_problems("copy"))
    if ratio > 2.0:
        problems.append(f"{key} i32[512,2048] S=64, donated: "
                        f"{_mb(donated.xla_bytes)} = {ratio:.2f}x a copy "
                        f"({_mb(copy.xla_bytes)}) > 2x")
    if fresh_ratio > 5.0:
        problems.append(f"{key} i32[512,2048] S=64, not donated: "
                        f"{_mb(fresh.xla_bytes)} = {fresh_ratio:.2f}x a copy > 5x")
    _check(problems)


@pytest.mark.parametrize("n", [4096, 131072])
@pytest.mark.parametrize("mode,baseline", [("select", "amk"), ("select_exact", "topk")])
def test_selection_gate(mode, baseline, n):
    """``SELECTION_ROWS[n]`` rows (8 at 4096, 64 at 131072), k = 2048: no per-element op (a
    per-row gather of the k winners has 8 x 2048 indices, more than the rows); <= 1.5x
    approx_max_k(aggregate_to_topk=True) alone (default mode) / lax.top_k alone (exact
    mode)."""
    rows = SELECTION_ROWS[n]
    ours, base = _cost(f"{mode}:{n}"), _cost(f"{baseline}:{n}")
    ratio = ours.xla_bytes / base.xla_bytes
    problems = (_hlo_problems(f"{mode}:{n}") + _loop_problems(f"{mode}:{n}")
                + _loop_problems(f"{baseline}:{n}"))
    if ratio > 1.5:
        problems.append(f"{mode} f32[{rows},{n}] k={K}: {_mb(ours.xla_bytes)} = {ratio:.2f}x "
                        f"{baseline} alone ({_mb(base.xla_bytes)}) > 1.5x")
    _check(problems)


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("op", ["sparse_mla", "page_sparse_mla"])
def test_sparse_mla_gate(op, heads):
    """64 x 8192, k = 2048 (page: 32 pages of 64): no per-element op; XLA-side bytes (total -
    the kernels' CostEstimates) <= 0.25x the kernel's modelled bytes."""
    key = f"{op}:{heads}"
    c = _cost(key)
    assert c.kernels, f"{key}: no Pallas call in the program"
    model = _mla_case(op, heads).traffic(CHIP).bytes_moved
    ratio = c.xla_bytes / model
    problems = _hlo_problems(key) + _loop_problems(key)
    if ratio > 0.25:
        problems.append(f"{op} 64x8192 H={heads}: XLA side {_mb(c.xla_bytes)} (total "
                        f"{_mb(c.total_bytes)} - kernel estimates {_mb(c.kernel_bytes)}) = "
                        f"{ratio:.2f}x the kernel's modelled {_mb(model)} > 0.25x")
    _check(problems)


@pytest.mark.parametrize("shape", INDEXER_SHAPES)
@pytest.mark.parametrize("op", ["indexer_topk", "page_topk"])
def test_indexer_gate(op, shape):
    """Decode, one token per sequence: no per-element op; XLA-side bytes other than the
    selection stage <= 0.25x the kernel's key bytes."""
    key, stage_key = f"{op}:{shape}", f"stage:{op}@{shape}"
    c, stage = _cost(key), _cost(stage_key)
    assert c.kernels, f"{key}: no Pallas call in the program"
    keys = _decode_key_bytes(icases.GATE_SHAPES[shape][1])
    net = c.xla_bytes - stage.xla_bytes
    problems = _hlo_problems(key) + _loop_problems(key) + _loop_problems(stage_key)
    if net > 0.25 * keys:
        problems.append(f"{op} {shape}: XLA side {_mb(c.xla_bytes)} - selection stage "
                        f"{_mb(stage.xla_bytes)} = {_mb(net)} = {net / keys:.2f}x the key bytes "
                        f"{_mb(keys)} > 0.25x")
    _check(problems)


def test_cache_write_has_no_per_element_scatter():
    """update_kv_cache (donated), 64 decode rows: row scatters only (one cache row per token)."""
    _check(_hlo_problems("cache_write") + _loop_problems("cache_write"))


# ----------------------------------------------------------------------------- the report


@pytest.mark.slow
def test_whole_op_cost_quick_report(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    md = tmp_path / "whole_op_cost.md"
    out = subprocess.run([sys.executable, "-m", "scripts.cost.whole_op_cost", "--quick",
                          "--chips", CHIP, "--markdown", str(md)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = md.read_text()
    assert f"### {CHIP}" in text and "FAILED" not in text
    assert "scatter_topology_witnesses" in text and "while loop" in text


# ----------------------------------------------------------------------------- the step
# ``dsa_step``'s body (``report.step_build``: the report's own programs), decode 64 x 4096,
# H = 128, V3.2 dims, caches donated, IndexShare pattern of the CLI (2 layers: full, shared;
# 8: 2 full; 61: 16 full). The step must read each layer's cache in place, not copy it out of
# the stacked caches: copies show as XLA-side bytes (and temp memory) that grow with the cache.


def _step(layers: int, fmt: str, gran: str,
          chip: str = CHIP) -> tuple[xla_cost.XlaCost, int | None]:
    """XLA's cost and temp bytes of the Pallas step on ``chip`` (compiled once per process,
    however ``chip`` is passed)."""
    return _compiled_step(layers, fmt, gran, chip)


@functools.cache
def _compiled_step(layers: int, fmt: str, gran: str,
                   chip: str) -> tuple[xla_cost.XlaCost, int | None]:
    fn, specs, donate = report.step_build(layers, gran, "pallas", fmt)(chip)
    compiled = xla_cost.compile_program(fn, specs, chip, donate_argnums=donate)
    return xla_cost.analyze(compiled), report.temp_bytes(compiled)


def _step_loop_problems(name: str, c: xla_cost.XlaCost) -> list[str]:
    if c.loops_negligible:
        return []
    return [f"{name}: a while loop carries {c.loop_state_bytes} B; XLA counts its body once, so "
            f"the step's bytes are not a total ({[lp.op_name for lp in c.loops]})"]


# The v6e rows (every format and granularity at 2 layers), then the rows where the other chips
# differed: on tpu7x the fp8 step was 0.20x (2 layers, token) and 0.25x (8 layers, page) while
# XLA relaid the MLA kernel's bf16 output from (16, 128) to (8, 128) tiles and prefetched the
# indexer's q into VMEM in a copy (mla.kernel.out_groups, indexer.kernel.score_call); v5e is
# the chip with the least HBM.
# The v6e fp8 token row at 2 layers is gated inside test_step_layer_scaling, which compiles that
# program anyway (one compile of it per run, whichever worker takes the test).
STEP_GATE_ROWS = ([(CHIP, 2, fmt, gran) for fmt in ("packed", "fp8") for gran in ("token", "page")
                   if (fmt, gran) != ("fp8", "token")]
                  + [(chips.NEWEST, 2, "fp8", "token"), (chips.NEWEST, 8, "fp8", "page"),
                     (chips.OLDEST, 2, "fp8", "token")])


@pytest.mark.parametrize("chip,layers,fmt,gran", STEP_GATE_ROWS)
def test_step_xla_side_gate(chip, layers, fmt, gran):
    """Pallas step, 2 layers (full, shared) or 8 (2 full), decode 64 x 4096, H=128, packed bf16
    latent + bf16 index caches or fp8 caches: XLA-side bytes <= 0.10x the kernels' estimates +
    the cache rows the step writes (``report.step_rows_written``); 3.50x before the stacked
    caches were read in place (0.02-0.09x after, v5e, v6e and tpu7x)."""
    _check(_step_gate_problems(chip, layers, fmt, gran))


def _step_gate_problems(chip, layers, fmt, gran) -> list[str]:
    c, _ = _step(layers, fmt, gran, chip)
    name = f"dsa_step {layers} layers {fmt} {gran} on {chip}"
    assert c.kernels, f"{name}: no Pallas call in the program"
    allowance = report.step_xla_allowance(c.kernel_bytes, layers, fmt)
    problems = _step_loop_problems(name, c)
    if c.xla_bytes > allowance:
        big = ", ".join(f"{r.opcode} {r.shape} {_mb(r.bytes)}" for r in c.large_results[:6])
        problems.append(
            f"{name}: XLA side {_mb(c.xla_bytes)} (total {_mb(c.total_bytes)} - kernel "
            f"estimates {_mb(c.kernel_bytes)}) = {c.xla_bytes / c.kernel_bytes:.2f}x the kernels' "
            f"bytes > {report.STEP_XLA_BOUND:g}x + rows written "
            f"{_mb(report.step_rows_written(layers, fmt))} = {_mb(allowance)}; largest XLA "
            f"results: "
            f"{big or 'none >= 64 MiB'}")
    return problems


def test_step_layer_scaling():
    """Pallas step, fp8 caches, token, decode 64 x 4096: 8 layers (2 full) move <= 4.2x the
    bytes of 2 layers (1 full) in total; the kernels alone scale by 4x (MLA) and 2x (indexer),
    so per-layer XLA glue that grows with the number of stacked layers (a copy of the stack per
    layer) fails. Also the XLA-side gate of ``test_step_xla_side_gate`` on the 2-layer program
    (its v6e fp8 token row, gated here where the program is compiled)."""
    two, _ = _step(2, "fp8", "token")
    eight, _ = _step(8, "fp8", "token")
    ratio = eight.total_bytes / two.total_bytes
    problems = (_step_gate_problems(CHIP, 2, "fp8", "token")
                + _step_loop_problems("dsa_step 8 layers", eight))
    if ratio > report.STEP_SCALING_BOUND:
        problems.append(f"dsa_step fp8 token: 8 layers {_mb(eight.total_bytes)} = {ratio:.2f}x "
                        f"2 layers {_mb(two.total_bytes)} > {report.STEP_SCALING_BOUND:g}x "
                        f"(XLA side {_mb(eight.xla_bytes)} vs {_mb(two.xla_bytes)})")
    _check(problems)


@pytest.mark.slow
@pytest.mark.parametrize("chip", [CHIP, chips.NEWEST])
def test_real_size_step_temp_memory(chip):
    """The 61-layer Pallas step (16 full layers), fp8 caches (16.4 GB of latent cache),
    decode 64 x 4096, H=128, on v6e and tpu7x: XLA's temp buffers < 64 MiB (v6e 23 MiB, tpu7x
    39 MiB with one MLA call for every layer; tpu7x 500 MiB while XLA relaid the MLA output;
    v6e 418 MiB with a call per layer, whose outputs all stay live until XLA stacks them; 15.8
    GB when each layer's cache was copied out of the stack). v5e refuses the program: its
    16.4 GB of caches exceed the chip's HBM (BENCHMARKS.md)."""
    c, temp = _step(report.REAL_LAYERS, "fp8", "token", chip)
    assert temp is not None, "memory_analysis() reported no temp size"
    assert c.kernels, "no Pallas call in the 61-layer step"
    assert temp < report.REAL_TEMP_BOUND, (
        f"dsa_step {report.REAL_LAYERS} layers fp8 on {chip}: temp {temp / 2**20:.1f} MiB >= "
        f"{report.REAL_TEMP_BOUND >> 20} MiB (XLA side {_mb(c.xla_bytes)}, kernels "
        f"{_mb(c.kernel_bytes)})")


# ----------------------------------------------------------------------------- fp8 and MTP
# fp8 caches and MTP rows (v6e). The bound the issue asks is 0.10x; where it is not met yet the
# test pins today's figure as a regression bound and says the cause (scripts/cost/whole_op_cost.py's
# OPMIN_GATES carry the same labels).

MTP_Q, MTP_KV = [4] * 16, [4096] * 16


def _opmin_program(key: str):
    """(fn, specs, rows, reference bytes) of an fp8-cache or MTP program."""
    kind, _, arg = key.partition(":")
    if kind in ("sparse_mla", "page_sparse_mla"):
        cases = mcases.token_cases if kind == "sparse_mla" else mcases.page_cases
        if arg == "fp8":
            (case,) = [c for c in cases(quick=True)
                       if c.shape.startswith("decode64x8192_h128_") and c.shape.endswith("_fp8")]
        else:  # MTP: 16 sequences x 4 rows at 4096, H = 128, as whole_op_cost measures it
            fmt, dt = ("packed", jnp.uint32) if kind == "sparse_mla" else ("bf16", jnp.bfloat16)
            case = mcases.mla_case("token" if kind == "sparse_mla" else "page", f"mtp_{fmt}",
                                   64, 16, 4096, 128, fmt, dt)
        kernel = case.fn_for_chip(CHIP)
        statics = ("sm_scale", "pages_per_seq", "v_dim")
        opts = {k: v for k, v in kernel.keywords.items() if k not in statics}
        fn = functools.partial(getattr(dsa_jax, kind), **{k: kernel.keywords[k] for k in statics},
                               backend="pallas", kernel_options={**opts, "interpret": False})
        return fn, case.specs, case.specs[0].shape[0], case.traffic(CHIP).bytes_moved
    fn, specs, _, _ = _indexer_program(kind, MTP_Q, MTP_KV, False)
    return fn, specs, sum(MTP_Q), _decode_key_bytes(MTP_KV)


@pytest.mark.parametrize("key,bound,cause", [
    ("sparse_mla:fp8", 0.20, "XLA stores the 576-wide q parameter {1,2,0}: a layout copy"),
    ("page_sparse_mla:fp8", 0.20, "the same q layout copy"),
    ("sparse_mla:mtp", 0.10, ""),
    ("page_sparse_mla:mtp", 0.10, ""),
])
def test_fp8_and_mtp_mla_gate(key, bound, cause):
    """fp8 latent cache (decode 64 x 8192, H = 128) and MTP rows: XLA-side bytes over the
    kernel's modelled bytes (the fp8 q relayout moved into the kernel: 0.51 -> 0.16 on v6e)."""
    fn, specs, rows, model = _opmin_program(key)
    c = xla_cost.analyze(_compile(fn, specs))
    bad = [op.describe() for op in c.indexed_ops
           if not xla_cost.classify(op, row_limit=rows, allowed=xla_cost.HOT_PATH_ALLOWED).ok]
    assert not bad and c.loops_negligible, bad
    assert c.xla_bytes <= bound * model, (key, c.xla_bytes / model, cause)


@pytest.mark.parametrize("op", ["indexer_topk", "page_topk"])
def test_mtp_indexer_keeps_the_cache_in_hbm(op):
    """MTP 16 x 4 @ 4096: the keys (16.8 MB) stay in HBM: before the kernel pinned them, XLA
    copied the cache into VMEM for the ladder's later level calls (79 MB of XLA on v6e)."""
    fn, specs, _, keys = _opmin_program(f"{op}:mtp")
    c = xla_cost.analyze(_compile(fn, specs))
    assert c.xla_bytes <= 2.0 * keys, c.xla_bytes / keys  # 1.7x with the selection (v6e)
