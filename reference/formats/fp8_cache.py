"""The fp8 paged caches as TPU stores them: two small pytrees, their whole-cache (de)quantizers,
the rows a cache writer stores, and byte-exact interop with the GPU layouts.

The values are ``reference.quant.fp8``'s rules (rule 1: indexer keys, one f32 scale per token; rule
2: the latent cache, four power-of-two scales per token, rope kept in bf16). This module only says
where the bytes live on TPU. Every op takes these objects where it takes a cache array today.

``Fp8IndexCache(keys, scales)``, the indexer's key cache:

- ``keys: float8_e4m3fn[P, page_size, 128]``: the e4m3 key bytes, one row per token.
- ``scales: f32[P, scale_lanes(page_size)]``: token ``r`` of page ``p`` has scale ``scales[p, r]``.
  Lanes ``>= page_size`` are padding (zeros when written here; never read).
- Why this layout:
  - The keys use XLA TPU's default layout for an 8-bit array, tiles of (32, 128)
    (measured: ``f8e4m3fn[8192,64,128]{2,1,0:T(32,128)(4,1)}``). So a page is whole tiles, and
    one DMA per page, as the bf16 cache uses, compiles, only if ``page_size % 32 == 0``
    (``INDEX_PAGE_MULTIPLE``; other page sizes are refused).
  - The scales sit on lanes because the kernel scales a ``[rows, tokens]`` score block whose
    tokens are lanes: one page's scales are one row, moved by one DMA.
  - The row is padded to whole 128 lanes because XLA lays out ``f32[8192, 64]`` transposed
    (measured: ``{0,1:T(8,128)}``). A kernel operand with that layout would cost a transpose
    copy of every scale on every call.
  - Cost: ``128 + 4 * scale_lanes(ps) / ps`` bytes per token: 132 B at page sizes that are
    multiples of 128, 136 B at 64, 144 B at 32 (GPU layout: 132 B).

``Fp8LatentCache(words)``, the MLA latent cache: ``words: u32[P, page_size, 256]``, 1024 bytes
per token:

- words ``[0, 128)``: byte ``j`` (bits ``8j..8j+7``) of word ``w`` is the e4m3 code of nope
  feature ``128 j + w``. Byte plane ``j`` is therefore scale tile ``j``, on lanes.
- words ``[128, 160)``: the rope, two bf16 values per word, paired as
  ``reference.formats.packed_cache`` pairs them. The low half of word ``128 + i`` is rope ``i`` and
  the high half is rope ``32 + i``.
- words ``[160, 164)``: the f32 bits of the 4 tile scales.
- words ``[164, 256)``: zero.
- Why 32-bit words in whole 128-lane rows (all measured through libtpu's AOT compile on v5e,
  v6e and tpu7x; see ``scripts/probes/fp8_layout_probe.py``):
  - The token-sparse kernel DMAs single token rows. A single row of an 8-bit or 16-bit array
    is part of a tile, and Mosaic refuses such a DMA (``reference.formats.packed_cache``).
  - A DMA of part of a 32-bit row at a dynamic lane offset is refused as well ("dynamic offset
    times the element size is a multiple of the word size (4096 bits)" on v5e/tpu7x, "Source
    and target leading tiles have different trailing dimensions" on v6e). So the 164 words
    FlashMLA's 656 bytes need cannot be split into a 512-byte row plus a part of a shared row.
    The next whole-row size is 2 x 128 words = 1024 B.
  - Cost: 1.56x FlashMLA's 656 B, 0.67x the packed bf16 cache's 1536 B.
- Decoding in VMEM: plane ``j`` is ``(w >> 8j) & 0xFF`` bitcast to e4m3, upcast, times scale
  ``j``. Every e4m3 value times a power-of-two scale is exact in bf16, so the MXU sees exactly
  the dequantized values.

Interop: ``latent_cache_to_flashmla`` / ``latent_cache_from_flashmla`` (FlashMLA V32_FP8Sparse,
656 B per token) and ``index_cache_to_paged_fp8`` / ``index_cache_from_paged_fp8`` (vLLM /
DeepGEMM, ``page_size * 132`` B per page). These are pure bit moves, so round trips are
bit-exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.quant import fp8

LANES = 128
INDEX_PAGE_MULTIPLE = 32  # rows of one (32, 128) e4m3 tile: a page must be whole tiles
LATENT_WORDS = 256  # u32 words per latent token: 2 whole 128-lane rows
NOPE_WORDS = fp8.LATENT_NOPE // 4  # 128: four e4m3 codes per word, one per scale tile
ROPE_WORD0 = NOPE_WORDS  # 128
ROPE_PAIRS = fp8.LATENT_ROPE // 2  # 32 words, (rope i, rope 32 + i)
SCALE_WORD0 = ROPE_WORD0 + ROPE_PAIRS  # 160
LATENT_TOKEN_BYTES = 4 * LATENT_WORDS  # 1024


def scale_lanes(page_size: int) -> int:
    """Lanes of one page's scale row: ``page_size`` rounded up to a multiple of 128."""
    return -(-page_size // LANES) * LANES


def index_bytes_per_token(page_size: int) -> float:
    """HBM bytes the fp8 index cache spends per token (keys plus the padded scale row)."""
    return fp8.INDEX_HEAD_DIM + 4 * scale_lanes(page_size) / page_size


class _Paged:
    """``num_pages`` and ``page_size`` from a cache's logical ``shape`` (``[..., P, ps, D]``)."""

    @property
    def num_pages(self) -> int:
        return self.shape[-3]

    @property
    def page_size(self) -> int:
        return self.shape[-2]


@dataclass(frozen=True)
class Fp8IndexCache(_Paged):
    """The fp8 indexer key cache (module docstring): ``keys float8_e4m3fn[P, ps, 128]``,
    ``scales f32[P, scale_lanes(ps)]``. A pytree: it passes through ``jax.jit``."""

    keys: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(num_pages, page_size, 128)`` of the keys it holds (with any leading
        layer dims of a stacked cache)."""
        return tuple(np.shape(self.keys))


@dataclass(frozen=True)
class Fp8LatentCache(_Paged):
    """The fp8 latent cache (module docstring): ``words u32[P, ps, 256]``. A pytree."""

    words: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(num_pages, page_size, 576)`` of the latent rows it holds (with any
        leading layer dims of a stacked cache)."""
        return (*np.shape(self.words)[:-1], fp8.LATENT_DIM)


jax.tree_util.register_dataclass(Fp8IndexCache, data_fields=["keys", "scales"], meta_fields=[])
jax.tree_util.register_dataclass(Fp8LatentCache, data_fields=["words"], meta_fields=[])


# ---------------------------------------------------------------------------------------------
# Static checks.

def _dtype(x) -> np.dtype:
    return np.dtype(jnp.result_type(x))


def check_index_page_size(page_size: int, name: str = "page_size") -> None:
    """Refuse a page size the fp8 index format cannot tile (module docstring)."""
    if page_size % INDEX_PAGE_MULTIPLE:
        raise ValueError(
            f"the fp8 index cache needs {name} to be a multiple of {INDEX_PAGE_MULTIPLE} (one "
            f"e4m3 tile is ({INDEX_PAGE_MULTIPLE}, 128) rows x lanes, and a page must be whole "
            f"tiles), got {name}={page_size} ({page_size} % {INDEX_PAGE_MULTIPLE} = "
            f"{page_size % INDEX_PAGE_MULTIPLE})")


def check_index_cache(name: str, cache) -> None:
    """Refuse an ``Fp8IndexCache`` whose parts do not match the format, naming the numbers."""
    if not isinstance(cache, Fp8IndexCache):
        raise TypeError(f"{name} must be an Fp8IndexCache, got {type(cache).__name__}")
    keys, scales = cache.keys, cache.scales
    _checks.rank(f"{name}.keys", keys, 3)
    if _dtype(keys) != fp8.FP8_DTYPE:
        raise ValueError(f"{name}.keys must have dtype {fp8.FP8_DTYPE}, got {_dtype(keys)}")
    _checks.dim(f"{name}.keys", keys, 2, fp8.INDEX_HEAD_DIM, "the fp8 indexer head dim")
    pages, page_size, _ = np.shape(keys)
    check_index_page_size(page_size, f"{name}.keys.shape[1] (page_size)")
    if _dtype(scales) != np.dtype(np.float32):
        raise ValueError(f"{name}.scales must have dtype float32, got {_dtype(scales)}")
    want = (pages, scale_lanes(page_size))
    if tuple(np.shape(scales)) != want:
        raise ValueError(f"{name}.scales must have shape (num_pages, scale_lanes(page_size)) = "
                         f"{want} for keys of shape {tuple(np.shape(keys))}, got "
                         f"{tuple(np.shape(scales))}")


def refuse_other_kind(name: str, cache, *, wanted: str) -> None:
    """TypeError naming ``name`` when ``cache`` is the *other* fp8 cache: ``wanted="latent"``
    (sparse MLA) refuses an ``Fp8IndexCache``, ``wanted="index"`` (the indexer) an
    ``Fp8LatentCache``. The one wording of that refusal for every entry."""
    if wanted == "latent" and isinstance(cache, Fp8IndexCache):
        raise TypeError(f"{name} is an Fp8IndexCache (the indexer's keys); sparse MLA takes the "
                        "latent cache: an array or an Fp8LatentCache")
    if wanted == "index" and isinstance(cache, Fp8LatentCache):
        raise TypeError(f"{name} is an Fp8LatentCache (the MLA latent cache); the indexer takes "
                        "its key cache: an f32/bf16 array or an Fp8IndexCache")


def check_latent_cache(name: str, cache) -> None:
    """Refuse an ``Fp8LatentCache`` whose words do not match the format."""
    if not isinstance(cache, Fp8LatentCache):
        raise TypeError(f"{name} must be an Fp8LatentCache, got {type(cache).__name__}")
    _checks.rank(f"{name}.words", cache.words, 3)
    if _dtype(cache.words) != np.dtype(np.uint32):
        raise ValueError(f"{name}.words must have dtype uint32, got {_dtype(cache.words)}")
    _checks.dim(f"{name}.words", cache.words, 2, LATENT_WORDS,
                "the fp8 latent token words (LATENT_WORDS)")


# ---------------------------------------------------------------------------------------------
# Index cache.

def quantize_index_rows(x, *, scale_fmt: str | None = "ue8m0") -> tuple[jax.Array, jax.Array]:
    """``x: f32|bf16[..., 128]`` -> ``(k8 float8_e4m3fn[..., 128], scale f32[...])`` (rule 1
    with one block per token)."""
    _checks.dim("x", x, -1, fp8.INDEX_HEAD_DIM, "the fp8 indexer head dim")
    k8, s = fp8.quantize_fp8(x, block_size=fp8.INDEX_HEAD_DIM, scale_fmt=scale_fmt)
    return k8, s[..., 0]


def _check_paged(name: str, x) -> None:
    """Refuse values that are not ``[..., P, page_size, D]`` (leading dims: stacked layers)."""
    if np.ndim(x) < 3:
        raise ValueError(f"{name} must be [..., num_pages, page_size, D] (rank >= 3), got "
                         f"rank {np.ndim(x)} (shape {tuple(np.shape(x))})")


def quantize_index_cache(keys, *, scale_fmt: str | None = "ue8m0") -> Fp8IndexCache:
    """``keys: f32|bf16[..., P, page_size, 128]`` -> the ``Fp8IndexCache`` holding rule 1 of
    each token (``page_size`` a multiple of 32; leading dims, e.g. stacked layers, kept)."""
    _check_paged("keys", keys)
    check_index_page_size(np.shape(keys)[-2], "keys.shape[-2] (page_size)")
    k8, s = quantize_index_rows(keys, scale_fmt=scale_fmt)
    pad = scale_lanes(s.shape[-1]) - s.shape[-1]
    return Fp8IndexCache(k8, jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)]))


