"""The fp8 index cache as one byte array per page, the scales on lanes in the page's tail
(issue 30): the same values and scales as ``Fp8IndexCache`` (rule 1 of ``reference.quant.fp8``,
``fp8_cache.quantize_index_rows``, either ``scale_fmt``), one array and one DMA per page.

Layout, ``u8[..., P, G, 4, 128]`` with ``G = page_groups(ps) = ps // 4 + ceil(ps / 128)``
(leading dims: stacked layers); a *group* ``[4, 128]`` is 512 bytes, one 32-bit row:

- groups ``[0, ps // 4)``: the keys. Token ``t``'s 128 e4m3 bytes are ``[t // 4, t % 4, :]``:
  ``pages[..., :ps // 4, :, :].reshape(ps, 128)`` is the ``Fp8IndexCache``'s ``keys`` page
  (byte for byte; tokamax's ``head_along_sublane`` order with 128-byte records).
- groups ``[ps // 4, G)``: the f32 scales along lanes. Byte ``i`` (little-endian) of token
  ``t``'s scale bits is ``[ps // 4 + t // 128, i, t % 128]``; lanes past ``ps`` are zero when
  written here and never read.

Why: XLA tiles ``u8[..., G, 4, 128]`` as ``T(4,128)(4,1)`` (one group is one 32-bit
``(1, 128)`` row; ``pallas_kernels.indexer.records`` reads tokamax's ``u8[P, ps // 4, 4, 256]``
the same way), so a page is whole rows and the kernel fetches it with ONE DMA: keys and scales
together (``Fp8IndexCache``: two, the key page and its scale row). Bytes per token:
``512 * G / ps``: 136 at ``ps = 64``, 132 at multiples of 128 (tokamax's ``seq_along_lane``
132 B; its 256-B record twice that). The f32 scales cost ``ceil(ps / 128)`` rows per page: a
dynamic DMA moves whole 512-byte rows (``fp8_cache``: a part of a row at a dynamic lane offset is
refused), so no page-local layout moves fewer than ``128 + 512 / ps`` bytes per token at
``ps < 128``: at 64 these are the ``Fp8IndexCache``'s bytes, in half the DMAs.

Bit-exact: the stored values are ``fp8_cache.quantize_index_rows``' codes and f32 scale bits,
moved as bytes (``from_index_cache`` / ``to_index_cache`` are pure bit moves; NaN payloads and
-0.0 survive), and ``dequantize_index_pages`` is ``dequantize_index_cache``'s product. One-byte
ue8m0 scales would save nothing here (the scale row is 512 B either way) and could not hold
``scale_fmt=None``'s scales (``amax / 448``, any f32) nor an inf scale (e8m0 has no inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.formats import fp8_cache
from reference.quant import fp8

LANES = fp8_cache.LANES
PACK = 4  # bytes per 32-bit word: token rows per group, bytes per f32 scale
GROUP_BYTES = PACK * LANES  # 512: one 32-bit row
KEY_DIM = fp8.INDEX_HEAD_DIM  # 128 e4m3 bytes per token (one group row of lanes)
_U8 = np.dtype(np.uint8)


def scale_groups(page_size: int) -> int:
    """Groups holding one page's f32 scales: ``ceil(page_size / 128)``."""
    return -(-page_size // LANES)


def page_groups(page_size: int) -> int:
    """Groups per page: ``page_size // 4`` of keys plus ``scale_groups(page_size)``."""
    return page_size // PACK + scale_groups(page_size)


def bytes_per_token(page_size: int) -> float:
    """HBM bytes per token, stored and moved: ``512 * page_groups(ps) / ps``."""
    return GROUP_BYTES * page_groups(page_size) / page_size


def check_page_size(page_size: int, name: str = "page_size") -> int:
    """Refuse a page size that is not a positive multiple of 4 (whole key groups)."""
    ps = _checks.positive_int(name, page_size)
    if ps % PACK:
        raise ValueError(f"fp8 index pages need {name} to be a multiple of {PACK} (tokens per "
                         f"key group), got {name}={ps} ({ps} % {PACK} = {ps % PACK})")
    return ps


def page_size_of(groups: int) -> int | None:
    """The page size whose pages have ``groups`` groups, or ``None`` (not every count is one:
    ``page_groups`` skips a value after each multiple of 128)."""
    for k in range(max(1, groups * 32 // 33 - 1), groups + 1):
        if page_groups(PACK * k) == groups:
            return PACK * k
    return None


def check_index_pages(name: str, pages) -> int:
    """Refuse anything but ``u8[..., P, G, 4, 128]`` with ``G`` a ``page_groups`` value (rank
    >= 4), naming the numbers; return the page size."""
    if np.ndim(pages) < 4:
        raise ValueError(f"{name} must be u8[..., P, G, 4, 128] (rank >= 4), got rank "
                         f"{np.ndim(pages)} (shape {tuple(np.shape(pages))})")
    dtype = np.dtype(jnp.result_type(pages))
    if dtype != _U8:
        raise TypeError(f"{name} must be uint8 (the fp8 index pages' bytes), got dtype {dtype}")
    _checks.dim(name, pages, -1, LANES, "lanes per group")
    _checks.dim(name, pages, -2, PACK, "bytes per 32-bit word")
    groups = int(np.shape(pages)[-3])
    ps = page_size_of(groups)
    if ps is None:
        raise ValueError(f"{name}.shape[-3] = {groups} groups is no page's count (page_size // "
                         f"4 + ceil(page_size / 128), e.g. 17 for 64, 33 for 128)")
    return ps


@dataclass(frozen=True)
class IndexPages:
    """fp8 index pages ``u8[..., P, G, 4, 128]`` (module docstring) seen by the indexer ops as
    keys of logical shape ``(..., P, ps, 128)`` (what their shape checks, batch and layer rules
    read). A pytree; ``pallas_kernels.indexer.fp8_pages.PagesCache`` is this class."""

    pages: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, 128)`` of the keys it holds."""
        *lead, groups, _, _ = np.shape(self.pages)
        return (*lead, page_size_of(groups), KEY_DIM)

    @property
    def page_size(self) -> int:
        """Tokens (entries) per page."""
        return self.shape[-2]


jax.tree_util.register_dataclass(IndexPages, data_fields=["pages"], meta_fields=[])


def is_index_pages(cache) -> bool:
    """Whether ``cache`` is meant as fp8 index pages: an ``IndexPages``, or a uint8 array of
    rank >= 4 (no other index cache of the indexer ops is bytes; checked in full by
    ``as_index_pages``)."""
    if isinstance(cache, IndexPages):
        return True
    shape = getattr(cache, "shape", None)
    return (shape is not None and hasattr(cache, "dtype") and len(shape) >= 4
            and np.dtype(cache.dtype) == _U8)


def as_index_pages(cache, name: str = "cache_kv") -> IndexPages:
    """``cache`` (pages ``u8[..., P, G, 4, 128]`` or an ``IndexPages``) as an ``IndexPages``,
    checked by ``check_index_pages`` (ValueError / TypeError naming ``name``)."""
    if isinstance(cache, IndexPages):
        return cache
    check_index_pages(name, cache)
    return IndexPages(jnp.asarray(cache))


# ---------------------------------------------------------------------------------------------
# Bit moves.

def _scale_bytes(scales: jax.Array, page_size: int) -> jax.Array:
    """``f32[..., ps]`` -> ``u8[..., scale_groups, 4, 128]``: byte ``i`` of token ``t``'s scale
    at ``[t // 128, i, t % 128]``, zero lanes past ``ps``."""
    b = lax.bitcast_convert_type(scales, jnp.uint8)  # [..., ps, 4] little-endian
    lanes = scale_groups(page_size) * LANES
    b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, lanes - page_size), (0, 0)])
    b = b.reshape(*b.shape[:-2], scale_groups(page_size), LANES, PACK)
    return jnp.swapaxes(b, -1, -2)


