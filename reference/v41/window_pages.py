"""V4.1's window kv (``formats.encode_window_kv``: e4m3 codes, ue8m0 scales per 32) laid out
for the TPU: one ``u32`` page of whole lane rows per page, a token's codes one record row, its
scale bytes in scale rows after the records.

Layout ``u32[L, P, R, W]`` (``W = D / 4`` words a record: 128 at ``D = 512``; ``R = ps +
scale_rows(ps, D)``):

- rows ``[0, ps)``: token ``t``'s record, row ``t``. Word ``l`` holds features ``l``, ``W + l``,
  ``2 W + l``, ``3 W + l`` in its bytes 0..3 (little-endian): byte plane ``j`` of the record is
  features ``j W .. (j + 1) W - 1``, MODEL1's record order (``reference.formats.model1``), so a
  kernel decodes plane ``j`` to the ``j``-th quarter of the row on lanes, in feature order.
- rows ``[ps, R)``: the ``D / 32`` ue8m0 bytes of each token as ``S = ceil(D / 128)`` words
  (little-endian, zero bytes padding the last), ``W / S`` tokens a row (32 at ``D = 512``):
  token ``t``'s words at row ``ps + t // (W / S)``, lanes ``S (t % (W / S)) ..``.

Bytes per token ``4 R W / ps``: **528** for ``D = 512`` at page sizes that are multiples of 128
(512 record + 16 scale bytes: the format's own), nothing padded. Why: the stored rows are
whole 128-lane rows at V4.1's ``D``, so XLA keeps the stack in its own layout. The earlier
``u32[.., 132]`` rows (528 B as words) are not whole lane tiles, and XLA laid the donated stack
out transposed and copied it twice a step (``scripts/cost/v41_step_cost.py``). Pure bit moves
of ``encode_window_kv``'s bytes: ``read_tokens`` returns them exactly."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from reference.v41.formats import WINDOW_BLOCK, window_kv_bytes

PLANES = 4  # bytes per word: byte planes of a record
SCALE_WORD_BYTES = 4


def record_words(dim: int) -> int:
    """Words of one token's record: ``D / 4`` (the lanes of a row)."""
    return dim // PLANES


