"""What Mosaic accepts and refuses among the DMA / strided-VMEM forms a page-run gather could be
written in (``pallas_kernels.measure.dma_probe``), pinned per chip: when a libtpu (or jax)
release flips one, this fails saying which form changed and how, and the kernels that rest on
the old answer (the V4 page runs, the fp8 rope-quarter expansion) should be revisited."""

from __future__ import annotations

import os
from importlib import metadata

import pytest

from pallas_kernels import aot

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from pallas_kernels.measure import dma_probe  # noqa: E402

pytestmark = pytest.mark.kernel_gate


def _libtpu() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in metadata.version("libtpu").split(".")[:3])
    except (metadata.PackageNotFoundError, ValueError):
        return (0,)


# libtpu 0.0.42 (jax 0.10.2's) refuses a strided bf16 load even at a static start; 0.0.50 (jax
# 0.12's) accepts it (a dynamic start stays refused: "Only static indices ... packed types").
_BF16_STATIC_LOAD = _libtpu() >= (0, 0, 50)

_UNALIGNED_OFFSET = "Offsets along tiled dimensions must be aligned to tiles"
_UNALIGNED_SIZE = "Slice sizes along tiled dimensions must be aligned to tiles"

# form -> (accepted, what the detail holds: "" when accepted, else a piece of Mosaic's message;
# for the flat runs, whether the program copies the whole cache)
EXPECTED: dict[str, tuple[bool, object]] = {
    "row": (True, ""),
    **{f"run {n}": (True, "") for n in dma_probe.RUNS},
    # a DMA of a traced number of rows compiles (Mosaic's memref<?x128> enqueue_dma)
    "run dynamic length": (True, ""),
    # ... and into VMEM at a dynamic row (runs packed one after another in one buffer)
    "run 8 to a dynamic vmem row": (True, ""),
    "run dynamic length to a dynamic vmem row": (True, ""),
    # the [P * ps, 128] view is a bitcast when a page is whole (8, 128) tiles, else a copy
    "flat run 1": (True, False),
    "flat run 8": (True, False),
    f"flat run 1, ps={dma_probe.ODD_PAGE_SIZE}": (True, True),
    **{f"strided {op} {dt} {j} j": (True, "")
       for op in ("store", "load") for dt in ("u32", "f32") for j in ("static", "dynamic")},
    "strided store bf16 static j": (False, "Strided store with non 32-bit data"),
    "strided store bf16 dynamic j": (False, "Strided store with non 32-bit data"),
    "strided load bf16 static j": ((True, "") if _BF16_STATIC_LOAD
                                   else (False, "Strided load with non 32-bit data")),
    "strided load bf16 dynamic j": (False, "compile: "),
    "dma to strided vmem": (False, "lower: NotImplementedError: Strided slices of references"),
    # 256-word rows (packed bf16 V4 rows; the same on libtpu 0.0.42 and 0.0.50): one row at any
    # dynamic HBM / VMEM row; several only at rows AND sizes provably multiples of 8 (the V4
    # page runs' "tiles" grain, or "exact": the tile-aligned middle plus single-row DMAs)
    "wide row": (True, ""),
    "wide run 8 at a multiple of 8": (True, ""),
    "wide run 8 at an unaligned row": (False, _UNALIGNED_OFFSET),
    "wide run 5": (False, _UNALIGNED_SIZE),
    "wide run dynamic length": (False, _UNALIGNED_SIZE),
    "wide run dynamic length, multiple of 8": (True, ""),
}


def _matches(want: tuple[bool, object], got: tuple[bool, object]) -> bool:
    if want[0] != got[0]:
        return False
    if isinstance(want[1], bool) or want[1] == "":
        return got[1] == want[1]
    return str(want[1]) in str(got[1])


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_mosaic_dma_forms_are_as_pinned(chip):
    got = dma_probe.probe(chip)
    assert set(got) == set(EXPECTED), sorted(set(got) ^ set(EXPECTED))
    changed = [f"{form}: pinned {EXPECTED[form]}, now {got[form]}"
               for form in EXPECTED if not _matches(EXPECTED[form], got[form])]
    assert not changed, (f"libtpu {'.'.join(map(str, _libtpu()))} on {chip} changed what Mosaic "
                         "accepts:\n" + "\n".join(changed))


def test_the_interpreters_on_a_dynamic_length_dma_are_as_pinned():
    """Mosaic compiles a DMA of a traced number of rows; of the CPU interpreters only the TPU
    one (``pltpu.InterpretParams``) runs it (and copies the right rows): a kernel using one
    must be tested with it, not with ``interpret=True``."""
    got = dma_probe.interpreter_facts()
    assert got["run dynamic length, TPU interpreter"] == (True, ""), got
    ok, msg = got["run dynamic length, interpret=True"]
    assert not ok and msg.startswith("trace: TypeError: Shapes must be 1D sequences"), got
