"""Traffic and VMEM model of the Pallas V4 compressor (``pallas_kernels.v4_compressor``).

Counts (all rows f32, ``W = coff * d`` wide, ``R = coff * r`` slots per entry):

- moved, pooling call: per completing entry its ``chunk_rows`` slots from this step's rows
  (ratio 128 runs of more than 8 rows that do not start tile-aligned: an aligned window of
  ``R + 8`` rows) and, when any slot
  precedes the step, its whole ring slot (``R`` rows), each kv and score, whole rows (``W``);
  every output slot writes its row (``d``); the ``[R, W]`` ape tile once; the 128-position
  tile of each RoPE table that holds a completing entry's position (``[h, 128]``, read through
  the tables' transposed view: ``finish``), once per run of entries in one tile, or, given the
  tables in the row layout (``row_table``: ``finish.rope_rows``), the entry's 512-B row (once per
  run of entries at one position), and the norm weight once;
- moved, state call: per state row written, this step's kv row copied HBM to HBM (read + write)
  and its score row read, ``+ ape``, written; ape ``[r, W]`` once;
- minimum: this step's kv and score rows read once (``step_rows``), the old ring slots the
  completing entries need read once at their used half (``d``: the ``R - chunk`` old slots per
  entry), the state rows written (kv and gate), the entries written (``d``) and their RoPE
  table rows read (``2 h``).

So the model's factors over the minimum come from: whole-row reads of the ring (ratio 4 uses
one half of each slot row; both halves move), every chunk row read by the ``coff`` entries that
pool it plus once more by the state call, and the unused output slots' zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels import aot, tpu
from pallas_kernels.v4_compressor.blocks import (  # noqa: F401 (WINDOW_MIN_ROWS: public here)
    WINDOW_MIN_ROWS,
    WINDOW_PAD,
    uses_window,
)
from reference import v4_compressor as vc

F32 = 4
HALF = vc.ROPE_DIM // 2  # the RoPE tables' width (cos / sin f32[P, HALF])
TABLE_TILE = tpu.LANES  # positions per table DMA (``finish.TILE``)
TABLE_ROW_BYTES = tpu.LANES * F32  # one position's row of ``finish.rope_rows``
# The window path (``uses_window``, ``WINDOW_MIN_ROWS``, ``WINDOW_PAD``) is the block table's:
# ``pallas_kernels.v4_compressor.blocks``.
@dataclass(frozen=True)
class StepCounts:
    """What one step does, in rows: ``entries`` completing (of ``slots`` output slots),
    ``chunk_rows`` pooled slots read from this step's rows (summed over entries),
    ``ring_entries`` entries that read their ring slot, ``old_slots`` pooled slots that precede
    the step (summed over entries; the minimum reads these), ``step_rows`` this step's rows,
    ``state_rows`` ring rows written; ``chunk_runs`` the pieces the chunk rows move in, one DMA
    per array (kv, score) each: a row alone, an aligned run of ``R`` rows or a window (summed
    over entries; ``None``: one per chunk row, every row alone); ``table_tiles`` RoPE table
    tiles loaded (a completing entry whose position lies in the tile the previous one loaded
    reuses it); ``table_rows`` ``rope_rows`` rows loaded (one per completing entry whose
    position differs from the previous one's)."""

    slots: int
    entries: int
    chunk_rows: int
    ring_entries: int
    old_slots: int
    step_rows: int
    state_rows: int
    chunk_runs: int | None = None
    table_tiles: int = 0
    table_rows: int = 0

    @property
    def runs(self) -> int:
        """``chunk_runs``, or ``chunk_rows`` where it is ``None``."""
        return self.chunk_rows if self.chunk_runs is None else self.chunk_runs


def _max_entries(num_rows: int, num_seqs: int, ratio: int) -> int:
    """``reference.v4_compressor.max_entries`` over every pooling ratio (``pool_coff``)."""
    vc.pool_coff(ratio)
    return num_rows // ratio + num_seqs


def decode_counts(seqs: int, ratio: int, *, complete: bool = True) -> StepCounts:
    """One decode token per sequence; ``complete``: every sequence completes an entry (the
    step a static program must serve: ratio 128 every 128th step), else none does."""
    rows = vc.pool_rows(ratio)
    done = seqs if complete else 0
    return StepCounts(slots=_max_entries(seqs, seqs, ratio), entries=done, chunk_rows=done,
                      ring_entries=done, old_slots=done * (rows - 1), step_rows=seqs,
                      state_rows=seqs, table_tiles=done, table_rows=done)


def prefill_counts(tokens: int, ratio: int, first_row: int = 0) -> StepCounts:
    """One sequence's first ``tokens`` tokens in one chunk (a multiple of ``ratio``) at row
    ``first_row`` of the step: every group completes from chunk rows (ratio 4's group 0 pools
    only its own 4); an unaligned ``first_row`` sends ratio 128's runs through the window."""
    coff, rows = vc.pool_coff(ratio), vc.pool_rows(ratio)
    entries = tokens // ratio
    chunk = entries * rows - (coff - 1) * ratio
    if first_row % WINDOW_PAD and uses_window(ratio, first_row + tokens):
        end = first_row + tokens  # entry j's window: its first row rounded down, R + 8 rows
        windows = sum((first_row + ratio * j) // WINDOW_PAD * WINDOW_PAD + rows + WINDOW_PAD
                      <= end for j in range(entries))
        chunk += windows * WINDOW_PAD
    return StepCounts(slots=_max_entries(tokens, 1, ratio), entries=entries, chunk_rows=chunk,
                      ring_entries=0, old_slots=0, step_rows=tokens,
                      state_rows=min(tokens, rows),
                      chunk_runs=sum(_prefill_runs(j, tokens, ratio, first_row)
                                     for j in range(entries)),
                      table_tiles=(entries - 1) * ratio // TABLE_TILE + 1 if entries else 0,
                      table_rows=entries)


def _prefill_runs(j: int, tokens: int, ratio: int, first_row: int) -> int:
    """The pieces entry ``j`` of ``prefill_counts``' chunk moves its chunk rows in (the pool
    kernel's choice, ``kernel._pool_kernel``): one aligned run of all ``R`` slots from a row
    that is a multiple of 8, else one window (``uses_window``: more than 8 rows whose aligned
    window lies inside the step), else one per row."""
    coff, rows = vc.pool_coff(ratio), vc.pool_rows(ratio)
    end = first_row + tokens  # the step's rows
    q0 = ratio * j - (coff - 1) * ratio
    k_c = min(max(-q0, 0), rows)  # slots before the sequence's first token are not read
    base = first_row + q0
    if end >= rows and k_c == 0 and base % WINDOW_PAD == 0:
        return 1
    first = base + k_c
    if (uses_window(ratio, end) and rows - k_c > WINDOW_PAD
            and first // WINDOW_PAD * WINDOW_PAD + rows + WINDOW_PAD <= end):
        return 1
    return rows - k_c


def worst_counts(num_rows: int, num_seqs: int, ratio: int) -> StepCounts:
    """A static upper bound for a step of ``num_rows`` rows and ``num_seqs`` sequences (what the
    kernels declare to XLA): every output slot completes; a chunk row is pooled by at most
    ``coff`` entries (plus 8 rows per entry on the window path); at most ``coff`` entries per
    sequence read the ring (ratio 4: the first two entries of a step may reach back); at most
    ``min(T, S R)`` state rows are written; a sequence's entries are consecutive, so its
    positions span at most ``e r / 128 + 2`` table tiles."""
    coff, rows = vc.pool_coff(ratio), vc.pool_rows(ratio)
    slots = _max_entries(num_rows, num_seqs, ratio)
    ring = min(slots, coff * num_seqs)
    pad = WINDOW_PAD if uses_window(ratio, num_rows) else 0
    chunk = min(slots * (rows + pad), coff * num_rows + slots * pad)
    return StepCounts(slots=slots, entries=slots, chunk_rows=chunk,
                      ring_entries=ring, old_slots=ring * (rows - 1), step_rows=num_rows,
                      state_rows=min(num_rows, num_seqs * rows),
                      chunk_runs=min(slots * rows, coff * num_rows),
                      table_tiles=min(slots, slots * ratio // TABLE_TILE + 2 * num_seqs),
                      table_rows=slots)


def table_bytes(c: StepCounts, *, half: int = HALF, row_table: bool = False) -> int:
    """HBM bytes of the RoPE table reads: per tile loaded ``2 x [h, 128]`` f32, or
    (``row_table``) per row loaded ``TABLE_ROW_BYTES``; 0 when the glue finishes the rows
    (``half`` 0)."""
    if not half:
        return 0
    if row_table:
        return c.table_rows * TABLE_ROW_BYTES
    return c.table_tiles * 2 * half * TABLE_TILE * F32


def pool_bytes(c: StepCounts, *, ratio: int, d: int, half: int = HALF,
               row_table: bool = False) -> int:
    """HBM bytes the pooling call moves (module docstring); ``half``: the RoPE tables' width
    when the kernel finishes the rows (``finish.fusable``; 0 when the glue does); ``row_table``:
    the tables given as ``finish.rope_rows``."""
    coff, rows = vc.pool_coff(ratio), vc.pool_rows(ratio)
    width = coff * d
    gathered = (c.chunk_rows + c.ring_entries * rows) * 2 * width * F32
    # the norm weight block once: the weight, or a zero block when the glue finishes the rows
    tables = table_bytes(c, half=half, row_table=row_table) + d * F32
    return gathered + c.slots * d * F32 + rows * width * F32 + tables


def state_bytes(c: StepCounts, *, ratio: int, d: int) -> int:
    """HBM bytes the state call moves: 4 row transfers per written row, ape once."""
    width = vc.pool_coff(ratio) * d
    return c.state_rows * 4 * width * F32 + ratio * width * F32


def pool_dmas(c: StepCounts, *, half: int = HALF, row_table: bool = False) -> int:
    """DMA descriptors of the pooling call: per chunk run and per ring slot read, one DMA each
    for kv and score; per RoPE table tile loaded, one each for cos and sin (``row_table``: one
    per ``rope_rows`` row loaded); each output slot's row; pipeline block copies: the ape tile once
    and the norm weight once (a zero block when the glue finishes the rows)."""
    tables = (c.table_rows if row_table else 2 * c.table_tiles) if half else 0
    return 2 * (c.runs + c.ring_entries) + tables + 1 + c.slots + 1


def state_dmas(c: StepCounts) -> int:
    """DMA descriptors of the state call: per state row written, the kv row HBM to HBM, the
    score row in and the gate row out; the ape block once (a pipeline block copy)."""
    return 3 * c.state_rows + 1


def compressor_traffic(c: StepCounts, *, ratio: int, d: int,
                       row_table: bool = False) -> aot.Traffic:
    """Both calls of one step against the minimum (module docstring); flops: the pooling's
    ~6 flops per pooled slot channel; VMEM: ``vmem_bytes``; DMA descriptors: ``pool_dmas`` +
    ``state_dmas`` (a decode step where every sequence completes an entry: 7 per sequence and
    one output row per slot, plus 2 per RoPE table tile loaded (``row_table``: 1 per table row),
    the two ape blocks and the norm weight)."""
    width = vc.pool_coff(ratio) * d
    rows = vc.pool_rows(ratio)
    moved = pool_bytes(c, ratio=ratio, d=d, row_table=row_table) + state_bytes(c, ratio=ratio, d=d)
    minimum = (c.step_rows * 2 * width + c.old_slots * 2 * d + c.state_rows * 2 * width
               + c.entries * (d + 2 * HALF)) * F32
    return aot.Traffic(int(moved), int(minimum), int(6 * c.entries * rows * d),
                       vmem_bytes(ratio=ratio, d=d, window=uses_window(ratio, c.step_rows),
                                  row_table=row_table),
                       dmas=pool_dmas(c, row_table=row_table) + state_dmas(c))


def vmem_bytes(*, ratio: int, d: int, window: bool = False, half: int = HALF,
               row_table: bool = False) -> int:
    """The larger of the two calls' VMEM (each buffer padded to (8, 128) tiles); ``half`` as
    ``pool_bytes``'."""
    coff, rows = vc.pool_coff(ratio), vc.pool_rows(ratio)
    width = coff * d
    slot = tpu.tile_bytes(rows, width, F32)
    pool = (4 * slot  # the chunk and ring buffers, kv and score each
            + 2 * slot  # the [R, W] ape tile, double-buffered by the pipeline
            + 2 * tpu.tile_bytes(1, d, F32)  # the pooled row block, double-buffered
            + 2 * (tpu.tile_bytes(rows + WINDOW_PAD, width, F32) if window  # the windows
                   else tpu.tile_bytes(tpu.SUBLANES, tpu.LANES, F32))
            + (tpu.tile_bytes(1, tpu.LANES, F32) if row_table and half  # the table row
               else 2 * tpu.tile_bytes(max(half, tpu.SUBLANES), TABLE_TILE, F32))  # the tiles
            + 2 * tpu.tile_bytes(1, d, F32))  # the norm weight, double-buffered
    state = slot + 2 * tpu.tile_bytes(ratio, width, F32)  # score rows; ape [r, W] x 2
    return max(pool, state)
