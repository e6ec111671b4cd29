"""tokamax 0.0.17's DeepSeek-V4 compressor ops, ``proj_and_save_state`` and ``dsv4_compressor``,
with tokamax's names, arguments, results and cache bytes (issue 29; ``docs/engines/tokamax.md``
section 5, checked against the wheel's ``dsv4_compressor/{api,base,reference,
csa_cache_layout,arg_specs}.py`` and ``proj_and_save_state/{api,base,reference}.py``).

The math is this package's compressor reference over tokamax's paged per-position state
(``reference.v4_compressor.paged_state``: the gather there, ``reference.v4_compressor.ref``'s
pooling, RMSNorm and RoPE); the records are written by the tokamax record encoders
(``reference.formats.tokamax_v4``: CSA and plane rows; ``reference.formats.tokamax_index``: the
indexer's 256-byte record).

- ``proj_and_save_state``: each token's f32 state ``[kv | score + ape[p % r]]`` from ``hidden @
  wkv_wgate``, stored from row ``slot_mapping[t]`` of the state cache.
- ``dsv4_compressor``: for each boundary token (``(p + 1) % r == 0``) with ``kv_slot_mapping >=
  0``, the entry of its window of states, stored at that slot as a CSA record (+ RoPE row), an
  indexer record or an HCA plane record, by mode (``head_dim``, ``overlap``).

Rounding: every state byte is tokamax's exactly (the same projection and the same bits stored).
An entry's f32 values differ from tokamax's reference in the last bits (this package sums by
fixed trees, tokamax by XLA reductions), so a stored bf16 / e4m3 code can differ by one where
the value lies that close to a rounding boundary (measured rates: ``paged_state``'s docstring).
The CSA and indexer records come from the encoders; the slots are addressed here as tokamax's
reference does (flat rows: an HCA record may start on an odd row, a CSA RoPE quarter is slot
``s`` of the flat ``rope_cache``), which the page-based writers of ``tokamax_v4`` do not take.

``implementation``: ``None`` or ``"xla"`` (the jnp path here); ``"mosaic_tpu"`` / ``"pallas"``
raise ``NotImplementedError`` (an ordered list tries each, then an ``ExceptionGroup``, as
tokamax's dispatch); any other name, and a callable (tokamax also takes one), is a
``ValueError``. Nothing is donated: jit the caller with
the caches donated to update them in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import backend as _backend
from reference.core import checks
from reference.formats import model1, tokamax_index, tokamax_v4
from reference.v4_compressor import paged_state

__all__ = ["dsv4_compressor", "proj_and_save_state"]

IMPLEMENTATIONS = ("xla", "mosaic_tpu", "pallas")
INDEXER_HEAD_DIM = tokamax_index.HEAD_DIM  # 128: the CSA indexer's mode
HEAD_DIM = model1.V4_DIM  # 512: CSA and HCA
ROPE_DIM = model1.V4_ROPE  # 64: cos_sin_cache's width (32 cos, 32 sin)
LANES = model1.LANES  # 128
CSA_QUANT_BLOCK = tokamax_v4.SCALE_PERIOD  # 64: the CSA scales' lane period (its only value)
SLAB = tokamax_v4.SLAB_ROWS  # 4
_WHY_NO_KERNEL = {
    "proj_and_save_state": "this package has no Pallas kernel for the compressor projection "
                           "(a matmul and a row scatter; the XLA path is the implementation)",
    "dsv4_compressor": "this package's Pallas compressor (pallas_kernels.v4_compressor) pools "
                       "from its own per-sequence state ring (dsa_jax.v4_compress_step), not "
                       "tokamax's paged per-position state, and writes no tokamax record",
}


def _dispatch(op: str, implementation, xla_call):
    """Run ``xla_call()`` under tokamax's ``implementation=`` rules (module docstring)."""
    names = _backend.chosen_names(f"tokamax.{op}", IMPLEMENTATIONS, implementation, None)
    names = names or ["xla"]

    def call(name):
        if name == "xla":
            return xla_call()
        raise NotImplementedError(f"tokamax.{op}: implementation {name!r} is not served: "
                                  f"{_WHY_NO_KERNEL[op]}; use implementation='xla'")

    return _backend.first_serving(f"tokamax.{op}", [(n, n) for n in names], call,
                                  group=len(names) > 1)


