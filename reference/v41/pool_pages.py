"""V4.1's compressed kv (``formats.encode_compressed_kv``: e2m1 nibbles, e4m3 scales per 16)
laid out for the TPU: ``row_pages``' rows with two entries' codes a record row and sixteen
entries' scale words a scale row.

Layout ``u32[K, P, R, W]``, ``W = D / 4`` words a row (128 at ``D = 512``):

- record rows ``[0, ceil(ps / 2))``: entry ``e``'s ``D / 2`` nibble bytes as ``D / 8``
  little-endian words (the official bytes in order: byte ``i`` holds features ``2i`` and ``2i +
  1``) at row ``e // 2``, lanes ``(e % 2) D / 8 ..``;
- scale rows: its ``D / 16`` e4m3 scale bytes as ``D / 64`` words at row ``ceil(ps / 2) + e //
  16``, lanes ``(e % 16) D / 64 ..``.

Bytes per entry ``4 R W / ps``: **288** for ``D = 512`` at page sizes that are multiples of 128
(the format's own; a page's rows are padded to a multiple of 8, ``row_pages.TILE_ROWS``). Why:
the step's pool rows ``u32[.., 72]`` (288 B as words) are not whole lane rows, so every top-k
entry was a gather of 72 words, one index an entry of less than a row, which XLA's TPU model
prices as a per-element gather; here each entry is two row-sized gathers (its record row, its
scale row) and a compare-select. Pure bit moves of ``encode_compressed_kv``'s bytes:
``read_entries`` returns them exactly. The Pallas attention
(``pallas_kernels.v41_attention``) reads them in place, a record row and a scale row an entry,
decoded to the lane order (``lane_order``)."""

from __future__ import annotations

import jax
import numpy as np

from reference.v41 import paged, row_pages
from reference.v41.formats import COMPRESSED_BLOCK, compressed_kv_bytes

WORD = paged.WORD  # bytes per stored word
PoolPages = row_pages.RowPages  # the pages seen as (K, P, ps, D) rows


def layout(dim: int) -> row_pages.RowLayout:
    """``W = D / 4``, a record ``D / 8`` words (two a row), scales ``D / 64`` (sixteen a row)."""
    return row_pages.RowLayout(dim // WORD, dim // (2 * WORD),
                               -(-(dim // COMPRESSED_BLOCK) // WORD))


def lane_order(dim: int) -> np.ndarray:
    """``i64[D]``: the feature at each position of the *lane order* a kernel decodes a record to
    (``pallas_kernels.v41_attention``): nibble plane ``q`` (bits ``4 q ..`` of every word) of an
    entry's ``D / 8`` words holds features ``8 w + q``, so position ``P = q D / 8 + w`` is
    feature ``8 (P % (D / 8)) + P // (D / 8)``: the features seen as ``[D / 8, 8]``,
    transposed. The window records store their bytes in this order too, so both caches decode
    to it with no lane shuffle (a query is permuted to it once)."""
    return np.arange(dim).reshape(dim // 8, 8).T.reshape(-1)


def to_lane_order(x: jax.Array) -> jax.Array:
    """``x[..., D]`` in feature order -> lane order (``lane_order``): a reshape and a transpose,
    no gather."""
    d = x.shape[-1]
    return jax.numpy.swapaxes(x.reshape(*x.shape[:-1], d // 8, 8), -1, -2).reshape(x.shape)


def from_lane_order(x: jax.Array) -> jax.Array:
    """``to_lane_order``'s inverse."""
    d = x.shape[-1]
    return jax.numpy.swapaxes(x.reshape(*x.shape[:-1], 8, d // 8), -1, -2).reshape(x.shape)


def page_rows(page_size: int, dim: int) -> int:
    """Rows of a page, ``R``."""
    return layout(dim).rows(page_size)


def bytes_per_entry(page_size: int, dim: int) -> float:
    """HBM bytes per entry, stored: ``4 R W / ps``."""
    return layout(dim).bytes_per_entry(page_size)


def _words(b: jax.Array, n: int) -> jax.Array:
    """``u8[..., m]`` -> ``u32[..., n]`` little-endian (zero bytes pad)."""
    b = jax.numpy.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, n * WORD - b.shape[-1])])
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], n, WORD), jax.numpy.uint32)


def _bytes(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jax.numpy.uint8).reshape(*w.shape[:-1], -1)


def _split(rows: jax.Array, dim: int):
    lay = layout(dim)
    return _words(rows[..., :dim // 2], lay.record), _words(rows[..., dim // 2:], lay.scale)


def _join(record: jax.Array, scales: jax.Array, dim: int) -> jax.Array:
    return jax.numpy.concatenate([_bytes(record), _bytes(scales)], axis=-1)[
        ..., :compressed_kv_bytes(dim)]


def write_entries(pages: jax.Array, layer, page_id, offset, rows: jax.Array, *,
                  page_size: int, dim: int) -> jax.Array:
    """``pages u32[K, P, R, W]`` with the official rows ``rows u8[..., 9 D / 16]`` stored at
    ``(layer, page_id, offset)`` (broadcasting against ``rows``' leading dims); ``page_id``
    outside ``[0, P)`` drops the row."""
    return row_pages.write(layout(dim), pages, layer, page_id, offset, *_split(rows, dim),
                           page_size=page_size)


def read_entries(pages: jax.Array, layer, page_id, offset, *, page_size: int,
                 dim: int) -> jax.Array:
    """The official rows ``u8[..., 9 D / 16]`` at ``(layer, page_id, offset)`` (arrays of one
    shape); ``page_id`` outside ``[0, P)`` reads zeros (never gathered)."""
    return _join(*row_pages.read(layout(dim), pages, layer, page_id, offset,
                                 page_size=page_size), dim)


def to_pages(rows: jax.Array) -> jax.Array:
    """``u8[..., P, ps, 9 D / 16]`` official rows per page -> ``u32[..., P, R, W]``."""
    dim = rows.shape[-1] * COMPRESSED_BLOCK // (COMPRESSED_BLOCK // 2 + 1)
    return row_pages.pack(layout(dim), *_split(rows, dim))


def from_pages(pages: jax.Array, page_size: int, dim: int) -> jax.Array:
    """``to_pages``' inverse: ``u32[..., P, R, W] -> u8[..., P, ps, 9 D / 16]``."""
    return _join(*row_pages.unpack(layout(dim), pages, page_size), dim)
