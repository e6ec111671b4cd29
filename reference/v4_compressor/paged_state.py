"""The V4 compressor over tokamax 0.0.17's paged per-position state cache (issue 29;
``docs/engines/tokamax.md`` section 5): the state store of ``proj_and_save_state`` and the
window gather, pooling, RMSNorm and RoPE of ``dsv4_compressor``, in pure ``jnp``.

**The state.** Each token's state is ``f32[state_dim]``, ``state_dim = 2 * coff * d``: its ``kv``
row (``coff * d`` wide; ``coff`` 2 with overlapping windows, 1 without) then its gate ``score +
ape[p % r]`` (the same width): ``reference.v4_compressor.ref``'s ring rows, one per position
instead of a ring of ``coff * r`` per sequence. It is stored in a paged cache of 128-multiple
``lanes``: a ``u8[P, rows, 4, lanes]`` slab array (f32 value ``l`` of a row is bytes ``(0..3,
l)``, little endian) or the same bytes as ``i32[P, rows, lanes]`` (word ``l`` is its bits). A
token fills ``rows_per_token = state_dim / lanes`` consecutive rows (16 for CSA, 8 for HCA, 2 in
the indexer's 256-lane cache).

**Addressing.** ``save_states``: token ``t`` goes to flat rows ``(slot[t] // rpt) * rpt ..
+ rpt`` (``slot`` is a row number, ``page * rows + row``, meant as a multiple of ``rpt``);
``slot < 0`` or past the cache: not stored. ``window_slots``: the state of position ``q`` of
request ``req`` is token ``q % state_block_size`` of page ``block_table[req * stride + q //
state_block_size]`` (``state_block_size <= rows // rpt``). Index lookups past the block table or
the pages are clamped (jnp's gather rule, as tokamax's reference): a broken batch reads some
state, unspecified.

**The math** is ``reference.v4_compressor.ref``'s, unchanged: the window of ``coff * r``
positions ``p - coff r + 1 .. p`` of a token at ``p`` is that module's pooled slots of entry ``j
= p // r`` (with overlap the older ``r`` positions take the state's first half ``[0, d)``, the
newer ``r`` its second half ``[d, 2 d)``; positions below 0 are gate ``-inf``, kv 0), pooled by
its ``_pool`` (per-channel softmax and weighted sum by fixed pairwise trees) and finished by its
``finish_entries`` (weighted RMSNorm, interleaved RoPE at position ``r j = (p // r) r``). Only
the state source changes (this module's gather replaces ``_gather_slots``' ring and chunk rows):
``compress_step`` itself cannot take it, since its state is a per-sequence ring filled by the
same call from projected rows, where tokamax's state is written beforehand per position by
another op and addressed by a block table.

Rounding versus tokamax's reference: the same operations, but tokamax sums and maxes with XLA
reductions (``jax.nn.softmax``, ``jnp.sum``, ``jnp.mean``) where this package uses fixed trees,
so an entry's f32 values differ from tokamax's in the last bits (on CPU about 60% of values,
by a few ulp of the summands). A stored code therefore differs, by one, only where a value lies
that close to a bf16 / e4m3 rounding boundary: measured on CPU over 150 random cases per mode
(``tests/test_tokamax_parity_compressor.py``), 13 of 153 600 HCA bf16 values, 1 of 28 800 CSA
RoPE bf16 values and none of 259 200 e4m3 codes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from reference.formats import tokamax_v4
from reference.v4_compressor import ref

_F32_BYTES = 4


def state_dim(head_dim: int, overlap: bool) -> int:
    """The f32 values of one token's state: ``2 * coff * head_dim`` (``coff = 1 + overlap``)."""
    return 2 * (1 + int(overlap)) * head_dim


def rows_per_token(dim: int, lanes: int) -> int:
    """Cache rows one token's ``f32[dim]`` state fills at ``lanes`` f32 values per row
    (ValueError unless ``lanes`` divides ``dim``)."""
    if lanes <= 0 or dim % lanes:
        raise ValueError(f"a state of {dim} f32 values does not fill whole cache rows of "
                         f"{lanes} lanes")
    return dim // lanes


def is_words(cache) -> bool:
    """Whether ``cache`` is the ``i32[P, rows, lanes]`` word view (else ``u8[P, rows, 4,
    lanes]`` slabs)."""
    return jnp.dtype(cache.dtype).itemsize == _F32_BYTES


def cache_lanes(cache) -> int:
    """The f32 values per row of a state cache (its last dim)."""
    return int(cache.shape[-1])


def rows_as_f32(rows: jax.Array) -> jax.Array:
    """Cache rows as their f32 values: ``i32[..., lanes]`` (a bitcast) or ``u8[..., 4,
    lanes]`` (byte ``b`` of value ``l`` is sub-row ``b``) -> ``f32[..., lanes]``."""
    if rows.dtype.itemsize != _F32_BYTES:
        rows = tokamax_v4.slabs_to_words(rows)
    return jax.lax.bitcast_convert_type(rows, jnp.float32)


def f32_as_rows(values: jax.Array, dtype) -> jax.Array:
    """The inverse of ``rows_as_f32``: ``f32[..., lanes]`` -> rows of ``dtype`` (int32 words or
    ``u8[..., 4, lanes]`` slabs, ``reference.formats.tokamax_v4.words_to_slabs``)."""
    values = jnp.asarray(values, jnp.float32)
    if jnp.dtype(dtype).itemsize == _F32_BYTES:
        return jax.lax.bitcast_convert_type(values, dtype)
    return tokamax_v4.words_to_slabs(jax.lax.bitcast_convert_type(values, jnp.uint32))


