"""One DeepSeek-V4.1 attention step over every layer of a model, on a ragged paged batch (issue
31, deliverable 5): the paged counterpart of the statement
``reference.statements.deepseek_v41.attention_stack``, checked against it in lock-step
(``tests/test_v41_step.py``).

The declarations (layout, caches, states, metadata, result) live in ``dsa_jax.v41_model``. The
step takes each layer's input ``xs [L, T, dim]`` (after its ``attn_norm``; rows ragged by the
package's row rule) and runs the layers in ``resolve_layers`` order, threading what sources
publish (the official ``shared_attn`` runtime: the last KV source's pool and index keys, the last
index source's top-k, the candidate source's blocks) as the statement does. Per layer:

1. the projections (``reference.statements.deepseek_v41_layer.project``: the statement's own
   functions), the window row stored in the window stack (fp8 / 32, 528 B) at its token's slot;
2. a KV source (FULL): ``reference.v41.compress_step`` on its inputs (ratio 2 with its state
   slot: a chunk starting on an odd position takes its partner from the state), the entries
   completing this step stored in its pool (fp4 / e4m3-16, 288 B) and its index keys (fp4 /
   ue8m0-32, 68 B) at ``entry_slots`` (the candidate source's keys also in the block layout,
   ``V41Caches.cand``, where the caches keep it);
3. an index source (FULL, REINDEX), a chunk of rows at a time (``select_rows``: never
   ``f32[T, E]`` scores): its query scores every visible entry of the published keys (read in
   place from the stack's index pages: ``reference.v41.index_pages``), then
   ``deepseek_v41_layer.select`` (candidate blocks, top-k restricted to them);
4. attention (``deepseek_v41_layer.attend``: one softmax over the row's window tokens and the
   published top-k's pool entries, the sink in the denominator), then the output stage.

Steps 1 and 2 run for every layer before any layer's 3 and 4 (each layer's writes depend only
on its own input rows; the window rows of all layers go in one scatter), so every write
precedes every read and XLA keeps one buffer per donated stack; every cache is read in place at
its stack row. The output is the layer's ``wo_b`` output (bf16 values under ``"bf16"``), rows
outside every sequence zeros. ``implementation``: ``"xla"`` (this pure-jnp path, the default) or
``"pallas"``: the ratio-2 compressor on its Pallas kernel (``pallas_kernels.v41_compressor``),
the index scores on the Pallas indexer over the index pages
(``pallas_kernels.indexer.v41_scores.index_select_v41``: each index source's selection a chunk
of rows at a time, no ``f32[T, E]`` scores; a candidate consumer fetching only the pages
holding its candidates, or, where ``layout.block_keys`` (V4.1-Flash's index geometry), only its
candidate blocks from the candidate source's keys in the block layout, ``V41Caches.cand``:
``dsa_jax.v41_consume``) and the attention on the Pallas kernel over the window and pool pages
(``pallas_kernels.v41_attention``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.cache import batch_write_slots
from dsa_jax.v41_consume import in_row_chunks as _in_row_chunks
from dsa_jax.v41_consume import pallas_consume
from dsa_jax.v41_model import (
    V41Caches,
    V41Meta,
    V41StepLayout,
    V41StepResult,
    init_v41_caches,
    init_v41_states,
    v41_meta,
)
from dsa_jax.v41_step_checks import check_v41_step_args
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, chunk_rows
from pallas_kernels.v41_attention.entry import window_segments
from reference.core import batch
from reference.quant.bf16 import V4_DEFAULT_PRECISION, check_precision, rounding
from reference.statements import deepseek_v41_layer as L
from reference.v4_compressor.ref import entry_slots
from reference.v41 import formats, index_blocks, index_pages, pool_pages, window_pages
from reference.v41.compressor import compress_step
from reference.v41.config import CandidateUse, Mode, resolve_layers
from reference.v41.paged import PagedBytes, ragged, row_slots

__all__ = ["V41Caches", "V41Meta", "V41StepLayout", "V41StepResult", "init_v41_caches",
           "init_v41_states", "v41_meta", "v41_step"]

IMPLEMENTATIONS = ("xla", "pallas")
# every Pallas kernel's options (compressor, indexer, attention)
KERNEL_OPTIONS = ("interpret", "vmem_limit_bytes")
# What the jnp index scores hold at once (``_scores``: gathered bytes, decoded keys, dots of a
# block of entries for every row of a chunk).
SCORE_BLOCK_BYTES = 64 * 2**20
# The jnp selection's chunk of rows (``select_rows``): its scores ``f32[C, E]`` at most this,
# the Pallas selection's bound (``index_select_v41``'s ``score_chunk_bytes``).
SELECT_CHUNK_BYTES = SCORE_CHUNK_BYTES
# The jnp attention's chunk of rows (``attend_rows``): its decoded kv ``f32[C, window + k, D]``
# at most this (51 rows at V4.1-Flash's 128 + 512 rows of 512).
ATTEND_CHUNK_BYTES = 64 * 2**20


class _Ops(NamedTuple):
    """The ops an implementation runs on its own code: ``compress`` (ratio-2 KV sources'
    compressor, ``reference.v41.compress_step``'s signature), ``attend`` (``_attend``') and an
    index source's selection: ``scores`` (``_scores``', then ``deepseek_v41_layer.select``) or
    ``select`` (``_pallas_select``'s, scoring and selecting at once), the other None; and
    ``consume`` (``v41_consume.pallas_consume``'s: a consumer's top-k from its candidate blocks
    alone, where the caches keep ``cand``) or None."""

    compress: object
    attend: object
    scores: object = None
    select: object = None
    consume: object = None


def _ops(implementation: str, kernel_options: tuple) -> _Ops:
    """``"xla"``: ``reference.v41.compress_step``, the jnp ``_scores`` and ``_attend``, a chunk
    of rows at a time (``_select_rows``, ``_attend_rows``).
    ``"pallas"``: ``pallas_kernels.v41_compressor.compress_step``, the Pallas indexer over the
    index pages with each index source's selection a chunk of rows at a time
    (``pallas_kernels.indexer.v41_scores.index_select_v41``) and the Pallas attention over the
    window and pool pages (``pallas_kernels.v41_attention``), each with ``kernel_options``
    (``interpret``, ``vmem_limit_bytes``). Ratio 1's compressor is row-wise XLA on both."""
    if implementation == "xla":
        return _Ops(compress_step, _attend_rows, scores=_scores)
    from pallas_kernels.indexer.v41_candidates import candidate_topk_v41
    from pallas_kernels.indexer.v41_scores import index_select_v41
    from pallas_kernels.v41_attention import v41_attention
    from pallas_kernels.v41_compressor import compress_step as pallas_compress

    opts = dict(kernel_options)
    return _Ops(functools.partial(pallas_compress, **opts),
                functools.partial(_pallas_attend, functools.partial(v41_attention, **opts)),
                select=functools.partial(_pallas_select,
                                         functools.partial(index_select_v41, **opts)),
                consume=functools.partial(pallas_consume,
                                          functools.partial(candidate_topk_v41, **opts)))


def _paged(layout, caches: V41Caches, meta: V41Meta, name: str, ratio: int):
    """``(PagedBytes, pages_per_seq)`` of cache field ``name`` (``window``: a ``WindowPages``,
    ``pool{r}``, ``keys{r}``: an ``IndexFp4Pages``) with its family's page table."""
    fam = "window" if ratio == 0 else f"r{ratio}"
    cache, c = getattr(caches, name), layout.config
    if name.startswith("keys"):
        cache = index_pages.IndexFp4Pages(cache, layout.page_size, c.index_head_dim)
    elif name == "window":
        cache = window_pages.WindowPages(cache, layout.page_size, c.head_dim)
    elif cache is not None:  # pool{r}
        cache = pool_pages.PoolPages(cache, layout.page_size, c.head_dim)
    return (PagedBytes(cache, getattr(meta, f"{fam}_page_indices"),
                       getattr(meta, f"{fam}_cu_lens")), layout.pages_per_seq(ratio))


def _compress(params, x, layer, layout, caches, states, meta, rb, compress):
    """KV source ``layer``'s compressor over this step's rows ``x f32[T, dim]``; the entries
    completing now stored in its pool and index keys. Returns ``(caches, states)``."""
    c = layout.config
    r, k = layout.source_slot(layer)
    cos, sin = L.rope_tables(c, r, layout.max_seq_len)
    if r == 1:
        kv, score, state = x @ rb(params["compressor.wkv.weight"]).T, None, None
    else:
        kv, score = L.compress_inputs(params, x, 2, c.rms_norm_eps, rb)
        state = states[layout.sources[2].index(layer)]
    entries, state = (compress_step if r == 1 else compress)(
        kv, score, params["compressor.norm.weight"], cos, sin, state, meta.state_slots,
        meta.kv_lens, meta.cu_q_lens, meta.distribution, ratio=r, eps=c.rms_norm_eps,
        output="latent")
    pos = jnp.where(entries.entry >= 0, r * entries.entry, 0)
    pool, keys = L.entry_rows(params, entries.rows, jnp.take(cos, pos, axis=0),
                              jnp.take(sin, pos, axis=0), c, rb)
    out = {}
    for name, rows_u8 in ((f"pool{r}", formats.encode_compressed_kv(pool)),
                          (f"keys{r}", formats.encode_index_fp4(keys))):
        kv_paged, per = _paged(layout, caches, meta, name, r)
        page_id, offset = entry_slots(
            entries, kv_paged.page_indices, kv_paged.cu_lens, page_size=layout.page_size,
            pages_per_seq=per, num_pages=int(kv_paged.cache.shape[1]))
        pages = index_pages if name.startswith("keys") else pool_pages
        out[name] = pages.write_entries(
            kv_paged.cache.pages, k, page_id, offset, rows_u8, page_size=layout.page_size,
            dim=c.index_head_dim if name.startswith("keys") else c.head_dim)
    if layer == layout.candidate_source and caches.cand is not None:  # the keys' slots
        out["cand"] = index_blocks.write_entries(caches.cand, 0, page_id, offset, rows_u8,
                                                 page_size=layout.page_size)
    if r == 2:
        i = layout.sources[2].index(layer)
        states = (*states[:i], state, *states[i + 1:])
    return caches._replace(**out), states


def score_block(num_rows: int, heads: int, dim: int, entries: int) -> int:
    """Entries scored per block (``_scores``): the most whose decoded keys, dots and gathered
    bytes for ``num_rows`` rows fit ``SCORE_BLOCK_BYTES``, at least 1, at most ``entries``."""
    per_entry = num_rows * (4 * dim + 4 * heads + formats.index_fp4_bytes(dim))
    return int(min(entries, max(1, SCORE_BLOCK_BYTES // max(per_entry, 1))))


def _scores(iq, w, keys, k, b, rows, meta, precision, cands=None, block=None):
    """``score f32[T, E]`` of ``iq f32[T, Hi, Di]`` / ``w f32[T, Hi]`` over entries ``0 .. E - 1``
    (``E = b.capacity_tokens``) of stack row ``k`` of ``keys`` (a ``PagedBytes`` of
    ``IndexFp4Pages``; each row its sequence's; the step passes one chunk of ``select_rows``
    rows at a time, ``_select_rows``), in blocks of whole pages (``score_block``
    entries, rounded down to pages, at least one): the decoded keys never exceed
    ``SCORE_BLOCK_BYTES`` whatever ``T`` and ``E``. Each row gathers its sequence's pages whole
    (one index a page, ``512 G`` bytes: no per-entry gather) and decodes them; an entry past the
    sequence's written entries, on a page out of range, or on a row outside every sequence
    reads as zeros (its bytes are never decoded into a score). ``cands`` (a consumer's
    candidate blocks of ``block`` entries) are not used: static shapes read every page, and
    ``select`` restricts the scores to them."""
    del cands, block
    t, heads, dim = iq.shape
    ps = b.page_size
    per = max(1, score_block(t, heads, dim, b.capacity_tokens) // ps)  # pages a block
    nb = per * ps
    written = jnp.where(rows.in_seq, b.kv_eff(rows.seq), 0)

    def block(p0):
        j = p0 + jnp.arange(per, dtype=jnp.int32)
        pid, ok = b.page_ids(rows.seq[:, None], j[None, :],
                             rows.in_seq[:, None] & (j < b.pages_per_seq)[None, :])
        got = keys.cache.pages.at[k, jnp.where(ok, pid, b.num_pages)].get(
            mode="fill", fill_value=0)  # [T, per, G, 4, 128]
        got = index_pages.from_pages(got, ps, dim).reshape(t, nb, -1)
        ent = p0 * ps + jnp.arange(nb, dtype=jnp.int32)
        ok = jnp.repeat(ok, ps, axis=1) & (ent[None, :] < written[:, None])
        krows = jnp.where(ok[..., None], formats.decode_index_fp4(got), 0.0)
        return L.index_score(iq[:, None], krows, w[:, None], precision)[:, 0]

    n = -(-b.pages_per_seq // per)
    if n == 1:
        return block(0)[:, :b.capacity_tokens]
    out = jax.lax.fori_loop(0, n, lambda i, acc: jax.lax.dynamic_update_slice_in_dim(
        acc, block(i * per), i * nb, axis=1), jnp.zeros((t, n * nb), jnp.float32))
    return out[:, :b.capacity_tokens]


def _pallas_select(kernel, iq, w, keys, k, b, meta, precision, plan, c, cands):
    """``deepseek_v41_layer.select``'s ``(topk, candidates)`` from the Pallas indexer reading
    the index pages in place at stack row ``k`` (``kernel``: ``index_select_v41`` with the
    kernel options), a chunk of rows at a time: no ``f32[T, E]`` scores. A consumer fetches
    only the pages holding its candidates; the candidate source publishes its blocks."""
    use = cands if plan.candidates is CandidateUse.CONSUMES else None
    made = plan.candidates is CandidateUse.PRODUCES
    top, blocks = kernel(
        iq, w, keys.cache, meta.kv_lens, keys.page_indices, meta.cu_q_lens, keys.cu_lens,
        meta.distribution, k=c.index_topk, pages_per_seq=b.pages_per_seq, page_size=b.page_size,
        dim=iq.shape[-1], compression_ratio=b.compression_ratio, precision=precision, layer=k,
        candidates=use, candidate_block=c.candidate_block_size,
        num_blocks=c.candidate_topk_blocks if made else None)
    return top, (blocks if made else cands)


def _select(params, x, qr, cos_p, sin_p, source, plan, layout, caches, meta, rows, cands, rb,
            precision, ops):
    """An index source's top-k (and, the candidate source, its candidate blocks) over every
    visible entry of KV source ``source``'s keys (read in place), a chunk of rows at a time:
    ``ops.select``'s (the Pallas indexer) or ``_select_rows`` (``ops.scores``' chunk, then
    ``select``)."""
    c = layout.config
    r, k = layout.source_slot(source)
    keys, per = _paged(layout, caches, meta, f"keys{r}", r)
    b = ragged(keys, meta.kv_lens, meta.cu_q_lens, meta.distribution, pages_per_seq=per,
               ratio=r)
    iq, w = L.index_query(params, x[None], qr[None], cos_p, sin_p, c, rb)
    if (ops.consume is not None and caches.cand is not None
            and plan.candidates is CandidateUse.CONSUMES):  # only its candidate blocks read
        return ops.consume(iq[0], w[0], caches.cand, b, rows, precision, c, cands), cands
    if ops.select is not None:
        return ops.select(iq[0], w[0], keys, k, b, meta, precision, plan, c, cands)
    return _select_rows(ops.scores, iq[0], w[0], keys, k, b, rows, meta, precision, plan, c,
                        cands)


def select_rows(num_rows: int, entries: int) -> int:
    """Rows per chunk of the jnp selection (``_select_rows``): the most whose scores
    ``f32[C, entries]`` fit ``SELECT_CHUNK_BYTES``, at least 1, balanced over the chunks
    (``pallas_kernels.indexer.scoring.chunk_rows``, the Pallas selection's rule)."""
    return chunk_rows(max(num_rows, 1), max(entries, 1), 1, SELECT_CHUNK_BYTES)


def _select_rows(scores, iq, w, keys, k, b, rows, meta, precision, plan, c, cands):
    """``deepseek_v41_layer.select`` over ``scores``' (``_scores``) rows a chunk of
    ``select_rows`` rows at a time (``_in_row_chunks``): what is held at once is one chunk's
    scores and its selection's temporaries, never ``f32[T, E]``. Every row's result depends
    only on its own scores, so chunking changes no bit."""
    use = cands if plan.candidates is CandidateUse.CONSUMES else None
    made = plan.candidates is CandidateUse.PRODUCES

    def chunk(row0, n):
        cut = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=row0, slice_size=n)
        mine = batch.RowFacts(*map(cut, rows))
        ids = None if use is None else cut(use)
        score = scores(cut(iq), cut(w), keys, k, b, mine, meta, precision, ids,
                       None if ids is None else c.candidate_block_size)
        lens = jnp.where(mine.in_seq, (mine.abs_pos + 1) // b.compression_ratio, 0)
        top, blocks = L.select(score, lens, plan, c, ids)
        return jnp.concatenate([top, blocks], axis=1) if made else top

    t = iq.shape[0]
    out = _in_row_chunks(chunk, t, select_rows(t, b.capacity_tokens))
    return out[:, :c.index_topk], (out[:, c.index_topk:] if made else cands)


def _slots(layout, caches, meta, rows, name: str, ratio: int, idx):
    """``(PagedBytes, page, offset, ok)`` of rows ``idx i32[T, n]`` (sequence-local, ``-1``
    none) of cache ``name`` (``window``, ``pool{r}``): ``row_slots`` under its page table."""
    kv, per = _paged(layout, caches, meta, name, ratio)
    b = ragged(kv, meta.kv_lens, meta.cu_q_lens, meta.distribution, pages_per_seq=per,
               ratio=max(ratio, 1))
    return (kv, *row_slots(idx, b, rows))


def _attend(q, layer, source, topk, layout, caches, meta, rows, sink, precision):
    """One softmax per head of ``q f32[T, H, D]`` over each row's window tokens and (``source``
    not None) the ``topk i32[T, k]`` entries of that KV source's pool; ``f32[T, H, D]``."""
    c, rb = layout.config, rounding(precision)
    idx = rows.abs_pos[:, None] + jnp.arange(1 - c.window_size, 1, dtype=jnp.int32)[None]
    window, page, offset, ok = _slots(layout, caches, meta, rows, "window", 0,
                                      jnp.where(idx >= 0, idx, -1))
    got = window_pages.read_tokens(window.cache.pages, layer, page, offset,
                                   page_size=layout.page_size, dim=c.head_dim)
    kv = jnp.where(ok[..., None], formats.decode_window_kv(got), 0.0)
    if source is not None:
        r, k = layout.source_slot(source)
        pool, page, offset, pok = _slots(layout, caches, meta, rows, f"pool{r}", r, topk)
        got = pool_pages.read_entries(pool.cache.pages, k, page, offset,
                                      page_size=layout.page_size, dim=c.head_dim)
        pkv = jnp.where(pok[..., None], formats.decode_compressed_kv(got), 0.0)
        kv, ok = jnp.concatenate([kv, pkv], axis=1), jnp.concatenate([ok, pok], axis=1)
    ok = ok.at[:, 0].set(ok[:, 0] | ~rows.in_seq)  # a row outside every sequence: finite, zeroed
    return L.attend(q[:, None], kv, ok[:, None], sink, c.head_dim ** -0.5, rb)[:, 0]


def attend_rows(num_rows: int, width: int, dim: int) -> int:
    """Rows per chunk of the jnp attention (``_attend_rows``): the most whose decoded kv
    ``f32[C, width, dim]`` (``width`` window tokens and top-k entries a row) fit
    ``ATTEND_CHUNK_BYTES``, at least 1, balanced over the chunks (``chunk_rows``)."""
    return chunk_rows(max(num_rows, 1), max(width * dim, 1), 1, ATTEND_CHUNK_BYTES)


def _attend_rows(q, layer, source, topk, layout, caches, meta, rows, sink, precision):
    """``_attend`` a chunk of ``attend_rows`` rows at a time (``_in_row_chunks``): the
    gathered and decoded window tokens and pool entries of one chunk at once, never
    ``f32[T, window + k, D]``. Each row's output depends only on its own reads: the same
    values as one call."""
    c = layout.config
    width = c.window_size + (0 if source is None else c.index_topk)

    def chunk(row0, n):
        cut = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=row0, slice_size=n)
        return _attend(cut(q), layer, source, None if source is None else cut(topk), layout,
                       caches, meta, batch.RowFacts(*map(cut, rows)), sink, precision)

    t = q.shape[0]
    return _in_row_chunks(chunk, t, attend_rows(t, width, c.head_dim))


def _pallas_attend(kernel, q, layer, source, topk, layout, caches, meta, rows, sink, precision):
    """``_attend``'s array from the Pallas attention (``kernel``: ``v41_attention`` with the
    kernel options) reading the window pages at stack row ``layer`` and the source's pool pages
    in place: each window segment's and listed entry's page looked up here (``row_slots``,
    ``-1`` where released, unwritten or outside the sequence)."""
    c = layout.config
    pos = jnp.where(rows.in_seq, rows.abs_pos, -1)
    base = window_segments(pos, window_size=c.window_size, page_size=layout.page_size,
                           dim=c.head_dim)
    _, page, _, ok = _slots(layout, caches, meta, rows, "window", 0,
                            jnp.where(rows.in_seq[:, None], base, -1))
    pool = {}
    if source is not None:
        r, k = layout.source_slot(source)
        _, ppage, poff, pok = _slots(layout, caches, meta, rows, f"pool{r}", r, topk)
        pool = dict(pool_pages_=getattr(caches, f"pool{r}"), pool_page=jnp.where(pok, ppage, -1),
                    pool_offset=poff, pool_layer=k)
    return kernel(q, sink, caches.window, jnp.where(ok, page, -1), base, pos,
                  window_size=c.window_size, page_size=layout.page_size, window_layer=layer,
                  precision=precision, **pool)


class _Projected(NamedTuple):
    """One layer's regime params, rounded input rows and query side, kept from the writes to
    the reads."""

    params: dict
    x: jax.Array
    qr: jax.Array
    q: jax.Array
    cos_p: jax.Array
    sin_p: jax.Array


def _write_layer(params, x, plan, layout, caches, states, meta, rows, precision, compress):
    """Layer ``plan.layer``'s projections and (a KV source) its compressor's entries and state,
    written. Returns ``(_Projected, its window rows u8[T, W], caches, states)``."""
    c, rb = layout.config, rounding(precision)
    # inside the jit: an engine's bf16 weights stay bf16 in HBM, upcast (exactly) where they
    # are read; the regime's rounding first (of a bf16 weight: none, not a rounded copy of it)
    params = {k: jnp.asarray(v, jnp.float32)
              for k, v in L.regime_params(params, precision).items()}
    x = rb(jnp.asarray(x, jnp.float32))
    cos, sin = L.rope_tables(c, plan.ratio, layout.max_seq_len)
    pos = jnp.clip(rows.abs_pos, 0, layout.max_seq_len - 1)
    cos_p, sin_p = jnp.take(cos, pos, axis=0), jnp.take(sin, pos, axis=0)
    qr, q, window_row = L.project(params, x[None], cos_p, sin_p, c, rb)
    if plan.mode is Mode.FULL:
        caches, states = _compress(params, x, plan.layer, layout, caches, states, meta, rb,
                                   compress)
    projected = _Projected(params, x, qr[0], q[0], cos_p, sin_p)
    return projected, formats.encode_window_kv(window_row[0]), caches, states


def _write_windows(rows_u8, layout, caches, meta):
    """Every layer's window rows ``u8[L, T, W]`` into the window stack, one scatter."""
    window, per = _paged(layout, caches, meta, "window", 0)
    page_id, offset = batch_write_slots(   # the package's write rule (dsa_jax.cache)
        ragged(window, meta.kv_lens, meta.cu_q_lens, meta.distribution, pages_per_seq=per),
        rows_u8.shape[1])
    layers = jnp.arange(rows_u8.shape[0], dtype=jnp.int32)[:, None]
    return caches._replace(window=window_pages.write_tokens(
        window.cache.pages, layers, page_id[None], offset[None], rows_u8,
        page_size=layout.page_size, dim=layout.config.head_dim))


def _read_layer(p: _Projected, plan, layout, caches, meta, rows, pub, precision, ops):
    """Layer ``plan.layer``'s reads: its top-k (an index source) and attention, then the
    output stage; ``pub`` (source, topk, candidates) updated in place. ``f32[T, dim]``."""
    c, rb = layout.config, rounding(precision)
    if plan.mode is Mode.FULL:
        pub["source"] = plan.layer
    if plan.mode in (Mode.FULL, Mode.REINDEX):
        pub["topk"], pub["candidates"] = _select(
            p.params, p.x, p.qr, p.cos_p, p.sin_p, pub["source"], plan, layout, caches, meta,
            rows, pub["candidates"], rb, precision, ops)
        pub["tops"].append(pub["topk"])
    source = None if plan.mode is Mode.SWA else pub["source"]
    o = ops.attend(p.q, plan.layer, source, pub["topk"], layout, caches, meta, rows,
                   p.params["attn_sink"], precision)
    out = L.layer_output(p.params, o[None], c, p.cos_p, p.sin_p, rb)[0]
    return jnp.where(rows.in_seq[:, None], out, 0.0)


def v41_step_body(params, xs, caches: V41Caches, states: tuple, meta: V41Meta, *,
                  layout: V41StepLayout, precision: str, implementation: str = "xla",
                  kernel_options: tuple = ()) -> V41StepResult:
    """The step, unjitted (``v41_step`` checks and jits it); ``kernel_options`` a sorted tuple
    of items. Every layer's writes (window rows, compressed entries, states) come before any
    read: each layer's writes depend only on its own input rows, and XLA keeps one buffer per
    donated stack (no copy of a stack between a read and a later write)."""
    ops = _ops(implementation, kernel_options)
    rows = batch.row_facts(xs.shape[1], meta.kv_lens, meta.cu_q_lens, meta.distribution)
    plans, projected, windows = resolve_layers(layout.config), [], []
    for plan in plans:
        p, w, caches, states = _write_layer(params[plan.layer], xs[plan.layer], plan, layout,
                                            caches, states, meta, rows, precision,
                                            ops.compress)
        projected.append(p)
        windows.append(w)
    caches = _write_windows(jnp.stack(windows), layout, caches, meta)
    pub = {"source": None, "topk": None, "candidates": None, "tops": []}
    out = jnp.stack([_read_layer(p, plan, layout, caches, meta, rows, pub, precision, ops)
                     for p, plan in zip(projected, plans, strict=True)])
    out = out if precision == "f32" else out.astype(jnp.bfloat16)
    topk = (jnp.stack(pub["tops"]) if pub["tops"]
            else jnp.zeros((0, xs.shape[1], layout.config.index_topk), jnp.int32))
    return V41StepResult(out, topk, pub["candidates"], caches, tuple(states))


_v41_step = jax.jit(v41_step_body, static_argnames=("layout", "precision", "implementation",
                                                   "kernel_options"),
                    donate_argnames=("caches", "states"))


def v41_step(params, xs, caches: V41Caches, states: tuple, meta: V41Meta, *,
             layout: V41StepLayout, precision: str = V4_DEFAULT_PRECISION,
             implementation: str | None = None,
             kernel_options: dict | None = None) -> V41StepResult:
    """One DeepSeek-V4.1 attention step over all layers (module docstring); jitted, caches
    and states donated.

    Args:
      params: list of per-layer dicts, one per ``compress_ratios`` entry
        (``reference.statements.deepseek_v41.param_shapes``), f32 or bf16 arrays (read in
        their dtype, upcast inside the step; the bf16 regime rounds ``BF16_WEIGHTS`` anyway).
      xs: ``f32|bf16[L, T, dim]``: each layer's input rows (after its ``attn_norm``).
      caches: ``V41Caches`` (``init_v41_caches``); states: ``init_v41_states``' tuple.
      meta: ``V41Meta`` (``v41_meta``): tokens, rows, state slots, each family's page table.
      layout: ``V41StepLayout`` (every static number).
      precision: ``"bf16"`` (the official regime, default) or ``"f32"``.
      implementation: ``"xla"`` / ``None`` (every op in jnp) or ``"pallas"``: the ops that have
        a V4.1 Pallas kernel run on it: the ratio-2 compressor
        (``pallas_kernels.v41_compressor``), the index scores over the index pages with the
        selection chunk by chunk (``pallas_kernels.indexer.v41_scores.index_select_v41``) and
        the attention (``pallas_kernels.v41_attention``) (docs/v41.md). Anything else:
        ``ValueError``.
      kernel_options: those kernels' ``interpret`` / ``vmem_limit_bytes`` (``"pallas"`` only).

    Returns ``V41StepResult(out [L, T, dim], topk [Li, T, index_topk], candidates, caches,
    states)``. ``T = 0`` is a step that does nothing. Bad shapes, dtypes or a config mismatch
    raise ``ValueError`` / ``TypeError`` naming the argument and the numbers."""
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"v41_step: implementation must be one of {IMPLEMENTATIONS} or None, "
                         f"got {implementation!r}")
    implementation = implementation or "xla"
    opts = dict(kernel_options or {})
    if opts and implementation != "pallas":
        raise ValueError(f"v41_step: kernel_options {sorted(opts)} apply to "
                         f"implementation='pallas' only, got implementation={implementation!r}")
    unknown = sorted(set(opts) - set(KERNEL_OPTIONS))
    if unknown:
        raise ValueError(f"v41_step: unknown kernel_options {unknown} (the Pallas kernels "
                         f"take {KERNEL_OPTIONS})")
    precision = check_precision(precision)
    check_v41_step_args(params, xs, caches, states, meta, layout)
    c, t = layout.config, int(np.shape(xs)[1])
    if t == 0:
        nb = c.candidate_topk_blocks
        has_cands = any(p.candidates.value == "produces" for p in resolve_layers(c))
        return V41StepResult(
            jnp.zeros((layout.num_layers, 0, c.dim),
                      jnp.float32 if precision == "f32" else jnp.bfloat16),
            jnp.zeros((len(layout.index_layers), 0, c.index_topk), jnp.int32),
            jnp.zeros((0, nb), jnp.int32) if has_cands else None, caches, states)
    return _v41_step([dict(p) for p in params], jnp.asarray(xs), caches, tuple(states), meta,
                     layout=layout, precision=precision, implementation=implementation,
                     kernel_options=tuple(sorted(opts.items())))
