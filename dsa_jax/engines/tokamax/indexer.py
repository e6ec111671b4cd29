"""tokamax 0.0.17's indexer ops, ``lightning_indexer`` and ``top_k``, with tokamax's names,
arguments and results, computed here (issue 29; ``docs/engines/tokamax.md`` sections 1, 2, 6).

``lightning_indexer`` reads tokamax's fp8 index cache bytes (``reference.formats.tokamax_index``:
256-byte records, ``"head_along_sublane"`` or ``"seq_along_lane"``) page by page, as this
package's indexer reads its own caches: one sequence at a time, its pages gathered once
(``reference.core.batch.RaggedBatch.seq_pages`` over the fixed-stride table that
``dsa_jax.Batch.from_fixed_stride`` turns into the packed form), its rows scored in windows
from ``reference.indexer.scores.window_ladder`` (each window's ``[rows, H, entries]`` products
within ``SCORE_BLOCK_BYTES``), the exact top-k by ``reference.indexer.selection``. The score is
tokamax's, in its order (f32; ``q``, the e4m3 codes and the weights upcast exactly):

    score[t, j] = (sum_h w[t, h] * relu(q[t, h] . code_j)) * scale_j

with ``scale_j = 2**(byte 128 of record j - 127)`` (only the first scale: a record written with
``quant_block < 128`` is read as tokamax reads it). On CPU this is bit-identical to tokamax's
``implementation="xla"`` under jax 0.12 (``tests/test_tokamax_parity_indexer.py``).

Differences from tokamax, all outside well-formed input or by choice:

- ``causal_rule``: ``"official"`` (default) shows entry ``j`` to a row at token position ``p``
  iff ``j < (p + 1) // r`` (DeepSeek-V4 / ``dsa_jax.indexer_topk``; an entry exists once its
  group's last token has arrived); ``"tpu_inference"`` is tokamax's ``j <= p // r``. Both also
  need ``j < seq_len // r``. They differ only for a row with ``p % r != r - 1`` that is not its
  sequence's last (prefill; tokamax's row sees one entry more, docs section 2.4).
- A page id outside ``[0, P)`` in a used page slot makes that page's entries invisible here;
  tokamax clips the id and reads that page. Rows before ``cu_q_lens[0]`` belong to no sequence
  here. Non-finite scores (NaN or inf keys or queries): a NaN is no candidate here, and a
  ``+inf`` is selected; tokamax's reference ranks both first and returns ``-1`` in their slots
  (so its ``-1`` are then not only a suffix). ``top_k`` agrees with tokamax's on both.
- ``implementation``: ``None`` / ``"xla"`` run the path above; ``"pallas"`` / ``"mosaic"`` run
  the package's Pallas token indexer on the records as stored
  (``pallas_kernels.indexer.token.streamindex_topk_records``, cache format
  ``pallas_kernels.indexer.records.RECORD_FORMAT``; off TPU in the strict interpreter), same
  score order and selection; ``"head_along_sublane"`` only (``"seq_along_lane"`` raises
  ``NotImplementedError`` there). An ordered list is tried in order
  (``dsa_jax.backend.first_serving``: ``ExceptionGroup`` when all fail); an unknown name is a
  ``ValueError`` (tokamax skips it).
- ``cp_size != 1`` (context parallelism) raises ``NotImplementedError``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_jax import backend as _backend
from dsa_jax.batch import Batch
from pallas_kernels.indexer import token as _pallas_token
from reference.core import batch as _batch
from reference.core import checks as _checks
from reference.formats import tokamax_index as _ti
from reference.indexer import scores as _scores
from reference.indexer import selection as _selection

__all__ = ["CAUSAL_RULES", "lightning_indexer", "top_k"]

CAUSAL_RULES = ("official", "tpu_inference")
INDEXER_IMPLEMENTATIONS = ("xla", "pallas", "mosaic")  # tokamax's: "mosaic", "xla"
TOP_K_IMPLEMENTATIONS = ("xla", "pallas", "mosaic_tpu")  # tokamax's: "mosaic_tpu", "xla"
_NO_KERNEL = {
    "lightning_indexer": "the Pallas indexer reads only the 'head_along_sublane' records; use "
                         "implementation='xla' for 'seq_along_lane'",
    "top_k": "this package has no standalone Pallas top-k (its top-k is lax.top_k inside the "
             "indexer); use implementation='xla'",
}
_FLOAT_Q = _checks.FLOAT_DTYPES + (jnp.dtype(jnp.float8_e4m3fn),)


def _dispatch(op: str, names: tuple[str, ...], implementation, serve, serve_pallas=None):
    """``serve()`` under ``implementation`` (module docstring): other names run
    ``serve_pallas()`` or, without one, raise ``NotImplementedError``; a list passes each
    failure on to the next name."""
    chosen = _backend.chosen_names(op, names, implementation, None) or ["xla"]

    def call(name):
        if name == "xla":
            return serve()
        if serve_pallas is None:
            raise NotImplementedError(f"{op}: implementation {name!r}: {_NO_KERNEL[op]}")
        return serve_pallas()

    return _backend.first_serving(op, [(n, n) for n in chosen], call, group=len(chosen) > 1)


def _int_vector(name: str, x) -> int:
    _checks.rank(name, x, 1)
    _checks.integer(name, x)
    return int(np.shape(x)[0])


def _check_indexer(q, w, cache, seq_lens, page_indices, cu_q_lens, distribution, *, k, ratio,
                   layout, rule, return_scores) -> int:
    """Static checks of ``lightning_indexer``; returns ``pages_per_seq``."""
    where = "lightning_indexer"
    _checks.positive_int("k", k, where)
    _checks.positive_int("compression_ratio", ratio, where)
    if ratio & (ratio - 1):
        raise ValueError(f"{where}: compression_ratio must be a power of 2 (tokamax's rule), "
                         f"got compression_ratio={ratio}")
    if rule not in CAUSAL_RULES:
        raise ValueError(f"{where}: unknown causal_rule {rule!r}; expected one of "
                         f"{CAUSAL_RULES}")
    if not isinstance(return_scores, bool):
        raise TypeError(f"{where}: return_scores must be a bool, got "
                        f"{type(return_scores).__name__}")
    _checks.rank("q", q, 3)
    dt = jnp.dtype(jnp.result_type(q))
    if dt not in _FLOAT_Q:
        raise TypeError(f"{where}: q must be float32, bfloat16 or float8_e4m3fn, got {dt}")
    _checks.dim("q", q, 2, _ti.HEAD_DIM, "the index record's key width")
    _checks.rank("indexer_weights", w, 2)
    _checks.floating("indexer_weights", w)
    _checks.dim("indexer_weights", w, 0, np.shape(q)[0], "q.shape[0] (T)")
    _checks.dim("indexer_weights", w, 1, np.shape(q)[1], "q.shape[1] (H)")
    _ti.check_index_cache("cache_kv", cache, layout)
    m = _int_vector("seq_lens", seq_lens)
    n = _int_vector("page_indices", page_indices)
    _int_vector("cu_q_lens", cu_q_lens)
    _int_vector("distribution", distribution)
    _checks.dim("cu_q_lens", cu_q_lens, 0, m + 1, "len(seq_lens) + 1")
    _checks.dim("distribution", distribution, 0, 3, "3 (decode_end, prefill_end, num_seqs)")
    if m and n % m:
        raise ValueError(f"{where}: len(page_indices) = {n} is not a multiple of "
                         f"len(seq_lens) = {m} (a fixed-stride table holds pages_per_seq = "
                         f"len(page_indices) // len(seq_lens) slots per sequence)")
    return n // m if m else 0


def lightning_indexer(q, indexer_weights, cache_kv, seq_lens, page_indices, cu_q_lens,
                      distribution, *, k: int, compression_ratio: int = 1,
                      kv_layout=_ti.HEAD_ALONG_SUBLANE, cp_size: int = 1, cp_rank=0,
                      interleave_size: int = 1, return_scores: bool = False,
                      implementation=None, causal_rule: str = "official"):
    """tokamax's ``lightning_indexer``: each row's ``k`` best compressed entries.

    Args:
      q: ``f32|bf16|float8_e4m3fn[T, H, 128]`` index queries (upcast to f32 exactly).
      indexer_weights: ``f32|bf16[T, H]`` per-head weights (every scale folded in).
      cache_kv: ``u8[P, ps // 4, 4, 256]`` (``"head_along_sublane"``) or ``u8[P, 33, 4, ps]``
        (``"seq_along_lane"``): tokamax's index records, ``ps`` entries per page.
      seq_lens: ``i32[M]`` **uncompressed** token counts, this step's rows included.
      page_indices: ``i32[M * pps]`` fixed-stride table over index pages: sequence ``s``'s
        entry ``j`` is in page ``page_indices[s * pps + j // ps]`` at ``j % ps``.
      cu_q_lens: ``i32[M + 1]`` row offsets; distribution: ``i32[3]`` ``(decode_end,
        prefill_end, num_seqs)``: rows at or after ``cu_q_lens[num_seqs]`` are all ``-1``.
      k: static, > 0: entries per row (more than a row sees: ``-1`` suffix).
      compression_ratio: static power of two ``r``: tokens per entry (4 for V4's CSA).
      kv_layout: ``"head_along_sublane"`` (default), ``"seq_along_lane"`` or tokamax's
        ``KVLayout`` (``reference.formats.tokamax_index.parse_layout``).
      cp_size, cp_rank, interleave_size: context parallelism; only ``cp_size=1`` is served
        (then the other two are ignored, as tokamax ignores them).
      return_scores: also return the selected scores as ``i32`` raw f32 bits (``-inf`` bits in
        the padding).
      implementation: ``None`` / ``"xla"`` / ``"pallas"`` / ``"mosaic"`` / an ordered list
        (module docstring).
      causal_rule: ``"official"`` (default, ``j < (p + 1) // r``) or ``"tpu_inference"``
        (tokamax's ``j <= p // r``); module docstring.

    Returns:
      ``i32[T, k]`` entry numbers within the sequence by descending score (ties to the lower
      entry), ``-1`` suffix-padded; with ``return_scores``, ``(indices, score_bits i32[T, k])``.
    """
    layout = _ti.parse_layout(kv_layout)
    pps = _check_indexer(q, indexer_weights, cache_kv, seq_lens, page_indices, cu_q_lens,
                         distribution, k=k, ratio=compression_ratio, layout=layout,
                         rule=causal_rule, return_scores=return_scores)
    cp = _checks.positive_int("cp_size", cp_size, "lightning_indexer")

    def serve():
        if cp != 1:
            raise NotImplementedError(f"lightning_indexer: cp_size={cp}: context-parallel "
                                      f"shards are not served (only cp_size=1)")
        idx, bits = _indexer(q, indexer_weights, cache_kv, seq_lens, page_indices, cu_q_lens,
                             distribution, k=k, ratio=compression_ratio, layout=layout,
                             pages_per_seq=pps, rule=causal_rule)
        return (idx, bits) if return_scores else idx

    def serve_pallas():
        if cp != 1:
            raise NotImplementedError(f"lightning_indexer: cp_size={cp}: context-parallel "
                                      f"shards are not served (only cp_size=1)")
        if layout != _ti.HEAD_ALONG_SUBLANE:
            raise NotImplementedError(f"lightning_indexer: kv_layout {layout!r}: "
                                      f"{_NO_KERNEL['lightning_indexer']}")
        idx, bits = _pallas_indexer(q, indexer_weights, cache_kv, seq_lens, page_indices,
                                    cu_q_lens, distribution, k=k, ratio=compression_ratio,
                                    pages_per_seq=pps, rule=causal_rule)
        return (idx, bits) if return_scores else idx

    return _dispatch("lightning_indexer", INDEXER_IMPLEMENTATIONS, implementation, serve,
                     serve_pallas)


def _pallas_indexer(q, w, cache, seq_lens, page_indices, cu_q_lens, distribution, *, k: int,
                    ratio: int, pages_per_seq: int, rule: str):
    """The ``"pallas"`` path (module docstring): ``(i32[T, k], score bits i32[T, k])``; the
    strict interpreter off TPU."""
    num_rows, num_seqs = int(np.shape(q)[0]), int(np.shape(seq_lens)[0])
    ps = _ti.check_index_cache("cache_kv", cache, _ti.HEAD_ALONG_SUBLANE)
    if num_rows == 0 or num_seqs == 0 or pages_per_seq == 0:
        neg = _score_bits(jnp.float32(-jnp.inf))
        return (jnp.full((num_rows, k), -1, jnp.int32), jnp.full((num_rows, k), neg, jnp.int32))
    fixed = Batch.from_fixed_stride(seq_lens, jnp.reshape(page_indices, (num_seqs, -1)),
                                    cu_q_lens, distribution, page_size=ps)
    q = jnp.asarray(q)
    if q.dtype == jnp.float8_e4m3fn:  # exact in bf16
        q = q.astype(jnp.bfloat16)
    return _pallas_token.streamindex_topk_records(
        q, jnp.asarray(w), jnp.asarray(cache), *fixed.arrays, k=k, pages_per_seq=pages_per_seq,
        compression_ratio=ratio, causal_rule=rule, interpret=not _backend.on_tpu())


def tokamax_scores(q: jax.Array, w: jax.Array, codes: jax.Array,
                   scale: jax.Array) -> jax.Array:
    """tokamax's score, in its order: ``q: f[R, H, 128]``, ``w: f[R, H]``, ``codes:
    f32[N, 128]`` (e4m3 values), ``scale: f32[N]`` -> ``f32[R, N] = (sum_h w * relu(q_h .
    code)) * scale`` (f32 products and sums)."""
    dots = jnp.einsum("rhd,nd->rhn", q.astype(jnp.float32), codes,
                      preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    weighted = jnp.sum(jnp.maximum(dots, 0.0) * w.astype(jnp.float32)[:, :, None], axis=1)
    return weighted * scale[None, :]


def _visible_limit(abs_pos, ratio: int, rule: str):
    """The last entry a row at token position ``abs_pos`` sees under ``rule`` (-1: none)."""
    if rule == "official":
        return _batch.last_visible_key(abs_pos, ratio)
    return abs_pos // ratio


def _score_bits(vals: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(vals.astype(jnp.float32), jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "ratio", "layout", "pages_per_seq", "rule"))
def _indexer(q, w, cache, seq_lens, page_indices, cu_q_lens, distribution, *, k: int,
             ratio: int, layout: str, pages_per_seq: int, rule: str):
    """The ``"xla"`` path (module docstring): ``(i32[T, k], score bits i32[T, k])``."""
    num_rows, heads = q.shape[0], q.shape[1]
    ps = _ti.check_index_cache("cache_kv", cache, layout)
    idx = jnp.full((num_rows, k), -1, jnp.int32)
    bits = jnp.full((num_rows, k), _score_bits(jnp.float32(-jnp.inf)), jnp.int32)
    num_seqs = seq_lens.shape[0]
    if num_rows == 0 or num_seqs == 0 or pages_per_seq == 0:
        return idx, bits
    fixed = Batch.from_fixed_stride(seq_lens, page_indices.reshape(num_seqs, pages_per_seq),
                                    cu_q_lens, distribution, page_size=ps)
    rb = _batch.RaggedBatch(*fixed.arrays, page_size=ps, pages_per_seq=pages_per_seq,
                            num_pages=int(cache.shape[0]), compression_ratio=ratio)
    facts = rb.rows(num_rows)
    limit = jnp.where(facts.in_seq, _visible_limit(facts.abs_pos, ratio, rule), -1)
    cap = rb.capacity_tokens
    ladder = _scores.window_ladder(num_rows, cap * heads)
    ladder_arr = jnp.asarray(ladder, jnp.int32)
    cols = jnp.arange(cap, dtype=jnp.int32)

    def seq_body(s, out):
        pages = rb.seq_pages(s)
        raw = jnp.take(cache, pages.page_ids, axis=0, mode="fill", fill_value=0)
        codes, scale = _ti.split_index_bytes(_ti.page_bytes(raw, layout).reshape(cap, -1))
        q_start = jnp.clip(cu_q_lens[s], 0, num_rows)
        q_end = jnp.clip(cu_q_lens[s + 1], q_start, num_rows)
        q_end = jnp.where(s < rb.num_active(), q_end, q_start)

        def window(width, start, out):
            s0 = jnp.clip(start, 0, num_rows - width)
            rows = s0 + jnp.arange(width, dtype=jnp.int32)
            sl = lambda x: lax.dynamic_slice_in_dim(x, s0, width, axis=0)  # noqa: E731
            scores = tokamax_scores(sl(q), sl(w), codes, scale)
            ok = pages.token_ok[None, :] & (cols[None, :] <= sl(limit)[:, None])
            sel, vals = _selection.select_topk_scored(jnp.where(ok, scores, -jnp.inf), k,
                                                      exact=True)
            mine = ((rows >= start) & (rows < q_end))[:, None]
            return tuple(lax.dynamic_update_slice_in_dim(o, jnp.where(mine, new, sl(o)), s0, 0)
                         for o, new in zip(out, (sel, _score_bits(vals)), strict=True))

        branches = [functools.partial(window, width) for width in ladder]

        def body(carry):
            start, out = carry
            pick = jnp.sum(ladder_arr > q_end - start)  # the largest window that fits
            return start + ladder_arr[pick], lax.switch(pick, branches, start, out)

        return lax.while_loop(lambda c: c[0] < q_end, body, (q_start, out))[1]

    return lax.fori_loop(0, num_seqs, seq_body, (idx, bits))


# ------------------------------------------------------------------------------------- top_k

def top_k(scores, k: int, row_lengths=None, *, return_scores: bool = False,
          implementation=None):
    """tokamax's ``top_k``: each row's ``k`` best columns.

    Args:
      scores: ``f32[b, n]``, or ``i32[b, n]`` holding raw f32 bits (``lightning_indexer``'s
        ``return_scores``).
      k: static, ``1 <= k <= n``.
      row_lengths: ``i32[b]`` or None: columns at or after a row's length (clipped to
        ``[0, n]``) are never chosen; nor are ``-inf`` and NaN scores.
      return_scores: also return the selected scores as ``i32`` raw f32 bits (``-inf`` bits in
        the padding).
      implementation: ``None`` / ``"xla"`` (``lax.top_k``), ``"pallas"`` / ``"mosaic_tpu"``
        (``NotImplementedError``), or an ordered list of them.

    Returns:
      ``i32[b, k]`` column indices by descending score (ties to the lower column), ``-1``
      suffix-padded; with ``return_scores``, ``(indices, score_bits i32[b, k])``.
    """
    where = "top_k"
    _checks.rank("scores", scores, 2)
    dt = jnp.dtype(jnp.result_type(scores))
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)):
        raise TypeError(f"{where}: scores must be float32 or int32 (raw f32 bits), got {dt}")
    b, n = (int(d) for d in np.shape(scores))
    _checks.positive_int("k", k, where)
    if k > n:
        raise ValueError(f"{where}: k = {k} exceeds the scores' columns n = {n} "
                         f"(scores.shape = {(b, n)})")
    if row_lengths is not None:
        _int_vector("row_lengths", row_lengths)
        _checks.dim("row_lengths", row_lengths, 0, b, "scores.shape[0]")
    if not isinstance(return_scores, bool):
        raise TypeError(f"{where}: return_scores must be a bool, got "
                        f"{type(return_scores).__name__}")

    def serve():
        idx, bits = _top_k(scores, row_lengths, k=k)
        return (idx, bits) if return_scores else idx

    return _dispatch(where, TOP_K_IMPLEMENTATIONS, implementation, serve)


@functools.partial(jax.jit, static_argnames=("k",))
def _top_k(scores, row_lengths, *, k: int):
    s = scores if scores.dtype == jnp.float32 else lax.bitcast_convert_type(scores, jnp.float32)
    n = s.shape[1]
    if row_lengths is not None:
        lens = jnp.clip(row_lengths.astype(jnp.int32), 0, n)
        s = jnp.where(jnp.arange(n, dtype=jnp.int32)[None, :] < lens[:, None], s, -jnp.inf)
    idx, vals = _selection.select_topk_scored(s, k, exact=True)
    return idx, _score_bits(vals)