def save_states(cache: jax.Array, states: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store each token's state in the paged cache (module docstring, "addressing").

    Args:
      cache: ``u8[P, rows, 4, lanes]`` or ``i32[P, rows, lanes]``; ``rows`` a multiple of
        ``rpt = state_dim / lanes``.
      states: ``f32[N, state_dim]``.
      slot_mapping: ``i32[N]`` first row (flat, ``page * rows + row``) of each token's state;
        negative: not stored.

    Returns:
      ``cache`` (same shape and dtype) with rows ``(slot // rpt) * rpt + [0, rpt)`` of every
      stored token replaced; nothing else changes.
    """
    num_tokens, dim = states.shape
    lanes = cache_lanes(cache)
    rpt = rows_per_token(dim, lanes)
    flat = cache.reshape(-1, *cache.shape[2:])
    total = flat.shape[0] // rpt * rpt
    first = (slot_mapping // rpt) * rpt
    first = jnp.where((slot_mapping >= 0) & (first < total), first, total + rpt)
    rows = (first[:, None] + jnp.arange(rpt, dtype=first.dtype)).reshape(-1)
    values = f32_as_rows(states.reshape(num_tokens * rpt, lanes), cache.dtype)
    return flat.at[rows].set(values, mode="drop").reshape(cache.shape)


def window_slots(state_cache: jax.Array, positions, block_table, token_to_req_indices, *,
                 block_table_stride: int, state_block_size: int, head_dim: int, ratio: int,
                 overlap: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's window of states as ``ref._pool``'s slots: ``(gate, kv)``, both
    ``f32[coff * r, N, head_dim]`` (slot-major; slot ``k`` is position ``p - coff r + 1 + k``,
    half ``k // r`` with overlap; below position 0: gate ``-inf``, kv 0).

    ``state_cache``: ``u8[P, rows, 4, lanes]`` or ``i32[P, rows, lanes]``; ``positions``,
    ``token_to_req_indices i32[N]``; ``block_table i32[R * block_table_stride]``."""
    coff = 1 + int(overlap)
    window, width = coff * ratio, coff * head_dim
    rpt = rows_per_token(2 * width, cache_lanes(state_cache))
    q = positions[:, None] - (window - 1) + jnp.arange(window, dtype=positions.dtype)[None, :]
    valid = q >= 0
    safe = jnp.maximum(q, 0)
    page = block_table[token_to_req_indices[:, None] * block_table_stride
                       + safe // state_block_size]
    row = (safe % state_block_size) * rpt
    rows = row[..., None] + jnp.arange(rpt, dtype=row.dtype)  # [N, W, rpt]
    state = rows_as_f32(state_cache[page[..., None], rows]).reshape(*q.shape, 2 * width)
    kv, gate = state[..., :width], state[..., width:]
    if overlap:  # the older r positions: half 0; the newer r: half 1
        kv = jnp.concatenate([kv[:, :ratio, :head_dim], kv[:, ratio:, head_dim:]], axis=1)
        gate = jnp.concatenate([gate[:, :ratio, :head_dim], gate[:, ratio:, head_dim:]], axis=1)
    gate = jnp.where(valid[..., None], gate, -jnp.inf)
    kv = jnp.where(valid[..., None], kv, 0.0)
    return jnp.swapaxes(gate, 0, 1), jnp.swapaxes(kv, 0, 1)


@functools.partial(jax.jit, static_argnames=("block_table_stride", "state_block_size", "ratio",
                                             "overlap", "eps"))
def paged_entries(state_cache: jax.Array, positions, block_table, token_to_req_indices, store,
                  rms_weight, cos_sin_cache, *, block_table_stride: int, state_block_size: int,
                  ratio: int, overlap: bool, eps: float) -> jax.Array:
    """The compressed entry of each token (module docstring, "the math"): ``f32[N, d]``.

    Args:
      state_cache: the paged state (``window_slots``).
      positions, block_table, token_to_req_indices: as ``window_slots``.
      store: ``bool[N]``, the tokens whose entry is wanted; other rows come back 0.
      rms_weight: ``f32[d]``.
      cos_sin_cache: ``f32[max_pos, rope_dim]``, ``rope_dim / 2`` cos then as many sin per
        position (tokamax's table); RoPE rotates the last ``rope_dim`` dims at ``(p // r) r``
        (a position past the table reads its last row: jnp's clamped gather, as tokamax's).
      block_table_stride, state_block_size, ratio, overlap: static geometry.
      eps: the RMSNorm epsilon.
    """
    d = rms_weight.shape[0]
    gate, kv = window_slots(state_cache, positions, block_table, token_to_req_indices,
                            block_table_stride=block_table_stride,
                            state_block_size=state_block_size, head_dim=d, ratio=ratio,
                            overlap=overlap)
    half = cos_sin_cache.shape[1] // 2
    entry = jnp.where(store, positions // ratio, 0)
    return ref.finish_entries(ref._pool(gate, kv), rms_weight.astype(jnp.float32),
                              cos_sin_cache[:, :half], cos_sin_cache[:, half:2 * half],
                              jnp.zeros_like(entry), entry, store, ratio=ratio,
                              eps=eps).rows
