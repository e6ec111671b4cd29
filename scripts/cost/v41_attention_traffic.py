"""HBM bytes and DMA descriptors a V4.1-Flash decode row of the Pallas V4.1 attention moves
(``pallas_kernels.v41_attention.entry.traffic``, the model the interpreter's counts equal; not
a TPU time): 64 heads x 512, window 128 at position 8191 (aligned: 4 segments of 32), top-512
pool entries on pages of 128, a call of ``--rows`` rows (the sink's block amortised over
them), bf16 q. The entries a row lists: drawn at random among 8192 (ratio 1) or 4096 (ratio
2) entries, or the newest 512 (a run); each in a shuffled order (the entry sorts them).
Beside the kernel's count (entries sharing a record row, two a row, or a scale row, sixteen a
row, fetch it once) the count with every entry fetching its own two rows (no ``pool_offset``:
the kernel before session 27).

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m scripts.cost.v41_attention_traffic [--rows 16]
        [--trials 5]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from pallas_kernels.v41_attention.entry import traffic, window_segments
from pallas_kernels.v41_attention.kernel import AttnConfig

HEADS, DIM, PAGE, WINDOW, TOPK, POSITION = 64, 512, 128, 128, 512, 8191
ENTRIES = {"ratio 1": 8192, "ratio 2": 4096}


def window(rows: int):
    """``(window_page, window_base, positions)`` of ``rows`` rows at ``POSITION``: every
    segment overlapping the window on a page (id 1), the others none."""
    pos = np.full(rows, POSITION, np.int32)
    base = np.asarray(window_segments(jnp.asarray(pos), window_size=WINDOW, page_size=PAGE,
                                      dim=DIM))
    seg = AttnConfig(HEADS, DIM, WINDOW, PAGE, TOPK, "bf16").seg
    page = np.where((base <= pos[:, None]) & (base + seg > POSITION - WINDOW + 1), 1, -1)
    return page.astype(np.int32), base, pos


def per_row(entries: int, how: str, rows: int, rng) -> dict:
    """One call's model per row: ``bytes``, ``minimum``, ``dmas`` (the kernel) and
    ``bytes_unshared``, ``dmas_unshared`` (every entry its own two rows)."""
    lists = np.stack([rng.permutation(rng.choice(entries, TOPK, replace=False) if how == "random"
                                      else np.arange(entries - TOPK, entries))
                      for _ in range(rows)])
    page, off = (lists // PAGE).astype(np.int32), (lists % PAGE).astype(np.int32)
    shape = dict(heads=HEADS, dim=DIM, window_size=WINDOW, page_size=PAGE, q_itemsize=2)
    got = traffic(*window(rows), page, **shape, pool_offset=off)
    alone = traffic(*window(rows), page, **shape)
    return dict(bytes=got.bytes_moved / rows, minimum=got.bytes_min / rows,
                dmas=got.dmas / rows, bytes_unshared=alone.bytes_moved / rows,
                dmas_unshared=alone.dmas / rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16, help="rows a call (default 16)")
    p.add_argument("--trials", type=int, default=5, help="random draws averaged (default 5)")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    for name, entries in ENTRIES.items():
        for how in ("random", "newest"):
            runs = [per_row(entries, how, a.rows, rng)
                    for _ in range(a.trials if how == "random" else 1)]
            r = {k: float(np.mean([x[k] for x in runs])) for k in runs[0]}
            print(f"{name} ({entries} entries), {how} {TOPK}: {r['bytes'] / 1e3:.0f} KB / "
                  f"{r['minimum'] / 1e3:.0f} KB = {r['bytes'] / r['minimum']:.2f}x, "
                  f"{r['dmas']:.0f} DMAs; every entry its own rows: "
                  f"{r['bytes_unshared'] / 1e3:.0f} KB = "
                  f"{r['bytes_unshared'] / r['minimum']:.2f}x, {r['dmas_unshared']:.0f} DMAs")


if __name__ == "__main__":
    main()
