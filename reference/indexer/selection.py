"""The selection stage shared by every top-k path (reference and Pallas score kernels alike).

    scores -> approx_max_k (aggregated) or top_k (exact) -> guard (-1) -> segment-witness merge

Scores use ``-inf`` to mark a non-candidate; a NaN score is treated as a non-candidate too
(a NaN key in a valid slot is bad data, and NaN must never be selected ahead of real scores).

Modes:

- default (``exact=False``): ``jax.lax.approx_max_k(recall_target=..., aggregate_to_topk=True)``.
  It keeps the same approximate candidates as the seed's ``aggregate_to_topk=False`` -> ``top_k``
  -> ``take_along_axis`` (XLA aggregates them to the top k by a sort) without the per-element
  gather, which XLA's TPU cost model prices at 59x (64 x 4096) the bytes of this form. On
  CPU/GPU ``approx_max_k`` is exact; on TPU it is not, so results can differ by platform:
  compare by score, not by index.
- ``exact=True``: one ``jax.lax.top_k``. Deterministic tie rule: among equal scores the lower
  index (earlier token / page) comes first, on every platform.

Guard: slot ``j`` of a row keeps its index only if its score is ``> -inf``; everything else is
``-1``. Both modes return their ``k`` values sorted descending with distinct indices, so the
slots with a score ``> -inf`` are a prefix of at most ``n_valid`` (the row's candidate count)
slots: ``-1`` appears only in the tail, and a row with ``n <= k`` candidates selects all ``n``
(exact mode; the approximate mode may miss candidates on TPU, by its recall). ``k`` larger
than the number of columns is allowed: the extra slots are ``-1``. No reduction over the
scores beyond the top-k itself (a separate ``n_valid`` count cost another pass over them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from reference.core import checks as _checks
from reference.witnesses.policy import check_witness_policy, scatter_topology_witnesses

NEG_INF = float("-inf")
DEFAULT_RECALL_TARGET = 0.70


def check_selection_args(k: int, recall_target: float, exact: bool, num_segments: int,
                         *, k_name: str = "k", fill: str = "tail",
                         refuse_full_overwrite: bool = False) -> None:
    """Trace-time checks of the selection statics."""
    _checks.positive_int(k_name, k)
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    if not isinstance(recall_target, (int, float)) or not 0.0 < recall_target <= 1.0:
        raise ValueError(f"recall_target must be in (0, 1], got recall_target={recall_target!r}")
    _checks.nonneg_int("num_segments", num_segments)
    check_witness_policy(num_segments, k, fill, refuse_full_overwrite, topk_name=k_name)


def select_topk(scores: jax.Array, k: int, *, recall_target: float = DEFAULT_RECALL_TARGET,
                exact: bool = False) -> jax.Array:
    """Top-k column indices of each row of ``scores``, descending by score, ``-1`` padded.

    Args:
      scores: f32[R, N]; ``-inf`` (or NaN) marks a column that is not a candidate.
      k: static budget, may exceed N.
      recall_target: passed to ``approx_max_k`` (ignored when ``exact``).
      exact: exact ``top_k`` with the documented tie rule.

    Returns:
      i32[R, k] column indices, ``-1`` in the tail.
    """
    return select_topk_scored(scores, k, recall_target=recall_target, exact=exact)[0]


def select_topk_scored(scores: jax.Array, k: int, *,
                       recall_target: float = DEFAULT_RECALL_TARGET,
                       exact: bool = False) -> tuple[jax.Array, jax.Array]:
    """``select_topk`` and the selected scores as the top-k op returns them (no re-gather):
    ``(i32[R, k] indices, f32[R, k] scores)``, ``-1`` / ``-inf`` in the tail (NaN read as
    ``-inf``). Context-sharded top-k merges shards by these scores."""
    scores = scores.astype(jnp.float32)
    scores = jnp.where(jnp.isnan(scores), NEG_INF, scores)
    num_cols = scores.shape[-1]
    kk = min(k, num_cols)
    if exact:
        vals, idx = jax.lax.top_k(scores, kk)
    else:
        vals, idx = jax.lax.approx_max_k(scores, kk, recall_target=recall_target,
                                         aggregate_to_topk=True)
    ok = vals > NEG_INF
    idx = jnp.where(ok, idx, -1).astype(jnp.int32)
    vals = jnp.where(ok, vals, NEG_INF)
    if kk < k:
        idx = jnp.pad(idx, ((0, 0), (0, k - kk)), constant_values=-1)
        vals = jnp.pad(vals, ((0, 0), (0, k - kk)), constant_values=NEG_INF)
    return idx, vals


def causal_token_count(abs_pos: jax.Array, kv_len: jax.Array) -> jax.Array:
    """A row's causal candidate count in tokens: ``min(abs_pos + 1, kv_len)``, clipped at 0.
    In keys generally: ``abs_pos`` the row's last visible key and ``kv_len`` the keys that
    exist (compressed entries: ``reference.core.batch.last_visible_key`` / ``kv_eff``).

    The witness context length of token top-k (and, in pages, of page top-k)."""
    return jnp.clip(jnp.minimum(abs_pos + 1, kv_len), 0, None)


def select_and_merge(scores: jax.Array, k: int, context_lens: jax.Array, *,
                     recall_target: float, exact: bool, num_segments: int,
                     fill: str = "tail") -> jax.Array:
    """The whole stage: ``select_topk`` then ``finish_selection``. scores f32[R, N] (-inf for
    non-candidates), context_lens i32[R] -> i32[R, k]."""
    idx = select_topk(scores, k, recall_target=recall_target, exact=exact)
    return finish_selection(idx, context_lens, num_segments, fill)


def finish_selection(idx: jax.Array, context_lens: jax.Array, num_segments: int,
                     fill: str = "tail") -> jax.Array:
    """Apply the segment-witness merge (serving entry, ``fill`` as
    ``scatter_topology_witnesses``) after the guard; identity when 0.

    idx: i32[R, k]; context_lens: i32[R] (the row's causal candidate count: tokens, or pages
    for page top-k; ``<= 0`` for rows outside every sequence, which then get no witnesses).
    """
    if num_segments == 0:
        return idx
    return scatter_topology_witnesses(idx, context_lens.astype(jnp.int32), num_segments,
                                      fill=fill)
