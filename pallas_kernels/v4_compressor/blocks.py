"""Block parameters of the Pallas V4 compressor (``kernel``). Its buffers are fixed by the ratio
(an entry's ``R = coff * r`` slot rows, ``reference.v4_compressor.state_rows``); what it sizes
per call is the pool kernel's aligned-window path: a run of more than 8 of this step's rows
that does not start tile-aligned moves as one window of ``R + WINDOW_PAD`` rows from the run's
first row rounded down to 8 (2 DMAs instead of one per row), for entries of at least
``window_min_rows`` slots. Ratio 4's 8-slot entries keep row DMAs: a 16-row window would double
their bytes (``traffic``'s model).

The tuned-block table (the form of ``pallas_kernels.block_table``): chip -> shape key ->
``window_min_rows``. The key is ``(pow2(R),)`` (8 at ratio 4, 128 at ratio 128); ``()`` is the
chip's row for any ratio, and ``FALLBACK`` serves a chip the table lacks. ``uses_window``
clamps to the problem: the window path needs a step of at least ``R + WINDOW_PAD`` rows (a
static slice of the window must fit).
"""

from __future__ import annotations

from pallas_kernels import block_table, tpu
from pallas_kernels.block_table import Row, pow2
from reference import v4_compressor as vc

# Entries of at least this many slots (ratio 128) move a run of more than 8 chunk rows as one
# aligned window of R + 8 rows (2 DMAs, 8 rows over); ratio 4's 8 slots keep row DMAs (a
# 16-row window would double their bytes).
WINDOW_MIN_ROWS = 64
WINDOW_PAD = tpu.SUBLANES  # the window starts at the run's first row rounded down to 8

_MODEL = "default: traffic model (2 DMAs per unaligned ratio-128 run vs one per row); not timed"
_GATE4 = ("AOT compile OK: tests/test_compile_v4.py compressor cases (ratio 4, d 512 / 128, "
          "decode and prefill: row DMAs); not timed")
_GATE128 = ("AOT compile OK: tests/test_compile_v4.py compressor cases (ratio 128, d 512, "
            "decode and prefill: the window path); not timed")


def _chip_rows(min_rows: int) -> dict[tuple, Row]:
    return {(): Row(min_rows, _MODEL), (8,): Row(min_rows, _GATE4),
            (128,): Row(min_rows, _GATE128)}


FALLBACK: dict[tuple, Row] = {(): Row(WINDOW_MIN_ROWS, "default: traffic model, for any chip")}
TABLE: dict[str, dict[tuple, Row]] = block_table.checked({
    "v5e": _chip_rows(WINDOW_MIN_ROWS),
    "v6e": _chip_rows(WINDOW_MIN_ROWS),
    "tpu7x": _chip_rows(WINDOW_MIN_ROWS),
}, FALLBACK)


def shape_key(ratio: int) -> tuple:
    """The table key: ``(pow2(R),)``, ``R`` the entry's slot rows at ``ratio``."""
    return (pow2(vc.pool_rows(ratio)),)


def row(chip: str | None, ratio: int) -> Row:
    """The table row for ``chip`` at ``ratio`` (``block_table.lookup``)."""
    return block_table.lookup(TABLE, FALLBACK, chip, shape_key(ratio))


def uses_window(ratio: int, num_rows: int, chip: str | None = None) -> bool:
    """Whether the pool kernel has the window path at this ratio and step size (static): the
    entry has at least the table's ``window_min_rows`` slots and the step holds a window."""
    rows = vc.pool_rows(ratio)
    return rows >= row(chip, ratio).blocks and num_rows >= rows + WINDOW_PAD