def pages_from_parts(k8, scales) -> jax.Array:
    """``(k8 float8_e4m3fn[..., P, ps, 128], scales f32[..., P, ps])`` -> the pages
    ``u8[..., P, G, 4, 128]`` (module docstring; a pure bit move)."""
    if np.ndim(k8) < 3 or np.dtype(jnp.result_type(k8)) != fp8.FP8_DTYPE:
        raise ValueError(f"k8 must be float8_e4m3fn[..., P, ps, 128], got "
                         f"{jnp.result_type(k8)}{tuple(np.shape(k8))}")
    _checks.dim("k8", k8, -1, KEY_DIM, "the fp8 indexer head dim")
    ps = check_page_size(int(np.shape(k8)[-2]), "k8.shape[-2] (page_size)")
    if np.dtype(jnp.result_type(scales)) != np.dtype(np.float32):
        raise ValueError(f"scales must be float32, got {jnp.result_type(scales)}")
    if tuple(np.shape(scales)) != tuple(np.shape(k8))[:-1]:
        raise ValueError(f"scales must have shape k8.shape[:-1] = {tuple(np.shape(k8))[:-1]}, "
                         f"got {tuple(np.shape(scales))}")
    k8, scales = jnp.asarray(k8), jnp.asarray(scales)
    keys = lax.bitcast_convert_type(k8, jnp.uint8)
    keys = keys.reshape(*keys.shape[:-2], ps // PACK, PACK, KEY_DIM)
    return jnp.concatenate([keys, _scale_bytes(scales, ps)], axis=-3)


def split_index_pages(pages) -> tuple[jax.Array, jax.Array]:
    """The pages' parts: ``(k8 float8_e4m3fn[..., P, ps, 128], scales f32[..., P, ps])``, the
    exact inverse of ``pages_from_parts``."""
    ps = check_index_pages("pages", pages)
    pages = jnp.asarray(pages)
    rows = ps // PACK
    keys = pages[..., :rows, :, :].reshape(*pages.shape[:-3], ps, KEY_DIM)
    sb = jnp.swapaxes(pages[..., rows:, :, :], -1, -2)  # [..., sg, 128, 4]
    sb = sb.reshape(*sb.shape[:-3], scale_groups(ps) * LANES, PACK)[..., :ps, :]
    return (lax.bitcast_convert_type(keys, fp8.FP8_DTYPE),
            lax.bitcast_convert_type(sb, jnp.float32))


def from_index_cache(cache: fp8_cache.Fp8IndexCache) -> jax.Array:
    """An ``Fp8IndexCache`` (``[..., P, ps, 128]``, any leading dims) as pages (bit move)."""
    if not isinstance(cache, fp8_cache.Fp8IndexCache):
        raise TypeError(f"cache must be an Fp8IndexCache, got {type(cache).__name__}")
    return pages_from_parts(cache.keys, cache.scales[..., :cache.page_size])


def to_index_cache(pages) -> fp8_cache.Fp8IndexCache:
    """The pages (``u8[..., P, G, 4, 128]`` or an ``IndexPages``) as an ``Fp8IndexCache`` (bit
    move; scale lanes past ``ps`` zero)."""
    if isinstance(pages, IndexPages):
        pages = pages.pages
    k8, s = split_index_pages(pages)
    ps = k8.shape[-2]
    pad = fp8_cache.scale_lanes(ps) - ps
    return fp8_cache.Fp8IndexCache(k8, jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)]))


