"""What a V4.1 candidate consumer's index scores read (issue 31, Deliver 4): the Pallas indexer
over the fp4 index pages with ``candidates=`` (``pallas_kernels.indexer.v41_scores``) fetches
only the pages holding an entry of some row's candidate blocks, against the same call without
them (every visible page). Decode rows (one row a sequence) at V4.1-Flash's indexer dims and
candidate budget (2048 blocks of 8 entries), pages of 128 entries, rows of 8K / 128K / 1M
entries, three placements of the row's 2048 blocks:

- ``newest``: the newest 2048 blocks (one contiguous run: 16384 entries, 128 pages);
- ``random``: 2048 distinct blocks drawn uniformly (seeded);
- ``spread``: one block a page as far as the pages go (the most pages 2048 blocks can touch).

Numbers are ``v41_scores.traffic``'s model (bytes and DMA descriptors; equal to the strict
interpreter's counts in ``tests/test_v41_index_pages.py``), not TPU times. The model's minimum
with candidates is the visible entries on the pages read (a page-granular reader); the
candidate entries themselves are ``2048 * 8 * 68`` B = 1.1 MB a row.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m scripts.cost.v41_candidate_reads [--markdown]
"""

from __future__ import annotations

import argparse

import numpy as np

from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.v41_scores import traffic
from reference.v41 import v41_flash

PAGE = 128
ENTRIES = (8192, 131072, 1 << 20)
ROWS = 4


def placements(entries: int, num_blocks: int, block: int, rng) -> dict[str, set[int]]:
    """Sequence-local pages read for each placement of one row's ``num_blocks`` blocks."""
    nb = entries // block
    n = min(num_blocks, nb)
    per_page = PAGE // block
    newest = np.arange(nb - n, nb)
    rand = rng.choice(nb, n, replace=False)
    pages = entries // PAGE
    spread = (np.arange(n) % pages) * per_page + (np.arange(n) // pages)
    return {name: {int(b) * block // PAGE for b in ids}
            for name, ids in (("newest", newest), ("random", rand), ("spread", spread))}


def rows(seed: int = 0):
    """``[(entries, placement, all-pages Traffic, candidate Traffic, pages read a row)]``."""
    c = v41_flash()
    rng = np.random.default_rng(seed)
    out = []
    for n in ENTRIES:
        pps = n // PAGE
        blocks = resolve_blocks(None, block_rows=1, block_pages=None, chip=None,
                                one_token_per_seq=True, pages_per_seq=pps, page_size=PAGE,
                                mosaic=True)
        kw = dict(heads=c.index_n_heads, dim=c.index_head_dim, page_size=PAGE,
                  pages_per_seq=pps, q_itemsize=2, blocks=blocks, one_token_per_seq=True)
        q_lens, kv_lens = [1] * ROWS, [n] * ROWS
        full = traffic(q_lens, kv_lens, **kw)
        for name, pages in placements(n, c.candidate_topk_blocks, c.candidate_block_size,
                                      rng).items():
            cand = traffic(q_lens, kv_lens, **kw, read_pages=[pages] * ROWS)
            out.append((n, name, full, cand, len(pages)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    head = ("entries / row", "placement", "pages read / all", "MB / row: all pages",
            "MB / row: candidates", "DMAs / row: all", "DMAs / row: candidates")
    sep = " | "
    print(sep.join(head))
    if args.markdown:
        print("|".join(["---"] * len(head)))
    for n, name, full, cand, pages in rows():
        print(sep.join((f"{n}", name, f"{pages} / {n // PAGE}",
                        f"{full.bytes_moved / ROWS / 1e6:.2f}",
                        f"{cand.bytes_moved / ROWS / 1e6:.2f}",
                        f"{full.dmas / ROWS:.0f}", f"{cand.dmas / ROWS:.0f}")))


if __name__ == "__main__":
    main()
