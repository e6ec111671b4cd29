"""Block sizes of the lightning-indexer score kernels: the tuned-block table (``TABLE``), and the
VMEM estimate that keeps every default under half of the chip's VMEM.

Two knobs (``pallas_kernels.indexer.kernel`` explains the design):

- ``block_rows`` (R): the largest row block: query rows of ONE sequence scored together per grid
  step (a power of two). The q block is ``[L * H, D]`` so every key page fetched is used by all
  L rows x all H heads. The general path runs a ladder ``R, R/4, ..., 1`` (one kernel call per
  level): full blocks of R rows, plus one block of the smallest level holding a sequence's
  remainder, so a decode row in a mixed batch is a 1-row block (a larger block would only
  multiply MXU work by rows that do not exist). ``one_token_per_seq`` uses R = 1 alone.
- ``block_pages`` (P): key pages DMAed per pipeline stage (double-buffered). The score tile is
  ``f32[R * H, P * page_size]``; P divides 128 so a block's page scores never straddle a lane
  group, and ``P * page_size`` is a multiple of 128 lanes (Mosaic's tiling; checked when compiled).

Why these numbers: decode is HBM-bound (each key byte feeds 2*H flops per row), so P is large
enough that a stage moves >= 128 KiB of keys (DMA issue cost amortised) and small enough that the
f32 score tile stays ~256 KiB. Prefill is MXU-bound; R = 16 keeps the re-read of the causal keys
(once per row block) below the score writes, and the score tile ~1 MiB.

The table (the form of ``pallas_kernels.block_table``): chip -> shape key -> ``IndexerBlocks``.
The key is ``(mode, pow2(page_size))``, mode ``"decode"`` (``one_token_per_seq``) or
``"general"``; ``(mode,)`` is the chip's row for any page size, and ``FALLBACK`` serves a chip
the table lacks. ``resolve_blocks`` clamps the row to the problem (no stage past a sequence's
pages; widened to whole lanes for Mosaic).
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels import block_table, tpu
from pallas_kernels.block_table import Row, pow2
from pallas_kernels.tpu import LANES, tile_bytes


@dataclass(frozen=True)
class IndexerBlocks:
    """The indexer kernel's blocks: ``block_rows`` (query rows per step) and ``block_pages``
    (key pages per stage), each a power of two (``block_pages <= 128``), or ``None`` for the
    chip's table default. Built valid or not at all (``ValueError`` naming the field)."""

    block_rows: int | None = None
    block_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_rows", "block_pages"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {name}={v!r}")
        if self.block_pages is not None and self.block_pages > LANES:
            raise ValueError(f"block_pages={self.block_pages} must be <= {LANES} (page scores "
                             "fill one lane group)")

    def over(self, base: IndexerBlocks) -> IndexerBlocks:
        """These blocks with ``base``'s values where a field is ``None``."""
        return IndexerBlocks(base.block_rows if self.block_rows is None else self.block_rows,
                             base.block_pages if self.block_pages is None else self.block_pages)


# Same across generations today: decode is HBM-bound everywhere, and the general tile already
# fits v7x's 64 MiB VMEM with room to spare. Nothing timed (no TPU was available).
_BUDGET = "default: VMEM budget (half the chip's VMEM at every gate shape), HBM-bound decode"
_GATE = ("AOT compile OK: tests/test_compile_indexer.py (V3.2 and V4 indexers, H=64, D=128, "
         "pages of 64), widened for Mosaic by resolve_blocks; not timed")


def _chip_rows(decode: IndexerBlocks, general: IndexerBlocks) -> dict[tuple, Row]:
    return {("decode",): Row(decode, _BUDGET), ("general",): Row(general, _BUDGET),
            ("decode", 64): Row(decode, _GATE), ("general", 64): Row(general, _GATE)}


FALLBACK: dict[tuple, Row] = {
    (): Row(IndexerBlocks(16, 4), "default: the general rows' blocks, for any chip"),
    ("decode",): Row(IndexerBlocks(1, 16), "default: the decode rows' blocks, for any chip"),
    ("general",): Row(IndexerBlocks(16, 4), "default: the general rows' blocks, for any chip")}
