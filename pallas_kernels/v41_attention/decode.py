"""In-VMEM decode of DeepSeek-V4.1's window and pool page rows (``reference.v41.window_pages``,
``pool_pages``) into the *lane order* (``pool_pages.lane_order``: position ``P`` holds feature
``8 (P % (D / 8)) + P // (D / 8)``), the order both caches' records are stored in, so neither
needs a lane shuffle; the kernel's query is permuted to it once, its output back (``entry``).

Shapes (``W = D / 4`` words a row, 128 at ``D = 512``):

- ``window_values(records u32[N, W], scale_rows u32[N, W], slot i32[N, 1], dim)``: each row's
  token record (byte plane ``j`` = positions ``j W ..``) and the scale row holding its ue8m0
  words at slot ``slot`` (``W / S`` tokens a row, ``S = D / 128`` words each) -> ``f32[N, D]``,
  ``e4m3(code) * 2^(byte - 127)``; the scale of lane ``l`` is block ``(l % (D / 8)) // 4``.
- ``pool_values(records u32[N, W], half i32[N, 1], scale_rows u32[N, W], slot i32[N, 1],
  dim)``: the record row holding the entry in half ``half`` (two entries a row, ``D / 8`` words
  each) and the scale row holding its ``D / 64`` e4m3 scale words at slot ``slot`` (16 a row)
  -> ``f32[N, D]``, ``e2m1(nibble) * e4m3(scale)``; nibble plane ``q`` of word ``w`` is feature
  ``8 w + q`` at position ``q D / 8 + w``; the scale of lane ``l`` is block ``(l % (D / 8)) //
  2``.

Every value is exact in f32 and in bf16 (a 3- or 4-bit significand times a power of two, or an
e2m1 value times an e4m3 one: at most 5 significant bits), equal to ``reference.v41.formats``'
``decode_window_kv`` / ``decode_compressed_kv`` of the same bytes. A slot's words are moved to
lane 0 by a select over static lane rolls (``_align``: a select, so another slot's NaN cannot
leak), then spread to the lanes that use them by selects and per-lane shifts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from reference.quant import fp8
from reference.v41 import formats, paged, pool_pages, window_pages
from reference.v41.formats import COMPRESSED_BLOCK, WINDOW_BLOCK, e2m1_values, ue8m0_values

BYTE_BITS = formats.BYTE_BITS
WORD_BYTES = paged.WORD
NIBBLES = 2 * WORD_BYTES  # nibbles a word


_align = tpu.align_slot  # a slot's words moved to lane 0


def _spread_bytes(aligned, lane_block):
    """Byte ``b = lane_block[., l]`` of each row's aligned words ``u32[N, words]`` (word ``b //
    4``, byte ``b % 4``) at lane ``l``: ``i32[N, W]`` holding 0..255."""
    word_of = lane_block // WORD_BYTES
    out = jnp.broadcast_to(aligned[:, 0:1], lane_block.shape)
    for w in range(1, aligned.shape[-1]):
        out = jnp.where(word_of == w, aligned[:, w:w + 1], out)
    shift = (lane_block % WORD_BYTES * BYTE_BITS).astype(jnp.uint32)
    return ((out >> shift) & jnp.uint32(0xFF)).astype(jnp.int32)


def _lane_blocks(shape, dim: int, block: int):
    """``i32[shape]``: the scale block of each lane of a lane-order row piece of ``W`` lanes:
    ``(l % (D / 8)) * 8 // block`` (a position's feature ``8 (l % (D / 8)) + q``, ``q < 8``)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return (lane % (dim // NIBBLES)) * NIBBLES // block


def _e4m3(codes):
    """``i32`` holding e4m3 bytes -> f32 (exact)."""
    return jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), fp8.FP8_DTYPE).astype(
        jnp.float32)


def window_values(records, scale_rows, slot, dim: int):
    """Window tokens -> ``f32[N, D]`` in the lane order (module docstring)."""
    records, scale_rows = records.astype(jnp.uint32), scale_rows.astype(jnp.uint32)
    words = window_pages.scale_words(dim)
    blocks = _lane_blocks(records.shape, dim, WINDOW_BLOCK)
    scale = ue8m0_values(_spread_bytes(_align(scale_rows, slot, words)[:, :words], blocks))
    planes = [_e4m3((records >> (BYTE_BITS * j)) & jnp.uint32(0xFF)) * scale
              for j in range(WORD_BYTES)]
    return jnp.concatenate(planes, axis=1)


def pool_values(records, half, scale_rows, slot, dim: int):
    """Pool entries -> ``f32[N, D]`` in the lane order (module docstring)."""
    records, scale_rows = records.astype(jnp.uint32), scale_rows.astype(jnp.uint32)
    lay = pool_pages.layout(dim)
    width, part, words = records.shape[-1], lay.record, lay.scale  # W; D / 8; D / 64 words
    blocks = _lane_blocks(records.shape, dim, COMPRESSED_BLOCK)
    scale = _e4m3(_spread_bytes(_align(scale_rows, slot, words)[:, :words], blocks))
    mine = jnp.where(half == 1, pltpu.roll(records, width - part, 1), records)  # lanes < D/8
    upper = pltpu.roll(mine, part, 1)  # the same words on lanes D/8 .. D/4 - 1
    lane = jax.lax.broadcasted_iota(jnp.int32, records.shape, 1)
    pieces = []
    for a in range(NIBBLES // 2):  # piece a: nibble planes 2a (lanes < D/8) and 2a + 1
        lo = (mine >> (4 * 2 * a)) & jnp.uint32(0xF)
        hi = (upper >> (4 * (2 * a + 1))) & jnp.uint32(0xF)
        nib = jnp.where(lane < part, lo, hi).astype(jnp.int32)
        pieces.append(e2m1_values(nib) * scale)
    return jnp.concatenate(pieces, axis=1)