def _index_vector(where: str, name: str, x, length: int | None = None) -> int:
    """Refuse anything but ``i32[length]`` (tokamax's bind: int32 exactly); return the length."""
    checks.rank(f"{where}: {name}", x, 1)
    dt = np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)
    if dt != np.int32:
        raise TypeError(f"{where}: {name} must be int32, got dtype {dt}")
    if length is not None and np.shape(x)[0] != length:
        raise ValueError(f"{where}: {name} must have shape ({length},) (one per token), got "
                         f"{tuple(np.shape(x))}")
    return int(np.shape(x)[0])


def _state_geometry(where: str, name: str, cache, dim: int) -> tuple[int, int]:
    """``(rows_per_token, tokens_per_page)`` of a state cache ``u8[P, rows, 4, lanes]`` /
    ``i32[P, rows, lanes]`` holding ``f32[dim]`` states (ValueError naming the numbers)."""
    shape = tuple(np.shape(cache))
    dt = jnp.dtype(cache.dtype)
    if not ((dt == jnp.uint8 and len(shape) == 4 and shape[2] == SLAB)
            or (dt == jnp.int32 and len(shape) == 3)):
        raise ValueError(f"{where}: {name} must be uint8 (num_pages, page_size, {SLAB}, lanes) "
                         f"or int32 (num_pages, page_size, lanes), got {dt} {shape}")
    lanes = shape[-1]
    if lanes % LANES or dim % lanes:
        raise ValueError(f"{where}: {name} has {lanes} lanes, which must be a multiple of "
                         f"{LANES} dividing the {dim} f32 values of a token's state")
    rpt = dim // lanes
    if shape[1] % rpt:
        raise ValueError(f"{where}: {name} page_size {shape[1]} must be a multiple of the "
                         f"{rpt} rows a token's state occupies ({dim} f32 / {lanes} lanes)")
    return rpt, shape[1] // rpt


# ------------------------------------------------------------------------ proj_and_save_state

def proj_and_save_state(hidden_states, wkv_wgate, ape, positions, slot_mapping, cache, *,
                        compress_ratio: int, implementation=None) -> jax.Array:
    """tokamax's ``proj_and_save_state``: project each token and store its f32 compressor state.

    Args:
      hidden_states: ``f32|bf16[T, hidden]``.
      wkv_wgate: ``f32|bf16[hidden, 2 * state_width]``: the fused ``wkv`` then ``wgate``
        columns (``state_width = coff * d``: 1024 for CSA, 256 for the indexer, 512 for HCA).
      ape: ``f32|bf16[compress_ratio, state_width]``: the gate's position bias, row ``p % r``.
      positions: ``i32[T]`` token positions.
      slot_mapping: ``i32[T]`` first cache row (``page * page_size + row``) of each token's
        state, meant as a multiple of the rows per token (tokamax's reference stores at ``slot
        // rpt * rpt``, and so does this); negative or past the cache: the token is skipped.
      cache: ``u8[P, page_size, 4, lanes]`` or ``i32[P, page_size, lanes]`` (``lanes`` a
        multiple of 128 dividing ``state_width``; ``page_size`` whole token states).
      compress_ratio: ``r`` (static, >= 1): the rows of ``ape``.
      implementation: module docstring.

    Returns:
      ``cache``'s shape and dtype, each stored token's ``rpt = 2 * state_width / lanes`` rows
      holding its state ``[kv | score + ape[p % r]]`` (f32 value ``l`` = slab bytes ``(0..3,
      l)``, or word ``l``), where ``[kv | score] = hidden @ wkv_wgate`` in jnp's promoted dtype
      (bf16 inputs give a bf16 product and sum, then stored as f32: tokamax's rule).

    Raises:
      ValueError / TypeError naming the argument: bad ranks, dtypes, shapes or geometry.
    """
    where = "tokamax.proj_and_save_state"
    ratio = checks.positive_int("compress_ratio", compress_ratio, where)
    for name, x in (("hidden_states", hidden_states), ("wkv_wgate", wkv_wgate), ("ape", ape)):
        checks.rank(f"{where}: {name}", x, 2)
        checks.floating(f"{where}: {name}", x)
    num_tokens, hidden = np.shape(hidden_states)
    if np.shape(wkv_wgate)[0] != hidden or np.shape(wkv_wgate)[1] % 2:
        raise ValueError(f"{where}: wkv_wgate must be (hidden, 2 * state_width) with hidden = "
                         f"{hidden} (hidden_states.shape[1]), got {tuple(np.shape(wkv_wgate))}")
    width = np.shape(wkv_wgate)[1] // 2
    if tuple(np.shape(ape)) != (ratio, width):
        raise ValueError(f"{where}: ape must have shape (compress_ratio, state_width) = "
                         f"({ratio}, {width}), got {tuple(np.shape(ape))}")
    _index_vector(where, "positions", positions, num_tokens)
    _index_vector(where, "slot_mapping", slot_mapping, num_tokens)
    _state_geometry(where, "cache", cache, 2 * width)
    return _dispatch("proj_and_save_state", implementation, lambda: _proj_and_save(
        hidden_states, wkv_wgate, ape, positions, slot_mapping, cache, ratio=ratio))


