"""XLA glue at the peers' floor (issue 30 deliverable 4), by XLA's TPU cost model of AOT compiles
through libtpu on CPU (no TPU runs): the program's bytes accessed minus the Pallas kernels'
declared estimates (``pallas_kernels.measure.xla_cost.analyze``), at V4-Flash decode (64 rows x
8192 tokens) on v5e, v6e and tpu7x, one compile per chip and program:

- the compressed-key indexer (``streamindex_topk``, ``compression_ratio=4``, index heads 64 x
  128, top-512; ``pallas_kernels.indexer.compile_cases``' Flash decode case) <= 5 MB per call:
  what is left is the selection (``approx_max_k``'s sort of ``f32[64, 2048]``, the masks);
- the Pallas V4 compressor (d 512, ratio 4, the pool donated;
  ``pallas_kernels.v4_compressor.compile_cases``' ``csa_d512_decode64``) <= 7.5 MB per call.

Before (main 2027a0e, v6e): indexer 11.2 MB (the work list's scalar gathers, priced by XLA at
kilobytes per index, and the ``[T, H, 1]`` weights relaid with 128x lane padding), compressor
22.3 MB (the RoPE tables copied row-major to gather rows, the norm and RoPE on the ``E`` rows,
the per-slot facts' gathers). Plus one strict-interpreter check of the compressor's in-kernel
finish on a RoPE table whose length is not a multiple of 128 (the padded table view)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import aot
from pallas_kernels import v4_compressor as pvc
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.measure import xla_cost
from pallas_kernels.v4_compressor import compile_cases as ccases
from reference import v4_compressor as vc

pytestmark = pytest.mark.kernel_gate

MB = 1e6
INDEXER_FLASH = "V4-Flash decode 64x8192 (2048 entries) k=512"
COMPRESSOR = "csa_d512_decode64"
GLUE_BOUND = {"indexer": 5.0 * MB, "compressor": 7.5 * MB}


def _program(name: str):
    """``(fn, specs, donate_argnums)`` of the gated program on each chip."""
    if name == "indexer":
        case = next(c for c in icases.v4_cases(quick=True) if c.shape == INDEXER_FLASH)
        return case.fn_for_chip, case.specs, ()
    case = next(c for c in ccases.compile_cases() if c.shape == COMPRESSOR)
    return case.fn_for_chip, case.specs, (6, 7)  # the pool donated, as the step does


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
@pytest.mark.parametrize("name", sorted(GLUE_BOUND))
def test_glue_at_the_peers_floor(name, chip):
    fn_for_chip, specs, donate = _program(name)
    compiled = xla_cost.compile_program(fn_for_chip(chip), specs, chip, donate_argnums=donate,
                                        case=f"{name} glue")
    cost = xla_cost.analyze(compiled)
    assert cost.loops_negligible, cost.loops  # a loop body counted once would hide bytes
    assert cost.kernels and cost.kernels_without_estimate == 0
    assert cost.xla_bytes <= GLUE_BOUND[name], (
        f"{name} on {chip}: XLA glue {cost.xla_bytes / MB:.2f} MB > "
        f"{GLUE_BOUND[name] / MB} MB (kernels {cost.kernel_bytes / MB:.2f} MB); largest XLA "
        f"results: {[(r.opcode, r.shape, r.op_name) for r in cost.large_results[:8]]}")


def test_compressor_finish_on_a_table_not_a_multiple_of_128():
    """Ratio 4, d 128, a 200-position table (the kernel reads a padded transposed view): the
    entries equal the reference's bit for bit (the same ops in the same order; XLA CPU), the
    unused slots zero."""
    rng = np.random.default_rng()
    ratio, d, n = 4, 128, 13
    cos, sin = vc.rope_tables(200)
    width = vc.compressor_coff(ratio) * d
    kv, score = (jnp.asarray(rng.standard_normal((n, width)), jnp.float32) for _ in range(2))
    ape = jnp.asarray(rng.standard_normal((ratio, width)), jnp.float32)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    # a zero pool: entry 45 pools tokens 176..179 from the ring
    state = vc.CompressorState(*(jnp.zeros((2, vc.state_rows(ratio), width), jnp.float32)
                                 for _ in range(2)))
    # kv_len 193 (this step's tokens 180..192): entries 45..47 at positions 180..188, in the
    # table's last tile (positions 128..199, padded to 256)
    args = (kv, score, ape, weight, cos, sin, state, jnp.asarray([1], jnp.int32),
            jnp.asarray([180 + n], jnp.int32), jnp.asarray([0, n], jnp.int32),
            jnp.asarray([0, 1, 1], jnp.int32))
    got, _ = pvc.compress_step(*args, ratio=ratio, interpret=True)
    want, _ = vc.compress_step(*args, ratio=ratio)
    np.testing.assert_array_equal(np.asarray(got.seq), np.asarray(want.seq))
    np.testing.assert_array_equal(np.asarray(got.entry), np.asarray(want.entry))
    assert (np.asarray(got.entry) >= 0).sum() == 3
    np.testing.assert_array_equal(np.asarray(got.rows).view(np.uint32),
                                  np.asarray(want.rows).view(np.uint32))
