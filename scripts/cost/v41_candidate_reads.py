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
candidate entries themselves are ``2048 * 8 * 68`` B = 1.1 MB a row. The last columns: the
candidate-block kernel over the block layout (``pallas_kernels.indexer.v41_candidates.traffic``,
equal to the interpreter's counts in ``tests/test_v41_candidate_blocks.py``): a block row a
candidate, a scale row per run of candidates sharing one, compact scores (``--markdown`` adds
its ratio to its own minimum, the candidate entries' 68 B and a score each).

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m scripts.cost.v41_candidate_reads [--markdown]
"""

from __future__ import annotations

import argparse

import numpy as np

from pallas_kernels.indexer import v41_candidates
from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.v41_scores import traffic
from reference.v41 import index_blocks as ib
from reference.v41 import v41_flash

PAGE = 128
ENTRIES = (8192, 131072, 1 << 20)
ROWS = 4


def placement_ids(entries: int, num_blocks: int, block: int, rng) -> dict[str, np.ndarray]:
    """Each placement's ``num_blocks`` block ids of one row, ascending."""
    nb = entries // block
    n = min(num_blocks, nb)
    per_page = PAGE // block
    newest = np.arange(nb - n, nb)
    rand = rng.choice(nb, n, replace=False)
    pages = entries // PAGE
    spread = (np.arange(n) % pages) * per_page + (np.arange(n) // pages)
    return {name: np.sort(ids) for name, ids in (("newest", newest), ("random", rand),
                                                ("spread", spread))}


def placements(entries: int, num_blocks: int, block: int, rng) -> dict[str, set[int]]:
    """Sequence-local pages read for each placement of one row's ``num_blocks`` blocks."""
    return {name: {int(b) * block // PAGE for b in ids}
            for name, ids in placement_ids(entries, num_blocks, block, rng).items()}


def block_traffic(ids: np.ndarray, entries: int, heads: int):
    """The candidate-block kernel's model for ``ROWS`` rows each reading ``ids`` (pages in
    order: the row-local page is the page id)."""
    per = ib.block_rows(PAGE)
    tile = np.tile(ids, (ROWS, 1))
    return v41_candidates.traffic(tile, tile // per, tile % per, np.full(ROWS, entries),
                                  heads=heads)


def rows(seed: int = 0):
    """``[(entries, placement, all-pages Traffic, candidate Traffic, pages read a row, block
    kernel Traffic)]``."""
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
        for name, ids in placement_ids(n, c.candidate_topk_blocks, c.candidate_block_size,
                                       rng).items():
            pages = {int(b) * c.candidate_block_size // PAGE for b in ids}
            cand = traffic(q_lens, kv_lens, **kw, read_pages=[pages] * ROWS)
            out.append((n, name, full, cand, len(pages),
                        block_traffic(ids, n, c.index_n_heads)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    head = ("entries / row", "placement", "pages read / all", "MB / row: all pages",
            "MB / row: candidates", "DMAs / row: all", "DMAs / row: candidates",
            "MB / row: blocks", "DMAs / row: blocks", "blocks / minimum")
    sep = " | "
    print(sep.join(head))
    if args.markdown:
        print("|".join(["---"] * len(head)))
    for n, name, full, cand, pages, blk in rows():
        print(sep.join((f"{n}", name, f"{pages} / {n // PAGE}",
                        f"{full.bytes_moved / ROWS / 1e6:.2f}",
                        f"{cand.bytes_moved / ROWS / 1e6:.2f}",
                        f"{full.dmas / ROWS:.0f}", f"{cand.dmas / ROWS:.0f}",
                        f"{blk.bytes_moved / ROWS / 1e6:.2f}", f"{blk.dmas / ROWS:.0f}",
                        f"{blk.ratio:.2f}x")))


if __name__ == "__main__":
    main()
