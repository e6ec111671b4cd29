"""The libtpu facts ``reference.fp8_cache``'s docstring gives as the reasons for its layouts
(``scripts/probes/fp8_layout_probe.py``), checked on every chip we compile for: if a libtpu release
changes one, this fails and the layout (and its docstring) should be revisited."""

from __future__ import annotations

import os

import pytest

from pallas_kernels import aot

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from pallas_kernels.measure import fp8_layout_probe  # noqa: E402


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_the_fp8_layout_reasons_hold(chip):
    got = fp8_layout_probe.probe(chip)
    # scale rows: 64 lanes per row would be laid out transposed; whole 128-lane rows are not
    assert got["layout f32[8192,64]"].startswith("f32[8192,64]{0,1:"), got
    assert got["layout f32[8192,128]"].startswith("f32[8192,128]{1,0:"), got
    # e4m3 key pages: (32, 128) tiles, so a page of a multiple of 32 rows is whole tiles
    assert ":T(32,128)" in got["layout f8e4m3fn[8192,64,128]"], got
    # the latent token: part of a 32-bit row at a dynamic lane offset is refused, a whole row
    # is not (so 164 words cannot share rows; the token takes 2 whole rows = 1024 B)
    assert not got["dma 64 of 128 lanes at a dynamic offset"][0], got
    assert not got["dma 32 of 128 lanes at a dynamic offset"][0], got
    assert got["dma a whole 128-lane row"][0], got
    assert got["e4m3 page upcast to bf16 + bf16 dot"] and got["e4m3 x e4m3 dot"], got
