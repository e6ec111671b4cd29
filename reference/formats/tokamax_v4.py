"""tokamax 0.0.17's DeepSeek-V4 cache byte layouts, as this package's cache formats (issue 29;
``docs/engines/tokamax.md`` sections 1, 3.2 and 4.2 state the layouts and where they were read).

Every tokamax V4 cache is 32-bit words with 128 lanes, ``i32[P, rows, 128]`` (the same bytes as
its ``u8[P, rows, 4, 128]`` "slab" view: slab ``(b, w)`` is byte ``b`` of word ``w``, little
endian; ``slabs_to_words`` / ``words_to_slabs``).

- ``CsaCache`` (the CSA cache of tokamax's ``sparse_mla`` / ``dsv4_compressor``): ``nope
  i32[P, ps, 128]``, one 512-byte record per entry: feature ``i < 448`` is the e4m3 byte ``i //
  128`` of word ``i % 128``, and the 64 ue8m0 scales are byte 3 of words ``64 .. 127``, scale
  ``j`` applying to every feature ``d`` with ``d % 64 == j`` ("lane-periodic"); ``rope
  i32[P, ps // 4, 128]``, four entries per row, entry ``t``'s words ``32 (t % 4) ..`` holding
  bf16 rope ``k`` (low half) and ``k + 32`` (high half): MODEL1's rope rows
  (``reference.formats.model1``), which differ only in the nope record's scales.
- ``PlaneCache`` (tokamax's ``mla_swa`` window cache and its HCA cache): raw bf16 rows, two
  128-word rows per token: row ``2 k`` word ``w`` holds features ``w`` (low half) and ``128 + w``
  (high half), row ``2 k + 1`` word ``w`` features ``256 + w`` and ``384 + w``. Token ``k`` of a
  page is rows ``2 k, 2 k + 1``; a page holds ``logical_page_size <= rows // 2`` used tokens.
  ``words`` may also be the ``u8[P, rows, 4, 128]`` slab view (tokamax's ``mla_swa`` takes
  either; its HCA compressor writes the u8 one): read and written in place, same bytes.

Word dtypes: ``int32`` (tokamax's declaration) or ``uint32`` (this package's), the same bits;
every function here keeps the dtype it is given.

The CSA quantizer (``quantize_csa``, tokamax ``dsv4_compressor/reference.py``
``quantize_fp8_lane_periodic``): per scale group ``j`` (the 7 nope features ``d < 448`` with ``d
% 64 == j``), in f32, ``s_j = 2**ceil(log2(max(amax_j, 1e-4) / 448))``: the floor is on the
*amax* (``reference.quant.fp8`` rule 1, the official QAT rule; MODEL1 floors the scale), so an
all-zero group gets ``2**-22``. The quotient is a true f32 division and the ceiling is exact
from its bits (``reference.quant.fp8._pow2_ceil``); tokamax takes ``ceil(log2(.))`` in f32,
which can differ only for a quotient within an f32 ulp above a power of two (it then picks
half the scale, and its code for the group's largest value rounds to 448 either way). Codes
``e4m3(x_d / s_j)``, round to nearest even; the rope is cast to bf16 (RNE). Decoding is
``e4m3 * 2**(byte - 127)`` per feature, exact in f32 and bf16 for every byte the quantizer
writes (tokamax multiplies in bf16: the same values).

Slots: ``CsaCache`` entry ``t`` of page ``p`` is flat slot ``p * ps + t``; ``PlaneCache`` token
``k`` of page ``p`` is flat slot ``p * logical_page_size + k`` (flat over leading dims too). A
gather of a slot outside ``[0, num_slots)`` reads nothing (zeros); a write there is dropped.
(tokamax's compressor addresses an HCA record by its first slab row ``s``: page ``s // rows``,
token ``(s % rows) // 2``.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.formats import fp8_cache, model1
from reference.quant import fp8

LANES = model1.LANES  # 128 words per row in every tokamax V4 cache
ROWS_PER_TOKEN = 2  # a PlaneCache token: 2 rows of 128 words = 1024 B = 512 bf16
PLANE_WORDS = ROWS_PER_TOKEN * LANES  # 256 words per PlaneCache token
SLAB_ROWS = 4  # bytes per word: the u8 slab view's sub-rows
SCALE_PERIOD = model1.V4_TILE  # 64: scale j serves the nope features d % 64 == j
ROPE_PER_ROW = model1.ROPE_TOKENS_PER_ROW  # 4 entries per rope row
CSA_WORDS = model1.ROW_WORDS  # 160: a gathered CSA entry (128 nope + 32 rope words)
WORD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))
_U8 = np.dtype(np.uint8)
_U32 = jnp.uint32


@dataclass(frozen=True)
class CsaCache(fp8_cache._Paged):
    """tokamax's CSA cache (module docstring): ``nope i32[..., P, ps, 128]``, ``rope
    i32[..., P, ps // 4, 128]``. A pytree: it passes through ``jax.jit``."""

    nope: jax.Array
    rope: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, 512)`` of the entries it holds."""
        return (*np.shape(self.nope)[:-1], model1.V4_DIM)


@dataclass(frozen=True)
class PlaneCache(fp8_cache._Paged):
    """tokamax's window / HCA cache (module docstring): ``words i32[..., P, rows, 128]`` (or the
    ``u8[..., P, rows, 4, 128]`` slab view), two rows per token, ``logical_page_size`` tokens
    used per page (static: pytree metadata)."""

    words: jax.Array
    logical_page_size: int

    @property
    def is_slab(self) -> bool:
        """Whether ``words`` is the u8 slab view."""
        return np.dtype(self.words.dtype) == _U8

    @property
    def rows(self) -> int:
        """128-word rows per page (``2 * logical_page_size`` or more)."""
        return np.shape(self.words)[-3 if self.is_slab else -2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, logical_page_size, 512)`` of the tokens it holds."""
        lead = np.shape(self.words)[:-3 if self.is_slab else -2]
        return (*lead, self.logical_page_size, model1.V4_DIM)