@functools.partial(jax.jit, static_argnames=("ratio",))
def _proj_and_save(hidden_states, wkv_wgate, ape, positions, slot_mapping, cache, *, ratio):
    kv_score = jnp.matmul(hidden_states, wkv_wgate)
    width = kv_score.shape[1] // 2
    states = jnp.concatenate([kv_score[:, :width], kv_score[:, width:] + ape[positions % ratio]],
                             axis=-1)
    return paged_state.save_states(cache, states.astype(jnp.float32), slot_mapping)


# ---------------------------------------------------------------------------- dsv4_compressor

def _mode(where: str, cache, rope_cache, head_dim: int, overlap: bool, quant_block) -> str:
    """``"indexer"``, ``"csa"`` or ``"hca"`` from ``head_dim`` and ``overlap`` (tokamax's
    ``base.py`` rules), checking the caches and ``quant_block`` that mode needs."""
    shape, dt = tuple(np.shape(cache)), jnp.dtype(cache.dtype)
    if head_dim == INDEXER_HEAD_DIM:
        if not overlap:
            raise ValueError(f"{where}: the CSA indexer (head_dim={head_dim}) requires "
                             f"overlap=True")
        want = (SLAB, tokamax_index.RECORD_BYTES)
        if dt != jnp.uint8 or len(shape) != 4 or shape[2:] != want:
            raise ValueError(f"{where}: the CSA indexer cache must be uint8 (num_pages, rows, "
                             f"{want[0]}, {want[1]}), got {dt} {shape}")
        tokamax_index.check_quant_block(quant_block)
        return "indexer"
    if head_dim != HEAD_DIM:
        raise ValueError(f"{where}: rms_weight has head_dim {head_dim}; served: "
                         f"{INDEXER_HEAD_DIM} (CSA indexer) or {HEAD_DIM} (CSA / HCA)")
    if not overlap:
        if dt != jnp.uint8 or len(shape) != 4 or shape[2:] != (SLAB, LANES):
            raise ValueError(f"{where}: the HCA cache must be uint8 (num_pages, rows, {SLAB}, "
                             f"{LANES}), got {dt} {shape}")
        return "hca"
    if dt != jnp.int32 or len(shape) != 3 or shape[2] != LANES:
        raise ValueError(f"{where}: the CSA cache must be int32 (num_pages, rows, {LANES}), got "
                         f"{dt} {shape}")
    if rope_cache is None:
        raise ValueError(f"{where}: CSA (overlap=True, head_dim={head_dim}) needs rope_cache")
    want = (shape[0], shape[1] // SLAB, LANES)
    if jnp.dtype(rope_cache.dtype) != jnp.int32 or tuple(np.shape(rope_cache)) != want:
        raise ValueError(f"{where}: rope_cache must be int32 (num_pages, rows // 4, {LANES}) = "
                         f"{want} for cache {shape}, got {jnp.dtype(rope_cache.dtype)} "
                         f"{tuple(np.shape(rope_cache))}")
    if isinstance(quant_block, bool) or quant_block != CSA_QUANT_BLOCK:
        raise ValueError(f"{where}: quant_block must be {CSA_QUANT_BLOCK} for CSA, got "
                         f"quant_block={quant_block!r}")
    return "csa"


def dsv4_compressor(cache, positions, block_table, token_to_req_indices, kv_slot_mapping,
                    rms_weight, *, cos_sin_cache, block_table_stride: int, state_block_size: int,
                    compress_ratio: int, overlap: bool, state_cache=None, rope_cache=None,
                    quant_block: int = CSA_QUANT_BLOCK, rms_eps: float = 1e-6,
                    implementation=None) -> tuple[jax.Array, jax.Array | None]:
    """tokamax's ``dsv4_compressor``: compress each boundary token's window of states into its
    record in the compressed cache.

    Args:
      cache: by mode (``head_dim``, ``overlap``): CSA (512, True) ``i32[P, rows, 128]`` (it
        also hosts the state); CSA indexer (128, True) ``u8[P, rows, 4, 256]`` (also hosts the
        state); HCA (512, False) ``u8[P, rows, 4, 128]``.
      positions: ``i32[N]`` token positions.
      block_table: ``i32[R * block_table_stride]`` state pages of each request.
      token_to_req_indices: ``i32[N]`` each token's request.
      kv_slot_mapping: ``i32[N]`` each token's record slot, ``-1`` to skip: a 512-byte cache
        row (CSA, and the RoPE quarter ``slot`` of ``rope_cache``), a 256-byte record (indexer,
        ``[slot // 4, slot % 4]`` of the flat rows) or the first of two rows (HCA). Only
        boundary tokens (``(p + 1) % r == 0``) are stored; a slot past the cache is dropped
        (an HCA record at the last row keeps its first half, as tokamax's reference).
      rms_weight: ``f32|bf16[head_dim]``, head_dim 512 or 128.
      cos_sin_cache: ``f32[max_pos, 64]``: 32 cos then 32 sin, row ``(p // r) * r``.
      block_table_stride, state_block_size, compress_ratio: static positive ints; the state of
        position ``q`` is token ``q % state_block_size`` of page ``block_table[req * stride + q
        // state_block_size]`` (``reference.v4_compressor.paged_state``).
      overlap: windows of ``2 r`` positions (CSA, indexer) or ``r`` (HCA).
      state_cache: ``u8[SP, rows, 4, 128]``, the state array (HCA), or ``None``: ``cache``
        hosts the state.
      rope_cache: ``i32[P, rows // 4, 128]``, required for CSA, ignored otherwise.
      quant_block: 64 for CSA (its lane period; enforced), a divisor of 128 for the indexer
        (scales per record: ``128 // quant_block``), unused for HCA.
      rms_eps: the RMSNorm epsilon.
      implementation: module docstring.

    Returns:
      ``(cache, rope_cache)`` for CSA, ``(cache, None)`` otherwise; each stored token's record
      replaced, every other byte (the states included) unchanged. Records: CSA
      ``reference.formats.tokamax_v4.encode_csa_records`` (448 e4m3 + 64 lane-periodic ue8m0 and
      the bf16 RoPE words), indexer ``reference.formats.tokamax_index.encode_index_records``
      (128 e4m3 + ue8m0 scales + zero padding to 256 bytes), HCA
      ``reference.formats.tokamax_v4.encode_plane_rows`` (bf16 lo/hi planes, two rows).

    Raises:
      ValueError / TypeError naming the argument: bad ranks, dtypes, shapes, mode or geometry
      (``state_block_size`` past the state page's capacity).
    """
    where = "tokamax.dsv4_compressor"
    num_tokens = _index_vector(where, "positions", positions)
    _index_vector(where, "token_to_req_indices", token_to_req_indices, num_tokens)
    _index_vector(where, "kv_slot_mapping", kv_slot_mapping, num_tokens)
    table_len = _index_vector(where, "block_table", block_table)
    stride = checks.positive_int("block_table_stride", block_table_stride, where)
    if table_len % stride:
        raise ValueError(f"{where}: len(block_table) = {table_len} must be a multiple of "
                         f"block_table_stride = {stride}")
    block = checks.positive_int("state_block_size", state_block_size, where)
    ratio = checks.positive_int("compress_ratio", compress_ratio, where)
    if not isinstance(overlap, (bool, np.bool_)):
        raise TypeError(f"{where}: overlap must be a bool, got {type(overlap).__name__}")
    checks.rank(f"{where}: rms_weight", rms_weight, 1)
    checks.floating(f"{where}: rms_weight", rms_weight)
    checks.rank(f"{where}: cos_sin_cache", cos_sin_cache, 2)
    if jnp.result_type(cos_sin_cache) != jnp.float32 or np.shape(cos_sin_cache)[1] != ROPE_DIM:
        raise ValueError(f"{where}: cos_sin_cache must be f32[max_pos, {ROPE_DIM}], got "
                         f"{jnp.result_type(cos_sin_cache)}{tuple(np.shape(cos_sin_cache))}")
    head_dim = int(np.shape(rms_weight)[0])
    mode = _mode(where, cache, rope_cache, head_dim, bool(overlap), quant_block)
    if state_cache is not None and jnp.dtype(state_cache.dtype) != jnp.uint8:
        raise ValueError(f"{where}: state_cache must be uint8, got {state_cache.dtype}")
    name, state = ("cache", cache) if state_cache is None else ("state_cache", state_cache)
    _, capacity = _state_geometry(where, name, state, paged_state.state_dim(head_dim, overlap))
    if block > capacity:
        raise ValueError(f"{where}: state_block_size {block} exceeds the {capacity} token states "
                         f"a page of {name} {tuple(np.shape(state))} holds")
    return _dispatch("dsv4_compressor", implementation, lambda: _compress_store(
        cache, rope_cache if mode == "csa" else None, state, positions, block_table,
        token_to_req_indices, kv_slot_mapping, rms_weight, cos_sin_cache, stride=stride,
        block=block, ratio=ratio, overlap=bool(overlap), mode=mode, quant_block=int(quant_block),
        eps=float(rms_eps)))


def _dest(store, slot, num: int, offset: int = 0):
    """Flat row ``slot + offset`` where stored and inside ``[0, num)``, else ``num`` (dropped;
    compared before adding, so a huge slot cannot wrap)."""
    return jnp.where(store & (slot < num - offset), slot + offset, num)


@functools.partial(jax.jit, static_argnames=("stride", "block", "ratio", "overlap", "mode",
                                             "quant_block", "eps"))
def _compress_store(cache, rope_cache, state, positions, block_table, token_to_req_indices,
                    kv_slot_mapping, rms_weight, cos_sin_cache, *, stride, block, ratio, overlap,
                    mode, quant_block, eps):
    store = ((positions + 1) % ratio == 0) & (kv_slot_mapping >= 0)
    rows = paged_state.paged_entries(state, positions, block_table, token_to_req_indices, store,
                                     rms_weight, cos_sin_cache, block_table_stride=stride,
                                     state_block_size=block, ratio=ratio, overlap=overlap,
                                     eps=eps)
    slot = kv_slot_mapping
    if mode == "csa":
        nope, rope = tokamax_v4.encode_csa_records(rows)
        flat = cache.reshape(-1, LANES)
        flat = flat.at[_dest(store, slot, flat.shape[0])].set(nope, mode="drop")
        # The rope quarter of slot s: words [32 (s % 4), +32) of rope row s // 4, scattered
        # into the 128-word rows as they are (a [slots, 32] view has another TPU tiling: XLA
        # would relay the whole rope cache out and back).
        rrows = rope_cache.reshape(-1, LANES)
        quarters = LANES // rope.shape[-1]
        dest = _dest(store, slot, rrows.shape[0] * quarters)
        lanes = (dest % quarters)[:, None] * rope.shape[-1] + jnp.arange(rope.shape[-1])
        rrows = rrows.at[(dest // quarters)[:, None], lanes].set(rope, mode="drop")
        return flat.reshape(cache.shape), rrows.reshape(rope_cache.shape)
    if mode == "indexer":
        records = tokamax_index.encode_index_records(rows, quant_block=quant_block)
        return tokamax_index.write_index_records(cache, jnp.where(store, slot, -1), records), None
    planes = tokamax_v4.words_to_slabs(tokamax_v4.encode_plane_rows(rows))  # u8[N, 2, 4, 128]
    flat = cache.reshape(-1, *cache.shape[2:])
    num, per = flat.shape[0], planes.shape[1]
    dest = jnp.stack([_dest(store, slot, num, o) for o in range(per)], axis=1).reshape(-1)
    flat = flat.at[dest].set(planes.reshape(-1, *planes.shape[2:]), mode="drop")
    return flat.reshape(cache.shape), None
