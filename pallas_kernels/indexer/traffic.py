"""Traffic model of the indexer score kernel: HBM bytes, MXU flops and VMEM, replaying the work
lists in plain Python (what ``scripts/cost/hbm_traffic.py`` checks against interpreter counts)."""

from __future__ import annotations

from pallas_kernels import aot
from pallas_kernels.indexer.blocks import IndexerBlocks, vmem_estimate
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, chunk_rows
from pallas_kernels.indexer.work_list import row_ladder
from pallas_kernels.tpu import LANES


def replay_items(q_lens, kv_lens, *, row0: int, rows: int, total_rows: int,
                 ladder: tuple[int, ...], page_size: int, capacity: int,
                 compression_ratio: int = 1, read_pages=None):
    """Plain-Python replay of ``work_list`` for one chunk: per level, the real items'
    ``(q row, rows n, pages needed)`` in grid order (the traffic model's and tests' view).
    ``kv_lens`` in tokens; ``compression_ratio = r``: pages and ``capacity`` hold entries, a
    block whose last row sits at token ``p`` needs ``(p + 1) // r`` of them. ``read_pages``:
    per sequence, the sequence-local pages its table lets the kernel fetch (the rest are -1:
    V4.1's candidate pages); then the third field counts the needed pages among them."""
    r = compression_ratio
    top = ladder[-1]
    levels = [[] for _ in ladder]
    q0 = 0
    for seq, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        lo, hi = min(max(q0, row0), row0 + rows), min(max(q0 + ql, row0), row0 + rows)
        full, rem = divmod(max(hi - lo, 0), top)
        blocks = [(len(ladder) - 1, lo + i * top) for i in range(full)]
        if rem:
            blocks.append((sum(rem > lvl for lvl in ladder), lo + full * top))
        kv_eff = min(max(kl, 0) // r, capacity)
        for i, a in blocks:
            n = min(ladder[i], hi - a)
            last = min(max((kl - ql + (a - q0) + n) // r, 0), kv_eff)
            pages = -(-last // page_size)
            if read_pages is not None:
                pages = sum(1 for p in read_pages[seq] if 0 <= p < pages)
            levels[i].append((min(max(a, 0), total_rows - ladder[i]), n, pages))
        q0 += ql
    return levels


def traffic(q_lens, kv_lens, *, heads: int, dim: int, page_size: int, pages_per_seq: int,
            key_itemsize: int, q_itemsize: int, blocks: IndexerBlocks, page_mode: bool,
            one_token_per_seq: bool, chunk_bytes: int = SCORE_CHUNK_BYTES,
            scale_lanes: int = 0, compression_ratio: int = 1,
            index_quant: str | None = None, read_pages=None) -> aot.Traffic:
    """HBM bytes, MXU flops and VMEM of the score kernel (and the page-score row map in XLA)
    for a batch of sequences ``(q_lens[i], kv_lens[i])``, replaying the work lists.

    Kernel side: key pages per item; one q block ``[L, H, D]`` plus the lane-padded weight
    rows ``f32[L, 1, H]`` per change of q row along the grid (the pipeline skips an
    unchanged block); the item's score rows (page mode: ``page_cols`` wide), one DMA each.
    Minimum: q and weights read once, each
    sequence's ``kv_len`` keys read once, scores written once. ``scale_lanes > 0``: an fp8
    cache, each fetched page also moves its f32 scale row of ``scale_lanes`` lanes (the
    minimum counts 4 scale bytes per key: the GPU layout's 132 B per key).
    ``compression_ratio = r``: ``kv_lens`` stay tokens, keys are their ``kv_len // r`` entries
    (``page_size`` / ``pages_per_seq`` in entries). ``index_quant="fp4_sim"``: the same HBM
    bytes as plain keys (the cache is read as stored; the rotation and FP4 rounding happen on
    the tile in VMEM, q is simulated in the glue and moves as ``q_itemsize``), plus the
    rotation's MXU flops ``2 * D * D`` per fetched key, and its VMEM temporaries.
    ``read_pages`` (``replay_items``): only those pages move; the MXU still runs every needed
    page's stage (an unfetched page is masked, not skipped).

    DMA descriptors (``dmas``), replayed the same way: manual DMAs, one per fetched key page
    (two with an fp8 cache: its keys and its scale row; one per page of tokamax's records) and
    one per score row written; pipeline block copies, two per q block fetched (the q block and
    the weight column). A decode row (a 1-row item) issues ``pages needed`` (fp8: twice that)
    + 1 + 2 descriptors."""
    total = sum(q_lens)
    cap = pages_per_seq * page_size
    width = pages_per_seq if page_mode else cap
    c = chunk_rows(total, width, blocks.block_rows, chunk_bytes)
    ladder = row_ladder(blocks.block_rows, c, one_token_per_seq)
    p_blk = blocks.block_pages
    page_cols = -(-(-(-pages_per_seq // p_blk) * p_blk) // LANES) * LANES
    key_row = dim * key_itemsize
    q_row = heads * dim * q_itemsize + -(-heads // LANES) * LANES * 4  # q + lane-padded weights
    chunks = sorted({min(i * c, total - c) for i in range(-(-total // c))})
    keys = flops = q_moved = out = dmas = 0
    page_dmas = 2 if scale_lanes else 1  # an fp8 page: its keys and its scale row
    for row0 in chunks:
        kw = dict(row0=row0, rows=c, total_rows=total, ladder=ladder, page_size=page_size,
                  capacity=cap, compression_ratio=compression_ratio)
        needed = replay_items(q_lens, kv_lens, **kw)
        levels = needed if read_pages is None else replay_items(q_lens, kv_lens, **kw,
                                                                read_pages=read_pages)
        for size, items, need in zip(ladder, levels, needed, strict=True):
            qrows = [qr for qr, _, _ in items] or [0]
            fetches = 1 + sum(a != b for a, b in zip(qrows, qrows[1:], strict=False))
            q_moved += fetches * size * q_row
            dmas += 2 * fetches  # the q block and the weight column: one block copy each
            for (_, n, pages), (_, _, computed) in zip(items, need, strict=True):
                dmas += pages * page_dmas + n  # key pages in, one score row out per row
                keys += pages * (page_size * key_row + 4 * scale_lanes)
                flops += 2 * size * heads * dim * computed * page_size
                if index_quant is not None:  # the key tile's Hadamard rotation
                    flops += 2 * dim * dim * computed * page_size
                out += n * (page_cols if page_mode else cap) * 4
    min_key = key_row + (4 if scale_lanes else 0)
    keys_min = sum(kl // compression_ratio * min_key for kl in kv_lens)
    bytes_min = (total * heads * (dim * q_itemsize + 4) + keys_min
                 + total * width * 4)
    vmem = vmem_estimate(block_rows=ladder[-1], block_pages=p_blk, num_heads=heads, dim=dim,
                         page_size=page_size, pages_per_seq=pages_per_seq,
                         key_itemsize=key_itemsize, q_itemsize=q_itemsize, page_mode=page_mode,
                         scale_lanes=scale_lanes, index_quant=index_quant)
    return aot.Traffic(bytes_moved=keys + q_moved + out, bytes_min=bytes_min, flops=flops,
                       vmem_bytes=vmem, dmas=dmas)


def fetched_pages(q_lens, kv_lens, *, page_size: int, pages_per_seq: int,
                  blocks: IndexerBlocks, one_token_per_seq: bool,
                  chunk_bytes: int = SCORE_CHUNK_BYTES, compression_ratio: int = 1,
                  read_pages=None) -> int:
    """Key pages the token-mode kernel fetches for the batch (``traffic``'s replay, every chunk
    and level; ``read_pages`` as ``replay_items``): what a stored format's model counts its one
    DMA per page from."""
    total = sum(q_lens)
    cap = pages_per_seq * page_size
    c = chunk_rows(total, cap, blocks.block_rows, chunk_bytes)
    ladder = row_ladder(blocks.block_rows, c, one_token_per_seq)
    pages = 0
    for row0 in sorted({min(i * c, total - c) for i in range(-(-total // c))}):
        for items in replay_items(q_lens, kv_lens, row0=row0, rows=c, total_rows=total,
                                  ladder=ladder, page_size=page_size, capacity=cap,
                                  compression_ratio=compression_ratio, read_pages=read_pages):
            pages += sum(p for _, _, p in items)
    return pages
