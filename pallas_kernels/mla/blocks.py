"""Block sizes and the VMEM budget of the sparse MLA kernels (token- and page-sparse).

One block is the set of cache rows the kernel gathers into VMEM before one online-softmax
step: ``units_per_block`` gather units (one token row for ``sparse_mla``, one whole page for
``page_sparse_mla``). Bigger blocks amortise the per-block softmax bookkeeping and keep more
DMAs in flight; smaller blocks waste less on a row's last, partial block and use less VMEM.

The tuned-block table (``TABLE``, the form of ``pallas_kernels.block_table``): chip -> shape
key -> cache rows (tokens) per gathered block. The key is ``(pow2(selected tokens per row),)``
(token mode: k; page mode: k_pages * page_size); ``()`` is the chip's row for any selection, and
``FALLBACK`` serves a chip the table lacks (``DEFAULT_TOKENS_PER_BLOCK``). Sizes are clamped to
the problem (never more than a row's selection, rounded up to the 8-row sublane tile) by
``token_block`` / ``page_block``. ``TOKENS_PER_BLOCK`` is each chip's ``()`` row.
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels import block_table
from pallas_kernels.block_table import Row, pow2
from pallas_kernels.tpu import LANES, SUBLANES, round_up

# ``row_info``: one i32 row of ROW_INFO_WORDS per query row, scalar-prefetched into SMEM: the
# entries that can be valid, one past the last of them, the first page slot, the limit.
_COUNT, _END, _SLOT0, _LIMIT, ROW_INFO_WORDS = range(5)

# Why these numbers: v5e has 16 MiB of scoped VMEM by default and a lower HBM bandwidth (so a
# smaller block already hides the DMA latency); v6e/tpu7x stream faster and get bigger blocks.
# Untuned: no TPU was available to measure (see the kernels' docstrings); the values respect
# each chip's VMEM with a 2x margin at H=128, D=640. The gate rows (same blocks) record that the
# compile gates compile them at those selections on that chip.
_VMEM = "default: VMEM budget (2x margin at H=128, D=640), HBM bandwidth; not timed"
_MLA_GATE = ("AOT compile OK: tests/test_compile_mla.py (k=2048 tokens, or 32 pages of 64), "
             "clamped by token_block / page_block; not timed")
_V4_GATE = ("AOT compile OK: tests/test_compile_v4.py two-pass cases (window 128, k 512 / "
            "1024, ratio-128 entries 64), clamped by token_block; not timed")


def _chip_rows(tokens: int) -> dict[tuple, Row]:
    return {(): Row(tokens, _VMEM), (2048,): Row(tokens, _MLA_GATE),
            (64,): Row(tokens, _V4_GATE), (128,): Row(tokens, _V4_GATE),
            (512,): Row(tokens, _V4_GATE), (1024,): Row(tokens, _V4_GATE)}


DEFAULT_TOKENS_PER_BLOCK = 256
FALLBACK: dict[tuple, Row] = {
    (): Row(DEFAULT_TOKENS_PER_BLOCK, "default: the smallest chip row (v5e's), for any chip")}
TABLE: dict[str, dict[tuple, Row]] = block_table.checked({
    "v5e": _chip_rows(256),
    "v6e": _chip_rows(512),
    "tpu7x": _chip_rows(512),
}, FALLBACK)
# chip -> cache rows per gathered block for any selection (each chip's () row)
TOKENS_PER_BLOCK: dict[str, int] = {chip: rows[()].blocks for chip, rows in TABLE.items()}


@dataclass(frozen=True)
class MlaBlocks:
    """The sparse MLA kernels' blocks: ``tokens_per_block`` (cache rows per gathered block of
    ``sparse_mla``, a positive multiple of 8) and ``pages_per_block`` (whole pages per block of
    ``page_sparse_mla``, positive); ``None`` takes the chip's table default. Built valid or not
    at all (``ValueError`` naming the field)."""

    tokens_per_block: int | None = None
    pages_per_block: int | None = None

    def __post_init__(self) -> None:
        for name, multiple in (("tokens_per_block", SUBLANES), ("pages_per_block", 1)):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % multiple:
                raise ValueError(f"{name} must be a positive multiple of {multiple}, got "
                                 f"{name}={v!r}")


def pick(blocks: MlaBlocks | None, name: str, explicit: int | None) -> int | None:
    """The explicit knob, else ``blocks``' field ``name`` (either may be ``None``)."""
    if blocks is not None and not isinstance(blocks, MlaBlocks):
        raise TypeError(f"blocks must be an MlaBlocks, got {type(blocks).__name__}")
    return explicit if explicit is not None else getattr(blocks or MlaBlocks(), name)


