"""The TPU page layout V4.1's window and pool caches share (``window_pages``, ``pool_pages``):
each page ``u32[R, W]`` of whole ``W``-word rows, first the *record rows* (a token's or entry's
codes, ``per_row`` records a row), then the *scale rows* (its scale words, ``per_scale_row``
entries a row), stacked ``u32[L, P, R, W]``.

Reads use row-sized gathers only: a record's row and its scale row, each gathered whole (one
index per entry), then the entry's words taken by a compare-select over the row's slots. A
gather of fewer words is one index a word on TPU (XLA's TPU model prices it at tens of times
its data) and a ``lax.gather`` / ``lax.scatter`` window along the lanes measured worse (per-word
gathers; a ``while`` loop and two copies of the stack: ``docs/v41.md``). Writes scatter whole
record rows when a record is a row (the window), else one index per word of this step's
entries only (a few per row)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# A 32-bit TPU tile's rows (sublanes; pallas_kernels.tpu.SUBLANES on the kernel side). A page's
# row count is a multiple of it: with 132 rows (pages of 128 window tokens: 128 records + 4
# scale rows) TPU's default layout of the stack u32[L, P, 132, W] put the page axis second-minor
# (no row padding), and a kernel reading the stack in place (Mosaic takes the row-major layout)
# then cost a copy of the whole stack per step (scripts/cost/v41_step_cost.py, measured).
TILE_ROWS = 8


@dataclass(frozen=True)
class RowLayout:
    """``width`` words a row, ``record`` words an entry's codes, ``scale`` words its scales."""

    width: int
    record: int
    scale: int

    @property
    def per_row(self) -> int:
        """Records a row."""
        return self.width // self.record

    @property
    def per_scale_row(self) -> int:
        """Entries whose scale words share a row."""
        return self.width // self.scale

    def record_rows(self, page_size: int) -> int:
        return -(-page_size // self.per_row)

    def scale_rows(self, page_size: int) -> int:
        return -(-page_size // self.per_scale_row)

    def rows(self, page_size: int) -> int:
        """Rows of a page, ``R``: the record and scale rows, rounded up to ``TILE_ROWS`` (padding
        rows after them, never read)."""
        used = self.record_rows(page_size) + self.scale_rows(page_size)
        return -(-used // TILE_ROWS) * TILE_ROWS

    def bytes_per_entry(self, page_size: int) -> float:
        return 4 * self.rows(page_size) * self.width / page_size


def _pick(rows: jax.Array, slot, n: int, words: int) -> jax.Array:
    """``rows u32[..., W]`` seen as ``n`` slots of ``words`` -> slot ``slot [...]``'s words."""
    if n == 1:
        return rows[..., :words]
    rows = rows[..., :n * words].reshape(*rows.shape[:-1], n, words)
    mine = jnp.arange(n, dtype=jnp.int32) == jnp.asarray(slot, jnp.int32)[..., None]
    return jnp.max(jnp.where(mine[..., None], rows, jnp.uint32(0)), axis=-2)


def _set(pages, layer, page_id, row, slot, words, n: int, values):
    """``values u32[..., words]`` into slot ``slot`` of row ``row`` (whole rows when ``n == 1``
    and a slot is the row; else one index a word); ``page_id`` out of range drops (a negative
    one too: never wrapped to the end)."""
    page_id = jnp.asarray(page_id)
    page_id = jnp.where((page_id >= 0) & (page_id < pages.shape[1]), page_id, pages.shape[1])
    if n == 1 and words == pages.shape[-1]:
        return pages.at[layer, page_id, row].set(values, mode="drop")
    lanes = jnp.asarray(slot, jnp.int32)[..., None] * words + jnp.arange(words, dtype=jnp.int32)
    return pages.at[jnp.asarray(layer)[..., None], page_id[..., None], row[..., None],
                    lanes].set(values, mode="drop")


def write(lay: RowLayout, pages: jax.Array, layer, page_id, offset, record: jax.Array,
          scales: jax.Array, *, page_size: int) -> jax.Array:
    """``pages u32[L, P, R, W]`` with ``record u32[..., record]`` / ``scales u32[..., scale]``
    stored at ``(layer, page_id, offset)`` (broadcasting against their leading dims)."""
    page_id, offset = jnp.asarray(page_id), jnp.asarray(offset, jnp.int32)
    out = _set(pages, layer, page_id, offset // lay.per_row, offset % lay.per_row, lay.record,
               lay.per_row, record)
    srow = lay.record_rows(page_size) + offset // lay.per_scale_row
    return _set(out, layer, page_id, srow, offset % lay.per_scale_row, lay.scale,
                lay.per_scale_row, scales)


def read(lay: RowLayout, pages: jax.Array, layer, page_id, offset, *,
         page_size: int) -> tuple[jax.Array, jax.Array]:
    """``(record u32[..., record], scales u32[..., scale])`` at ``(layer, page_id, offset)``
    (arrays of one shape); ``page_id`` out of range reads zeros (never gathered)."""
    page_id, offset = jnp.asarray(page_id), jnp.asarray(offset, jnp.int32)
    rec = pages.at[layer, page_id, offset // lay.per_row].get(mode="fill", fill_value=0)
    srow = lay.record_rows(page_size) + offset // lay.per_scale_row
    sc = pages.at[layer, page_id, srow].get(mode="fill", fill_value=0)
    return (_pick(rec, offset % lay.per_row, lay.per_row, lay.record),
            _pick(sc, offset % lay.per_scale_row, lay.per_scale_row, lay.scale))


def pack(lay: RowLayout, record: jax.Array, scales: jax.Array) -> jax.Array:
    """``record u32[..., ps, record]``, ``scales u32[..., ps, scale]`` -> pages ``u32[..., R,
    W]`` (unused words and the padding rows zero)."""
    *lead, ps, _ = record.shape

    def rows_of(x, n, words, count):
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, count * n - ps), (0, 0)])
        x = x.reshape(*lead, count, n * words)
        return jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (0, lay.width - n * words)])

    pad = lay.rows(ps) - lay.record_rows(ps) - lay.scale_rows(ps)
    return jnp.concatenate([rows_of(record, lay.per_row, lay.record, lay.record_rows(ps)),
                            rows_of(scales, lay.per_scale_row, lay.scale, lay.scale_rows(ps)),
                            jnp.zeros((*lead, pad, lay.width), record.dtype)], axis=-2)


def unpack(lay: RowLayout, pages: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """``pack``'s inverse: ``(record u32[..., ps, record], scales u32[..., ps, scale])``."""
    *lead, _, _ = pages.shape
    nr, ns = lay.record_rows(page_size), lay.scale_rows(page_size)

    def of_rows(x, n, words):
        x = x[..., :n * words].reshape(*lead, -1, words)
        return x[..., :page_size, :]

    return (of_rows(pages[..., :nr, :], lay.per_row, lay.record),
            of_rows(pages[..., nr:nr + ns, :], lay.per_scale_row, lay.scale))


@dataclass(frozen=True)
class RowPages:
    """Pages ``u32[L, P, R, W]`` seen by the batch rules as rows of logical shape ``(L, P, ps,
    D)``. A pytree (``page_size`` and ``dim`` static)."""

    pages: jax.Array
    page_size: int
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, dim)``."""
        return (*self.pages.shape[:-2], self.page_size, self.dim)


jax.tree_util.register_dataclass(RowPages, data_fields=["pages"],
                                 meta_fields=["page_size", "dim"])
