"""Caches the indexer kernel reads as their stored bytes and decodes in VMEM, one DMA per page:
tokamax's 256-byte records (``records``), the fp8 index pages (``fp8_pages``) and V4.1's fp4
index pages (``v41_pages``). The kernel asks this module for a format's page buffer, HBM
operand, stage decode and the axis its decoded keys hold the features on (``kernel``)."""

from __future__ import annotations

import jax

from pallas_kernels.indexer import fp8_pages, records, v41_pages
from reference.formats import fp8_cache
from reference.formats import tokamax_index as ti

FORMATS = (records.RECORD_FORMAT, fp8_pages.PAGES_FORMAT, v41_pages.V41_FORMAT)


def cache_format(cache_kv) -> str | None:
    """The stored format of ``cache_kv`` (one of ``FORMATS``), ``None`` for keys read as an
    array or an ``Fp8IndexCache`` pair."""
    if isinstance(cache_kv, records.RecordCache):
        return records.RECORD_FORMAT
    if isinstance(cache_kv, fp8_pages.PagesCache):
        return fp8_pages.PAGES_FORMAT
    if isinstance(cache_kv, v41_pages.PagesCache):
        return v41_pages.V41_FORMAT
    return None


def page_shape(fmt: str | None, page_size: int, dim: int) -> tuple[int, ...]:
    """One page in VMEM, as stored: ``u8[ps // 4, 4, 256]`` records, ``u8[G, 4, 128]`` pages
    (fp8 or V4.1), ``[ps, dim]`` keys (``fmt=None``)."""
    if fmt is None:
        return (page_size, dim)
    if fmt == v41_pages.V41_FORMAT:
        return v41_pages.page_shape(page_size, dim)
    if fmt == records.RECORD_FORMAT:
        return (page_size // ti.KV_PACKING, ti.KV_PACKING, ti.RECORD_BYTES)
    return fp8_pages.page_shape(page_size)


def array(fmt: str | None, cache_kv) -> jax.Array:
    """The array the kernel reads in place: the stored ``u8`` bytes, ``cache_kv`` itself for
    ``fmt=None``."""
    if fmt is None:
        return cache_kv
    return cache_kv.records if fmt == records.RECORD_FORMAT else cache_kv.pages  # fp8 or V4.1


def decode_stage(fmt: str, keys: jax.Array, page_size: int, compute_dtype,
                 dim: int) -> tuple[jax.Array, jax.Array | None]:
    """A stage's pages as stored -> ``(codes compute_dtype[P * ps, 128], scale row f32[1, P *
    ps])``; V4.1 pages: ``(keys compute_dtype[dim, P * ps], None)`` (``feature_axis`` 0, the
    values already scaled)."""
    if fmt == v41_pages.V41_FORMAT:
        return v41_pages.decode_stage(keys, page_size, dim, compute_dtype), None
    if fmt == records.RECORD_FORMAT:
        return records.decode_stage(keys, compute_dtype)
    return fp8_pages.decode_stage(keys, page_size, compute_dtype)


def feature_axis(fmt: str | None) -> int:
    """The axis of the decoded key tile that holds the features: 1 (``[nb, D]``, entries on
    sublanes), 0 for V4.1 pages (``[D, nb]``, entries on lanes)."""
    return 0 if fmt == v41_pages.V41_FORMAT else 1


def key_bytes(fmt: str, page_size: int, dim: int) -> tuple[int, int]:
    """``(bytes per key, scale lanes per page)`` a page moves, the split the VMEM estimate and
    cost estimate take: a record is 256 bytes with its scale inside; a page of fp8 index pages is
    ``ps`` 128-byte keys plus its scale rows (``fp8_cache.scale_lanes(ps)`` f32 lanes); V4.1
    pages ``v41_pages.key_bytes``."""
    if fmt == v41_pages.V41_FORMAT:
        return v41_pages.key_bytes(page_size, dim)
    if fmt == records.RECORD_FORMAT:
        return ti.RECORD_BYTES, 0
    return ti.HEAD_DIM, fp8_cache.scale_lanes(page_size)