TABLE: dict[str, dict[tuple, Row]] = block_table.checked({
    "v5e": _chip_rows(IndexerBlocks(1, 16), IndexerBlocks(16, 4)),
    "v6e": _chip_rows(IndexerBlocks(1, 16), IndexerBlocks(16, 8)),
    "tpu7x": _chip_rows(IndexerBlocks(1, 16), IndexerBlocks(16, 4)),
}, FALLBACK)
# chip -> (decode blocks, general blocks) for any page size (the table's (mode,) rows)
_TABLE: dict[str, tuple[IndexerBlocks, IndexerBlocks]] = {
    chip: (rows[("decode",)].blocks, rows[("general",)].blocks) for chip, rows in TABLE.items()}
_FALLBACK = (FALLBACK[("decode",)].blocks, FALLBACK[("general",)].blocks)


def shape_key(*, one_token_per_seq: bool, page_size: int | None = None) -> tuple:
    """The table key of a problem: ``(mode, pow2(page_size))``, ``(mode,)`` without a page size."""
    mode = "decode" if one_token_per_seq else "general"
    return (mode,) if page_size is None else (mode, pow2(page_size))


def row(chip: str | None, *, one_token_per_seq: bool, page_size: int | None = None) -> Row:
    """The table row for ``chip`` at this problem (``block_table.lookup``; ``None`` or unknown
    chip: ``FALLBACK``)."""
    return block_table.lookup(TABLE, FALLBACK, chip,
                              shape_key(one_token_per_seq=one_token_per_seq, page_size=page_size))


def default_blocks(chip: str | None, *, one_token_per_seq: bool,
                   page_size: int | None = None) -> IndexerBlocks:
    """Table defaults for ``chip`` (``None`` or unknown -> fallback)."""
    return row(chip, one_token_per_seq=one_token_per_seq, page_size=page_size).blocks


