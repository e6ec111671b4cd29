"""The V4.1 ratio-2 Pallas compressor (``pallas_kernels.v41_compressor``) compiles with Mosaic
for every chip (AOT through libtpu on CPU) at V4.1-Flash's dims, the state pool donated: no loop
and no per-element gather or scatter in the glue, no copy of the pool, the kernels' declared
bytes equal to the model's (``traffic.kernel_bytes``), the model within its measured factor
over the minimum and under the chip's VMEM. Each case compiles on one chip on the newest jax
(``tests/chip_turns.py``), on every chip on the pinned leg."""

from __future__ import annotations

import pytest

from pallas_kernels import aot, xla_cost
from pallas_kernels.v41_compressor import compile_cases as cc
from pallas_kernels.v41_compressor import traffic
from tests import glue_gates
from tests.chip_turns import on_every_chip

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

PARAMS = on_every_chip(cc.compile_cases(), lambda c: c.shape)
# The model's bytes over the minimum, measured by this gate (every chip: one block size).
# Decode (64 sequences each completing an entry; 96 output slots): per sequence its new row,
# its ring row read whole (kv and score) and the state call reading the new row again, 32
# unused slots' zero rows: 1.654x ("latent"); "roped" adds the two 16-KB RoPE table tiles per
# entry (the V4 kernel's tile reads; ``rope_rows`` would read 512 B): 3.871x. Prefill (8192
# tokens from 0): every row read once by its entry, the last two again by the state call: 1.000x
# and 1.025x.
MAX_RATIO = {"r2_d512_decode64_latent": 1.66, "r2_d512_decode64_roped": 3.88,
             "r2_d512_prefill8192_latent": 1.001, "r2_d512_prefill8192_roped": 1.03}


@pytest.mark.parametrize("case,chip", PARAMS)
def test_v41_compressor_compiles_in_place_without_per_element_glue(case, chip):
    compiled = xla_cost.compile_program(case.fn_for_chip(chip), case.specs, chip,
                                        donate_argnums=(5, 6), case=case.shape)
    cost = xla_cost.analyze(compiled)
    rows, seqs = case.specs[0].shape[0], case.specs[7].shape[0]
    slots = rows // traffic.RATIO + seqs
    glue_gates.assert_pool_in_place(compiled, cost, case.specs[5], max(rows, slots))
    output = case.shape.rsplit("_", 1)[1]
    worst = traffic.v4t.worst_counts(rows, seqs, traffic.RATIO)
    assert cost.kernel_bytes == traffic.kernel_bytes(worst, d=cc.D, output=output)
    t = case.traffic(chip)
    assert t.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes
    assert t.bytes_min <= t.bytes_moved
    assert t.ratio <= MAX_RATIO[case.shape], (case.shape, t)
    if rows == seqs:  # decode: 7 per sequence, one per output slot, ape x 2, the norm weight;
        # "roped": a cos and a sin tile per completing entry
        assert t.dmas == 7 * seqs + slots + 3 + 2 * seqs * (output == "roped"), t.dmas
    else:  # prefill: each entry's pair as 1 or 2 DMAs per array (a run of R = 2 rows moves in
        # one DMA only from an 8-aligned row), 3 per ring row written
        entries = rows // traffic.RATIO
        assert 2 * entries + slots <= t.dmas <= 4 * entries + slots + 3 * 2 + 5, t.dmas


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_the_v4_compressor_finish_lowers_in_the_bf16_regime(chip):
    """The pool kernel's finish rounds with the convert pair (``pallas_kernels.tpu.round_bf16``):
    Mosaic has no ``reduce_precision``, so with ``reference.quant.bf16.round_bf16`` in the
    kernel the V4 compressor at ``precision="bf16"`` (the V4 step's default) did not compile
    ("Unimplemented primitive in Pallas TPU lowering for tc: reduce_precision"), while its f32
    cases did."""
    from pallas_kernels.v4_compressor import compile_cases as v4cc
    from pallas_kernels.v4_compressor.kernel import compress_step as v4_step
    from reference import v4_compressor as vc

    case = v4cc.compile_cases()[0]

    def fn(kv, score, ape, weight, cos, sin, skv, sscore, slots, kv_lens, cu, dist, rows):
        return v4_step(kv, score, ape, weight, cos, sin, vc.CompressorState(skv, sscore), slots,
                       kv_lens, cu, dist, ratio=4, rope_rows=rows, precision="bf16")

    xla_cost.compile_program(fn, case.specs, chip, donate_argnums=(6, 7),
                             case=f"{case.shape} bf16")
