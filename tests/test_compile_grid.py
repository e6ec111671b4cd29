"""Validators that guarantee a compile (issue 14 item 5), sampled: every combination of page
size, heads, dims, cache format, batch kind and blocks that an entry accepts AOT-compiles for
the chip (``scripts/cost/compile_grid.py``; its ``--full`` grid is the complete check, run by hand).
A seeded sample per kernel on one chip per run keeps this under a minute or two; the chips
rotate with the seed so every chip is covered across the parametrization."""

from __future__ import annotations

import pytest

from pallas_kernels import chips
from scripts.cost import compile_grid as grid_mod
from tests.chip_turns import on_every_chip

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)


CHIPS = chips.NAMES
SAMPLE = 3  # combinations per kernel and chip in CI (the seed picks them; compiles ~1-2 s each)


@pytest.mark.parametrize("kernel,chip", on_every_chip(grid_mod.KERNELS, str))
def test_every_accepted_combination_in_a_seeded_sample_compiles(kernel, chip):
    seed = CHIPS.index(chip) * 17 + grid_mod.KERNELS.index(kernel)
    combos = grid_mod.grid(kernel, False, SAMPLE, seed)
    assert len(combos) == SAMPLE
    failures = []
    for combo in combos:
        status, message, _ = grid_mod.compile_result(combo, chip)
        if status == "failed":  # "rejected" = refused by the entry's checks: allowed
            failures.append(f"{combo}: {message}")
    assert not failures, "\n".join(failures)
