"""Compile gate: the sparse MLA kernels AOT-compile (real Mosaic, no TPU needed) for v5e, v6e
and tpu7x at the serving shapes of ``compile_cases``, and the token-sparse decode moves at most
1.25x the minimum bytes (``Traffic``)."""

from __future__ import annotations

import os

import pytest

from pallas_kernels import aot
from pallas_kernels.mla import compile_cases as mcases
from tests.chip_turns import on_every_chip

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

# Several processes (parallel test runs, other tools) may initialise libtpu for topologies;
# without this libtpu refuses all but the first ("multi-process lockfile").
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CASES = on_every_chip(mcases.compile_cases(quick=True), lambda c: f"{c.kernel}-{c.shape}")


@pytest.mark.parametrize("case,chip", CASES)
def test_compiles(case, chip):
    case.compile(chip)  # raises CompileError naming chip, shape and Mosaic's message
    t = case.traffic(chip)
    assert t.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes
    assert t.bytes_min <= t.bytes_moved  # the model never moves less than the minimum


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_token_sparse_decode_traffic_within_1_25x_of_minimum(chip):
    decode = [c for c in mcases.token_cases(quick=True)
              if "decode" in c.tags and c.shape.endswith("_packed")]
    assert {c.shape.split("_")[1] for c in decode} == {"h128", "h16"}
    for case in decode:
        assert case.traffic(chip).ratio <= 1.25, (case.shape, case.traffic(chip))


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_fp8_latent_cache_moves_at_most_1024_bytes_per_gathered_token(chip):
    """Issue 10: sparse MLA bytes per gathered token <= 1024 B with the fp8 latent cache (the
    packed bf16 cache moves 1536 B; FlashMLA's layout 656 B, the model's minimum)."""
    fp8 = [c for c in mcases.compile_cases(quick=True) if c.shape.endswith("_fp8")]
    assert {c.kernel for c in fp8} == {"sparse_mla", "page_sparse_mla"}
    assert len(fp8) == 2 * len(mcases.COMPILE_SHAPES)
    for case in fp8:
        _, rows, _, _, heads = next(s for s in mcases.COMPILE_SHAPES
                                    if case.shape.startswith(s[0]))
        t = case.traffic(chip)
        tokens = rows * mcases.K_TOKENS
        q_out = rows * heads * (mcases.FP8_DIM + mcases.MLA_V_DIM) * 2  # q read as given
        lanes = -(-mcases.FP8_DIM // 128) * 128  # the kernel's q blocks: whole lane groups
        q_moved = q_out + rows * heads * (lanes - mcases.FP8_DIM) * 2
        per_token = (t.bytes_moved - q_moved) / tokens  # + SMEM entry + preparation
        assert 1024 <= per_token <= 1024 + 16, (case.shape, per_token)
        assert (t.bytes_min - q_out) / tokens == 656, (case.shape, t.bytes_min)


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_dma_descriptors_per_row_are_one_per_selected_token_or_page_plus_three(chip):
    """The model's DMA descriptors per query row (``mla_traffic``, equal to the interpreter's
    count in ``tests/test_hbm_traffic.py``), from the layout: one gather per selected entry (a
    token row: k = 2048; page mode a whole page: 32 pages of 64), the row's entries into SMEM,
    the q block in and the out block back: 2051 and 35 per row, every format and shape."""
    for case in mcases.compile_cases(quick=True):
        rows = case.specs[0].shape[0]
        entries = mcases.K_TOKENS if case.kernel == "sparse_mla" else mcases.K_PAGES
        assert 0 < case.traffic(chip).dmas == rows * (entries + 1 + 2), case.shape


def test_compile_cases_cover_the_issue_shapes():
    names = [c.shape for c in mcases.token_cases(quick=True)]
    assert any(n.startswith("decode64x8192_h128_k2048") for n in names)
    assert any(n.startswith("decode64x8192_h16_k2048") for n in names)
    assert any(n.startswith("prefill1024@32768") for n in names)
    pages = [c.shape for c in mcases.page_cases(quick=True)]
    assert all("p32x64" in n for n in pages) and len(pages) == 2 * len(mcases.COMPILE_SHAPES)
    assert any(n.startswith("mixed") for n in names)
