"""Compile gate: DeepSeek-V4 attention (``pallas_kernels.v4``: the fused kernel, the default, on
packed bf16 and fp8 MODEL1 caches; the two-pass form, two token-mode MLA kernel calls merged in XLA,
on packed caches) AOT-compiles for v5e, v6e and tpu7x at V4-Flash (H=64, top-512; and the
ratio-128 layer) and V4-Pro (H=128, top-1024) decode shapes (64 rows x 8192 tokens, window 128),
with no per-element gather/scatter or loop in the XLA glue, and its modelled bytes per decode row
within the stated factor of the minimum (window rows + selected entries at 1024 B for packed
bf16, at the 640 B stored per token for fp8; q read and out written once).

The factors (measured by the model, ``v4_traffic``): 1.43x (Flash CSA), 2.01x (Flash HCA:
only 64 entries at 8192, so q, the two partial outputs and the merge weigh as much as the
gathered rows), 1.47x (Pro CSA). What is over the minimum: q read twice, two partial outputs
written and read back by the merge. The fused kernel (``fused=True``) removes it; it reads
the window (and the HCA entries) as page runs (issue 30: one DMA per 64-row page segment, at
most 3 for a 128-token window), each DMA of a dynamic number of rows, the segment's wanted
ones only (``formats.issue_run``), widened to whole 8-row tiles for packed rows (256 words:
Mosaic refuses a VMEM slice of them at an unaligned row or size; ``formats.run_align``): at
most 136 rows for a 128-token window, so 1.014x (Flash CSA), 1.027x (Flash HCA: 8 rows of 200),
1.009x (Pro CSA); 1.0035x / 1.0017x / 1.0033x before page runs, 1.09x / 1.20x / 1.05x with
whole segments. ``run_grain="exact"`` (``exact_run_cases``, each shape on one chip) moves the
wanted rows only, a segment's whole 8-row tiles as one DMA and its ragged head and tail rows one
DMA each: 1.00348x / 1.00172x / 1.00332x (the bytes before page runs) in 8 more DMAs per decode
row (a 128-token window: <= 3 tile DMAs + 8 one-row DMAs, against 3 DMAs). fp8 caches (fused
only): a CSA entry's 2 DMAs move 1024 B against the 640 B stored (1.6x on those bytes), page
runs a 512 B record per token and the rope rows (4 tokens each) their tokens touch (a 128-token
window: at most 33 rows, <= 644 B per token), so 1.37x (Flash CSA), 1.004x (Flash HCA), 1.40x
(Pro CSA) of the fp8 minimum, in 2x the packed DMAs. Numbers per chip:
``python scripts/cost/v4_cost.py`` (BENCHMARKS.md, "DeepSeek-V4 attention (issue 20)").
The bf16 regime (``precision="bf16"``, issue 27; ``bf16_regime_cases``): the fused
kernel at the V4-Flash CSA shape on packed caches (1.014x, the packed case's program) and on
f32 caches (2048 B rows against the 1024 B of their bf16 values, 8-row tiles: 1.86x).

The Pallas compressor (``pallas_kernels.v4_compressor``, issue 21) compiles at the V4 dims
(d 512 ratio 4 and 128, d 128 ratio 4; 64 decode sequences and an 8192-token prefill) with its
pool updated in place (no copy of the donated pool) and its model within the stated factor.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from pallas_kernels import aot, chips, xla_cost
from pallas_kernels.v4 import compile_cases as v4cases
from pallas_kernels.v4.fused import INFO_WORDS
from pallas_kernels.v4_attention import blocks as v4_blocks
from pallas_kernels.v4_attention import formats, traffic
from pallas_kernels.v4_attention.compile_cases import (
    bf16_regime_cases,
    exact_run_cases,
    plane_run_cases,
)
from pallas_kernels.v4_compressor import compile_cases as v4ccases
from pallas_kernels.v4_compressor import traffic as v4ctraffic
from reference import v4_compressor as vc
from tests import glue_gates
from tests.chip_turns import on_every_chip

pytestmark = pytest.mark.kernel_gate

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

_NAME = lambda c: f"{c.kernel}-{c.shape}"  # noqa: E731
CASES = on_every_chip([case for fused, fmt in ((False, "packed"), (True, "packed"), (True, "fp8"))
                       for case in v4cases.compile_cases(fused, fmt)] + bf16_regime_cases(),
                      _NAME)
# run_grain="exact": each shape on one chip (every chip once; Mosaic's answer on 256-word rows
# is the same on all three: tests/test_dma_probe.py)
CASES += [pytest.param(c, chip, id=f"{_NAME(c)}-{chip}")
          for c, chip in zip(exact_run_cases(), sorted(aot.CHIPS), strict=True)]
# bf16 in 128-word plane rows: each shape on one chip (the chips in another order)
CASES += [pytest.param(c, chip, id=f"{_NAME(c)}-{chip}")
          for c, chip in zip(plane_run_cases(), sorted(aot.CHIPS, reverse=True), strict=True)]
# the model's bytes per decode row over the minimum, per path and shape (module docstring)
MAX_RATIO = {"v4_attention": {"flash_csa": 1.45, "flash_hca": 2.05, "pro_csa": 1.5},
             "v4_attention_fused": {"flash_csa": 1.014, "flash_hca": 1.027, "pro_csa": 1.009},
             # run_grain="exact": every wanted row once, 1.00348x / 1.00172x / 1.00332x (the
             # bytes of one DMA per token, before page runs), in <= 8 more DMAs per decode row
             "v4_attention_fused_exact": {"flash_csa": 1.00349, "flash_hca": 1.00173,
                                          "pro_csa": 1.00333},
             # plane rows (128 words): the exact bytes at the tiles' descriptors
             "v4_attention_fused_plane": {"flash_csa": 1.00349, "flash_hca": 1.00173,
                                          "pro_csa": 1.00333},
             "v4_attention_fused_fp8": {"flash_csa": 1.37, "flash_hca": 1.005, "pro_csa": 1.40},
             "v4_attention_fused_packed_precision_bf16": {"flash_csa": 1.014},
             "v4_attention_fused_f32_precision_bf16": {"flash_csa": 1.86}}


@pytest.mark.parametrize("case,chip", CASES)
def test_compiles_without_per_element_glue_and_within_the_traffic_bound(case, chip):
    cost = xla_cost.analyze(case.compile(chip))  # CompileError names chip, shape, Mosaic's text
    t = assert_gate(case, chip, cost, MAX_RATIO[case.kernel][case.shape.split("_decode")[0]])
    if case.kernel.startswith("v4_attention_fused"):  # the kernel declares the model's bytes
        assert cost.kernel_bytes == t.bytes_moved - case.specs[0].shape[0] * INFO_WORDS * 4


def assert_gate(case, chip: str, cost, max_ratio: float):
    """The V4 compile gate's checks of one compiled ``case`` on ``chip`` (``cost``:
    ``xla_cost.analyze``'s): no loop and no per-element gather/scatter in the XLA glue, the
    model's VMEM under the chip's, its bytes at least the minimum and at most ``max_ratio``
    times it. Returns the model (``case.traffic(chip)``)."""
    rows = case.specs[0].shape[0]
    assert not cost.has_loop
    assert not [op.describe() for op in cost.indexed_ops
                if xla_cost.is_per_element(op, row_limit=rows)]
    t = case.traffic(chip)
    assert t.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes
    assert t.bytes_min <= t.bytes_moved
    assert t.ratio <= max_ratio, (case.shape, t)
    return t


# ----------------------------------------------------------------------------- the compressor

COMPRESSOR_CASES = [(case, chip) for case in v4ccases.compile_cases() for chip in aot.CHIPS]
COMPRESSOR_PARAMS = on_every_chip(v4ccases.compile_cases(), lambda c: c.shape)
# the model's bytes over the minimum (pallas_kernels.v4_compressor.traffic): ratio 4 moves each
# chunk row whole to both entries that pool it and once more to the ring, and its ring slot
# whole (both halves): 1.98x decode, 1.94x prefill; ratio 128 moves its old ring slot whole
# (128 rows for 127): 1.03x decode, 1.03x prefill (rows from row 0: each entry's 128 rows in
# one aligned DMA; from an unaligned row, windows of 136 rows: 1.09x, prefill_counts). Since
# the pool kernel finishes the rows (issue 30: norm and RoPE in the kernel, ~20 MB of XLA
# glue per decode call gone), each completing entry whose position is in another 128-position
# tile than the previous entry's reads that tile of both RoPE tables (2 x 16 KB, where the
# minimum counts its 2 x 128 B rows): decode 2.67x (d 512, ratio 4), 4.67x (d 128), 1.09x
# (ratio 128); prefill (32 entries per tile at ratio 4) 1.96x / 2.00x, 1.09x
# the tables given as ``finish.rope_rows`` (one 512-B row per entry; the tables' 2 x 16 KB
# tiles gave 2.67 / 4.67 at decode d512 / d128): 1.984, 1.031, 1.985, 1.942, 1.031, 1.943
COMPRESSOR_MAX_RATIO = {"csa_d512_decode64": 1.99, "hca_d512_decode64": 1.04,
                        "index_d128_decode64": 1.99, "csa_d512_prefill8192": 1.95,
                        "hca_d512_prefill8192": 1.04, "index_d128_prefill8192": 1.95}


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_two_pass_dma_descriptors_per_decode_row(chip):
    """The two-pass path's model (``v4_traffic``; its per-call terms equal the interpreter's
    count in ``tests/test_hbm_traffic.py``): per decode row and MLA call one gather DMA per
    token (the window's 128; the k selected entries, or HCA's 64 visible), the row's entries
    into SMEM, q in, out and LSE back: 128 + k + 8 per row (648 Flash CSA, 200 Flash HCA,
    1160 Pro CSA)."""
    for case in v4cases.compile_cases(False, "packed"):
        name, rows, context, _, ratio, k = next(s for s in v4cases.SHAPES
                                                if case.shape.startswith(s[0]))
        entries = k if ratio == 4 else context // ratio
        t = case.traffic(chip)
        assert 0 < t.dmas == rows * (v4cases.WINDOW + entries + 2 * (1 + 2 + 1)), name


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_exact_runs_dma_descriptors_per_decode_row(chip):
    """The fused kernel's page runs per decode row (model), ``run_grain="tiles"`` vs
    ``"exact"``: a 128-token window anywhere (pages of 64) is <= 3 DMAs of tiles (<= 136 rows)
    or <= 3 tile DMAs + 14 one-row DMAs of its 128 rows exactly (the worst window, first row
    ``1 mod 8``: 3 + 8 = 11); HCA's 64 entries from 0: one DMA either way. So exact takes 8
    more DMAs per decode row at every shape and moves 8 rows fewer at the worst window."""
    for tiles, exact in zip(v4cases.compile_cases(True, "packed"), exact_run_cases(),
                            strict=True):
        rows = tiles.specs[0].shape[0]
        block = v4_blocks.block(chip, "packed", tiles.specs[0].shape[1])
        seg, w_runs, _ = traffic.segment_plan("packed", block, v4cases.PAGE, v4cases.PAGE, True)
        window = dict(window=v4cases.WINDOW, entries=0, seg=seg, window_runs=w_runs,
                      compressed_runs=False, align=formats.run_align("packed"))
        assert traffic.run_bound(**window) == (0, 136, 3)
        _, w_rows, w_dmas = traffic.run_bound(**window, exact=True)
        assert w_rows == v4cases.WINDOW and w_dmas == 11 <= 3 + 14
        assert exact.traffic(chip).dmas - tiles.traffic(chip).dmas == rows * (11 - 3)


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_plane_rows_meet_both_window_bounds(chip):
    """Issue 30's two window bounds at once, where the rows are 128 words: on bf16 plane rows
    (``plane_run_cases``) a 128-token window anywhere is <= ceil(128 / 64) + 1 = 3 DMAs of
    exactly its 256 plane rows (2 per token), and every shape's call moves ``"exact"``'s bytes
    (1 KB per gathered token, as one DMA per token did) in the tiles' DMA count."""
    for tiles, exact, plane in zip(v4cases.compile_cases(True, "packed"), exact_run_cases(),
                                   plane_run_cases(), strict=True):
        block = v4_blocks.block(chip, "plane", plane.specs[0].shape[1])
        seg, w_runs, _ = traffic.segment_plan("plane", block, v4cases.PAGE, v4cases.PAGE, True)
        window = dict(window=v4cases.WINDOW, entries=0, seg=seg, window_runs=w_runs,
                      compressed_runs=False, align=formats.run_align("plane"))
        assert traffic.run_bound(**window) == (0, v4cases.WINDOW, 3)
        t_plane, t_tiles, t_exact = (c.traffic(chip) for c in (plane, tiles, exact))
        assert t_plane.dmas == t_tiles.dmas and t_plane.bytes_moved == t_exact.bytes_moved


