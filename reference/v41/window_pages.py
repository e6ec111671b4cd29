"""V4.1's window kv (``formats.encode_window_kv``: e4m3 codes, ue8m0 scales per 32) laid out
for the TPU: one ``u32`` page of whole lane rows per page, a token's codes one record row, its
scale bytes in scale rows after the records.

Layout ``u32[L, P, R, W]`` (``W = D / 4`` words a record: 128 at ``D = 512``; ``R = ps +
scale_rows(ps, D)``):

- rows ``[0, ps)``: token ``t``'s record, row ``t``. Byte ``j`` (little-endian) of word ``l``
  holds the feature at position ``j W + l`` of the pool's lane order
  (``pool_pages.lane_order``: feature ``8 (P % (D / 8)) + P // (D / 8)`` at position ``P``):
  byte plane ``j`` is positions ``j W .. (j + 1) W - 1``, so a kernel decodes plane ``j`` to
  the ``j``-th quarter of the row on lanes, in the same order as the pool's nibble planes
  (each lane's scale block depends on ``l % (D / 8)`` only: ``(l % (D / 8)) // 4``).
- rows ``[ps, R)``: the ``D / 32`` ue8m0 bytes of each token as ``S = ceil(D / 128)`` words
  (little-endian, zero bytes padding the last), ``W / S`` tokens a row (32 at ``D = 512``):
  token ``t``'s words at row ``ps + t // (W / S)``, lanes ``S (t % (W / S)) ..``.

The rows, reads and writes are ``row_pages``' (one record a row here; a page's rows padded to a
multiple of 8, ``row_pages.TILE_ROWS``). Bytes per token ``4 R W / ps``: **544** for ``D = 512``
at pages of 128 (132 rows padded to 136), **528** at multiples of 256 (512 record + 16 scale
bytes: the format's own, nothing padded). Why: the stored rows are
whole 128-lane rows at V4.1's ``D``, so XLA keeps the stack in its own layout. The earlier
``u32[.., 132]`` rows (528 B as words) are not whole lane tiles, and XLA laid the donated stack
out transposed and copied it twice a step (``scripts/cost/v41_step_cost.py``). Pure bit moves
of ``encode_window_kv``'s bytes: ``read_tokens`` returns them exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reference.v41 import paged, pool_pages, row_pages
from reference.v41.formats import WINDOW_BLOCK, window_kv_bytes

PLANES = paged.WORD  # bytes per word: byte planes of a record
SCALE_WORD_BYTES = paged.WORD
WindowPages = row_pages.RowPages  # the pages seen as (L, P, ps, D) rows


def record_words(dim: int) -> int:
    """Words of one token's record: ``D / 4`` (the lanes of a row)."""
    return dim // PLANES


def scale_words(dim: int) -> int:
    """Words holding one token's ``D / 32`` scale bytes: ``ceil(D / 128)``."""
    return -(-(dim // WINDOW_BLOCK) // SCALE_WORD_BYTES)


def layout(dim: int) -> row_pages.RowLayout:
    """The rows of window pages of ``D = dim``: one record a row, ``W / S`` tokens' scale words
    a scale row."""
    return row_pages.RowLayout(record_words(dim), record_words(dim), scale_words(dim))


def tokens_per_scale_row(dim: int) -> int:
    """Tokens whose scale words share a row: ``W / S`` (32 at ``D = 512``)."""
    return layout(dim).per_scale_row


def scale_rows(page_size: int, dim: int) -> int:
    """Scale rows of a page: ``ceil(ps / (W / S))``."""
    return layout(dim).scale_rows(page_size)


def page_rows(page_size: int, dim: int) -> int:
    """Rows of a page, ``R = ps + scale_rows``."""
    return layout(dim).rows(page_size)


def bytes_per_token(page_size: int, dim: int) -> float:
    """HBM bytes per token, stored: ``4 R W / ps``."""
    return layout(dim).bytes_per_entry(page_size)


def _split(rows: jax.Array, dim: int):
    """Official rows ``u8[..., 33 D / 32]`` -> ``(record u32[..., W], scales u32[..., S])``."""
    w, s = record_words(dim), scale_words(dim)
    planes = pool_pages.to_lane_order(rows[..., :dim]).reshape(*rows.shape[:-1], PLANES, w)
    record = jax.lax.bitcast_convert_type(jnp.swapaxes(planes, -1, -2), jnp.uint32)
    sb = rows[..., dim:]
    sb = jnp.pad(sb, [(0, 0)] * (sb.ndim - 1) + [(0, s * SCALE_WORD_BYTES - sb.shape[-1])])
    scales = jax.lax.bitcast_convert_type(sb.reshape(*sb.shape[:-1], s, SCALE_WORD_BYTES),
                                          jnp.uint32)
    return record, scales


def _join(record: jax.Array, scales: jax.Array, dim: int) -> jax.Array:
    """``_split``'s inverse."""
    planes = jnp.swapaxes(jax.lax.bitcast_convert_type(record, jnp.uint8), -1, -2)
    codes = pool_pages.from_lane_order(planes.reshape(*record.shape[:-1], dim))
    sb = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(*scales.shape[:-1], -1)
    return jnp.concatenate([codes, sb[..., :dim // WINDOW_BLOCK]], axis=-1)


def write_tokens(pages: jax.Array, layer, page_id, offset, rows: jax.Array, *,
                 page_size: int, dim: int) -> jax.Array:
    """``pages u32[L, P, R, W]`` with the official rows ``rows u8[..., 33 D / 32]`` stored at
    ``(layer, page_id, offset)`` (ints or arrays broadcasting against ``rows``' leading dims:
    several layers in one scatter); ``page_id`` outside ``[0, P)`` drops the row (the slot
    rules' ``num_pages``)."""
    record, scales = _split(rows, dim)
    return row_pages.write(layout(dim), pages, layer, page_id, offset, record, scales,
                           page_size=page_size)


def read_tokens(pages: jax.Array, layer, page_id, offset, *, page_size: int,
                dim: int) -> jax.Array:
    """The official rows ``u8[..., 33 D / 32]`` at ``(layer, page_id, offset)`` (arrays of one
    shape ``[...]``); ``page_id`` outside ``[0, P)`` reads zeros (never gathered)."""
    record, scales = row_pages.read(layout(dim), pages, layer, page_id, offset,
                                    page_size=page_size)
    return _join(record, scales, dim)[..., :window_kv_bytes(dim)]


def to_pages(rows: jax.Array) -> jax.Array:
    """``u8[..., P, ps, 33 D / 32]`` official rows per page -> ``u32[..., P, R, W]``."""
    dim = rows.shape[-1] * WINDOW_BLOCK // (WINDOW_BLOCK + 1)
    return row_pages.pack(layout(dim), *_split(rows, dim))


def from_pages(pages: jax.Array, page_size: int, dim: int) -> jax.Array:
    """``to_pages``' inverse: ``u32[..., P, R, W] -> u8[..., P, ps, 33 D / 32]``."""
    return _join(*row_pages.unpack(layout(dim), pages, page_size), dim)
