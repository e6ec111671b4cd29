"""BASELINE ONLY: a faithful re-expression of the seed reference's algorithms (``shared/seeds/
003_*.txt``), kept so benchmarks can measure ours against it side by side. Not part of the
package and not for serving: it has the seed's known defects (clamped page windows without tail
padding, O(S * T * max_kv) general path, NaN leaking from unselected slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = float("-inf")


def _seq_keys(cache, page_indices, cu_kv_lens, seq, page_size, pages_per_seq):
    pages = jax.lax.dynamic_slice_in_dim(page_indices, cu_kv_lens[seq] // page_size,
                                         pages_per_seq)
    return cache[pages].reshape(pages_per_seq * page_size, cache.shape[-1])


def _seed_select(scores, mask, k):
    cand_v, cand_i = jax.lax.approx_max_k(scores, k, recall_target=0.70, aggregate_to_topk=False)
    vals, sel = jax.lax.top_k(cand_v, k)
    idx = jnp.take_along_axis(cand_i, sel, axis=-1)
    n_valid = mask.sum(-1, keepdims=True)
    return jnp.where((jnp.arange(k)[None, :] < n_valid) & (vals > _NEG), idx, -1)


def _seed_scores(q, w, keys):
    t, h, _ = q.shape
    if t * h * keys.shape[0] <= 1 << 26:
        s = jnp.einsum("thd,kd->thk", q, keys, preferred_element_type=jnp.float32)
        return jnp.einsum("th,thk->tk", w, jax.nn.relu(s))

    def h_step(i, acc):
        q_h = jax.lax.dynamic_index_in_dim(q, i, axis=1, keepdims=False)
        w_h = jax.lax.dynamic_index_in_dim(w, i, axis=1, keepdims=True)
        s_h = jnp.einsum("td,kd->tk", q_h, keys, preferred_element_type=jnp.float32)
        return acc + jax.nn.relu(s_h) * w_h

    return jax.lax.fori_loop(0, h, h_step, jnp.zeros((t, keys.shape[0]), jnp.float32))


@functools.partial(jax.jit, static_argnames=("k", "pages_per_seq", "one_token_per_seq"))
def seed_topk(q, weights, cache, seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
              *, k, pages_per_seq, one_token_per_seq=False):
    """The seed's token top-k: decode fast path, or the general path that rescores all T rows
    for every sequence."""
    num_rows = q.shape[0]
    page_size = cache.shape[1]
    max_kv = pages_per_seq * page_size
    w = weights.astype(jnp.float32)
    out = jnp.full((num_rows, k), -1, jnp.int32)

    def body_decode(seq, out):
        keys = _seq_keys(cache, page_indices, cu_kv_lens, seq, page_size, pages_per_seq)
        q_i = jax.lax.dynamic_slice_in_dim(q, seq, 1, 0)
        w_i = jax.lax.dynamic_slice_in_dim(w, seq, 1, 0)
        mask = (jnp.arange(max_kv) < seq_lens[seq])[None, :]
        scores = jnp.where(mask, _seed_scores(q_i, w_i, keys), _NEG)
        return jax.lax.dynamic_update_slice_in_dim(out, _seed_select(scores, mask, k), seq, 0)

    def body(seq, out):
        q_start, q_end, kv_len = cu_q_lens[seq], cu_q_lens[seq + 1], seq_lens[seq]
        keys = _seq_keys(cache, page_indices, cu_kv_lens, seq, page_size, pages_per_seq)
        rows, pos = jnp.arange(num_rows), jnp.arange(max_kv)
        in_seq = (rows >= q_start) & (rows < q_end)
        abs_q = kv_len - (q_end - q_start) + (rows - q_start)
        mask = in_seq[:, None] & (pos[None] < kv_len) & (pos[None] <= abs_q[:, None])
        scores = jnp.where(mask, _seed_scores(q, w, keys), _NEG)
        return jnp.where(in_seq[:, None], _seed_select(scores, mask, k), out)

    return jax.lax.fori_loop(0, seq_lens.shape[0], body_decode if one_token_per_seq else body,
                             out)


@functools.partial(jax.jit, static_argnames=("k_pages", "pages_per_seq", "one_token_per_seq"))
def seed_page_topk(q, weights, cache, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                   distribution, *, k_pages, pages_per_seq, one_token_per_seq=False):
    """The seed's page top-k: token scores max-pooled per page, exact ``top_k`` over pages; the
    general path rescores all T rows for every sequence."""
    num_rows = q.shape[0]
    page_size = cache.shape[1]
    max_kv = pages_per_seq * page_size
    w = weights.astype(jnp.float32)
    out = jnp.full((num_rows, k_pages), -1, jnp.int32)

    def select(scores, rows):
        page_scores = scores.reshape(rows, pages_per_seq, page_size).max(axis=-1)
        vals, pidx = jax.lax.top_k(page_scores, k_pages)
        return jnp.where(vals > _NEG, pidx, -1)

    def body_decode(seq, out):
        keys = _seq_keys(cache, page_indices, cu_kv_lens, seq, page_size, pages_per_seq)
        q_i = jax.lax.dynamic_slice_in_dim(q, seq, 1, 0)
        w_i = jax.lax.dynamic_slice_in_dim(w, seq, 1, 0)
        mask = (jnp.arange(max_kv) < seq_lens[seq])[None, :]
        scores = jnp.where(mask, _seed_scores(q_i, w_i, keys), _NEG)
        return jax.lax.dynamic_update_slice_in_dim(out, select(scores, 1), seq, 0)

    def body(seq, out):
        q_start, q_end, kv_len = cu_q_lens[seq], cu_q_lens[seq + 1], seq_lens[seq]
        keys = _seq_keys(cache, page_indices, cu_kv_lens, seq, page_size, pages_per_seq)
        rows, pos = jnp.arange(num_rows), jnp.arange(max_kv)
        in_seq = (rows >= q_start) & (rows < q_end)
        abs_q = kv_len - (q_end - q_start) + (rows - q_start)
        mask = in_seq[:, None] & (pos[None] < kv_len) & (pos[None] <= abs_q[:, None])
        scores = jnp.where(mask, _seed_scores(q, w, keys), _NEG)
        return jnp.where(in_seq[:, None], select(scores, num_rows), out)

    return jax.lax.fori_loop(0, seq_lens.shape[0], body_decode if one_token_per_seq else body,
                             out)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_seq", "v_dim"))
def seed_sparse_mla(q, cache, kv_lens, topk_indices, page_indices, cu_q_lens, cu_kv_lens,
                    distribution, *, sm_scale, pages_per_seq, v_dim):
    """The seed's sparse MLA: per sequence, gathers and attends all T rows, masks the rest."""
    num_rows = q.shape[0]
    page_size = cache.shape[1]
    out = jnp.zeros((num_rows, q.shape[1], v_dim), q.dtype)

    def body(seq, out):
        q_start, q_end = cu_q_lens[seq], cu_q_lens[seq + 1]
        kv_flat = _seq_keys(cache, page_indices, cu_kv_lens, seq, page_size, pages_per_seq)
        in_seq = (jnp.arange(num_rows) >= q_start) & (jnp.arange(num_rows) < q_end)
        idx = jnp.where(topk_indices >= 0, topk_indices, 0)
        valid = (topk_indices >= 0) & (topk_indices < kv_lens[seq]) & in_seq[:, None]
        kv_sel = kv_flat[idx]
        logits = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32),
                            kv_sel.astype(jnp.float32)) * sm_scale
        logits = jnp.where(valid[:, None, :], logits, _NEG)
        p = jnp.where(valid[:, None, :], jax.nn.softmax(logits, axis=-1), 0.0)
        o = jnp.einsum("thk,tkd->thd", p, kv_sel[..., :v_dim].astype(jnp.float32))
        return jnp.where(in_seq[:, None, None], o.astype(q.dtype), out)

    return jax.lax.fori_loop(0, kv_lens.shape[0], body, out)
