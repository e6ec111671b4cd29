"""The shape every family's tuned-block table takes (``indexer/blocks.py``, ``mla/blocks.py``,
``v4_attention/blocks.py``, ``v4_compressor/blocks.py``), modelled on jax's
``pallas/ops/tpu/ragged_paged_attention/tuned_block_sizes.py``:

- a table ``{chip name: {shape key: Row}}``, chip names from ``pallas_kernels.chips`` (checked
  when the table is built, ``checked``);
- a shape key: a tuple the family builds from the problem, sizes normalised (``pow2``: the next
  power of two), most significant field first, so one row serves every problem that normalises
  to its key; a key's prefixes are coarser keys (``()`` is the chip's row for any shape);
- a fallback: rows of the same form for a chip the table lacks, with a ``()`` row, so every
  lookup answers (``lookup``: the longest prefix of the key with a row, in the chip's rows,
  then in the fallback's);
- each row's ``basis``: how its blocks were chosen. ``"measured: ..."`` (timed on that chip;
  none is today, no TPU was available), ``"AOT compile OK: ..."`` (the compile gate compiles
  these blocks for that chip at that shape; compiled, not timed), ``"default: ..."`` (chosen by
  a model: the VMEM budget, a traffic argument).

Each family clamps what the table gives to the problem (a block no larger than the rows there
are, a VMEM fit); explicit knobs override the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pallas_kernels import chips

BASES = ("measured", "AOT compile OK", "default")


@dataclass(frozen=True)
class Row:
    """One table row: the family's ``blocks`` and the ``basis`` they rest on (``BASES``)."""

    blocks: Any
    basis: str

    def __post_init__(self) -> None:
        if not self.basis.startswith(BASES):
            raise ValueError(f"a row's basis starts with one of {BASES}, got {self.basis!r}")

    @property
    def measured(self) -> bool:
        """Whether the blocks were timed on the chip (else a compile check or a default)."""
        return self.basis.startswith("measured")


Rows = dict[tuple, Row]


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): a normalised size."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def checked(table: dict[str, Rows], fallback: Rows) -> dict[str, Rows]:
    """``table`` when every chip is in ``chips.CHIPS`` and the fallback has a ``()`` row, else
    ``ValueError``."""
    for chip in table:
        chips.check(chip)
    if () not in fallback:
        raise ValueError("a block table's fallback needs a () row (any shape)")
    return table


def lookup(table: dict[str, Rows], fallback: Rows, chip: str | None, key: tuple) -> Row:
    """The row for ``key`` on ``chip``: the longest prefix of ``key`` with a row in ``chip``'s
    rows, else in ``fallback`` (a ``None`` or unknown chip: the fallback)."""
    for rows in (table.get(chip or "", {}), fallback):
        for n in range(len(key), -1, -1):
            row = rows.get(tuple(key[:n]))
            if row is not None:
                return row
    raise AssertionError("unreachable: checked() requires a () fallback row")