def shape_key(selected_tokens: int | None) -> tuple:
    """The table key of a problem: ``(pow2(selected tokens per row),)``; ``()`` when unknown."""
    return () if selected_tokens is None else (pow2(selected_tokens),)


def row(chip: str | None, selected_tokens: int | None = None) -> Row:
    """The table row for ``chip`` at a selection of ``selected_tokens`` (``block_table.lookup``:
    the chip's row for the key, else its ``()`` row, else ``FALLBACK``)."""
    return block_table.lookup(TABLE, FALLBACK, chip, shape_key(selected_tokens))


def tokens_per_block(chip: str | None, selected_tokens: int | None = None) -> int:
    """The table's rows per block for ``chip`` (``None`` or unknown: the default), unclamped."""
    return row(chip, selected_tokens).blocks


def token_block(k: int, chip: str | None, override: int | None = None) -> int:
    """Token rows per block for a token top-k of width ``k``: a multiple of 8, <= round_up(k)."""
    blk = override if override is not None else tokens_per_block(chip, k)
    if blk <= 0 or blk % SUBLANES:
        raise ValueError(f"tokens_per_block must be a positive multiple of {SUBLANES}, got "
                         f"tokens_per_block={blk}")
    return min(blk, round_up(k, SUBLANES))


def page_block(k_pages: int, page_size: int, chip: str | None,
               override: int | None = None) -> int:
    """Pages per block: the table's tokens divided by ``page_size`` (at least 1), <= k_pages."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"pages_per_block must be positive, got pages_per_block={override}")
        return min(override, k_pages)
    return max(1, min(tokens_per_block(chip, k_pages * page_size) // page_size, k_pages))


@dataclass(frozen=True)
class MlaBlockShape:
    """Static sizes the kernel allocates for (one per call)."""

    heads: int  # H
    q_words: int  # words per query head row (D, or D/2 for the packed bf16 path)
    num_q_parts: int  # 1 (plain) or 2 (packed: even and odd features)
    q_itemsize: int
    block_rows: int  # cache rows per gathered block
    cache_words: int  # words (or bf16 elements) per cache row
    cache_itemsize: int
    out_cols: int  # v_dim
    meta_words: int  # SMEM words of per-row gather metadata (one row)
    unpacked_parts: int = 1  # operands made from one gathered row (packed: low, high halves)


def vmem_bytes(s: MlaBlockShape) -> int:
    """Estimated VMEM the kernel uses: each buffer padded to (8, 128) tiles, one line each."""
    hp = round_up(s.heads, SUBLANES)
    rows = round_up(s.block_rows, 16)
    cw = round_up(s.cache_words, LANES)
    total = 2 * rows * cw * s.cache_itemsize  # gather double buffer
    total += 2 * s.num_q_parts * hp * round_up(s.q_words, LANES) * s.q_itemsize  # q blocks (x2)
    total += 2 * s.num_q_parts * hp * round_up(s.out_cols, LANES) * s.q_itemsize  # out (x2)
    total += 2 * hp * LANES * 4  # lse block (x2), lanes padded
    total += s.unpacked_parts * rows * cw * (4 + 2)  # unpacked f32 rows and their bf16 copies
    total += 3 * hp * round_up(s.block_rows, LANES) * 4  # logits, p and its cast
    total += s.num_q_parts * hp * round_up(s.out_cols, LANES) * 4 * 2  # acc carry + update
    total += s.num_q_parts * hp * round_up(s.q_words, LANES) * 4  # q upcast (f32 path)
    return total
