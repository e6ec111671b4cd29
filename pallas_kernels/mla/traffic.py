"""Traffic model of the sparse MLA kernels: HBM bytes, flops and VMEM of one call (what the
compile gate and ``scripts/cost/hbm_traffic.py`` check)."""

from __future__ import annotations

from pallas_kernels import aot
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla.blocks import ROW_INFO_WORDS
from pallas_kernels.tpu import LANES
from reference.formats.cache_format import CacheFormat

# XLA index preparation (``row_info``) per top-k entry: each entry is read once (the row
# reductions fuse into that read); the per-row outputs are noise beside it.
PREP_BYTES_PER_ENTRY = 4


def prefetch_bytes(*, rows: int, table_words: int) -> int:
    """HBM -> SMEM bytes of the scalar prefetch: ``row_info`` and the page table."""
    return 4 * (rows * ROW_INFO_WORDS + table_words)


def mla_traffic(*, rows: int, heads: int, dim: int, v_dim: int, selected_rows: int,
                fmt: CacheFormat | str, q_itemsize: int, meta_words: int, prep_bytes: int,
                table_words: int, shape: mla_blocks.MlaBlockShape) -> aot.Traffic:
    """Modelled HBM traffic of one call where every query row selects ``selected_rows`` valid
    cache rows. The minimum moves each selected row once at the plain dtype and D features
    (bf16: 2 bytes, f32: 4), reads q once and writes out once; the kernel moves a packed row as
    its ``packed_words(D)`` words (Mosaic moves rows whole; see ``reference.packed_cache``),
    each row's ``meta_words`` raw entries into SMEM, and the scalar-prefetched row info and
    page table (``table_words``) once. ``prep_bytes`` is the XLA side (``row_info``).

    DMA descriptors (``dmas``), per query row: one gather DMA per entry (every one of the
    row's ``meta_words`` entries valid, the model's premise: a token row in token mode, a
    whole page in page mode), one DMA of the row's raw entries into SMEM, and two pipeline
    block copies (the q block in, the out block back); an optional LSE output adds one more
    per row (the caller's to add). The scalar prefetch is not counted (``aot.Traffic``)."""
    fmt = CacheFormat.named(fmt)
    q_out = rows * heads * (dim + v_dim) * q_itemsize
    # the kernel's q blocks move whole 128-lane groups (a 576-wide fp8-case q: 640 lanes)
    q_moved = q_out + rows * heads * (-(-dim // LANES) * LANES - dim) * q_itemsize
    gathered = rows * selected_rows * fmt.row_bytes(dim)
    bytes_min = rows * selected_rows * fmt.plain_row_bytes(dim) + q_out
    smem = 4 * rows * meta_words + prefetch_bytes(rows=rows, table_words=table_words)
    moved = gathered + q_moved + smem + prep_bytes
    flops = 2 * rows * heads * selected_rows * (dim + v_dim)
    dmas = rows * (meta_words + 1 + 2)  # gathers, the entries row, q in and out back
    return aot.Traffic(int(moved), int(bytes_min), int(flops), mla_blocks.vmem_bytes(shape),
                       dmas=dmas)

PREP_BYTES_PER_PAGE = PREP_BYTES_PER_ENTRY  # page mode: each page entry read once, the same way
