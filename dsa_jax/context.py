"""Context parallelism: one sequence's KV pages spread over a ``ctx`` mesh axis of ``N`` shards.

The rule, declared once (``PagedLayout.context_shard``): page ``j`` of every sequence (its
sequence-local page number) lives on context shard ``j % N``. A growing sequence adds its pages
to the shards in turn, so every shard holds ``ceil`` or ``floor`` of ``pages / N`` of it.

Local tables. Every shard keeps a page table of the global table's shape, with the global
batch metadata (``kv_lens``, ``cu_q_lens``, ``cu_kv_lens``, ``distribution``) unchanged. A slot
the shard owns holds the page's id in the shard's own cache; every other slot holds ``ABSENT``
(-1). By the one page rule of every op (``reference.batch.lookup_page``) a slot without a page
id in ``[0, num_pages)`` holds no page: its tokens are never candidates, never gathered, and a
cache write to it is dropped. So every op (reference or Pallas kernel) runs unchanged on a
shard and sees exactly the tokens the shard owns, at their global positions: causality, ``-1``
rules and witnesses' context lengths are the single-device ones.

Merges (``shard_map`` collectives over the ``ctx`` axis):

- top-k: each shard selects its local top-k with scores (the op's own score path, so a token's
  score is bit-identical to the single-device one); the shards' candidates are gathered and the
  global top-k taken by (score descending, index ascending), the single-device exact mode's tie
  rule; ``-1`` where fewer than ``k`` candidates exist. The segment-witness merge runs after it
  with the row's global causal context (``reference.selection.finish_selection``).
- sparse MLA: each shard attends to the selected tokens it owns and returns ``(out, lse)``;
  ``lse = logsumexp_i lse_i``, ``out = sum_i exp(lse_i - lse) out_i`` (a shard with no selected
  token has ``lse_i = -inf`` and contributes nothing; a row with none at all gives zeros and
  ``lse = -inf``). Attention sinks (``reference.sinks``) enter after that merge, once: the
  shards return sink-free states and ``merge_lse(..., attn_sink=)`` scales the merged output.

Cost: each shard reads only its own KV pages (the bytes scale 1/N); the indexer kernels still
walk every page slot of the sequence (absent pages are skipped, not fetched) and the MLA walk
checks every entry. ``scripts/cost/context_cost.py`` models the bytes read vs exchanged.

Host helpers: ``shard_pages`` turns a global page table into per-shard local tables and the
local->global page map; ``shard_cache`` / ``unshard_cache`` move caches (arrays or the fp8
cache pytrees) between the single-device and the per-shard forms.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.formats import stacked
from reference.indexer import scores as index_scores
from reference.indexer import selection
from reference.indexer.args import check_topk_args
from reference.indexer.page_topk import causal_page_count, page_max
from reference.mla import sinks

ABSENT = -1  # a local table slot whose page lives on another context shard


class ContextShards(NamedTuple):
    """Per-shard page tables and page maps of one batch (``shard_pages``).

    ``tables i32[N, len(page_indices)]``: local page ids, ``ABSENT`` for slots owned elsewhere;
    ``pages i32[N, P_local]``: global page id of each local page (``-1`` padding);
    ``P_local`` = the largest number of pages a shard owns."""

    tables: np.ndarray
    pages: np.ndarray

    @property
    def num_shards(self) -> int:
        return self.tables.shape[0]

    @property
    def local_pages(self) -> int:
        return self.pages.shape[1]


def used_slots(layout, meta):
    """``(sequence, page j, slot)`` of every page an active sequence uses (host-side): page
    ``j < ceil(min(kv_len, capacity) / page_size)`` of sequence ``i < distribution[2]`` at slot
    ``cu_kv_lens[i] // page_size + j`` inside the table. Other slots are read by no op."""
    kv_lens, table, _, cu_kv, dist = (np.asarray(x, np.int64) for x in meta)
    for i in range(min(int(dist[2]), kv_lens.shape[0])):
        kv = min(max(int(kv_lens[i]), 0), layout.capacity_tokens)
        for j in range(layout.pages_for(kv)):
            slot = int(cu_kv[i] // layout.page_size + j)
            if 0 <= slot < table.shape[0]:
                yield i, j, slot


def shard_pages(layout, num_shards: int, meta, num_pages: int) -> ContextShards:
    """Split a batch's page table over ``num_shards`` context shards by the layout's rule.

    Host-side (NumPy); ``meta`` = (kv_lens, page_indices, cu_q_lens, cu_kv_lens,
    distribution). Each used slot (``used_slots``) holding a page id in ``[0, num_pages)`` gets
    a local id on shard ``layout.context_shard(j, num_shards)``, in slot order; every other slot
    is ``ABSENT`` everywhere."""
    table = np.asarray(meta[1], np.int64)
    tables = np.full((num_shards, table.shape[0]), ABSENT, np.int32)
    owned: list[list[int]] = [[] for _ in range(num_shards)]
    for _, j, slot in used_slots(layout, meta):
        pid = int(table[slot])
        if tables[:, slot].max() != ABSENT or not 0 <= pid < num_pages:
            continue  # a slot two sequences use (a broken batch) keeps its first owner
        n = layout.context_shard(j, num_shards)
        tables[n, slot] = len(owned[n])
        owned[n].append(pid)
    width = max(1, max(len(o) for o in owned))
    pages = np.full((num_shards, width), -1, np.int32)
    for n, o in enumerate(owned):
        pages[n, :len(o)] = o
    return ContextShards(tables, pages)


def shard_cache(shards: ContextShards, cache, *, page_axis: int = 0):
    """``cache`` (an array ``[..., P, page_size, W]`` with pages on ``page_axis``, or an fp8
    cache pytree) -> the shards' caches stacked on a new leading axis ``[N, ..., P_local,
    ...]``; padding pages are zeros."""
    def one(x):
        x = np.asarray(x)
        taken = [np.take(x, np.maximum(p, 0), axis=page_axis) for p in shards.pages]
        out = np.stack(taken)
        pad = (shards.pages < 0)
        shape = [shards.num_shards] + [1] * x.ndim
        shape[page_axis + 1] = shards.local_pages
        return np.where(pad.reshape(shape), np.zeros((), x.dtype), out)

    return jax.tree.map(one, cache)


def unshard_cache(shards: ContextShards, local_caches, global_cache, *, page_axis: int = 0):
    """The inverse of ``shard_cache``: write each shard's pages back over ``global_cache``
    (pages no shard owns keep ``global_cache``'s contents)."""
    def one(local, glob):
        out = np.array(glob, copy=True)
        local = np.asarray(local)
        for n in range(shards.num_shards):
            for lp, gp in enumerate(shards.pages[n]):
                if gp >= 0:
                    src = np.take(local[n], lp, axis=page_axis)
                    idx = [slice(None)] * out.ndim
                    idx[page_axis] = gp
                    out[tuple(idx)] = src
        return out

    return jax.tree.map(one, local_caches, global_cache)


def check_local_tables(layout, tables, meta, local_pages: int) -> None:
    """Refuse local tables that break the layout's rule (``ValueError`` naming the slot): a
    used slot (``used_slots``) of sequence page ``j`` may hold a local page id only on shard
    ``context_shard(j, N)``, and ids must lie in ``[0, local_pages)`` or be ``ABSENT``.
    Host-side; ``meta`` as ``shard_pages`` (its ``page_indices`` unused)."""
    tables = np.asarray(tables)
    num_shards = tables.shape[0]
    for i, j, slot in used_slots(layout, (meta[0], tables[0], *meta[2:])):
        owner = layout.context_shard(j, num_shards)
        for n in range(num_shards):
            v = int(tables[n, slot])
            if v == ABSENT:
                continue
            if n != owner:
                raise ValueError(
                    f"local page table of context shard {n} holds page id {v} at slot {slot} "
                    f"(sequence {i}, page {j}), but the layout's rule puts page {j} on shard "
                    f"{j} % {num_shards} = {owner}")
            if not 0 <= v < local_pages:
                raise ValueError(f"local page table of context shard {n} holds page id {v} at "
                                 f"slot {slot}, outside its cache's [0, {local_pages})")


# ----------------------------------------------------------------------------- in shard_map


def _finish(k: int, exact: bool, recall_target: float):
    """A selection hand-off that keeps the scores: ``i32[R, 2k]`` = (indices, f32 score bits)."""
    def pack(scores):
        idx, vals = selection.select_topk_scored(scores, k, recall_target=recall_target,
                                                 exact=exact)
        return jnp.concatenate([idx, jax.lax.bitcast_convert_type(vals, jnp.int32)], axis=1)
    return pack


def local_topk(q, weights, cache, arrays, *, k: int, page_mode: bool, pages_per_seq: int,
               one_token_per_seq: bool, exact: bool, recall_target: float, backend: str,
               kernel_options: dict, layer=None) -> tuple[jax.Array, jax.Array]:
    """This shard's top-k with scores: ``(i32[T, k] indices, f32[T, k] scores)`` (``-1`` /
    ``-inf`` in the tail), through the backend's own score path; ``layer`` of a stacked
    ``cache``, read in place (``reference.stacked``)."""
    one_layer = stacked.resolve("cache", cache, layer).one
    check_topk_args((q, weights, one_layer, *arrays), k=k, k_name="k_pages" if page_mode else "k",
                    pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq,
                    num_segments=0, recall_target=recall_target, exact=exact)
    pack = _finish(k, exact, recall_target)
    ps = cache.shape[-2]
    if backend == "reference":
        def finish(scores, token_ok, abs_pos, kv_len):
            s = (page_max(scores, token_ok, ps) if page_mode
                 else jnp.where(token_ok, scores, selection.NEG_INF))
            return pack(s)

        out = index_scores.score_and_select(q, weights, cache, *arrays,
                                            pages_per_seq=pages_per_seq, out_width=2 * k,
                                            one_token_per_seq=one_token_per_seq, finish=finish,
                                            layer=layer)
    else:
        from pallas_kernels.indexer import blocks as iblocks
        from pallas_kernels.indexer import scoring

        opts = dict(kernel_options)
        interpret = opts.get("interpret", False)
        chunk_bytes = opts.get("score_chunk_bytes", scoring.SCORE_CHUNK_BYTES)
        iblocks.check_kernel_knobs(chunk_bytes, opts.get("vmem_limit_bytes"))  # as the entries
        chip, blocks = iblocks.entry_blocks(
            opts.get("chip"), opts.get("blocks"), opts.get("block_rows"),
            opts.get("block_pages"), one_token_per_seq=one_token_per_seq,
            pages_per_seq=pages_per_seq, page_size=ps, page_mode=page_mode, interpret=interpret)
        b = batch.RaggedBatch.of(cache, *arrays, pages_per_seq=pages_per_seq)
        out = scoring.score_and_select(
            q, weights, cache, b, one_token_per_seq=one_token_per_seq, page_mode=page_mode,
            blocks=blocks, chunk_bytes=chunk_bytes,
            vmem_limit_bytes=opts.get("vmem_limit_bytes"), interpret=interpret, chip=chip,
            out_width=2 * k, out_dtype=jnp.int32,
            finish=lambda s, row_ok, *_: jnp.where(row_ok[:, None], pack(s), -1), layer=layer)
    idx = out[:, :k]
    vals = jax.lax.bitcast_convert_type(out[:, k:], jnp.float32)
    return idx, jnp.where(idx >= 0, vals, -jnp.inf)


def merge_topk(idx, vals, k: int, axis_name: str) -> jax.Array:
    """The global top-k of every shard's candidates (module docstring): ``i32[T, k]``."""
    all_idx = jax.lax.all_gather(idx, axis_name, axis=1, tiled=True)  # [T, N*k]
    all_vals = jax.lax.all_gather(vals, axis_name, axis=1, tiled=True)
    ok = (all_idx >= 0) & (all_vals > -jnp.inf)
    neg = jnp.where(ok, 0.0 - all_vals, jnp.inf)  # 0 - v: -0.0 and +0.0 sort as one score
    key = jnp.where(ok, all_idx, jnp.iinfo(jnp.int32).max)
    neg, key = jax.lax.sort((neg, key), dimension=1, num_keys=2)
    return jnp.where(neg[:, :k] < jnp.inf, key[:, :k], -1).astype(jnp.int32)


def context_lens(b: batch.RaggedBatch, num_rows: int, *, page_mode: bool,
                 one_token_per_seq: bool = False) -> jax.Array:
    """Each row's global causal context (tokens, or pages), 0 outside sequences: the witness
    merge's context length, as the single-device top-k computes it."""
    rows = b.rows(num_rows, one_token_per_seq=one_token_per_seq)
    kv = b.kv_eff(rows.seq)
    ctx = (causal_page_count(rows.abs_pos, kv, b.page_size) if page_mode
           else selection.causal_token_count(rows.abs_pos, kv))
    return jnp.where(rows.in_seq, ctx, 0)


def merge_lse(out, lse, axis_name: str, attn_sink=None) -> tuple[jax.Array, jax.Array]:
    """``(out f[T, H, V], lse f32[T, H])`` of each shard -> the combined attention (module
    docstring), ``out`` in its dtype. The shards' states must be sink-free; ``attn_sink``
    (optional ``f32[H]``, ``reference.sinks``) is applied once, to the merged f32 output, before
    the cast; the returned LSE stays sink-free."""
    m = jax.lax.pmax(lse, axis_name)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # exp(-inf) = 0 for a shard without a selected token
    den = jax.lax.psum(w, axis_name)
    num = jax.lax.psum(w[..., None] * out.astype(jnp.float32), axis_name)
    merged = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    total = jnp.where(den > 0, m_safe + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    return sinks.apply_sink(merged, total, attn_sink).astype(out.dtype), total
