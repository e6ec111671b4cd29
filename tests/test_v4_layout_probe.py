"""The libtpu facts ``reference.v4_cache``'s docstring gives as the reasons for the V4 cache's
TPU layout (``scripts/probes/v4_layout_probe.py``), on every chip we compile for: if a libtpu
release
changes one, this fails and the layout (and its docstring) should be revisited."""

from __future__ import annotations

import os

import pytest

from pallas_kernels import aot
from reference import v4_cache

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from pallas_kernels.measure import v4_layout_probe  # noqa: E402

pytestmark = pytest.mark.kernel_gate


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_the_v4_cache_layout_reasons_hold(chip):
    got = v4_layout_probe.probe(chip, quick=True)
    # whole 128-lane rows: one DMA per token, row-major by default (no relayout copy)
    for words, size in ((128, 512), (256, 1024)):
        assert got[f"row {words}"] == (True, False), got
        assert got[f"bytes/token {words}"] == size, got
        assert got[f"layout {words}"].endswith("{2,1,0:T(8,128)}"), got
    # 160 words (the token's 583 bytes rounded to words): a transposed default layout, so the
    # Pallas program copies the whole cache into the row-major one (padded to 256 lanes)
    assert got["row 160"] == (True, True), got
    assert not got["layout 160"].endswith("{2,1,0:T(8,128)}"), got
    # a DMA of a quarter of a row is refused even at a static lane offset: 512-byte granules
    assert not got["quarter static, same lanes"][0], got
    assert "divisible by 512" in got["quarter static, same lanes"][1], got  # (message cut)
    # the module's layout: two whole-row DMAs per token compile, no relayout, 640 B per token
    assert got[f"split ps={v4_layout_probe.PAGE_SIZE}"] == (
        True, False, v4_cache.STORED_BYTES_PER_TOKEN), got
