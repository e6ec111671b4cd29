"""Traffic, DMA-descriptor and VMEM model of the V4.1 ratio-2 compressor
(``pallas_kernels.v41_compressor``): the V4 compressor's model
(``pallas_kernels.v4_compressor.traffic``, its module docstring has every count) at pooling
ratio 2 (``coff = 1``, ``R = 2``), with the kernel's finish (``output="roped"`` / ``"cache"``:
the RoPE table tiles read) or without it (``"latent"``: no table read, the norm in the glue).

The minimum: this step's kv and score rows read once, each completing entry's old ring row (kv
and score, when its partner precedes the step), the ring rows written (kv and score), the
entries written (``d``) and, when the kernel ropes them, their two table rows. Above it: the
unused output slots' zero rows, each chunk row read a second time by the state call, the ring
row read whole, and V4.1's zero ape (``2 x d`` f32 read by each call)."""

from __future__ import annotations

from pallas_kernels import aot
from pallas_kernels.v4_compressor import traffic as v4t

RATIO = 2  # V4.1 pools pairs (ratio 1: nothing to pool, no kernel)
F32 = v4t.F32
decode_counts = v4t.decode_counts
prefill_counts = v4t.prefill_counts


def half_of(output: str) -> int:
    """The RoPE tables' width the kernel reads: 0 for ``"latent"`` (no finish in the kernel)."""
    return 0 if output == "latent" else v4t.HALF


def kernel_bytes(c: v4t.StepCounts, *, d: int, output: str) -> int:
    """HBM bytes both calls move (the pool call with or without its finish, the state call)."""
    half = half_of(output)
    return (v4t.pool_bytes(c, ratio=RATIO, d=d, half=half)
            + v4t.state_bytes(c, ratio=RATIO, d=d))


def step_traffic(c: v4t.StepCounts, *, d: int, output: str = "latent") -> aot.Traffic:
    """One step against the minimum (module docstring)."""
    half = half_of(output)
    minimum = (c.step_rows * 2 * d + c.old_slots * 2 * d + c.state_rows * 2 * d
               + c.entries * (d + 2 * half)) * F32
    return aot.Traffic(kernel_bytes(c, d=d, output=output), int(minimum),
                       int(6 * c.entries * RATIO * d),
                       v4t.vmem_bytes(ratio=RATIO, d=d, half=half,
                                      window=v4t.uses_window(RATIO, c.step_rows)),
                       dmas=v4t.pool_dmas(c, half=half) + v4t.state_dmas(c))