def dequantize_index_cache(cache: Fp8IndexCache) -> jax.Array:
    """The values an ``Fp8IndexCache`` holds: ``f32[P, page_size, 128]`` (``k8 * scale``)."""
    check_index_cache("cache", cache)
    return _dequantize_index(cache.keys, cache.scales)


@jax.jit
def _dequantize_index(keys, scales):
    return keys.astype(jnp.float32) * scales[:, :keys.shape[1], None]


def _drop_outside(cache, page_id, offset):
    """``page_id`` with ``num_pages`` (drop) wherever ``offset`` is outside ``[0, page_size)``
    or ``page_id`` is negative: an offset past the page must not land in the scale row's
    padding lanes, and a negative id must not wrap around to the last page."""
    ok = (offset >= 0) & (offset < cache.page_size) & (page_id >= 0)
    return jnp.where(ok, page_id, cache.num_pages)


def write_index_rows(cache: Fp8IndexCache, page_id, offset, rows, *,
                     scale_fmt: str | None = "ue8m0", layer=None) -> Fp8IndexCache:
    """Quantize ``rows f[T, 128]`` and store row ``t`` at ``(page_id[t], offset[t])`` (of
    ``layer`` of a stacked ``[L, P, ...]`` cache when given); a ``page_id`` outside ``[0,
    num_pages)`` or an offset outside ``[0, page_size)`` drops the row (``mode="drop"``),
    nothing else changes."""
    page_id = _drop_outside(cache, page_id, offset)
    at = (page_id, offset) if layer is None else (layer, page_id, offset)
    k8, s = quantize_index_rows(rows, scale_fmt=scale_fmt)
    return Fp8IndexCache(cache.keys.at[at].set(k8, mode="drop"),
                         cache.scales.at[at].set(s, mode="drop"))


