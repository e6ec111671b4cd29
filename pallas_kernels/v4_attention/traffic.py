"""The HBM traffic model of one fused V4 attention call (``kernel``; ``fused_traffic``): what
its DMAs and blocks move, the minimum, flops, VMEM and DMA descriptors. ``kernel`` declares
``bytes_moved`` as its cost estimate; ``compile_cases`` builds the AOT cases' models from it, and
the tests check it against the compiled kernel's declared bytes and the interpreter's counts.

Page runs (``segment_plan``): the contiguous sources, a row's window tokens and the HCA's
entries ``0 .. c_limit - 1``, are read as aligned segments of ``seg`` rows of a page (one DMA
per segment per cache part, a dynamic start and a dynamic number of rows: only the segment's
wanted rows, ``formats.issue_run``; packed / f32 rows widened to 8-row tiles,
``formats.run_align``, or with ``run_grain="exact"`` moved exactly, ragged ends a row a DMA):
``run_reads`` / ``run_rope_rows`` count them exactly per
row, ``run_bound`` / ``run_rope_bound`` bound them from shapes (the AOT cases' static model).
fp8 / CSA listed (CSA-selected) entries: ``listed_reads`` counts their record runs and shared
rope rows exactly from the lists; the static model keeps the worst case (2 DMAs, 1024 B each)."""

from __future__ import annotations

import math

import numpy as np

from pallas_kernels import aot
from pallas_kernels.tpu import SUBLANES
from pallas_kernels.v4_attention.formats import (  # noqa: F401 (FP8_FORMATS: old name)
    FP8_FORMATS,
    LANES,
    QUARTERS,
    gather_row_vmem,
)
from pallas_kernels.v4_attention.writes import WRITE_BYTES
from reference import v4_attention as v4

INFO_WORDS = 6  # row_info words per query row (kernel.row_info): SMEM
MAX_SLOTS = 32  # segment slots per gathered block at most (the masks unroll over them)


def segment_plan(fmt: str, block: int, w_page: int, c_page: int, listed: bool
                 ) -> tuple[int, bool, bool]:
    """``(seg, window runs, compressed runs)``: the rows of one segment slot of a gathered block
    and whether the window / the compressed entries are read as page runs. ``seg`` is
    ``gcd(block, window page, compressed page)`` (the compressed page only for an unlisted,
    HCA walk): it divides the block and every read page, so a segment lies in one page and
    slots tile the block. Off (``seg = block``, one slot, every position one row) for ``seg``
    not a multiple of 8 (Mosaic slices a VMEM buffer at whole 8-row tiles; fp8 / CSA: of 32,
    the run's ``seg / 4`` rope rows too) or more than ``MAX_SLOTS`` slots. A listed (CSA) walk
    reads one row per entry either way."""
    seg = math.gcd(block, w_page) if listed else math.gcd(block, w_page, c_page)
    tile = SUBLANES * (QUARTERS if fmt in FP8_FORMATS else 1)
    if seg % tile or block // seg > MAX_SLOTS:
        return block, False, False
    return seg, True, not listed