def scale_words(dim: int) -> int:
    """Words holding one token's ``D / 32`` scale bytes: ``ceil(D / 128)``."""
    return -(-(dim // WINDOW_BLOCK) // SCALE_WORD_BYTES)


def tokens_per_scale_row(dim: int) -> int:
    """Tokens whose scale words share a row: ``W / S`` (32 at ``D = 512``)."""
    return record_words(dim) // scale_words(dim)


def scale_rows(page_size: int, dim: int) -> int:
    """Scale rows of a page: ``ceil(ps / (W / S))``."""
    return -(-page_size // tokens_per_scale_row(dim))


def page_rows(page_size: int, dim: int) -> int:
    """Rows of a page, ``R = ps + scale_rows``."""
    return page_size + scale_rows(page_size, dim)


def bytes_per_token(page_size: int, dim: int) -> float:
    """HBM bytes per token, stored: ``4 R W / ps``."""
    return 4 * page_rows(page_size, dim) * record_words(dim) / page_size


def _split(rows: jax.Array, dim: int):
    """Official rows ``u8[..., 33 D / 32]`` -> ``(record u32[..., W], scales u32[..., S])``."""
    w, s = record_words(dim), scale_words(dim)
    planes = rows[..., :dim].reshape(*rows.shape[:-1], PLANES, w)
    record = jax.lax.bitcast_convert_type(jnp.swapaxes(planes, -1, -2), jnp.uint32)
    sb = rows[..., dim:]
    sb = jnp.pad(sb, [(0, 0)] * (sb.ndim - 1) + [(0, s * SCALE_WORD_BYTES - sb.shape[-1])])
    scales = jax.lax.bitcast_convert_type(sb.reshape(*sb.shape[:-1], s, SCALE_WORD_BYTES),
                                          jnp.uint32)
    return record, scales


def _join(record: jax.Array, scales: jax.Array, dim: int) -> jax.Array:
    """``_split``'s inverse."""
    planes = jnp.swapaxes(jax.lax.bitcast_convert_type(record, jnp.uint8), -1, -2)
    codes = planes.reshape(*record.shape[:-1], dim)
    sb = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(*scales.shape[:-1], -1)
    return jnp.concatenate([codes, sb[..., :dim // WINDOW_BLOCK]], axis=-1)


def _scale_row(offset, page_size: int, dim: int):
    """``(scale row, first lane)`` of token ``offset`` of a page (i32)."""
    s, per = scale_words(dim), tokens_per_scale_row(dim)
    offset = jnp.asarray(offset, jnp.int32)
    return page_size + offset // per, s * (offset % per)


def write_tokens(pages: jax.Array, layer, page_id, offset, rows: jax.Array, *,
                 page_size: int, dim: int) -> jax.Array:
    """``pages u32[L, P, R, W]`` with the official rows ``rows u8[..., 33 D / 32]`` stored at
    ``(layer, page_id, offset)`` (ints or arrays broadcasting against ``rows``' leading dims:
    several layers in one scatter); ``page_id`` outside ``[0, P)`` drops the row (the slot
    rules' ``num_pages``). Two scatters: the record rows, the scale words."""
    record, scales = _split(rows, dim)
    page_id, offset = jnp.asarray(page_id), jnp.asarray(offset)
    out = pages.at[layer, page_id, offset].set(record, mode="drop")
    srow, lane0 = _scale_row(offset, page_size, dim)  # S words a token: this step's rows only
    lanes = lane0[..., None] + jnp.arange(scale_words(dim), dtype=jnp.int32)
    return out.at[jnp.asarray(layer)[..., None], page_id[..., None], srow[..., None],
                  lanes].set(scales, mode="drop")


def read_tokens(pages: jax.Array, layer, page_id, offset, *, page_size: int,
                dim: int) -> jax.Array:
    """The official rows ``u8[..., 33 D / 32]`` at ``(layer, page_id, offset)`` (arrays of one
    shape ``[...]``); ``page_id`` outside ``[0, P)`` reads zeros (never gathered)."""
    page_id = jnp.asarray(page_id)
    record = pages.at[layer, page_id, offset].get(mode="fill", fill_value=0)
    srow, _ = _scale_row(offset, page_size, dim)
    # the token's whole scale row (a row-sized gather; a gather of its S words is one index a
    # word on TPU), then its words by a compare-select over the row's tokens
    row = pages.at[layer, page_id, srow].get(mode="fill", fill_value=0)
    per = tokens_per_scale_row(dim)
    row = row.reshape(*row.shape[:-1], per, scale_words(dim))
    mine = jnp.arange(per, dtype=jnp.int32) == (jnp.asarray(offset, jnp.int32) % per)[..., None]
    scales = jnp.max(jnp.where(mine[..., None], row, jnp.uint32(0)), axis=-2)
    return _join(record, scales, dim)[..., :window_kv_bytes(dim)]


def to_pages(rows: jax.Array) -> jax.Array:
    """``u8[..., P, ps, 33 D / 32]`` official rows per page -> ``u32[..., P, R, W]``."""
    *lead, ps, width = rows.shape
    dim = width * WINDOW_BLOCK // (WINDOW_BLOCK + 1)
    record, scales = _split(rows, dim)  # [..., ps, W], [..., ps, S]
    per, nrows = tokens_per_scale_row(dim), scale_rows(ps, dim)
    scales = jnp.pad(scales, [(0, 0)] * len(lead) + [(0, nrows * per - ps), (0, 0)])
    scales = scales.reshape(*lead, nrows, record_words(dim))  # token-major rows
    return jnp.concatenate([record, scales], axis=-2)


def from_pages(pages: jax.Array, page_size: int, dim: int) -> jax.Array:
    """``to_pages``' inverse: ``u32[..., P, R, W] -> u8[..., P, ps, 33 D / 32]``."""
    *lead, _, _ = pages.shape
    record = pages[..., :page_size, :]
    scales = pages[..., page_size:, :].reshape(*lead, -1, scale_words(dim))[..., :page_size, :]
    return _join(record, scales, dim)


@dataclass(frozen=True)
class WindowPages:
    """Window pages ``u32[L, P, R, W]`` (module docstring) seen by the batch rules as rows of
    logical shape ``(L, P, ps, D)``. A pytree (``page_size`` and ``dim`` static)."""

    pages: jax.Array
    page_size: int
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, dim)``."""
        return (*self.pages.shape[:-2], self.page_size, self.dim)


jax.tree_util.register_dataclass(WindowPages, data_fields=["pages"],
                                 meta_fields=["page_size", "dim"])