def gather_index_pages(cache: Fp8IndexCache, page_ids) -> tuple[jax.Array, jax.Array]:
    """``(k8 float8_e4m3fn[n * ps, 128], scale f32[n * ps])`` of pages ``page_ids i32[n]``,
    zeros (no read) for ids ``== num_pages`` (``reference.core.batch.gather_pages``' rule)."""
    ps = cache.page_size
    keys = jnp.take(cache.keys, page_ids, axis=0, mode="fill", fill_value=0)
    scales = jnp.take(cache.scales[:, :ps], page_ids, axis=0, mode="fill", fill_value=0)
    return keys.reshape(-1, fp8.INDEX_HEAD_DIM), scales.reshape(-1)


def index_cache_to_paged_fp8(cache: Fp8IndexCache) -> jax.Array:
    """``u8[P, page_size * 132]``, the vLLM / DeepGEMM page layout (``reference.quant.fp8``)."""
    check_index_cache("cache", cache)
    ps = cache.page_size
    return fp8.index_to_paged_fp8_bytes(cache.keys, cache.scales[:, :ps, None])


def index_cache_from_paged_fp8(b, *, page_size: int | None = None) -> Fp8IndexCache:
    """The exact inverse of ``index_cache_to_paged_fp8``; ``page_size`` defaults to
    ``b.shape[1] // 132``."""
    if page_size is None:
        _checks.rank("b", b, 2)
        width = np.shape(b)[1]
        if width % fp8.INDEX_TOKEN_BYTES or width == 0:
            raise ValueError(f"b.shape[1] = {width} is not a multiple of "
                             f"{fp8.INDEX_TOKEN_BYTES} bytes per token ({fp8.INDEX_HEAD_DIM} fp8 "
                             "+ 4 scale) holding at least one token")
        page_size = width // fp8.INDEX_TOKEN_BYTES
    check_index_page_size(page_size)
    k8, s = fp8.index_from_paged_fp8_bytes(b, page_size=page_size)
    pad = scale_lanes(page_size) - page_size
    return Fp8IndexCache(k8, jnp.pad(s[..., 0], ((0, 0), (0, pad))))