def window_segments(w_first, w_n, seg: int):
    """Segments of ``seg`` aligned rows covering tokens ``w_first .. w_first + w_n - 1`` (0 for
    ``w_n = 0``; numpy or jnp, elementwise)."""
    last = (w_first + w_n - 1) // seg
    return (w_n > 0) * (last - w_first // seg + 1)


def _touched(first, n, grain: int):
    """Rows of ``grain`` (numpy, elementwise) tokens ``first .. first + n - 1`` touch (0 for
    ``n = 0``)."""
    return (n > 0) * ((first + n - 1) // grain - first // grain + 1)


def _exact_dmas(first, n, seg: int, tile: int):
    """Elementwise (numpy): DMAs of ``run_grain="exact"`` runs of tokens ``first .. first + n -
    1`` split at multiples of ``seg`` (``formats._exact_run``): per segment its whole ``tile``-row
    tiles as one DMA (segments split at multiples of ``tile``: only the run's first and last
    segment are ragged), its ragged head and tail rows one each."""
    end = first + n
    a = -(-first // tile) * tile  # first tile boundary at or after the run's start
    head_end = np.minimum(a, end)
    z = np.maximum(end // tile * tile, a)
    tail = np.maximum(end - np.maximum(z, head_end), 0)
    middles = (z > a) * ((z - 1) // seg - a // seg + 1)
    return (n > 0) * (head_end - first + tail + middles)


def run_reads(w_first, w_n, c_n, *, seg: int, window_runs: bool, compressed_runs: bool,
              dmas_per_read: int = 1, align: int = 1,
              exact: bool = False) -> tuple[int, int, int]:
    """Exact ``(token rows read one by one, token rows read by page runs, gather DMAs)`` of
    query rows with windows ``w_first, w_n`` and
    compressed walks of ``c_n`` valid positions (``row_info``'s fields, arrays; every page
    present: a released page's segments are not read), ``segment_plan``'s ``seg`` and flags;
    ``dmas_per_read``: DMAs per segment / token (fp8 / CSA: 2). A segment's DMAs move its
    wanted rows (``formats.issue_run``) widened to whole tiles of ``align`` rows
    (``formats.run_align``; 1: each wanted token once; segments split at multiples of
    ``align``, so a run's rows are the ``align``-row tiles its tokens touch); ``exact``
    (``run_grain="exact"``, one part): the wanted rows once, in a segment's whole tiles as one
    DMA and its ragged rows one DMA each (``_exact_dmas``)."""
    w_first, w_n, c_n = (np.asarray(x, np.int64) for x in (w_first, w_n, c_n))
    w_seg = window_segments(w_first, w_n, seg) if window_runs else w_n
    c_seg = -(-c_n // seg) if compressed_runs else c_n
    single = (0 if window_runs else w_seg.sum()) + (0 if compressed_runs else c_seg.sum())
    if exact and align > 1:
        runs = (w_n.sum() if window_runs else 0) + (c_n.sum() if compressed_runs else 0)
        dmas = ((_exact_dmas(w_first, w_n, seg, align) if window_runs else w_seg).sum()
                + (_exact_dmas(0, c_n, seg, align) if compressed_runs else c_seg).sum())
        return int(single), int(runs), int(dmas * dmas_per_read)
    runs = align * ((_touched(w_first, w_n, align).sum() if window_runs else 0)
                    + (_touched(0, c_n, align).sum() if compressed_runs else 0))
    return int(single), int(runs), int((w_seg + c_seg).sum() * dmas_per_read)


def run_rope_rows(w_first, w_n, c_n, *, window_runs: bool, compressed_runs: bool) -> int:
    """fp8 / CSA: the rope rows (4 tokens each) the page runs of ``run_reads``' rows read
    exactly: a run of tokens ``f .. f + n - 1`` reads rows ``f // 4 .. (f + n - 1) // 4`` (its
    segments split at multiples of 4: no row twice); an HCA walk's from entry 0."""
    w_first, w_n, c_n = (np.asarray(x, np.int64) for x in (w_first, w_n, c_n))
    return int((_touched(w_first, w_n, QUARTERS).sum() if window_runs else 0)
               + (_touched(0, c_n, QUARTERS).sum() if compressed_runs else 0))


def _touched_bound(window: int, entries: int, grain: int, window_runs: bool,
                   compressed_runs: bool) -> int:
    """Rows of ``grain`` tokens at most: ``window`` tokens anywhere touch ``ceil((W - 1) /
    grain) + 1`` (``W`` for grain 1), ``entries`` from 0 ``ceil(entries / grain)``."""
    w_rows = (window and -(-(window - 1) // grain) + 1) if window_runs else 0
    return w_rows + (-(-entries // grain) if compressed_runs else 0)


def run_bound(*, window: int, entries: int, seg: int, window_runs: bool,
              compressed_runs: bool, dmas_per_read: int = 1,
              align: int = 1, exact: bool = False) -> tuple[int, int, int]:
    """``run_reads``' triple for one query row at most: ``window`` window tokens
    anywhere (``ceil((W - 1) / seg) + 1`` segments) and ``entries`` compressed positions
    (HCA: entries from 0, ``ceil(entries / seg)`` segments); the runs read their tokens'
    ``align``-row tiles (``align`` 1: the tokens once); ``exact``: the tokens once, in the most
    DMAs a window starting anywhere takes (``_exact_dmas`` over every first row mod ``seg``)."""
    if exact and align > 1:
        flags = dict(seg=seg, window_runs=window_runs, compressed_runs=compressed_runs,
                     dmas_per_read=dmas_per_read, align=align, exact=True)
        return max((run_reads(f, window, entries, **flags) for f in range(seg)),
                   key=lambda reads: reads[2])
    w_seg = (window and -(-(window - 1) // seg) + 1) if window_runs else window
    c_seg = -(-entries // seg) if compressed_runs else entries
    single = (0 if window_runs else w_seg) + (0 if compressed_runs else c_seg)
    runs = align * _touched_bound(window, entries, align, window_runs, compressed_runs)
    return single, runs, (w_seg + c_seg) * dmas_per_read


def run_rope_bound(*, window: int, entries: int, window_runs: bool,
                   compressed_runs: bool) -> int:
    """``run_rope_rows`` for one query row at most: ``window`` tokens anywhere touch
    ``ceil((W - 1) / 4) + 1`` rope rows, ``entries`` from 0 ``ceil(entries / 4)``."""
    return _touched_bound(window, entries, QUARTERS, window_runs, compressed_runs)


def listed_reads(entries, c_limit, *, page: int, block: int, start_rows=0
                 ) -> tuple[int, int, int]:
    """fp8 / CSA, exact: ``(entries read, record DMAs, rope-row DMAs)`` of the listed (CSA)
    entries of query rows with lists ``entries`` (``i32[T, k]`` in walk order:
    ``walk.walk_order``'s) and entry limits ``c_limit`` (``i32[T]``), every page present, the
    row's window filling ``start_rows[t]`` rows of its blocks first (``block``-row blocks):
    ``walk._listed``'s rule. A record DMA covers a run of list neighbours ``e, e + 1, ..`` on
    one page of ``page`` entries, cut at the block's end; a rope DMA is skipped for an entry
    whose previous row in the block is a listed entry of the same page and rope row (``e //
    4`` of the page), the group under ``QUARTERS`` rows. Each read moves its 512 B record; each
    rope DMA one 512 B rope row. Worst case (no two entries adjacent or sharing): 2 DMAs and
    1024 B per entry, ``row_bytes``."""
    entries = np.asarray(entries, np.int64)
    c_limit = np.broadcast_to(np.asarray(c_limit, np.int64), entries.shape[:1])
    start_rows = np.broadcast_to(np.asarray(start_rows, np.int64), entries.shape[:1])
    reads = records = ropes = 0
    for ent, limit, n in zip(entries, c_limit, start_rows % block, strict=True):
        ok = (ent >= 0) & (ent < limit)
        walk = int(np.max(np.where(ok, np.arange(1, len(ent) + 1), 0), initial=0))
        left = group = 0
        key = None
        for j in range(walk):
            e = int(ent[j])
            if not ok[j]:
                continue
            if n == block:  # the next block: nothing carries over
                n, left, key = 0, 0, None
            if left:
                left -= 1
            else:
                cap = min(block - n, page - e % page, limit - e, walk - j)
                length = 1
                while length < cap and ent[j + length] == e + length:
                    length += 1
                records, left = records + 1, length - 1
            here = (e // page, e % page // QUARTERS)
            if key == here and group < QUARTERS:
                group += 1
            else:
                key, group, ropes = here, 1, ropes + 1
            reads, n = reads + 1, n + 1
    return reads, records, ropes


def fused_traffic(*, rows: int, heads: int, gathered_rows: int, meta_words: int,
                  table_words: int, block: int, q_itemsize: int, row_bytes: int,
                  min_row_bytes: int = 2 * v4.HEAD_DIM, fp8: bool = False,
                  acc_in_itemsize: int = 0, acc_out_itemsize: int = 0,
                  written_rows: int = 0, read_rows: int | None = None,
                  gather_dmas: int | None = None, run_rows: int = 0,
                  run_row_bytes: int = 0, run_rope_rows: int = 0,
                  write_bytes: int = WRITE_BYTES, write_dmas: int = 1) -> aot.Traffic:
    """Modelled HBM traffic of one fused call where every query row gathers ``gathered_rows``
    rows (window + selected entries) of ``row_bytes`` each (packed and plane: 1024 B, one DMA;
    fp8 / CSA: ``FP8_ROW_BYTES`` = 1024 B in 2 DMAs, the 512 B record and the 512 B rope row it
    shares with 3 tokens): those rows, q read once, out written once (plus its f32 LSE), the
    rows' lists (``meta_words``) and ``row_info`` into SMEM, the page tables once. With a flash
    state: ``acc_in_itemsize`` (0: none) reads the state's ``acc`` in that itemsize and its f32
    ``l`` and ``m``; ``acc_out_itemsize`` (0: the normalized output and LSE) writes the state
    in their place; ``written_rows``: tokens the call writes into its window cache in place
    (``writes``: ``write_bytes`` and ``write_dmas`` each, ``writes.written_bytes`` /
    ``written_dmas`` of the format (default: a plane token's 2 KB in one DMA), and a 4-byte
    position in SMEM per DMA). Page runs
    (all query rows together, ``run_reads`` / ``run_bound``): ``read_rows`` tokens read one by
    one (None: ``rows * gathered_rows``), ``run_rows`` read by page runs at ``run_row_bytes``
    each (0: ``row_bytes``; fp8 / CSA: the 512 B record) and, fp8 / CSA, their
    ``run_rope_rows`` 512 B rope rows (``run_rope_rows``: 4 tokens a row), in
    ``gather_dmas`` descriptors (None: one per token read one by one per part). The minimum
    moves each row once at ``min_row_bytes`` (512 bf16 features: 1024 B; fp8 / CSA: the 640 B
    stored per token) plus q, out, the state and the writes. VMEM: the gather blocks (fp8 /
    CSA: nope, rope and quarter buffers; with runs their rope rows and expansion), the f32
    accumulator, q, out and state blocks double-buffered. ``dmas``: the gathers, one list load
    per row (``meta_words``), ``write_dmas`` per written token, and the pipeline's block
    copies (q, out and LSE or the state's three, the state read's three, the sink once)."""
    dim = v4.HEAD_DIM
    out_itemsize = acc_out_itemsize or q_itemsize
    per_head = dim * q_itemsize + dim * out_itemsize + (8 if acc_out_itemsize else 4)
    per_head += (dim * acc_in_itemsize + 8) if acc_in_itemsize else 0
    q_out = rows * heads * per_head + written_rows * write_bytes
    smem = 4 * (rows * (meta_words + INFO_WORDS) + written_rows * write_dmas + table_words)
    read_rows = rows * gathered_rows if read_rows is None else read_rows
    gather_dmas = read_rows * (2 if fp8 else 1) if gather_dmas is None else gather_dmas
    moved = (read_rows * row_bytes + run_rows * (run_row_bytes or row_bytes)
             + run_rope_rows * 4 * LANES + q_out + smem)
    bytes_min = rows * gathered_rows * min_row_bytes + q_out
    flops = 2 * rows * heads * gathered_rows * 2 * dim
    buf_bytes = gather_row_vmem(fp8, row_bytes, runs=bool(run_rows))
    vmem = (2 * block * buf_bytes + 4 * heads * dim
            + 2 * heads * dim * (q_itemsize + out_itemsize + acc_in_itemsize))
    blocks = rows * (1 + (3 if acc_out_itemsize else 2) + (3 if acc_in_itemsize else 0)) + 1
    dmas = gather_dmas + rows * bool(meta_words) + written_rows * write_dmas + blocks
    return aot.Traffic(int(moved), int(bytes_min), int(flops), int(vmem), int(dmas))
