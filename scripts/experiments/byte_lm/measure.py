"""Selections at equal budget on real attention rows, their metrics, and the model-level effect.

Rows: every query position ``t`` of every held-out window (a window of ``T`` tokens is one
sequence; row ``t`` has the causal context ``L = t + 1``). Metrics are reported on the rows
whose budget binds, ``L > k``: there every selection below holds exactly ``k`` distinct valid
tokens (checked and recorded as ``budget``). Rows with ``L <= k`` select their whole context
under every selection (all are then dense).

Selections (``i32[R, k]`` sequence-local token offsets, ``-1`` padding):

- ``indexer``: ``dsa_jax.indexer_topk(..., exact=True, backend="reference")`` on the distilled
  indexer's ``q``, ``w`` and keys, laid out as a paged batch (one sequence per window);
- ``indexer+wit_tail``: the serving merge ``scatter_topology_witnesses(indexer, L, S)``
  (``fill="tail"``, the default: witnesses from slot ``k - S`` upward), checked identical to the
  same ``indexer_topk`` call with ``num_segments=S`` (every cell in the full run; the first cell
  only in ``--quick``);
- ``indexer+wit_lowest``: ``scatter_topology_witnesses(..., fill="lowest")``: a row's ``w``
  valid witnesses overwrite its last ``w`` slots (padding first, then the lowest-scored
  entries), slots before them unchanged; checked identical to ``fill_lowest`` below (a NumPy
  statement of the rule) and to ``indexer_topk(num_segments=S, fill="lowest")`` as the tail;
- ``random``: ``dsa_jax.random_selector(T, k, seed + window)`` (row ``t`` draws from ``[0, t]``);
- ``local``: ``dsa_jax.local_selector(T, k)`` (the ``k`` most recent tokens);
- ``oracle``: ``reference.selection.select_topk(exact=True)`` of the true attention row (the
  layer's attention averaged over its heads): the upper bound of recall at budget ``k``.

Metrics (definitions equal to ``reference.witnesses``; vectorised here, and cross-checked against
``segment_coverage`` / ``attention_mass_recall`` on sampled rows of every cell):

- recall = ``sum(a[C]) / sum(a)`` with ``a`` the head-averaged attention row of the layer over
  ``[0, L)``, ``C`` the distinct valid entries;
- coverage = share of the ``S_eff = min(S, L)`` segments ``x * S_eff // L`` that ``C`` meets.

Model-level effect: held-out bits per byte when ONE layer's attention (all its heads) is
restricted to a row's selection (dense attention over the selected tokens only), the other
layers dense. Restricting one layer at a time keeps the selection consistent: the indexer reads
that layer's input, which the restriction does not change.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from reference.selection import select_topk
from reference.witnesses import attention_mass_recall, segment_coverage
from scripts.experiments.byte_lm import model as M

PAGE_SIZE = 64
BASE = ("indexer", "random", "local", "oracle")
WITNESS = ("indexer+wit_tail", "indexer+wit_lowest")
SELECTIONS = ("indexer", "indexer+wit_tail", "indexer+wit_lowest", "random", "local", "oracle")


# --------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------


def fill_lowest(topk: np.ndarray, context_lens: np.ndarray, num_segments: int) -> np.ndarray:
    """Witnesses written over the LOWEST-scored slots (the ``fill="lowest"`` candidate policy).

    ``topk: i32[R, k]`` rows as ``select_topk`` returns them (descending by score, ``-1``
    padding in the tail). The witnesses are ``dsa_jax.topology_witness_indices(topk, L, S)``
    (the segments the whole row misses), in ascending segment order. A row with ``w`` valid
    witnesses gets them in its last ``w`` slots (``k - w .. k - 1``): padding first, then the
    lowest-scored entries; slots ``[0, k - w)`` are bit-identical. ``w > k`` (only possible for
    ``S > k``) keeps the first ``k`` witnesses. ``S = 0`` is the identity.
    """
    topk = np.asarray(topk, np.int32)
    if num_segments == 0 or topk.shape[0] == 0:
        return topk.copy()
    wit = np.asarray(dsa_jax.topology_witness_indices(
        jnp.asarray(topk), jnp.asarray(context_lens, jnp.int32), num_segments))
    k = topk.shape[1]
    valid = wit >= 0
    m = np.minimum(valid.sum(axis=1), k)  # witnesses written per row
    order = np.argsort(~valid, axis=1, kind="stable")  # valid witnesses first, ascending
    comp = np.take_along_axis(wit, order, axis=1)
    rank = np.arange(k)[None, :] - (k - m)[:, None]  # which witness slot j takes
    take = rank >= 0
    vals = np.take_along_axis(comp, np.clip(rank, 0, comp.shape[1] - 1), axis=1)
    return np.where(take, vals, topk).astype(np.int32)


def paged_args(q, w, keys, page_size: int = PAGE_SIZE):
    """The windows as a paged prefill batch for ``dsa_jax.indexer_topk``: one sequence per
    window, ``q_len = kv_len = T``, identity page table. Returns ``(args, pages_per_seq)``."""
    b, t, hi, di = q.shape
    pps = t // page_size
    cache = jnp.asarray(keys).reshape(b * pps, page_size, di)
    cu = (np.arange(b + 1) * t).astype(np.int32)
    args = (jnp.asarray(q).reshape(b * t, hi, di), jnp.asarray(w).reshape(b * t, hi), cache,
            jnp.full((b,), t, jnp.int32), jnp.arange(b * pps, dtype=jnp.int32),
            jnp.asarray(cu), jnp.asarray(cu), jnp.asarray([0, b, b], jnp.int32))
    return args, pps


def base_selections(args, pps, attn: np.ndarray, k: int, seed: int) -> dict:
    """``{name: i32[B * T, k]}`` for the selections that do not depend on ``S``."""
    b, t, _ = attn.shape
    idx = dsa_jax.indexer_topk(*args, k=k, pages_per_seq=pps, exact=True,
                               backend="reference")
    causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
    masked = jnp.where(jnp.asarray(causal)[None], jnp.asarray(attn), -jnp.inf)
    oracle = select_topk(masked.reshape(b * t, t), k, exact=True)
    rand = np.concatenate([dsa_jax.random_selector(t, k, seed + i) for i in range(b)])
    local = np.tile(dsa_jax.local_selector(t, k), (b, 1))
    return {"indexer": np.asarray(idx), "random": rand, "local": local,
            "oracle": np.asarray(oracle)}


def witness_selections(args, pps, indexer: np.ndarray, ctx: np.ndarray, k: int, s: int, *,
                       via_indexer_topk: bool = True) -> dict:
    """The two witness policies at ``(k, S)``: ``scatter_topology_witnesses(indexer, L, S,
    fill=...)`` with ``"tail"`` (the serving merge) and ``"lowest"``; the lowest fill is checked
    identical to ``fill_lowest`` (the NumPy statement above). With ``via_indexer_topk`` both are
    also taken from ``dsa_jax.indexer_topk(num_segments=S, fill=...)`` (one compile per
    ``(k, S, fill)``, seconds) and checked identical."""
    out = {}
    for fill in ("tail", "lowest"):
        sel = np.asarray(dsa_jax.scatter_topology_witnesses(
            jnp.asarray(indexer), jnp.asarray(ctx, jnp.int32), s, fill=fill))
        if via_indexer_topk:
            api = np.asarray(dsa_jax.indexer_topk(*args, k=k, pages_per_seq=pps, exact=True,
                                                  backend="reference", num_segments=s,
                                                  fill=fill))
            if not np.array_equal(sel, api):
                raise AssertionError(f"indexer_topk(num_segments=S, fill={fill!r}) != "
                                     "scatter_topology_witnesses")
        out[f"indexer+wit_{fill}"] = sel
    if not np.array_equal(out["indexer+wit_lowest"], fill_lowest(indexer, ctx, s)):
        raise AssertionError("scatter_topology_witnesses(fill='lowest') != fill_lowest")
    return out


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def _distinct_valid(sel: np.ndarray, ctx: np.ndarray):
    """Sorted rows with invalid and duplicate entries set to -1, and their validity mask."""
    s = np.where((sel >= 0) & (sel < ctx[:, None]), sel, -1).astype(np.int64)
    s = np.sort(s, axis=1)
    dup = np.zeros_like(s, bool)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    ok = (s >= 0) & ~dup
    return np.where(ok, s, -1), ok


def budgets(sel: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """Distinct valid entries per row."""
    return _distinct_valid(sel, ctx)[1].sum(axis=1)


def recall_rows(sel: np.ndarray, attn_rows: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    s, ok = _distinct_valid(sel, ctx)
    picked = np.take_along_axis(attn_rows, np.where(ok, s, 0), axis=1)
    mass = np.where(ok, picked, 0.0).sum(axis=1, dtype=np.float64)
    inside = np.arange(attn_rows.shape[1])[None, :] < ctx[:, None]
    total = np.where(inside, attn_rows, 0.0).sum(axis=1, dtype=np.float64)
    return mass / total


def coverage_rows(sel: np.ndarray, ctx: np.ndarray, num_segments: int) -> np.ndarray:
    s, ok = _distinct_valid(sel, ctx)
    s_eff = np.minimum(num_segments, ctx).astype(np.int64)
    seg = np.where(ok, s * s_eff[:, None] // ctx[:, None].astype(np.int64), 0)
    occ = np.zeros((sel.shape[0], num_segments), bool)
    rows = np.broadcast_to(np.arange(sel.shape[0])[:, None], seg.shape)
    occ[rows[ok], seg[ok]] = True
    return occ.sum(axis=1) / s_eff


def crosscheck(sel, attn_rows, ctx, num_segments, rec, cov, rng, n: int = 16) -> None:
    """The vectorised metrics equal ``reference.witnesses``' on ``n`` sampled rows."""
    for r in rng.choice(sel.shape[0], size=min(n, sel.shape[0]), replace=False):
        length = int(ctx[r])
        want_c = segment_coverage(sel[r], length, num_segments)
        want_r = attention_mass_recall(sel[r], attn_rows[r, :length])
        if want_c != cov[r] or abs(want_r - rec[r]) > 1e-9:
            raise AssertionError(f"metric mismatch at row {r}: {want_c} vs {cov[r]}, "
                                 f"{want_r} vs {rec[r]}")


