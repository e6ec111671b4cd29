"""Compile gate: the fused V4 attention kernel on tokamax's cache formats and its flash-state
entries (``pallas_kernels.v4_attention.compile_cases.tokamax_cases``) AOT-compiles for v5e, v6e
and tpu7x at the engines' decode shapes (``tokamax_shapes``: 64 rows; V4-Flash H=64, top-512, at
8192 and 65536 tokens; V4-Pro H=128, top-1024, at 8192; window 128): the
window pass on a ``PlaneCache`` writing this step's rows in place (the cache donated: no copy
of it) and returning the bf16 flash state, the CSA entries from that state on a ``CsaCache``
(sink applied), and the HCA layer on ``PlaneCache`` caches in one call; no per-element
gather/scatter or loop in the XLA glue, the kernel's declared bytes equal the model's, and the
model's bytes within the stated factor of each call's minimum.

The factors (the model, ``tokamax_traffic``; the same on every chip): the window pass and the
HCA call 1.00x at 8K, up to 1.02x at 64K (the page tables; plane rows move their 1024 stored
bytes, one DMA per token; the state is the call's own I/O); the CSA pass 1.38x (2 DMAs move
1024 B per entry against the 640 B stored, as MODEL1 fp8). Per decode row at the V4-Flash CSA
8K shape: window pass 265,268 B + CSA pass 723,888 B = 989,156 B, 1.25x the one-call fused op's
789,424 B (packed or fp8 MODEL1 caches; the window pass includes its written row): q is read
twice and the bf16 state (64.5 KB) written and read back. The HCA call: 328,500 B, as packed.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from test_compile_v4 import assert_gate

from pallas_kernels import aot, xla_cost
from pallas_kernels.measure import hlo
from pallas_kernels.v4_attention.compile_cases import tokamax_cases
from pallas_kernels.v4_attention.kernel import INFO_WORDS
from tests.chip_turns import on_every_chip

pytestmark = pytest.mark.kernel_gate


def _compile(case, chip, donate=()):
    """``case`` compiled for ``chip`` with ``donate`` (argnums; pytree specs placed on the chip's
    topology device, as ``aot.aot_compile``)."""
    if not donate:
        return case.compile(chip)  # CompileError names chip, shape, Mosaic's text
    dev = aot.topology_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    placed = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), case.specs)
    with aot.compiling_on(dev):
        return jax.jit(case.fn_for_chip(chip), donate_argnums=donate).trace(
            *placed).lower().compile()

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

CASES = on_every_chip(tokamax_cases(), lambda c: f"{c.kernel}-{c.shape}")
# At 65536 tokens the page tables (read whole into SMEM, 4 B per page) add 1.6% to the window
# pass and 0.04% to the CSA pass: the bounds hold for both context lengths.
MAX_RATIO = {"v4_tokamax_window_writes_state_plane": 1.02,
             "v4_tokamax_entries_from_state_csa": 1.385, "v4_tokamax_hca_plane": 1.02}


@pytest.mark.parametrize("case,chip", CASES)
def test_compiles_without_per_element_glue_and_within_the_traffic_bound(case, chip):
    writes = "writes" in case.kernel
    compiled = _compile(case, chip, donate=(1,) if writes else ())
    cost = xla_cost.analyze(compiled)
    if writes:  # the donated window cache is written in place: no XLA op makes a copy of it
        cache = np.prod(case.specs[1].shape) * 4  # the window's words
        assert not hlo.parse_large_results(compiled.as_text(), cache)
    t = assert_gate(case, chip, cost, MAX_RATIO[case.kernel])
    assert cost.kernel_bytes == t.bytes_moved - case.specs[0].shape[0] * INFO_WORDS * 4
