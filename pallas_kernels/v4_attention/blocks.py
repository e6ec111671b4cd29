"""Block sizes of the fused DeepSeek-V4 attention kernel (``kernel``): cache rows per gathered
block, the one knob it sizes per call (``tokens_per_block`` of ``v4_attention``; the two-pass
path takes the MLA kernel's blocks, ``pallas_kernels.mla.blocks``).

One block is ``block`` cache rows (window tokens, then compressed entries) DMA'd into one of two
gather buffers before one online-softmax step: ``2 * block * 1 KiB`` of VMEM for packed / f32
rows, ``2 * block * 1.5 KiB`` for fp8 (nope, rope and quarter buffers).

The tuned-block table (the form of ``pallas_kernels.block_table``): chip -> shape key -> rows per
block. The key is ``(cache format, pow2(heads))``, format ``"packed"`` (also f32 rows) or
``"fp8"``; ``()`` is the chip's row for any shape, and ``FALLBACK`` serves a chip the table
lacks. ``clamp`` halves a block until its VMEM model fits half the chip's VMEM (never below 8
rows; no chip: unclamped); every row fits on every chip, so the clamp changes nothing today. A
clamp to the row's stream length (window + selected entries) is deliberately not applied: it
would change the block at small shapes (and with it the matmul shapes and VMEM limit).
"""

from __future__ import annotations

from pallas_kernels import block_table, tpu
from pallas_kernels.block_table import Row, pow2
from pallas_kernels.v4_attention import formats

DEFAULT_BLOCK = 256  # rows per gathered block: 256 KB of packed rows in VMEM
# how page runs move packed / f32 rows (formats.RUN_GRAINS): "tiles", one DMA per segment of
# its wanted rows widened to 8-row tiles (<= 14 rows more per window); "exact" moves the wanted
# rows only but its ragged head and tail one row a DMA (<= 14 DMAs more per window): Mosaic
# allows one of the two per run for 256-lane rows (tests/test_dma_probe.py). Not timed.
DEFAULT_RUN_GRAIN = "tiles"
MIN_BLOCK = tpu.SUBLANES  # a block is a positive multiple of 8 rows

_VMEM = "default: VMEM budget (two 256 KiB packed gather buffers, one DMA per row); not timed"
_GATE = ("AOT compile OK: tests/test_compile_v4.py fused cases (V4-Flash H=64, V4-Pro H=128 "
         "decode, window 128); not timed")


def _chip_rows(block: int) -> dict[tuple, Row]:
    rows = {(): Row(block, _VMEM)}
    for fmt in ("packed", "fp8"):
        rows |= {(fmt, 64): Row(block, _GATE), (fmt, 128): Row(block, _GATE)}
    return rows


FALLBACK: dict[tuple, Row] = {(): Row(DEFAULT_BLOCK, "default: VMEM budget, for any chip")}
TABLE: dict[str, dict[tuple, Row]] = block_table.checked({
    "v5e": _chip_rows(DEFAULT_BLOCK),
    "v6e": _chip_rows(DEFAULT_BLOCK),
    "tpu7x": _chip_rows(DEFAULT_BLOCK),
}, FALLBACK)


def table_format(kernel_format: str) -> str:
    """The table's format key of a kernel cache format (``formats.FORMATS``): ``"fp8"`` for the
    two-DMA fp8 formats (MODEL1 ``"fp8"``, tokamax ``"csa"``), else ``"packed"`` (one DMA per
    token: packed, f32 and tokamax ``"plane"`` rows)."""
    return "fp8" if kernel_format in formats.FP8_FORMATS else "packed"


def shape_key(fmt: str | None = None, heads: int | None = None) -> tuple:
    """The table key: ``(fmt, pow2(heads))`` (``fmt``: ``"packed"`` or ``"fp8"``), shorter when
    a part is unknown."""
    if fmt is None:
        return ()
    return (fmt,) if heads is None else (fmt, pow2(heads))


def row(chip: str | None, fmt: str | None = None, heads: int | None = None) -> Row:
    """The table row for ``chip`` at this shape (``block_table.lookup``)."""
    return block_table.lookup(TABLE, FALLBACK, chip, shape_key(fmt, heads))


def gather_vmem(block: int, *, fp8: bool) -> int:
    """VMEM bytes of the two gather buffers of ``block`` rows (``kernel.fused_traffic``'s
    gather term; fp8: with the page runs' rope rows and their expansion)."""
    return 2 * block * formats.gather_row_vmem(fp8, 4 * formats.WORDS, runs=True)


def clamp(block: int, chip: str | None, *, fp8: bool = False) -> int:
    """``block`` halved (not below ``MIN_BLOCK``) until its gather buffers fit half of
    ``chip``'s VMEM; unchanged when the chip is unknown."""
    capacity = tpu.chip_vmem(chip)
    while capacity and block > MIN_BLOCK and gather_vmem(block, fp8=fp8) > capacity // 2:
        block = max(MIN_BLOCK, block // 2 // MIN_BLOCK * MIN_BLOCK)
    return block


def block(chip: str | None, fmt: str | None = None, heads: int | None = None) -> int:
    """Rows per gathered block the table gives for this chip and shape, clamped."""
    return clamp(row(chip, fmt, heads).blocks, chip, fp8=fmt == "fp8")