def test_compressor_model_of_an_unaligned_hca_prefill():
    """A ratio-128 prefill whose rows start at row 3 moves its runs as 136-row windows (and,
    each entry in its own RoPE table tile, 2 x 16 KB of tables per entry: 1.09x -> 1.15x)."""
    t = v4ctraffic.compressor_traffic(v4ctraffic.prefill_counts(8192, 128, first_row=3),
                                      ratio=128, d=512)
    assert 1.14 < t.ratio < 1.16


@pytest.mark.parametrize("case,chip", COMPRESSOR_PARAMS)
def test_compressor_compiles_in_place_without_per_element_glue(case, chip):
    """The Pallas compressor at the V4 dims (pool donated): compiles; the glue has no loop, no
    per-element gather/scatter and no copy of the pool (the state call writes it in place);
    the kernels declare the model's static bound; the model is within its factor."""
    compiled = xla_cost.compile_program(case.fn_for_chip(chip), case.specs, chip,
                                        donate_argnums=(6, 7), case=case.shape)
    cost = xla_cost.analyze(compiled)
    rows, seqs = case.specs[0].shape[0], case.specs[8].shape[0]
    ratio, d = case.specs[2].shape[0], case.specs[3].shape[0]
    slots = vc.max_entries(rows, seqs, ratio)  # one scalar per output slot is metadata
    if case.shape == glue_gates.COMPRESSOR:  # issue 30: the glue at the peers' floor
        glue_gates.assert_glue("compressor", chip, cost)
    glue_gates.assert_pool_in_place(compiled, cost, case.specs[6], max(rows, slots))
    worst = v4ctraffic.worst_counts(rows, seqs, ratio)
    assert cost.kernel_bytes == (v4ctraffic.pool_bytes(worst, ratio=ratio, d=d, row_table=True)
                                 + v4ctraffic.state_bytes(worst, ratio=ratio, d=d))
    t = case.traffic(chip)
    assert t.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes
    assert t.bytes_min <= t.bytes_moved
    assert t.ratio <= COMPRESSOR_MAX_RATIO[case.shape], (case.shape, t)


