"""Compile gate: the sparse MLA kernels AOT-compile (real Mosaic, no TPU needed) for v5e, v6e
and tpu7x at the serving shapes of ``compile_cases``, and the token-sparse decode moves at most
1.25x the minimum bytes (``Traffic``)."""

from __future__ import annotations

import os

import pytest

from pallas_kernels import aot
from pallas_kernels.mla import compile_cases as mcases

# Several processes (parallel test runs, other tools) may initialise libtpu for topologies;
# without this libtpu refuses all but the first ("multi-process lockfile").
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CASES = [(case, chip) for case in mcases.compile_cases(quick=True)
         for chip in aot.CHIPS]


@pytest.mark.parametrize("case,chip", CASES,
                         ids=[f"{c.kernel}-{c.shape}-{chip}" for c, chip in CASES])
def test_compiles(case, chip):
    case.compile(chip)  # raises CompileError naming chip, shape and Mosaic's message
    t = case.traffic(chip)
    assert t.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes
    assert t.bytes_min <= t.bytes_moved  # the model never moves less than the minimum


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_token_sparse_decode_traffic_within_1_25x_of_minimum(chip):
    decode = [c for c in mcases.token_cases(quick=True) if "decode" in c.tags]
    assert {c.shape.split("_")[1] for c in decode} == {"h128", "h16"}
    for case in decode:
        assert case.traffic(chip).ratio <= 1.25, (case.shape, case.traffic(chip))


def test_compile_cases_cover_the_issue_shapes():
    names = [c.shape for c in mcases.token_cases(quick=True)]
    assert any(n.startswith("decode64x8192_h128_k2048") for n in names)
    assert any(n.startswith("decode64x8192_h16_k2048") for n in names)
    assert any(n.startswith("prefill1024@32768") for n in names)
    pages = [c.shape for c in mcases.page_cases(quick=True)]
    assert all("p32x64" in n for n in pages) and len(pages) == 3
