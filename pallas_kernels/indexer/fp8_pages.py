"""The fp8 index pages (``reference.formats.fp8_index_pages``) as a cache format of the Pallas
indexer (issue 30): the ``Fp8IndexCache``'s values and f32 scales, keys and scales of a page in
one ``u8[G, 4, 128]`` array, read with ONE DMA per page (the ``Fp8IndexCache``: two).

Format ``PAGES_FORMAT`` (``"fp8_index_pages"``): ``u8[P, G, 4, 128]`` (stacked: ``u8[L, P, G,
4, 128]``), ``G = ps // 4 + ceil(ps / 128)``: groups ``[0, ps // 4)`` the e4m3 keys (token ``t``
at ``[t // 4, t % 4, :]``), then the f32 scale bits along lanes (byte ``i`` of token ``t``'s
scale at ``[ps // 4 + t // 128, i, t % 128]``).

The kernel reads the cache as stored (``PagesCache`` wraps the array so the shared glue sees the
logical ``(P, ps, 128)``): one DMA per page of ``512 * G`` bytes into ``u8[G, 4, 128]`` VMEM,
the array's own tiling (``T(4,128)(4,1)``, as ``records``). Each stage then decodes its pages in
VMEM (``decode_stage``): the key groups are the e4m3 codes (a reshape and a same-width bitcast,
upcast as the ``Fp8IndexCache`` path upcasts them, ``kernel.compute_dtypes``); each scale's four
bytes are joined by integer shifts into its f32 bits (exact: no float op), already along lanes.
The stage multiplies its head-summed scores by that row, as the ``Fp8IndexCache`` path
multiplies by its scale rows: same operands, same order, so the same f32 scores bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from reference.formats import fp8_cache
from reference.formats import fp8_index_pages as fip
from reference.quant import fp8

PAGES_FORMAT = "fp8_index_pages"
_BYTE_BITS = 8


PagesCache = fip.IndexPages  # the pages seen as keys (..., P, ps, 128): declared in reference


def wrap(cache) -> PagesCache:
    """``u8[P, G, 4, 128]`` (or stacked ``[L, P, G, 4, 128]``) pages as a ``PagesCache``
    (checked by ``reference.formats.fp8_index_pages.check_index_pages``: ValueError/TypeError
    naming it); a ``PagesCache`` is returned as is."""
    return fip.as_index_pages(cache, "cache_kv")


def stand_in(cache: PagesCache) -> fp8_cache.Fp8IndexCache:
    """A shape-only ``Fp8IndexCache`` of the keys ``cache`` holds (``[..., P, ps, 128]`` e4m3,
    ``[..., P, scale_lanes(ps)]`` f32): what the ``Fp8IndexCache`` checks and dtype rules read."""
    *lead, ps, dim = cache.shape
    return fp8_cache.Fp8IndexCache(
        jax.ShapeDtypeStruct((*lead, ps, dim), fp8.FP8_DTYPE),
        jax.ShapeDtypeStruct((*lead, fp8_cache.scale_lanes(ps)), jnp.float32))


def page_shape(page_size: int) -> tuple[int, int, int]:
    """One page in VMEM: ``(G, 4, 128)`` bytes."""
    return (fip.page_groups(page_size), fip.PACK, fip.LANES)


def decode_stage(keys: jax.Array, page_size: int,
                 compute_dtype) -> tuple[jax.Array, jax.Array]:
    """In-kernel decode of a stage's pages ``u8[P, G, 4, 128]`` -> ``(codes
    compute_dtype[P * ps, 128], scale row f32[1, P * ps])`` (token order along both)."""
    rows = page_size // fip.PACK
    code_parts, scale_parts = [], []
    for p in range(keys.shape[0]):
        code_parts.append(keys[p, :rows].reshape(page_size, fip.KEY_DIM))
        b = keys[p, rows:].reshape(-1, fip.LANES).astype(jnp.int32)  # [4 * sg, 128]
        for g in range(fip.scale_groups(page_size)):
            word = b[fip.PACK * g:fip.PACK * g + 1]
            for i in range(1, fip.PACK):
                word = word | (b[fip.PACK * g + i:fip.PACK * g + i + 1] << (_BYTE_BITS * i))
            scale_parts.append(jax.lax.bitcast_convert_type(word, jnp.float32))
        # a page's last group may be partly padding: keep its first ps lanes only
        pad = fip.scale_groups(page_size) * fip.LANES - page_size
        if pad:
            scale_parts[-1] = scale_parts[-1][:, :fip.LANES - pad]
    codes = pltpu.bitcast(jnp.concatenate(code_parts, axis=0), fp8.FP8_DTYPE)
    return codes.astype(compute_dtype), jnp.concatenate(scale_parts, axis=1)