def as_keys(cache):
    """What the indexer references score: an ``IndexPages`` as its ``Fp8IndexCache``
    (``to_index_cache``, a bit move), anything else as given."""
    return to_index_cache(cache) if isinstance(cache, IndexPages) else cache


# ---------------------------------------------------------------------------------------------
# The rule.

def quantize_index_pages(keys, *, scale_fmt: str | None = "ue8m0") -> jax.Array:
    """``keys f32|bf16[..., P, ps, 128]`` -> pages ``u8[..., P, G, 4, 128]`` holding
    ``fp8_cache.quantize_index_rows(keys, scale_fmt=...)`` (rule 1, one f32 scale per token;
    ``ps`` a multiple of 4)."""
    if np.ndim(keys) < 3:
        raise ValueError(f"keys must be [..., P, page_size, 128] (rank >= 3), got rank "
                         f"{np.ndim(keys)} (shape {tuple(np.shape(keys))})")
    check_page_size(int(np.shape(keys)[-2]), "keys.shape[-2] (page_size)")
    k8, s = fp8_cache.quantize_index_rows(keys, scale_fmt=scale_fmt)
    return pages_from_parts(k8, s)


def dequantize_index_pages(pages) -> jax.Array:
    """The keys the pages hold, ``f32[..., P, ps, 128]``: ``k8.astype(f32) * scale``, the
    ``Fp8IndexCache``'s product (``fp8_cache.dequantize_index_cache``)."""
    k8, s = split_index_pages(pages)
    return k8.astype(jnp.float32) * s[..., None]


def write_index_pages(pages, page_id, offset, rows, *, scale_fmt: str | None = "ue8m0",
                      layer=None) -> jax.Array:
    """Quantize ``rows f32|bf16[T, 128]`` (rule 1) and store row ``t`` at ``(page_id[t],
    offset[t])`` of ``pages`` (of ``layer`` of a stacked ``[L, P, G, 4, 128]`` when given);
    a ``page_id`` outside ``[0, P)`` or an offset outside ``[0, ps)`` drops the row
    (``fp8_cache.write_index_rows``' rule); nothing else changes."""
    ps = check_index_pages("pages", pages)
    lead = np.ndim(pages) - 4
    if lead != (0 if layer is None else 1):
        raise ValueError(f"pages has rank {np.ndim(pages)}: one layer is [P, G, 4, 128] "
                         f"(layer=None), a stack [L, P, G, 4, 128] needs layer=")
    num_pages = int(np.shape(pages)[-4])
    page_id, offset = jnp.asarray(page_id, jnp.int32), jnp.asarray(offset, jnp.int32)
    ok = (offset >= 0) & (offset < ps) & (page_id >= 0)
    page_id = jnp.where(ok, page_id, num_pages)
    k8, s = fp8_cache.quantize_index_rows(rows, scale_fmt=scale_fmt)
    key_b = lax.bitcast_convert_type(k8, jnp.uint8)  # [T, 128]
    sc_b = lax.bitcast_convert_type(s, jnp.uint8)  # [T, 4]
    pre = () if layer is None else (layer,)
    out = jnp.asarray(pages).at[(*pre, page_id, offset // PACK, offset % PACK)].set(
        key_b, mode="drop")
    b = jnp.arange(PACK)
    at = (*pre, page_id[:, None], ps // PACK + offset[:, None] // LANES, b[None, :],
          offset[:, None] % LANES)
    return out.at[at].set(sc_b, mode="drop")
