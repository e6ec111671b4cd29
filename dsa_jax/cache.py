"""Writing this step's new tokens into the paged caches.

Each query row of the step is one new token. Its destination, units written out:

    pos    (tokens) = kv_len - q_len + (row - q_start)   the token's position in its sequence
    page   (pages)  = pos // page_size                    the sequence-local page number
    slot   (slots)  = cu_kv_lens[seq] // page_size + page   the entry of the packed page table
    page_id         = page_indices[slot]                  the physical page of the cache
    offset (tokens) = pos % page_size                     the row inside that page

Drop rule (documented once, here): a row is written only if it belongs to an active sequence
(``reference.batch.row_facts``), ``0 <= pos < capacity_tokens`` (``pages_per_seq *
page_size``), ``slot`` lies inside ``page_indices`` and ``page_id`` in ``[0, num_pages)``.
Any other row is dropped: nothing is written anywhere (the scatter targets one past the last
page with ``mode="drop"``), so a bad slot can never overwrite another sequence's cache.
Two rows with the same destination (a page table that maps two sequences to one page) is a
broken batch; which row lands is then unspecified.

Formats (``PagedLayout``'s declaration): a plain cache stores the row as its dtype, a packed
latent cache packs it (``reference.packed_cache``), an fp8 cache quantizes it on write
(``reference.fp8_cache``: the index row by DeepSeek-V3.2's indexer rule with the layout's
``index_scale_fmt``, the latent row by FlashMLA's rule; a latent row's zero padding past
``qk_dim`` is dropped). Only this step's rows are written; nothing else in the cache changes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.layout import PagedLayout
from reference.core import batch, checks
from reference.formats import fp8_cache, packed_cache


def write_slots(layout: PagedLayout, num_rows: int, num_pages: int, kv_lens, page_indices,
                cu_q_lens, cu_kv_lens, distribution):
    """``(page_id i32[T], offset i32[T])`` of each row's new token; ``page_id == num_pages``
    for a dropped row (module docstring)."""
    return batch_write_slots(layout.batch(num_pages, kv_lens, page_indices, cu_q_lens,
                                          cu_kv_lens, distribution), num_rows)


def batch_write_slots(b: batch.RaggedBatch, num_rows: int):
    """``write_slots`` of a ``RaggedBatch`` (the drop rule of the module docstring)."""
    rows = b.rows(num_rows)
    pos = rows.abs_pos
    ok = rows.in_seq & (pos >= 0) & (pos < b.capacity_tokens)
    page_id, offset, ok = b.token_slots(rows.seq, pos, ok)  # the one slot rule
    return jnp.where(ok, page_id, b.num_pages).astype(jnp.int32), offset.astype(jnp.int32)


def _pad_features(name: str, rows, want: int, allowed: tuple[int, ...]):
    checks.floating(f"update_kv_cache: {name}", rows)  # the dtypes every op reads
    got = np.shape(rows)[-1]
    if got not in allowed:
        raise ValueError(f"{name}.shape[-1] must be one of {sorted(set(allowed))} (the layout's "
                         f"dims), got {got} (shape {tuple(np.shape(rows))})")
    if got == want:
        return rows
    return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, want - got)])


def write_rows(cache, page_id, offset, rows, *, layout: PagedLayout, kind: str, layer=None):
    """Store ``rows f[T, D]`` at ``(page_id, offset)`` (of ``layer`` of a stacked cache when
    given) in the layout's ``kind`` format (module docstring); ``page_id == num_pages`` drops a
    row. Returns the updated cache."""
    fmt = layout.cache_format(kind)
    if fmt == "fp8" and kind == "index":
        return fp8_cache.write_index_rows(cache, page_id, offset, rows,
                                          scale_fmt=layout.index_scale_fmt, layer=layer)
    if fmt == "fp8":
        return fp8_cache.write_latent_rows(cache, page_id, offset, rows[..., :layout.qk_dim],
                                           layer=layer)
    if fmt == "packed":
        rows = packed_cache.pack_cache(rows)
    at = (page_id, offset) if layer is None else (layer, page_id, offset)
    return cache.at[at].set(rows.astype(cache.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("layout",),
                   donate_argnames=("latent_cache", "index_cache"))
def update_kv_cache(
    latent_cache,  # f32|bf16[num_pages, page_size, padded_dim], or u32 packed words
    #                [num_pages, page_size, packed_words(padded_dim)] (packed_latent), or an
    #                Fp8LatentCache (latent_cache_format="fp8")
    index_cache,  # f32|bf16[num_pages, page_size, index_dim], an Fp8IndexCache, or None
    new_latent: jax.Array,  # f[T, qk_dim or padded_dim] this step's latent rows (one per row)
    new_index: jax.Array | None,  # f[T, index_dim] this step's indexer keys, or None
    kv_lens: jax.Array,  # i32[S] (this step's tokens included)
    page_indices: jax.Array,  # i32[N]
    cu_q_lens: jax.Array,  # i32[S+1]
    cu_kv_lens: jax.Array,  # i32[S+1]
    distribution: jax.Array,  # i32[3]
    *,
    layout: PagedLayout,
) -> tuple[jax.Array, jax.Array | None]:
    """Write each query row's new latent row (and indexer key) at its token's cache slot.

    ``new_latent`` may have the logical ``qk_dim`` (576) or the cache's ``padded_dim`` (640):
    the padding is zeros, which change no logit. ``index_cache`` / ``new_index`` are ``None``
    together for a layer without an indexer (IndexShare ``"shared"``). Jitted with the caches
    donated (``donate_argnames``): the caller must not use the old cache arrays afterwards.
    Rows that fail the drop rule (module docstring) write nothing.

    Returns:
      ``(latent_cache, index_cache)`` updated (``index_cache`` stays ``None`` if it was).
    """
    layout.check_cache("latent_cache", latent_cache, "latent")
    num_rows = np.shape(new_latent)[0]
    num_pages = latent_cache.shape[-3]
    new_latent = _pad_features("new_latent", new_latent, layout.padded_dim,
                               (layout.qk_dim, layout.padded_dim))
    if (index_cache is None) != (new_index is None):
        raise ValueError("index_cache and new_index must both be given or both be None, got "
                         f"index_cache={'None' if index_cache is None else 'array'}, "
                         f"new_index={'None' if new_index is None else 'array'}")
    page_id, offset = write_slots(layout, num_rows, num_pages, kv_lens, page_indices,
                                  cu_q_lens, cu_kv_lens, distribution)
    latent_cache = write_rows(latent_cache, page_id, offset, new_latent, layout=layout,
                              kind="latent")
    if index_cache is not None:
        layout.check_cache("index_cache", index_cache, "index")
        if index_cache.shape[-3] != num_pages:
            raise ValueError(f"index_cache has {index_cache.shape[-3]} pages, latent_cache has "
                             f"{num_pages}; both caches share the page table")
        new_index = _pad_features("new_index", new_index, layout.index_dim, (layout.index_dim,))
        index_cache = write_rows(index_cache, page_id, offset, new_index, layout=layout,
                                 kind="index")
    return latent_cache, index_cache