def vmem_estimate(*, block_rows: int, block_pages: int, num_heads: int, dim: int,
                  page_size: int, pages_per_seq: int, key_itemsize: int, q_itemsize: int,
                  page_mode: bool, scale_lanes: int = 0, index_quant: str | None = None) -> int:
    """VMEM bytes the score kernel allocates (padded to tiles), one term per buffer
    (``scale_lanes``: an fp8 cache's scale rows, 0 for none; ``index_quant``: the in-kernel
    FP4 simulation's Hadamard matrix and f32 key-tile temporaries, ``indexer.fp4``)."""
    rh = block_rows * num_heads
    nb = block_pages * page_size
    num_blocks = -(-pages_per_seq // block_pages)
    total = 0
    total += 2 * tile_bytes(rh, dim, q_itemsize)  # q block [R*H, D], double-buffered
    total += 2 * tile_bytes(rh, 1, 4)  # weight column [R*H, 1] f32, double-buffered
    total += 2 * block_pages * tile_bytes(page_size, dim, key_itemsize)  # key pages, 2 stages
    total += tile_bytes(rh, nb, 4)  # f32 score tile [R*H, P*page] (compiler temporary)
    if key_itemsize != q_itemsize:
        total += tile_bytes(nb, dim, 4)  # key block cast to the compute dtype
    if index_quant is not None:
        total += tile_bytes(dim, dim, 4)  # the Hadamard matrix (built once per grid step)
        total += 4 * tile_bytes(nb, dim, 4)  # rotated keys, |x|, per-lane scale, 1/scale (f32)
    if scale_lanes:
        total += 2 * tile_bytes(block_pages, scale_lanes, 4)  # scale rows, 2 stages
        total += tile_bytes(1, nb, 4)  # the stage's scale row on lanes
    if page_mode:
        pages_pad = -(-num_blocks * block_pages // LANES) * LANES
        total += 2 * tile_bytes(block_rows, pages_pad, 4)  # page scores out block, 2 buffers
    else:  # row scores, 2 out buffers
        total += row_buffer_bytes(block_rows, block_pages, page_size, pages_per_seq)
    return total


def vmem_budget(chip: str | None) -> int | None:
    """Half of ``chip``'s VMEM: the ceiling every default must stay under (None if unknown)."""
    capacity = tpu.chip_vmem(chip)
    return capacity // 2 if capacity else None


def resolve_blocks(blocks: IndexerBlocks | None, *, block_rows: int | None,
                   block_pages: int | None, chip: str | None, one_token_per_seq: bool,
                   pages_per_seq: int, page_size: int | None = None, page_mode: bool = False,
                   mosaic: bool = False) -> IndexerBlocks:
    """``blocks``, then the explicit knobs, over the table defaults; clamped to the problem.

    ``mosaic`` (compiling for a TPU, not interpreting): in token mode a stage's scores are
    stored at lane offset ``stage * P * page_size`` of the row buffer, which Mosaic compiles
    only when ``P * page_size`` is a multiple of 128 (measured over 300 AOT compiles on v5e,
    v6e and tpu7x by ``scripts/cost/compile_grid.py``: every narrower stage failed with
    "cannot statically prove that index in dimension 2 is a multiple of 128", every whole-lane
    stage compiled). So ``P`` is doubled until it is: pages past an item's need are never
    fetched (their scores are ``-inf``), so a wider stage costs MXU work on at most 127
    tokens per item and no HBM traffic. Page mode stores per-page maxima into aligned 128-lane
    groups and needs no widening. Also when compiling, in token mode, ``block_rows`` is cut by
    4 (the row ladder's step) while the two f32 row-score buffers ``[R, capacity]`` exceed
    ``vmem_budget(chip)`` (``row_buffer_bytes``): a 1M-entry prefill row block of 16 needs
    128 MiB and Mosaic refuses it on every chip; 4 compiles (``docs/v41.md``, "Long rows")."""
    if blocks is not None and not isinstance(blocks, IndexerBlocks):
        raise TypeError(f"blocks must be an IndexerBlocks, got {type(blocks).__name__}")
    base = default_blocks(chip, one_token_per_seq=one_token_per_seq, page_size=page_size)
    picked = IndexerBlocks(block_rows, block_pages).over((blocks or IndexerBlocks()).over(base))
    p = min(picked.block_pages, 1 << (pages_per_seq - 1).bit_length())  # no stage past the seq
    if mosaic and not page_mode:
        if page_size is None:
            raise ValueError("resolve_blocks(mosaic=True) needs page_size")
        while (p * page_size) % LANES and p < LANES:  # p = 128 always works
            p *= 2
    rows, budget = picked.block_rows, vmem_budget(chip)
    if mosaic and not page_mode and budget:
        while rows > 1 and row_buffer_bytes(rows, p, page_size, pages_per_seq) > budget:
            rows = max(1, rows // 4)
    return IndexerBlocks(rows, p)


def row_buffer_bytes(block_rows: int, block_pages: int, page_size: int,
                     pages_per_seq: int) -> int:
    """VMEM of the token-mode kernel's two f32 row-score buffers ``[block_rows, capacity]``
    (``vmem_estimate``'s last term), ``capacity`` the stages' whole pages of a sequence."""
    stages = -(-pages_per_seq // block_pages)
    return 2 * tile_bytes(block_rows, stages * block_pages * page_size, 4)


def check_kernel_knobs(score_chunk_bytes, vmem_limit_bytes) -> None:
    """Refuse a non-positive ``score_chunk_bytes`` / ``vmem_limit_bytes`` (``ValueError``)."""
    v = score_chunk_bytes
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"score_chunk_bytes must be a positive int, got score_chunk_bytes={v!r}")
    tpu.check_vmem_limit(vmem_limit_bytes)


def entry_blocks(chip: str | None, blocks: IndexerBlocks | None, block_rows: int | None,
                 block_pages: int | None, *, one_token_per_seq: bool, pages_per_seq: int,
                 page_size: int, page_mode: bool, interpret) -> tuple[str | None, IndexerBlocks]:
    """What an entry runs with: the chip (``tpu.resolve_chip``) and its resolved blocks (widened
    for Mosaic when compiling, ``interpret is False``)."""
    chip = tpu.resolve_chip(chip)
    return chip, resolve_blocks(blocks, block_rows=block_rows, block_pages=block_pages,
                                chip=chip, page_size=page_size, page_mode=page_mode,
                                mosaic=interpret is False, one_token_per_seq=one_token_per_seq,
                                pages_per_seq=pages_per_seq)