jax.tree_util.register_dataclass(CsaCache, data_fields=["nope", "rope"], meta_fields=[])
jax.tree_util.register_dataclass(PlaneCache, data_fields=["words"],
                                 meta_fields=["logical_page_size"])


# ---------------------------------------------------------------------------------------------
# Static checks.

def _word_dtype(name: str, x) -> np.dtype:
    dt = np.dtype(jnp.result_type(x))
    if dt not in WORD_DTYPES:
        raise ValueError(f"{name} must have dtype int32 or uint32 (32-bit words), got {dt}")
    return dt


def _word_array(name: str, x, min_rank: int = 3) -> np.dtype:
    dt = _word_dtype(name, x)
    if np.ndim(x) < min_rank or np.shape(x)[-1] != LANES:
        raise ValueError(f"{name} must be [..., num_pages, rows, {LANES}] (rank >= {min_rank}, "
                         f"last dim {LANES}), got shape {tuple(np.shape(x))}")
    return dt


def check_csa_cache(name: str, cache) -> None:
    """Refuse anything but a well-formed ``CsaCache``: TypeError for another type; ValueError
    naming the part and the numbers for a dtype other than int32 / uint32 (both parts the
    same), a last dim other than 128, a page size not a multiple of 4, or a rope array that is
    not ``[..., P, ps // 4, 128]``. Static: shapes and dtypes only."""
    if not isinstance(cache, CsaCache):
        raise TypeError(f"{name} must be a CsaCache, got {type(cache).__name__}")
    dn = _word_array(f"{name}.nope", cache.nope)
    dr = _word_array(f"{name}.rope", cache.rope)
    if dn != dr:
        raise ValueError(f"{name}.nope and {name}.rope must have one dtype, got {dn} and {dr}")
    nope = tuple(np.shape(cache.nope))
    if nope[-2] % ROPE_PER_ROW:
        raise ValueError(f"{name}.nope page size {nope[-2]} must be a multiple of "
                         f"{ROPE_PER_ROW} (four entries per rope row), shape {nope}")
    want = (*nope[:-2], nope[-2] // ROPE_PER_ROW, LANES)
    if tuple(np.shape(cache.rope)) != want:
        raise ValueError(f"{name}.rope must have shape {want} (the pages of {name}.nope {nope}, "
                         f"page_size // 4 = {nope[-2] // ROPE_PER_ROW} rows), got "
                         f"{tuple(np.shape(cache.rope))}")


def check_plane_cache(name: str, cache) -> None:
    """Refuse anything but a well-formed ``PlaneCache``: TypeError for another type; ValueError
    naming the numbers for words that are neither ``i32|u32[..., P, rows, 128]`` nor
    ``u8[..., P, rows, 4, 128]``, or a ``logical_page_size`` outside ``[1, rows // 2]``."""
    if not isinstance(cache, PlaneCache):
        raise TypeError(f"{name} must be a PlaneCache, got {type(cache).__name__}")
    w = cache.words
    if np.dtype(jnp.result_type(w)) == _U8:
        if np.ndim(w) < 4 or tuple(np.shape(w)[-2:]) != (SLAB_ROWS, LANES):
            raise ValueError(f"{name}.words as u8 slabs must be [..., num_pages, rows, "
                             f"{SLAB_ROWS}, {LANES}], got shape {tuple(np.shape(w))}")
    else:
        _word_array(f"{name}.words", w)
    lps = _checks.positive_int(f"{name}.logical_page_size", cache.logical_page_size)
    if lps > cache.rows // ROWS_PER_TOKEN:
        raise ValueError(f"{name}.logical_page_size = {lps} exceeds the {cache.rows} rows // "
                         f"{ROWS_PER_TOKEN} = {cache.rows // ROWS_PER_TOKEN} tokens a page "
                         f"holds")


def _check_rows_in(name: str, x) -> jax.Array:
    x = fp8._float_input(name, x)
    _checks.dim(name, x, -1, model1.V4_DIM, "the V4 row (448 nope + 64 rope)")
    return x


# ---------------------------------------------------------------------------------------------
# Word views.

def _u32(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    return x if x.dtype == _U32 else lax.bitcast_convert_type(x, _U32)


def _as(words: jax.Array, dtype) -> jax.Array:
    """u32 words -> ``dtype`` (int32 / uint32: a bitcast; uint8: the slab view)."""
    dtype = np.dtype(dtype)
    if dtype == _U8:
        return words_to_slabs(words)
    return words if dtype == np.dtype(np.uint32) else lax.bitcast_convert_type(words, dtype)


def slabs_to_words(x) -> jax.Array:
    """``u8[..., 4, n]`` slabs -> ``u32[..., n]``: byte ``b`` of word ``w`` is slab ``(b, w)``."""
    x = jnp.asarray(x).astype(_U32)
    return sum(x[..., b, :] << (8 * b) for b in range(SLAB_ROWS))


def words_to_slabs(w) -> jax.Array:
    """``i32|u32[..., n]`` words -> ``u8[..., 4, n]`` slabs (inverse of ``slabs_to_words``)."""
    w = _u32(w)
    return jnp.stack([((w >> (8 * b)) & 0xFF).astype(jnp.uint8) for b in range(SLAB_ROWS)],
                     axis=-2)


# ---------------------------------------------------------------------------------------------
# The CSA record.

@jax.jit
def _quantize_csa(x: jax.Array):
    x32 = x.astype(jnp.float32)
    lead = x.shape[:-1]
    # [..., 64, 7]: group j holds features j, 64 + j, ..., 384 + j (lane-periodic)
    groups = jnp.swapaxes(x32[..., :model1.V4_NOPE].reshape(
        *lead, model1.V4_TILES, SCALE_PERIOD), -1, -2)
    amax = jnp.maximum(fp8._amax(groups), jnp.float32(fp8.AMAX_FLOOR))
    s = fp8._pow2_ceil(fp8._divide(amax, jnp.float32(fp8.FP8_MAX)))
    codes = jnp.swapaxes(fp8._cast_blocks(groups, s), -1, -2).reshape(*lead, model1.V4_NOPE)
    return codes, s, x32[..., model1.V4_NOPE:].astype(jnp.bfloat16)


def quantize_csa(rows) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokamax's CSA quantizer (module docstring): ``rows f32|bf16[..., 512]`` -> ``(codes
    float8_e4m3fn[..., 448], scales f32[..., 64], rope bf16[..., 64])``; scale ``j`` is the
    power of two of the features ``d % 64 == j``."""
    return _quantize_csa(_check_rows_in("rows", rows))


def _rope_words(rope: jax.Array) -> jax.Array:
    """``bf16[..., 64]`` -> ``u32[..., 32]``: word ``k`` = rope ``k`` | rope ``k + 32`` << 16."""
    bits = lax.bitcast_convert_type(rope, jnp.uint16).astype(_U32)
    return bits[..., :model1.ROPE_WORDS] | (bits[..., model1.ROPE_WORDS:] << 16)


@jax.jit
def _csa_words(rows: jax.Array) -> jax.Array:
    codes, s, rope = _quantize_csa(rows)
    record = jnp.concatenate([lax.bitcast_convert_type(codes, jnp.uint8),
                              model1._scale_bytes(s)], axis=-1)  # 448 codes + 64 scales
    return jnp.concatenate([model1._bytes_to_words(record), _rope_words(rope)], axis=-1)


def encode_csa_records(rows) -> tuple[jax.Array, jax.Array]:
    """``rows f32|bf16[N, 512]`` -> ``(nope i32[N, 128], rope i32[N, 32])``: each row's CSA
    nope record (tokamax's quantizer, module docstring) and its rope quarter's words (what
    ``CsaCache.rope`` holds for it)."""
    words = _csa_words(_check_rows_in("rows", rows))
    words = lax.bitcast_convert_type(words, jnp.int32)
    return words[..., :model1.NOPE_WORDS], words[..., model1.NOPE_WORDS:]


@jax.jit
def _decode_csa(words: jax.Array) -> jax.Array:
    words = _u32(words)
    record = model1._words_to_bytes(words[..., :model1.NOPE_WORDS])
    lead = words.shape[:-1]
    codes = lax.bitcast_convert_type(record[..., :model1.V4_NOPE], fp8.FP8_DTYPE)
    s = lax.bitcast_convert_type(record[..., model1.V4_NOPE:], model1.E8M0_DTYPE)
    nope = (codes.astype(jnp.float32).reshape(*lead, model1.V4_TILES, SCALE_PERIOD)
            * s.astype(jnp.float32)[..., None, :]).reshape(*lead, model1.V4_NOPE)
    rw = words[..., model1.NOPE_WORDS:]
    halves = jnp.concatenate([rw & 0xFFFF, rw >> 16], axis=-1).astype(jnp.uint16)
    rope = lax.bitcast_convert_type(halves, jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([nope, rope], axis=-1)


def decode_csa_words(words) -> jax.Array:
    """A gathered CSA entry ``i32|u32[..., 160]`` (nope record, then its rope words) -> its
    values ``f32[..., 512]`` (exact: ``e4m3 * 2**(byte - 127)``, the rope bf16)."""
    _word_dtype("words", words)
    _checks.dim("words", words, -1, CSA_WORDS, "a gathered CSA entry (128 nope + 32 rope words)")
    return _decode_csa(jnp.asarray(words))


def decode_csa_records(nope, rope) -> jax.Array:
    """``(nope i32|u32[N, 128], rope i32|u32[N, 32])`` (``encode_csa_records``' pair) ->
    ``f32[N, 512]``."""
    return decode_csa_words(jnp.concatenate([_u32(nope), _u32(rope)], axis=-1))


# ---------------------------------------------------------------------------------------------
# The plane (window / HCA) record.

@jax.jit
def _plane_words(rows: jax.Array) -> jax.Array:
    bits = lax.bitcast_convert_type(rows.astype(jnp.bfloat16), jnp.uint16).astype(_U32)
    q = [bits[..., LANES * i:LANES * (i + 1)] for i in range(4)]  # features 128 i .. + 127
    return jnp.stack([q[0] | (q[1] << 16), q[2] | (q[3] << 16)], axis=-2)


def encode_plane_rows(rows) -> jax.Array:
    """``rows f32|bf16[N, 512]`` -> ``i32[N, 2, 128]``: each row rounded to bf16 (RNE; exact for
    bf16 input) in the two-row plane record (module docstring)."""
    return lax.bitcast_convert_type(_plane_words(_check_rows_in("rows", rows)), jnp.int32)


@jax.jit
def _decode_plane(words: jax.Array) -> jax.Array:
    w = _u32(words)
    halves = jnp.concatenate([w[..., 0, :] & 0xFFFF, w[..., 0, :] >> 16,
                              w[..., 1, :] & 0xFFFF, w[..., 1, :] >> 16], axis=-1)
    return lax.bitcast_convert_type(halves.astype(jnp.uint16), jnp.bfloat16).astype(jnp.float32)


def decode_plane_rows(words) -> jax.Array:
    """Plane records ``i32|u32[..., 2, 128]`` (or ``[..., 256]``: the two rows flat) -> the
    values ``f32[..., 512]`` (exact bf16)."""
    w = jnp.asarray(words)
    if np.shape(w)[-1] == PLANE_WORDS:
        w = w.reshape(*w.shape[:-1], ROWS_PER_TOKEN, LANES)
    _word_array("words", w, 2)
    _checks.dim("words", w, -2, ROWS_PER_TOKEN, "rows per plane record")
    return _decode_plane(w)


# ---------------------------------------------------------------------------------------------
# Gathers by slot (what the attention references read) and writers.

def gather_csa_words(cache: CsaCache, slots) -> jax.Array:
    """The stored words of entries ``slots i32[...]`` -> ``[..., 160]`` in the cache's dtype;
    zeros for a slot outside ``[0, num_slots)``. Row gathers only (the rope quarter is picked
    by lanes): ``reference.formats.model1.gather_v4_rows``, whose rope rows are this layout."""
    return model1.gather_v4_rows(cache, slots)


def gather_csa_rows(cache: CsaCache, slots) -> jax.Array:
    """The values of entries ``slots i32[...]`` -> ``f32[..., 512]`` (zeros outside)."""
    check_csa_cache("cache", cache)
    return _decode_csa(gather_csa_words(cache, slots))


def gather_plane_words(cache: PlaneCache, slots) -> jax.Array:
    """The stored words of tokens ``slots i32[...]`` (flat: ``page * logical_page_size + k``)
    -> ``u32[..., 256]`` (rows ``2 k`` then ``2 k + 1`` of the page); zeros for a slot outside
    ``[0, num_slots)``. Two row gathers; a u8 slab cache's gathered rows become words."""
    lps, rows = cache.logical_page_size, cache.rows
    tail = (SLAB_ROWS, LANES) if cache.is_slab else (LANES,)
    flat = cache.words.reshape(-1, *tail)  # every page's rows, in order
    num_slots = flat.shape[0] // rows * lps
    slots = jnp.asarray(slots, jnp.int32)
    ok = (slots >= 0) & (slots < num_slots)
    s = jnp.where(ok, slots, 0)
    row0 = jnp.where(ok, (s // lps) * rows + ROWS_PER_TOKEN * (s % lps), flat.shape[0])
    parts = [jnp.take(flat, row0 + i, axis=0, mode="fill", fill_value=0)
             for i in range(ROWS_PER_TOKEN)]
    parts = [slabs_to_words(p) if cache.is_slab else _u32(p) for p in parts]
    return jnp.concatenate(parts, axis=-1)


def gather_plane_rows(cache: PlaneCache, slots) -> jax.Array:
    """The values of tokens ``slots i32[...]`` -> ``f32[..., 512]`` (zeros outside)."""
    check_plane_cache("cache", cache)
    w = gather_plane_words(cache, slots)
    return _decode_plane(w.reshape(*w.shape[:-1], ROWS_PER_TOKEN, LANES))


def _flat_slots(name: str, slots, pages, page_size: int, rows) -> jax.Array:
    slots = jnp.asarray(slots, jnp.int32)
    if np.ndim(rows) != 2 or np.shape(slots) != np.shape(rows)[:1]:
        raise ValueError(f"{name}: rows must be [N, 512] and slots [N], got rows "
                         f"{tuple(np.shape(rows))} and slots {tuple(np.shape(slots))}")
    if pages is None:
        return slots
    pages = jnp.asarray(pages, jnp.int32)
    if np.shape(pages) != np.shape(slots):
        raise ValueError(f"{name}: pages must have the shape of slots {tuple(np.shape(slots))},"
                         f" got {tuple(np.shape(pages))}")
    ok = (slots >= 0) & (slots < page_size) & (pages >= 0)
    return jnp.where(ok, pages * page_size + slots, -1)


def write_csa_rows(cache: CsaCache, rows, slots, pages=None) -> CsaCache:
    """Quantize ``rows f32|bf16[N, 512]`` (``encode_csa_records``) and store row ``n`` at entry
    ``slots[n]``: a flat slot (``page * ps + t``), or with ``pages i32[N]`` the entry ``t =
    slots[n]`` of page ``pages[n]``. A slot outside the cache drops its row; two rows with one
    slot: which lands is unspecified. Returns the new cache (same dtype)."""
    check_csa_cache("cache", cache)
    rows = _check_rows_in("rows", rows)
    flat = _flat_slots("write_csa_rows", slots, pages, cache.page_size, rows)
    return _write_csa(cache, flat, rows)


@jax.jit
def _write_csa(cache: CsaCache, slots, rows) -> CsaCache:
    words = _csa_words(rows)
    nope = cache.nope.reshape(-1, LANES)
    # Entry s owns rope words [32 (s % 4), +32) of rope row s // 4: scattered into the 128-word
    # rows as they are (a [entries, 32] view has another TPU tiling, a relayout of the cache).
    rope = cache.rope.reshape(-1, LANES)
    quarters = LANES // model1.ROPE_WORDS
    ok = (slots >= 0) & (slots < nope.shape[0])
    at = jnp.where(ok, slots, nope.shape[0])
    nope = nope.at[at].set(_as(words[:, :model1.NOPE_WORDS], nope.dtype), mode="drop")
    lanes = (at % quarters)[:, None] * model1.ROPE_WORDS + jnp.arange(model1.ROPE_WORDS)
    rope = rope.at[(at // quarters)[:, None], lanes].set(
        _as(words[:, model1.NOPE_WORDS:], rope.dtype), mode="drop")
    return CsaCache(nope.reshape(cache.nope.shape), rope.reshape(cache.rope.shape))


def write_plane_rows(cache: PlaneCache, rows, slots, pages=None) -> PlaneCache:
    """Store ``rows f32|bf16[N, 512]`` (as bf16, ``encode_plane_rows``) at tokens ``slots``: a
    flat slot (``page * logical_page_size + k``), or with ``pages i32[N]`` token ``k =
    slots[n]`` of page ``pages[n]``. A slot outside the cache drops its row; two rows with one
    slot: unspecified. Returns the new cache (same dtype and view)."""
    check_plane_cache("cache", cache)
    rows = _check_rows_in("rows", rows)
    flat = _flat_slots("write_plane_rows", slots, pages, cache.logical_page_size, rows)
    return _write_plane(cache, flat, rows)


@jax.jit
def _write_plane(cache: PlaneCache, slots, rows) -> PlaneCache:
    lps, nrows = cache.logical_page_size, cache.rows
    tail = (SLAB_ROWS, LANES) if cache.is_slab else (LANES,)
    flat = cache.words.reshape(-1, *tail)
    num_slots = flat.shape[0] // nrows * lps
    ok = (slots >= 0) & (slots < num_slots)
    s = jnp.where(ok, slots, 0)
    row0 = jnp.where(ok, (s // lps) * nrows + ROWS_PER_TOKEN * (s % lps), flat.shape[0])
    words = _plane_words(rows)  # [N, 2, 128] u32
    for i in range(ROWS_PER_TOKEN):
        flat = flat.at[row0 + i].set(_as(words[:, i], flat.dtype), mode="drop")
    return PlaneCache(flat.reshape(cache.words.shape), lps)


@functools.partial(jax.jit, static_argnames=("num_pages", "page_size", "dtype"))
def empty_csa_cache(num_pages: int, page_size: int, dtype=jnp.int32) -> CsaCache:
    """An all-zero ``CsaCache`` (every value 0): ``nope [P, ps, 128]``, ``rope [P, ps // 4,
    128]``."""
    return CsaCache(jnp.zeros((num_pages, page_size, LANES), dtype),
                    jnp.zeros((num_pages, page_size // ROPE_PER_ROW, LANES), dtype))
