"""The HBM traffic model of one fused V4 attention call (``kernel``; ``fused_traffic``): what
its DMAs and blocks move, the minimum, flops and VMEM. ``kernel`` declares ``bytes_moved`` as
its cost estimate; ``compile_cases`` builds the AOT cases' models from it, and the tests check
it against the compiled kernel's declared bytes and the interpreter's counts."""

from __future__ import annotations

from pallas_kernels import aot
from pallas_kernels.v4_attention.formats import LANES
from pallas_kernels.v4_attention.writes import WRITE_BYTES
from reference import v4_attention as v4

INFO_WORDS = 6  # row_info words per query row (kernel.row_info): SMEM


def fused_traffic(*, rows: int, heads: int, gathered_rows: int, meta_words: int,
                  table_words: int, block: int, q_itemsize: int, row_bytes: int,
                  min_row_bytes: int = 2 * v4.HEAD_DIM, fp8: bool = False,
                  acc_in_itemsize: int = 0, acc_out_itemsize: int = 0,
                  written_rows: int = 0) -> aot.Traffic:
    """Modelled HBM traffic of one fused call where every query row gathers ``gathered_rows``
    rows (window + selected entries) of ``row_bytes`` each (packed and plane: 1024 B, one DMA;
    fp8 / CSA: ``FP8_ROW_BYTES`` = 1024 B in 2 DMAs, the 512 B record and the 512 B rope row it
    shares with 3 tokens): those rows, q read once, out written once (plus its f32 LSE), the
    rows' lists (``meta_words``) and ``row_info`` into SMEM, the page tables once. With a flash
    state: ``acc_in_itemsize`` (0: none) reads the state's ``acc`` in that itemsize and its f32
    ``l`` and ``m``; ``acc_out_itemsize`` (0: the normalized output and LSE) writes the state
    in their place; ``written_rows``: rows the call writes into its window cache in place
    (``writes``: ``WRITE_BYTES`` each, and a 4-byte position in SMEM per query row). The
    minimum moves each row once at ``min_row_bytes`` (512 bf16 features: 1024 B; fp8 / CSA: the
    640 B stored per token) plus q, out, the state and the writes. VMEM: the gather
    blocks (fp8 / CSA: nope, rope and quarter buffers), the f32 accumulator, q, out and state
    blocks double-buffered."""
    dim = v4.HEAD_DIM
    out_itemsize = acc_out_itemsize or q_itemsize
    per_head = dim * q_itemsize + dim * out_itemsize + (8 if acc_out_itemsize else 4)
    per_head += (dim * acc_in_itemsize + 8) if acc_in_itemsize else 0
    q_out = rows * heads * per_head + written_rows * WRITE_BYTES
    smem = 4 * (rows * (meta_words + INFO_WORDS + bool(written_rows)) + table_words)
    moved = rows * gathered_rows * row_bytes + q_out + smem
    bytes_min = rows * gathered_rows * min_row_bytes + q_out
    flops = 2 * rows * heads * gathered_rows * 2 * dim
    buf_bytes = 3 * 4 * LANES if fp8 else row_bytes
    vmem = (2 * block * buf_bytes + 4 * heads * dim
            + 2 * heads * dim * (q_itemsize + out_itemsize + acc_in_itemsize))
    return aot.Traffic(int(moved), int(bytes_min), int(flops), int(vmem))
