"""Lightning-indexer scores and the row-window driver shared by token and page top-k.

    score[t, s] = sum_h w[t, h] * relu(q[t, h, :] . k[s, :])        (f32 accumulate)

``precision="bf16"`` (DeepSeek-V4's official inference code, docs/V4_OFFICIAL_REGIME.md steps
20-25): q, keys and weights rounded to bf16, then ``dot = bf16(q_h . k_s)`` (f32 accumulation,
one rounding), ``prod = bf16(relu(dot) * w_h)``, ``score = bf16(sum_h prod)`` (f32 accumulation
over heads, one rounding); scores are bf16 values held in f32.

Cost model of the general (ragged) path. For each active sequence the driver gathers the
sequence's own keys once (``[capacity_tokens, D]``) and scores that sequence's rows in windows of
``w`` rows, ``w`` drawn greedily (largest first) from a static ladder ``w_max, w_max/4, ..., 1``.
Each row is therefore scored against its own sequence only: O(T * capacity_tokens) work, not the
seed's O(S * T * capacity_tokens). Decode rows take the ``w = 1`` window, so a decode batch through
the general path costs what the ``one_token_per_seq`` fast path costs.

Memory bound (documented, static): one window's scores are ``f32[w_max, capacity_tokens]``,
with ``w_max`` the largest power of two such that this is ``<= SCORE_BLOCK_BYTES`` (64 MiB),
capped at ``MAX_WINDOW_ROWS`` and at ``T``. When the ``[w, H, capacity_tokens]`` head
intermediate would exceed the same budget, heads are accumulated one at a time instead.
Peak temporaries are therefore a small multiple of 64 MiB whatever T is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from reference.core import batch
from reference.formats import fp8_cache, stacked
from reference.quant import qat
from reference.quant.bf16 import round_bf16

SCORE_BLOCK_BYTES = 64 * 1024 * 1024
MAX_WINDOW_ROWS = 256


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array, precision: str = "f32") -> jax.Array:
    """Indexer scores of ``q: f[R, H, D]`` (weights ``w: f[R, H]``) against ``keys: f[N, D]``.

    Returns f32[R, N]. Inputs may be bf16 or f32; products accumulate in f32.
    ``precision="bf16"`` (checked by the entries): the official rounding (module docstring):
    q and keys are cast to bf16 (the mode always means bf16 operands; bf16 inputs are used as
    given), ``w`` is rounded to bf16, each head's dot and each ``relu(dot) * w`` product is
    rounded to bf16, the head sum accumulates in f32 and is rounded once. ``"f32"``: the traced
    program is the one without the argument.
    """
    rows, heads, _ = q.shape
    n = keys.shape[0]
    w = w.astype(jnp.float32)
    prec = jax.lax.Precision.HIGHEST
    bf16 = precision == "bf16"
    if bf16:
        q, keys, w = q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16), round_bf16(w)
    if rows * heads * n * 4 <= SCORE_BLOCK_BYTES:
        s = jnp.einsum("rhd,nd->rhn", q, keys, preferred_element_type=jnp.float32,
                       precision=prec)
        if bf16:
            prod = round_bf16(jax.nn.relu(round_bf16(s)) * w[:, :, None])
            return round_bf16(jnp.sum(prod, axis=1))
        return jnp.einsum("rh,rhn->rn", w, jax.nn.relu(s), precision=prec)

    def head_step(h, acc):
        q_h = jax.lax.dynamic_index_in_dim(q, h, axis=1, keepdims=False)
        w_h = jax.lax.dynamic_index_in_dim(w, h, axis=1, keepdims=True)
        s_h = jnp.einsum("rd,nd->rn", q_h, keys, preferred_element_type=jnp.float32,
                         precision=prec)
        if bf16:
            return acc + round_bf16(jax.nn.relu(round_bf16(s_h)) * w_h)
        return acc + jax.nn.relu(s_h) * w_h

    acc = jax.lax.fori_loop(0, heads, head_step, jnp.zeros((rows, n), jnp.float32))
    return round_bf16(acc) if bf16 else acc


def fp4_sim(x: jax.Array) -> jax.Array:
    """``f32[..., 128]``: the official indexer's view of q heads / keys, a normalized Hadamard
    rotation then the FP4 simulation (``reference.quant.qat.hadamard_rotate`` /
    ``fp4_act_quant_sim``, SPEC.md's ``fp4_act_quant`` rule: block 32, ue8m0, e2m1 RNE)."""
    return qat.fp4_act_quant_sim(qat.hadamard_rotate(x.astype(jnp.float32)))


# ``index_quant`` name -> the map applied to q heads ``f[T, H, D]`` and to the gathered keys
# ``f[N, D]`` before scoring (``None``: scores as given). One definition for the reference token
# and page top-k; the Pallas indexer applies the same map to q in its glue and to the keys in
# the kernel (``pallas_kernels.indexer.fp4``). Names are checked by
# ``args.check_index_quant``.
INDEX_QUANT_MAPS = {None: None, "fp4_sim": fp4_sim}


def window_ladder(num_rows: int, capacity: int) -> tuple[int, ...]:
    """Static window sizes (descending, ending in 1) for ``num_rows`` rows at ``capacity``."""
    w_max = max(1, min(MAX_WINDOW_ROWS, num_rows, SCORE_BLOCK_BYTES // (4 * capacity)))
    w_max = 1 << (w_max.bit_length() - 1)
    ladder = []
    w = w_max
    while w > 1:
        ladder.append(w)
        w //= 4
    return tuple(ladder) + (1,)


# finish(scores f32[w, cap], token_ok bool[w, cap], key_pos i32[w], kv_len i32) -> i32[w, width]
# key_pos: each row's last visible key (``batch.last_visible_key``: its absolute position for
# tokens, ``(p + 1) // r - 1`` for compressed entries); kv_len the effective length in keys,
# ``min(entries_of_tokens(kv_len), capacity)``. So ``min(key_pos + 1, kv_len)`` counts a row's
# candidates in either unit.
Finish = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def gather_keys(cache, page_ids, layer=None) -> tuple[jax.Array, jax.Array | None]:
    """A sequence's keys ``[n * page_size, D]`` and, for an ``Fp8IndexCache``, their per-token
    scales ``f32[n * page_size]`` (the codes are upcast to f32 exactly); ``None`` otherwise.
    ``layer``: of a stacked cache, read in place (``reference.formats.stacked``); ids
    ``== num_pages`` (and every id of a layer outside the stack) read nothing."""
    read = stacked.resolve("cache", cache, layer)
    st, lay = read.stacked, read.layer
    if isinstance(st, fp8_cache.Fp8IndexCache):
        k8 = stacked.take(st.keys, lay, page_ids)
        scale = stacked.take(st.scales, lay, page_ids)[:, :st.page_size]
        return k8.reshape(-1, st.shape[-1]).astype(jnp.float32), scale.reshape(-1)
    return stacked.take(st, lay, page_ids).reshape(-1, st.shape[-1]), None


def scaled_scores(q, w, keys, key_scale, precision: str = "f32") -> jax.Array:
    """``index_scores``, times each key's scale (fp8 cache): ``s[t, s] = scale[s] * sum_h w[t, h]
    * relu(q[t, h] . k8[s])`` (DeepGEMM's order: the positive scale commutes with relu). An fp8
    ``q`` is upcast to f32 exactly (its own scale is folded into ``w`` by the caller).
    ``precision``: as ``index_scores`` (``"bf16"`` comes without key scales: the entries refuse
    it with an fp8 cache)."""
    if q.dtype == fp8_cache.fp8.FP8_DTYPE:
        q = q.astype(jnp.float32)
    s = index_scores(q, w, keys, precision)
    return s if key_scale is None else s * key_scale[None, :]


def _score_window(width_rows, q, w, keys, key_scale, pages, start, q_start, q_end, kv_len, out,
                  finish: Finish, compression_ratio: int = 1, precision: str = "f32"):
    """Score rows ``[start, start + width_rows)`` (clamped into ``[0, T)``) of one sequence and
    write the rows that lie in ``[start, q_end)`` into ``out``. ``kv_len``: the sequence's
    length in tokens (row positions are tokens; keys are entries when ``compression_ratio >
    1``, ``reference.core.batch``)."""
    num_rows = q.shape[0]
    s0 = jnp.clip(start, 0, num_rows - width_rows)
    rows = s0 + jnp.arange(width_rows, dtype=jnp.int32)
    q_w = jax.lax.dynamic_slice_in_dim(q, s0, width_rows, axis=0)
    w_w = jax.lax.dynamic_slice_in_dim(w, s0, width_rows, axis=0)
    abs_pos = kv_len - (q_end - q_start) + (rows - q_start)
    key_pos = batch.last_visible_key(abs_pos, compression_ratio)
    cap = pages.token_ok.shape[0]
    causal = jnp.arange(cap, dtype=jnp.int32)[None, :] <= key_pos[:, None]
    token_ok = pages.token_ok[None, :] & causal
    sel = finish(scaled_scores(q_w, w_w, keys, key_scale, precision), token_ok, key_pos,
                 pages.kv_len)
    mine = (rows >= start) & (rows < q_end)
    old = jax.lax.dynamic_slice_in_dim(out, s0, width_rows, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], sel, old), s0, 0)


def score_and_select(q, weights, cache, kv_lens, page_indices, cu_q_lens, cu_kv_lens,
                     distribution, *, pages_per_seq: int, out_width: int,
                     one_token_per_seq: bool, finish: Finish, layer=None,
                     compression_ratio: int = 1, key_map=None,
                     precision: str = "f32") -> jax.Array:
    """Drive ``finish`` over every active sequence's rows; rows outside stay ``-1``.
    ``layer``: which layer of a stacked ``cache`` to read (``reference.formats.stacked``);
    ``compression_ratio``: the cache's keys are entries of that many tokens
    (``reference.core.batch``; ``kv_lens`` stay tokens); ``key_map``: applied to each sequence's
    gathered keys ``f[N, D]`` before scoring (``INDEX_QUANT_MAPS``), or None; ``precision``:
    the scores' rounding (``index_scores``; checked by the entries).

    Returns i32[T, out_width].
    """
    num_rows = q.shape[0]
    page_indices = stacked.mask_table(page_indices, stacked.resolve("cache", cache, layer))
    b = batch.RaggedBatch.of(cache, kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
                             pages_per_seq=pages_per_seq, compression_ratio=compression_ratio)
    num_seqs = b.num_seqs
    n_active = b.num_active()
    out = jnp.full((num_rows, out_width), -1, dtype=jnp.int32)
    ladder = (1,) if one_token_per_seq else window_ladder(num_rows, b.capacity_tokens)
    ladder_arr = jnp.asarray(ladder, dtype=jnp.int32)

    def seq_body(seq_id, out):
        pages = b.seq_pages(seq_id)
        keys, key_scale = gather_keys(cache, pages.page_ids, layer)
        if key_map is not None:
            keys = key_map(keys)
        if one_token_per_seq:  # row seq_id is the sequence's last token
            q_start, q_end = seq_id, seq_id + 1
        else:
            q_start = jnp.clip(cu_q_lens[seq_id], 0, num_rows)
            q_end = jnp.clip(cu_q_lens[seq_id + 1], q_start, num_rows)
        q_end = jnp.where(seq_id < n_active, q_end, q_start)
        branches = [
            lambda start, out, wr=wr: _score_window(wr, q, weights, keys, key_scale, pages,
                                                    start, q_start, q_end, kv_lens[seq_id], out,
                                                    finish, compression_ratio, precision)
            for wr in ladder
        ]

        def body(carry):
            start, out = carry
            pick = jnp.sum(ladder_arr > q_end - start)  # largest window that fits
            out = jax.lax.switch(pick, branches, start, out)
            return start + ladder_arr[pick], out

        return jax.lax.while_loop(lambda c: c[0] < q_end, body, (q_start, out))[1]

    return jax.lax.fori_loop(0, num_seqs, seq_body, out)
