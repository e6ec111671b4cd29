"""tokamax 0.0.17's fp8 index cache (the keys its ``lightning_indexer`` reads and its
``dsv4_compressor`` writes in indexer mode; issue 29, ``docs/engines/tokamax.md`` section 2.2).

One compressed index key is a **record**: ``HEAD_DIM = 128`` e4m3 bytes (the rotated key), then
ue8m0 scale bytes, then zero padding, ``RECORD_BYTES = 256`` bytes in all:

- bytes ``[0, 128)``: the e4m3 code of feature ``d`` at byte ``d``;
- bytes ``[128, 128 + 128 // quant_block)``: one ue8m0 scale per block of ``quant_block``
  features (value ``2**(byte - 127)``; 0xFF is NaN), block ``b`` scaling features
  ``[b * quant_block, (b + 1) * quant_block)``; tokamax's tests and its indexer use
  ``quant_block = 128``: one scale, at byte 128;
- the rest: zero (as the compressor writes it; nothing reads it).

Quantizer (``encode_index_records``, tokamax's ``dsv4_compressor/reference.py``
``quantize_fp8_ue8m0``, the rule restated): per block, ``amax = max(max |x|, 1e-4)``, ``s =
exp2(ceil(log2(amax / 448)))`` in f32 (the f32 ``log2`` of the quotient: for an ``amax`` a few ulps
above ``448 * 2**k`` it may give ``2**k`` where the exact ceiling is ``2**(k + 1)``; that code then
rounds to 448, so no overflow), codes ``float8_e4m3fn(x * (1 / s))`` (RNE; ``1 / s`` is exact).

Two cache layouts (``LAYOUTS``, tokamax's ``KVLayout`` names; ``ps`` entries per page):

- ``"head_along_sublane"``: ``u8[P, ps // 4, 4, 256]``. Entry ``t`` of a page is the record at
  ``[t // 4, t % 4, :]``: a page is its ``ps`` records back to back (``u8[P, ps, 256]`` is the
  same bytes). The compressor writes this one; a **flat slot** ``s`` is entry ``s % ps`` of page
  ``s // ps``.
- ``"seq_along_lane"``: ``u8[P, 33, 4, ps]``, i.e. ``u8[P, 132, ps]``: byte row ``r`` (sub-row
  ``r % 4`` of row ``r // 4``) holds record byte ``r`` of every entry (entries on lanes). Rows
  ``[0, 128)`` are the key, row 128 the scale, rows 129-131 padding (zero when tokamax converts a
  cache; ``write_index_records`` stores record bytes ``[129, 132)`` there). 132 bytes per entry;
  no tokamax op writes it.

Readers: ``gather_index_records`` (bytes of flat slots), ``split_index_bytes`` (codes and the
first scale, as f32, exactly), ``decode_index_records`` / ``dequantize_index_cache`` (f32 keys,
``e4m3 * 2**(byte - 127)`` per block, exact). ``lightning_indexer`` reads only the first scale
(byte 128), so a record written with ``quant_block < 128`` scores with block 0's scale there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.formats import model1, tokamax_v4
from reference.quant import fp8

HEAD_DIM = fp8.INDEX_HEAD_DIM  # 128 e4m3 key bytes
LANES = model1.LANES
KV_PACKING = tokamax_v4.SLAB_ROWS  # 4 bytes per 32-bit word: entries per slab row
RECORD_BYTES = -(-(HEAD_DIM + HEAD_DIM // LANES) // LANES) * LANES  # 129 used -> 256
SEQ_BYTES = HEAD_DIM + KV_PACKING  # 132 bytes per entry in "seq_along_lane"
SEQ_GROUPS = SEQ_BYTES // KV_PACKING  # 33
HEAD_ALONG_SUBLANE = "head_along_sublane"
SEQ_ALONG_LANE = "seq_along_lane"
LAYOUTS = (HEAD_ALONG_SUBLANE, SEQ_ALONG_LANE)
_ALIASES = {HEAD_ALONG_SUBLANE: HEAD_ALONG_SUBLANE, SEQ_ALONG_LANE: SEQ_ALONG_LANE,
            "seq_alone_lane": SEQ_ALONG_LANE}  # tokamax accepts this typo too
_U8 = np.dtype(np.uint8)


def parse_layout(kv_layout) -> str:
    """``kv_layout`` as one of ``LAYOUTS``: a string (case and surrounding blanks ignored, and
    tokamax's alias ``"seq_alone_lane"``), tokamax's ``KVLayout`` (a ``StrEnum`` whose value is
    the name), or ``None`` (``"head_along_sublane"``, tokamax's default). ValueError otherwise."""
    if kv_layout is None:
        return HEAD_ALONG_SUBLANE
    name = str(getattr(kv_layout, "value", kv_layout)).strip().lower()
    if name not in _ALIASES:
        raise ValueError(f"unknown kv_layout {kv_layout!r}; expected one of "
                         f"{sorted(_ALIASES)} (or tokamax's KVLayout)")
    return _ALIASES[name]


def check_quant_block(quant_block) -> int:
    """Refuse a ``quant_block`` that is not a positive int dividing ``HEAD_DIM``; return it."""
    qb = _checks.positive_int("quant_block", quant_block)
    if HEAD_DIM % qb:
        raise ValueError(f"quant_block must divide the key width {HEAD_DIM}, got "
                         f"quant_block={qb} ({HEAD_DIM} % {qb} = {HEAD_DIM % qb})")
    return qb


def cache_shape(num_pages: int, page_size: int, kv_layout=HEAD_ALONG_SUBLANE) -> tuple:
    """The ``u8`` shape of a cache of ``num_pages`` pages of ``page_size`` entries:
    ``(P, ps // 4, 4, 256)`` or ``(P, 33, 4, ps)`` (``page_size % 4 == 0`` for the first)."""
    layout = parse_layout(kv_layout)
    p = _checks.nonneg_int("num_pages", num_pages)
    ps = _checks.positive_int("page_size", page_size)
    if layout == SEQ_ALONG_LANE:
        return (p, SEQ_GROUPS, KV_PACKING, ps)
    if ps % KV_PACKING:
        raise ValueError(f"head_along_sublane needs page_size % {KV_PACKING} == 0, got "
                         f"page_size={ps}")
    return (p, ps // KV_PACKING, KV_PACKING, RECORD_BYTES)


def check_index_cache(name: str, cache, kv_layout) -> int:
    """Refuse a cache that is not ``u8`` in ``kv_layout``'s shape (module docstring); return
    its page size in entries."""
    layout = parse_layout(kv_layout)
    _checks.rank(name, cache, 4)
    dtype = np.dtype(jnp.result_type(cache))
    if dtype != _U8:
        raise TypeError(f"{name} must be uint8 (tokamax's index cache bytes), got dtype {dtype}")
    shape = tuple(np.shape(cache))
    if layout == SEQ_ALONG_LANE:
        _checks.dim(name, cache, 1, SEQ_GROUPS, f"(128 key + 4 scale/pad byte rows) // "
                    f"{KV_PACKING} in {layout}")
        _checks.dim(name, cache, 2, KV_PACKING, f"the byte packing in {layout}")
        return int(shape[3])
    _checks.dim(name, cache, 2, KV_PACKING, f"entries per row in {layout}")
    _checks.dim(name, cache, 3, RECORD_BYTES, f"the record bytes in {layout}")
    return int(shape[1]) * KV_PACKING


# ------------------------------------------------------------------------------- the quantizer

@functools.partial(jax.jit, static_argnames=("quant_block",))
def _encode(keys: jax.Array, quant_block: int) -> jax.Array:
    x = keys.astype(jnp.float32)
    blocks = x.reshape(x.shape[0], HEAD_DIM // quant_block, quant_block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True),
                       jnp.float32(fp8.AMAX_FLOOR))
    s = jnp.exp2(jnp.ceil(jnp.log2(amax / jnp.float32(fp8.FP8_MAX))))
    codes = (blocks * (1.0 / s)).astype(fp8.FP8_DTYPE).reshape(x.shape)
    scale = s[..., 0].astype(model1.E8M0_DTYPE)
    rec = jnp.concatenate([lax.bitcast_convert_type(codes, jnp.uint8),
                           lax.bitcast_convert_type(scale, jnp.uint8)], axis=-1)
    return jnp.pad(rec, ((0, 0), (0, RECORD_BYTES - rec.shape[-1])))


def encode_index_records(keys, *, quant_block: int = LANES) -> jax.Array:
    """Quantize index keys into tokamax's records (module docstring).

    Args:
      keys: ``f32|bf16[N, 128]`` index keys (after the compressor's norm and RoPE).
      quant_block: static, divides 128; features per ue8m0 scale (tokamax's indexer reads one
        scale, so ``128``, the default, is what ``lightning_indexer`` expects).

    Returns:
      ``u8[N, 256]``: codes ``[0, 128)``, ``128 // quant_block`` scale bytes from 128, zeros.
    """
    qb = check_quant_block(quant_block)
    _checks.rank("keys", keys, 2)
    _checks.floating("keys", keys)
    _checks.dim("keys", keys, 1, HEAD_DIM, "the index key width")
    return _encode(jnp.asarray(keys), qb)


# ---------------------------------------------------------------------------------- the writer

def _flat_slots(slots, capacity: int) -> jax.Array:
    """i32 slots; negative or ``>= capacity`` ones -> ``capacity`` (dropped by the scatter:
    a negative index would otherwise count from the end)."""
    s = jnp.asarray(slots, jnp.int32)
    return jnp.where((s >= 0) & (s < capacity), s, capacity)


def write_index_records(cache, slots, records, *, kv_layout=HEAD_ALONG_SUBLANE) -> jax.Array:
    """Store ``records`` at flat ``slots`` of ``cache`` (returns the new cache).

    Args:
      cache: ``u8`` cache in ``kv_layout`` (module docstring), ``P`` pages of ``ps`` entries.
      slots: ``i32[N]`` flat slots (entry ``s % ps`` of page ``s // ps``); a slot below 0 or
        at/after ``P * ps`` stores nothing. Repeated slots: one of them wins (unspecified).
      records: ``u8[N, 256]`` (``encode_index_records``); ``"seq_along_lane"`` stores bytes
        ``[0, 132)`` of each (the key, the first scale and record bytes 129-131).
    """
    layout = parse_layout(kv_layout)
    ps = check_index_cache("cache", cache, layout)
    _checks.rank("slots", slots, 1)
    _checks.integer("slots", slots)
    _checks.rank("records", records, 2)
    _checks.dim("records", records, 0, np.shape(slots)[0], "len(slots)")
    _checks.dim("records", records, 1, RECORD_BYTES, "the record bytes")
    num_pages = int(np.shape(cache)[0])
    s = _flat_slots(slots, num_pages * ps)
    records = jnp.asarray(records, jnp.uint8)
    # Scattered into the 4-D cache as it is: a reshape to [entries, 256] (or [P, 132, ps]) has
    # another TPU tiling than u8[P, rows, 4, lanes], and XLA would relay the whole cache out
    # and back (seen in the AOT HLO of dsv4_compressor's indexer mode).
    page, entry = s // ps, s % ps
    cache = jnp.asarray(cache)
    if layout == HEAD_ALONG_SUBLANE:
        return cache.at[page, entry // KV_PACKING, entry % KV_PACKING].set(records, mode="drop")
    b = jnp.arange(SEQ_BYTES)
    return cache.at[page[:, None], b // KV_PACKING, b % KV_PACKING, entry[:, None]].set(
        records[:, :SEQ_BYTES], mode="drop")


# --------------------------------------------------------------------------------- the readers

def page_bytes(pages: jax.Array, kv_layout) -> jax.Array:
    """Per-entry bytes of (gathered) pages: ``u8[n, ps // 4, 4, 256] -> u8[n, ps, 256]``
    (a view) or ``u8[n, 33, 4, ps] -> u8[n, ps, 132]`` (a transpose of those pages only)."""
    n = pages.shape[0]
    if parse_layout(kv_layout) == SEQ_ALONG_LANE:
        return pages.reshape(n, SEQ_BYTES, pages.shape[-1]).swapaxes(1, 2)
    return pages.reshape(n, -1, RECORD_BYTES)


def split_index_bytes(entry_bytes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``u8[..., W]`` entry bytes (``W >= 129``) -> ``(codes f32[..., 128], scale f32[...])``:
    the e4m3 codes upcast exactly and the first scale ``2**(byte 128 - 127)`` (NaN for 0xFF;
    byte 0 is the subnormal ``2**-127``). What ``lightning_indexer`` multiplies its scores by."""
    codes = lax.bitcast_convert_type(entry_bytes[..., :HEAD_DIM], fp8.FP8_DTYPE)
    scale = lax.bitcast_convert_type(entry_bytes[..., HEAD_DIM], model1.E8M0_DTYPE)
    return codes.astype(jnp.float32), scale.astype(jnp.float32)


def decode_index_records(entry_bytes, *, quant_block: int = LANES) -> jax.Array:
    """``u8[..., W]`` entry bytes -> ``f32[..., 128]`` keys, exactly: each block of
    ``quant_block`` features' e4m3 values times ``2**(its scale byte - 127)`` (a power-of-two
    product, so exact but for f32 under/overflow). ``W`` must hold the scales: 256 for records,
    132 (``"seq_along_lane"`` entries) only up to 4 scales (``quant_block >= 32``)."""
    qb = check_quant_block(quant_block)
    nb = HEAD_DIM // qb
    w = int(np.shape(entry_bytes)[-1])
    if w < HEAD_DIM + nb:
        raise ValueError(f"entry_bytes.shape[-1] = {w} cannot hold {HEAD_DIM} codes and "
                         f"{nb} scales (quant_block={qb})")
    b = jnp.asarray(entry_bytes, jnp.uint8)
    codes = lax.bitcast_convert_type(b[..., :HEAD_DIM], fp8.FP8_DTYPE).astype(jnp.float32)
    scales = lax.bitcast_convert_type(b[..., HEAD_DIM:HEAD_DIM + nb], model1.E8M0_DTYPE)
    blocks = codes.reshape(*codes.shape[:-1], nb, qb) * scales.astype(jnp.float32)[..., None]
    return blocks.reshape(codes.shape)


def gather_index_records(cache, slots, *, kv_layout=HEAD_ALONG_SUBLANE) -> jax.Array:
    """The bytes of flat ``slots`` (``i32[N]``): ``u8[N, 256]`` (``"head_along_sublane"``) or
    ``u8[N, 132]`` (``"seq_along_lane"``); zeros for a slot outside ``[0, P * ps)``. Only the
    slots' pages are read."""
    layout = parse_layout(kv_layout)
    ps = check_index_cache("cache", cache, layout)
    _checks.rank("slots", slots, 1)
    _checks.integer("slots", slots)
    num_pages = int(np.shape(cache)[0])
    s = _flat_slots(slots, num_pages * ps)
    pages = jnp.take(jnp.asarray(cache), s // ps, axis=0, mode="fill", fill_value=0)
    entries = page_bytes(pages, layout)  # [N, ps, W]
    return jnp.take_along_axis(entries, (s % ps)[:, None, None], axis=1)[:, 0]


def dequantize_index_cache(cache, *, kv_layout=HEAD_ALONG_SUBLANE,
                           quant_block: int = LANES) -> jax.Array:
    """The whole cache as keys ``f32[P, ps, 128]`` (``decode_index_records`` of every entry;
    for tests and oracles: the ops read only the pages they need)."""
    layout = parse_layout(kv_layout)
    check_index_cache("cache", cache, layout)
    return decode_index_records(page_bytes(jnp.asarray(cache), layout), quant_block=quant_block)