# --------------------------------------------------------------------------------------------
# Model-level effect
# --------------------------------------------------------------------------------------------


def allowed_mask(sel: np.ndarray, b: int, t: int) -> np.ndarray:
    """``bool[B, T, T]``: row ``t`` of window ``i`` may attend to its selected tokens."""
    sel = sel.reshape(b, t, -1)
    m = np.zeros((b, t, t + 1), bool)
    idx = np.where((sel >= 0) & (sel < t), sel, t)  # padding lands in the dropped column
    np.put_along_axis(m, idx, True, axis=2)
    return m[:, :, :t]


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def _restricted_nll(params, toks, allowed, cfg, layer):
    return M.token_nll(params, toks, cfg, restrict_layer=layer, allowed=allowed)[0]


def restricted_bits(params, windows: np.ndarray, sel: np.ndarray, cfg: M.LMConfig, layer: int,
                    chunk: int = 4) -> np.ndarray:
    """Per-token bits ``f64[N, T]`` with ``layer`` restricted to ``sel`` (``i32[N * T, k]``)."""
    n, t = windows.shape[0], windows.shape[1] - 1
    allowed = allowed_mask(sel, n, t)
    out = [np.asarray(_restricted_nll(params, jnp.asarray(windows[i:i + chunk]),
                                      jnp.asarray(allowed[i:i + chunk]), cfg, layer))
           for i in range(0, n, chunk)]
    return np.concatenate(out).astype(np.float64) / np.log(2.0)