# ---------------------------------------------------------------------------------------------
# Latent cache.

def _u32(x) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


@jax.jit
def parts_to_words(nope8, scales, rope) -> jax.Array:
    """``(nope8 e4m3[..., 512], scales f32[..., 4], rope bf16[..., 64])`` -> ``u32[..., 256]``
    (module docstring's word layout)."""
    lead = nope8.shape[:-1]
    codes = lax.bitcast_convert_type(nope8, jnp.uint8).astype(jnp.uint32)
    codes = codes.reshape(*lead, fp8.LATENT_TILES, NOPE_WORDS)  # [.., j, w]: feature 128 j + w
    nope = sum(codes[..., j, :] << (8 * j) for j in range(fp8.LATENT_TILES))
    bits = lax.bitcast_convert_type(rope, jnp.uint16).astype(jnp.uint32)
    rope_words = bits[..., :ROPE_PAIRS] | (bits[..., ROPE_PAIRS:] << 16)
    pad = jnp.zeros((*lead, LATENT_WORDS - SCALE_WORD0 - fp8.LATENT_TILES), jnp.uint32)
    return jnp.concatenate([nope, rope_words, _u32(scales), pad], axis=-1)


@jax.jit
def words_to_parts(words) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The exact inverse of ``parts_to_words`` (the zero words are ignored)."""
    lead = words.shape[:-1]
    nope = words[..., :NOPE_WORDS]
    codes = jnp.stack([(nope >> (8 * j)) & 0xFF for j in range(fp8.LATENT_TILES)], axis=-2)
    nope8 = lax.bitcast_convert_type(codes.astype(jnp.uint8), fp8.FP8_DTYPE)
    rw = words[..., ROPE_WORD0:SCALE_WORD0]
    halves = jnp.concatenate([rw & 0xFFFF, rw >> 16], axis=-1).astype(jnp.uint16)
    rope = lax.bitcast_convert_type(halves, jnp.bfloat16)
    scales = lax.bitcast_convert_type(words[..., SCALE_WORD0:SCALE_WORD0 + fp8.LATENT_TILES],
                                      jnp.float32)
    return nope8.reshape(*lead, fp8.LATENT_NOPE), scales, rope


def quantize_latent_rows(x) -> jax.Array:
    """``x: f32|bf16[..., 576]`` -> ``u32[..., 256]``: rule 2, stored as the module's words."""
    return parts_to_words(*fp8.quantize_latent_fp8(x))


