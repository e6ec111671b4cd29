"""The chips of the AOT compile gates, per CI leg.

The pinned leg (the README's test command) compiles every case on every chip. The newest-jax
leg (README, ``-m "(kernel_gate and not other_chips) or notebooks"``) compiles each case on one
chip, the chips taking turns along the case list: every chip still compiles a share of each
kernel's cases on the newest jax, in a third of the time (CI's last run ended at its time limit:
session 21)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from pallas_kernels import chips

OTHER_CHIPS = pytest.mark.other_chips


def on_every_chip(cases: Sequence, name: Callable[[object], str]) -> list:
    """``pytest.param(case, chip)`` for every case and chip (``chips.NAMES``), with the id
    ``f"{name(case)}-{chip}"``. Case ``i``'s turn is chip ``i % len(chips.NAMES)``; every other
    pair carries the ``other_chips`` mark (the newest-jax leg leaves it out)."""
    return [pytest.param(case, chip, id=f"{name(case)}-{chip}",
                         marks=() if j == i % len(chips.NAMES) else (OTHER_CHIPS,))
            for i, case in enumerate(cases) for j, chip in enumerate(chips.NAMES)]