@pytest.mark.parametrize("case,chip", COMPRESSOR_PARAMS)
def test_compressor_dma_descriptors(case, chip):
    """The compressor model's DMA descriptors (``traffic.pool_dmas`` + ``state_dmas``, equal
    to the interpreter's count in ``tests/test_hbm_traffic.py``): a decode step, per sequence
    (each completes an entry) its kv and score row, its kv and gate ring slot, and the state's
    kv copy, score row in and gate row out (7), one output row per slot, the two ape blocks, the
    norm weight and 1 per completing entry's ``rope_rows`` row; a
    prefill, at most one DMA pair per chunk row pooled (``coff`` pools per row) and 3 per
    state row, and at ratio 128 one pair per entry (every run aligned)."""
    rows, seqs = case.specs[0].shape[0], case.specs[8].shape[0]
    ratio = case.specs[2].shape[0]
    slots = vc.max_entries(rows, seqs, ratio)
    state = min(rows, seqs * vc.state_rows(ratio))
    dmas = case.traffic(chip).dmas
    # the rows finished in the kernel: the norm weight block, one ``rope_rows`` row DMA per
    # completing entry (the cases pass the tables in the row layout)
    counts = (v4ctraffic.decode_counts(seqs, ratio) if rows == seqs
              else v4ctraffic.prefill_counts(rows, ratio))
    finish = 1 + counts.table_rows
    if rows == seqs:
        assert counts.table_rows == seqs
        assert dmas == 7 * seqs + slots + 2 + finish, (case.shape, dmas)
    elif ratio == 128:
        assert counts.table_rows == rows // ratio
        assert dmas == 2 * (rows // ratio) + slots + 1 + 3 * state + 1 + finish, (case.shape, dmas)
    else:
        bound = 2 * vc.compressor_coff(ratio) * rows + slots + 1 + 3 * state + 1 + finish
        assert 0 < dmas <= bound, (case.shape, dmas, bound)


# ----------------------------------------------------------------------------- the step, fp8

def _v4_step_cost_script():
    from scripts.cost import v4_step_cost as mod

    return mod


def _hbm_copies(hlo_text: str, sizes: set[int]) -> list[str]:
    """Entry ``copy`` / ``copy-start`` lines whose array has one of ``sizes`` elements, except
    memory-space moves (XLA's prefetch of a small array into VMEM, ``S(1)``, and its eviction:
    at this test's small shape a compressed cache part fits there; at real contexts it does
    not): the copies of a cache part in HBM, a relayout or a copy around an update."""
    out = []
    for line in hlo_text[hlo_text.index("\nENTRY"):].splitlines():
        for op in (" copy(", " copy-start("):
            if op in line and " = " in line:
                shape = line.split(" = ", 1)[1].split(op)[0]
                if "S(1)" in shape:
                    continue
                first = xla_cost.strip_layout(shape).lstrip("(").split("]")[0] + "]"
                if math.prod(xla_cost.dims(first)) in sizes:
                    out.append(line.strip()[:160])
    return out


def test_fp8_v4_step_compiles_in_place_without_per_element_glue():
    """The V4 step (``dsa_jax.v4_step``, Pallas backend; V4-Flash dims, 4 layers SWA, SWA, CSA,
    HCA; decode 8 x 2048 + the CLI's 2 padding rows) with fp8 window and compressed (MODEL1)
    caches and the fp8 index cache, caches and states donated, AOT for v6e: no loop, no
    per-element gather / scatter (under a 128-lane row per index over more than the step's rows:
    the MODEL1 writer once stored each rope quarter as 32 one-word indices per token, which
    this check catches; at 64 x 8192 XLA also copied a rope array around them) and no copy in
    HBM of a MODEL1 part or the index keys.
    Not checked: the index cache's ``scales f32[Lc, P, 128]``, which XLA lays out ``{2,0,1}``
    for a small ``Lc`` and the indexer kernel reads row-major (a relayout per step,
    BENCHMARKS.md "The DeepSeek-V4 step")."""
    mod = _v4_step_cost_script()
    fmts = dict(window_format="fp8", compressed_format="fp8", index_format="fp8")
    fn, specs, donate, rows, layout = mod.program(4, 8, 2048, fmts)
    compiled = xla_cost.compile_program(fn, specs, chips.DEFAULT, donate_argnums=donate,
                                        case="v4_step_fp8")
    cost = xla_cost.analyze(compiled)
    assert cost.kernels and not cost.has_loop, cost.loops
    t = rows + 2
    # the indexer's row -> block-slot map (indexer.work_list): one scalar per block row of its
    # work list, per-row metadata of every step, the plain-cache one too (48 indices at T = 10)
    work_list = xla_cost.Allowed("indexer work list", "row -> block-slot map, metadata",
                                 "scatter", "work_list", max_indices=8 * t)
    assert not [op.describe() for op in cost.indexed_ops
                if not xla_cost.classify(op, row_limit=t, allowed=[work_list]).ok]
    caches = [specs[i] for i in donate if specs[i].dtype != np.float32]  # u32 parts, e4m3 keys
    assert len(caches) == 2 * 5 + 1  # 3 window + 2 compressed MODEL1 caches, the index keys
    copies = _hbm_copies(compiled.as_text(), {math.prod(x.shape) for x in caches})
    assert not copies, copies
    # the window rows are written by the attention kernels (pallas_kernels.v4_attention.writes):
    # no XLA scatter into a window cache part
    pages = rows * layout.window_pages_per_seq + 1
    assert not window_scatters(cost, [specs[i] for i in donate], pages)


def window_scatters(cost, donated, window_pages: int) -> list[str]:
    """The XLA scatters of a compiled V4 step whose operand is a window cache part: a donated
    u32 ``[Lx, P, rows, 128]`` array with the window cache's ``P`` pages (``v4_cli.build``'s
    tables: one spare page; the compressed caches have fewer), or its ``[Lx * P, rows, 128]``
    view (the MODEL1 writer's): same element count and minor dims."""
    parts = {(math.prod(x.shape), tuple(x.shape[2:])) for x in donated
             if x.dtype == np.uint32 and len(x.shape) == 4 and x.shape[1] == window_pages}
    assert len(parts) == 4  # nope and rope of the [2, ...] SWA and [1, ...] CSA / HCA stacks

    def key(shape: str):
        d = xla_cost.dims(xla_cost.strip_layout(shape).lstrip("(").split("]")[0] + "]")
        return math.prod(d), tuple(d[-2:])

    return [op.describe() for op in cost.indexed_ops if op.kind == "scatter"
            and op.operand_shapes[0].lstrip("(").startswith("u32")
            and key(op.operand_shapes[0]) in parts]
