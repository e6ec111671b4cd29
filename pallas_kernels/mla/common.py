"""What the token and page sparse MLA entries share after their checks and block choice:
``row_info`` (the XLA side of index preparation) and ``attend_entries`` (row info, the kernel,
the output cast)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import tpu
from pallas_kernels.mla import pool as mla_pool
from pallas_kernels.mla.blocks import _COUNT, _END, _LIMIT, _SLOT0, ROW_INFO_WORDS
from pallas_kernels.mla.kernel import gather_attend
from reference.core import batch
from reference.formats import stacked
from reference.formats.cache_format import CacheFormat


class PerformanceWarning(UserWarning):
    """A call that is correct but takes a documented slow path."""


def compute_query(q, fmt: CacheFormat):
    """The query in the compute dtype: f32 when the query or the cache is f32, else bf16 (a
    no-op for a bf16 query; the fp8 cache's query is read as given, ``kernel.segments``)."""
    return q.astype(jnp.promote_types(q.dtype, fmt.value_dtype))


def attend_entries(q, cache_kv, entries, b: batch.RaggedBatch, *, mode: str,
                   fmt: CacheFormat, units: int, sm_scale: float, v_dim: int, return_lse: bool,
                   vmem_limit_bytes: int | None, interpret, layer=None, attn_sink=None):
    """What both entries do after their checks and block choice: ``row_info`` in XLA, the
    kernel over the raw ``entries`` (token offsets or page numbers) and the page table, then the
    output in ``q``'s dtype (and the LSE ``f32[T, H]`` when ``return_lse``). ``cache_kv``: one
    layer, or a stacked cache read in place at ``layer`` (``reference.stacked``); ``q`` may be
    stacked too (``[L, T, H, D]``, read at ``layer`` by the kernel's block index).
    ``attn_sink``: checked ``f32[H]`` or None, applied in the kernel's finalize."""
    info = row_info(entries, b, mode=mode)
    read = stacked.resolve("cache_kv", cache_kv, layer)
    cache = mla_pool.kernel_operand(read.stacked)  # fp8 words, a token-packed pool: as stored
    res, lse = gather_attend(compute_query(q, fmt), cache, read.layer, entries.astype(jnp.int32),
                             info, tpu.smem_page_table(b.page_indices), mode=mode, fmt=fmt,
                             units=units, pages_per_seq=b.pages_per_seq, sm_scale=sm_scale,
                             v_dim=v_dim, return_lse=return_lse,
                             vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
                             sink=None if attn_sink is None else attn_sink[None])
    out = res.astype(q.dtype)
    return (out, lse[..., 0]) if return_lse else out


def row_info(entries, b: batch.RaggedBatch, *, mode: str) -> jax.Array:
    """Per query row, what the kernel's walk needs: ``i32[..., T, 4]`` (for ``entries i32[...,
    T, k]``: leading layer dims share the batch's rows) = (entries that can be valid,
    one past the last such entry, the sequence's first page slot, the limit).

    Elementwise over ``entries i32[T, k]`` plus two row reductions and per-row metadata: no
    per-entry page-table lookup (the kernel reads the table in SMEM) and no compaction (the
    kernel's walk skips invalid entries). "Can be valid": the row belongs to a sequence and
    ``0 <= e < limit`` (token: ``limit = min(kv_len, capacity)``), or the page holds a token
    below ``limit = min(kv_len, capacity, abs_pos + 1)`` (page); the page slot and page id
    checks happen in the kernel, which may therefore fill fewer rows than this count.
    """
    num_rows, k = entries.shape[-2:]  # leading dims (layers) share the rows' facts
    rows = b.rows(num_rows)
    limit = b.kv_eff(rows.seq)
    if mode == "page":
        limit = jnp.clip(jnp.minimum(limit, rows.abs_pos + 1), 0, None)
    limit = jnp.where(rows.in_seq, limit, 0)
    if mode == "token":
        ok = (entries >= 0) & (entries < limit[:, None])
    else:  # the page's first token is below the limit (clip: no overflow for huge numbers)
        first = jnp.clip(entries, 0, b.pages_per_seq) * b.page_size
        ok = (entries >= 0) & (first < limit[:, None])
    count = jnp.sum(ok, axis=-1, dtype=jnp.int32)
    end = jnp.max(jnp.where(ok, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=-1,
                  initial=0)
    slot0, limit = (jnp.broadcast_to(x, count.shape) for x in (b.first_slot(rows.seq), limit))
    fields = {_COUNT: count, _END: end, _SLOT0: slot0, _LIMIT: limit}  # the kernel's layout
    return jnp.stack([fields[i] for i in range(ROW_INFO_WORDS)], axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- entry point

