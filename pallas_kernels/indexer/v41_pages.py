"""DeepSeek-V4.1's fp4 index keys (e2m1, ue8m0 per 32, no Hadamard) as a cache format of the
Pallas indexer (issue 31): the pages ``u8[P, G, 4, 128]`` of ``reference.v41.index_pages``
(entries along lanes, the nibbles paired across the two feature halves, the scale bytes in the
block's tail groups) read in place with ONE DMA per page, decoded in VMEM.

Format ``V41_FORMAT`` (``"v41_fp4_index_pages"``): the kernel sees an ``IndexFp4Pages`` (its
logical keys ``(..., P, ps, D)`` for the shared glue). Each stage decodes its pages
(``decode_stage``): per block of 128 entries the ``D / 2`` nibble rows (``u8 -> i32``, a
reshape of whole groups), the low nibbles to features ``[0, D / 2)`` and the high ones to
``[D / 2, D)`` by ``reference.v41.formats.e2m1_values`` (selects), each row times its block's
scale ``reference.v41.formats.ue8m0_values`` (shifts and a bitcast, broadcast along sublanes):
the keys ``f32[D, P * ps]`` features on sublanes, entries on lanes, the reference's values bit
for bit (``value * 2^e`` in f32, exact, and exact in bf16). The stage contracts the query with
them along sublanes (``stored.feature_axis``): ``q [R*H, D] @ k [D, nb]``, the MXU's natural
form; no per-entry scale row after the head sum.

The scores are ``reference.indexer.scores.index_scores`` of the decoded keys: with
``precision="bf16"`` (DeepSeek's regime, what the V4.1 step runs) the kernel's bf16 rounding
of each dot, product and head sum (``kernel._stage_scores``). The entry and its traffic model:
``v41_scores``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reference.v41 import index_pages as ip
from reference.v41.formats import INDEX_BLOCK, NIBBLE_BITS, e2m1_values, ue8m0_values

V41_FORMAT = "v41_fp4_index_pages"
PagesCache = ip.IndexFp4Pages  # declared in reference


def page_shape(page_size: int, dim: int) -> tuple[int, int, int]:
    """One page in VMEM: ``(G, 4, 128)`` bytes."""
    return (ip.page_groups(page_size, dim), ip.PACK, ip.LANES)


def key_bytes(page_size: int, dim: int) -> tuple[int, int]:
    """``(nibble bytes per entry, scale lanes per page)``: a page moves ``ps`` times the first
    plus 4 bytes per scale lane, ``512 * G`` in all (lanes past ``ps`` included)."""
    nb = ip.blocks(page_size)
    return (ip.GROUP_BYTES * ip.nibble_groups(dim) * nb // page_size,
            ip.LANES * ip.scale_groups(dim) * nb)


def _block_scale(scales, first: int, rows: int):
    """``f32[rows, 128]``: row ``i`` (feature ``first + i``) times its block's scale row."""
    feat = first + jax.lax.broadcasted_iota(jnp.int32, (rows, ip.LANES), 0)
    s = jnp.broadcast_to(scales[first // INDEX_BLOCK], (rows, ip.LANES))
    for b in range(first // INDEX_BLOCK + 1, len(scales)):
        s = jnp.where(feat >= b * INDEX_BLOCK, scales[b], s)
    return s


def decode_stage(keys: jax.Array, page_size: int, dim: int, compute_dtype) -> jax.Array:
    """In-kernel decode of a stage's pages ``u8[P, G, 4, 128]`` -> ``compute_dtype[D, P * ps]``
    (features on sublanes, entries on lanes, entry order)."""
    half, ng, per = dim // 2, ip.nibble_groups(dim), ip.groups(dim)
    parts = []
    for p in range(keys.shape[0]):
        for c in range(ip.blocks(page_size)):
            g0 = c * per
            nib = keys[p, g0:g0 + ng].reshape(half, ip.LANES).astype(jnp.int32)
            sb = keys[p, g0 + ng:g0 + per].reshape(-1, ip.LANES).astype(jnp.int32)
            scales = [ue8m0_values(sb[i:i + 1]) for i in range(dim // INDEX_BLOCK)]
            lo = e2m1_values(nib & 0xF) * _block_scale(scales, 0, half)
            hi = e2m1_values(nib >> NIBBLE_BITS) * _block_scale(scales, half, half)
            k = jnp.concatenate([lo, hi], axis=0)  # [D, 128]
            parts.append(k[:, :page_size] if page_size < ip.LANES else k)
    return jnp.concatenate(parts, axis=1).astype(compute_dtype)


def wrap(cache, page_size: int, dim: int) -> PagesCache:
    """``u8[..., P, G, 4, 128]`` (or an ``IndexFp4Pages``) checked as V4.1 index pages."""
    return ip.as_index_fp4_pages(cache, page_size, dim, "cache_kv")


def stand_in(cache: PagesCache) -> jax.ShapeDtypeStruct:
    """Shape-only bf16 keys ``[..., P, ps, D]`` (what the shared checks read)."""
    return jax.ShapeDtypeStruct(cache.shape, jnp.bfloat16)