@jax.jit
def dequantize_latent_words(words) -> jax.Array:
    """``u32[..., 256]`` -> ``f32[..., 576]``, the values the words hold (each exact in bf16)."""
    return fp8._dequantize_latent(*words_to_parts(words))


def quantize_latent_cache(latent) -> Fp8LatentCache:
    """``latent: f32|bf16[..., P, page_size, 576]`` -> the ``Fp8LatentCache`` holding rule 2 of
    each token (leading dims kept)."""
    _check_paged("latent", latent)
    return Fp8LatentCache(quantize_latent_rows(latent))


def dequantize_latent_cache(cache: Fp8LatentCache) -> jax.Array:
    """The values an ``Fp8LatentCache`` holds: ``f32[P, page_size, 576]``."""
    check_latent_cache("cache", cache)
    return dequantize_latent_words(cache.words)


def write_latent_rows(cache: Fp8LatentCache, page_id, offset, rows, *,
                      layer=None) -> Fp8LatentCache:
    """Quantize ``rows f[T, 576]`` and store row ``t`` at ``(page_id[t], offset[t])``
    (``layer`` and ``mode="drop"`` as ``write_index_rows``)."""
    page_id = _drop_outside(cache, page_id, offset)
    at = (page_id, offset) if layer is None else (layer, page_id, offset)
    return Fp8LatentCache(cache.words.at[at].set(quantize_latent_rows(rows), mode="drop"))


def take_layer(cache, layer):
    """Layer ``layer`` of a stacked cache: an array's ``cache[layer]``, or each part's for an
    fp8 cache."""
    return jax.tree_util.tree_map(lambda x: x[layer], cache)


def latent_cache_to_flashmla(cache: Fp8LatentCache) -> jax.Array:
    """``u8[P, page_size, 656]``, FlashMLA's V32_FP8Sparse token bytes (``reference.quant.fp8``)."""
    check_latent_cache("cache", cache)
    return fp8.latent_to_flashmla_bytes(*words_to_parts(cache.words))


def latent_cache_from_flashmla(b) -> Fp8LatentCache:
    """The exact inverse of ``latent_cache_to_flashmla``: ``u8[P, page_size, 656]`` ->
    ``Fp8LatentCache``."""
    _checks.rank("b", b, 3)
    return Fp8LatentCache(parts_to_words(*fp8.latent_from_flashmla_bytes(b)))


@functools.partial(jax.jit, static_argnames=("num_pages", "page_size"))
def empty_latent_cache(num_pages: int, page_size: int) -> Fp8LatentCache:
    """An all-zero ``Fp8LatentCache`` (every value 0)."""
    return Fp8LatentCache(jnp.zeros((num_pages, page_size, LATENT_WORDS), jnp.uint32))


def empty_index_cache(num_pages: int, page_size: int) -> Fp8IndexCache:
    """An all-zero ``Fp8IndexCache`` (``page_size`` a multiple of 32)."""
    check_index_page_size(page_size)
    return Fp8IndexCache(jnp.zeros((num_pages, page_size, fp8.INDEX_HEAD_DIM), fp8.FP8_DTYPE),
                         jnp.zeros((num_pages, scale_lanes(page_size)), jnp.float32))
