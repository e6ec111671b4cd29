"""Segment witnesses: a covering constraint merged into learned sparse top-k rows.

A port of the candidate policy of vllm-project/vllm#47942 (``VLLM_SPARSE_MLA_TOPOLOGY_SEGMENTS``,
off by default), after the Rust port in ``shared/seeds/000_*.txt``, as a static-shape jnp
transform that runs after ``approx_max_k`` with no host sync.

The learned top-k is a density rule and may leave whole stretches of a context unselected. For a
row with context length ``L`` and ``S`` segments put ``S_eff = min(S, max(L, 1))`` and partition
``[0, L)`` into ``S_eff`` intervals ``I_s = [e_s, e_{s+1})`` with edges rounded *up*,
``e_s = ceil(s * L / S_eff)``. The segment of a token is
``sigma(x) = min(floor(x * S_eff / L), S - 1)`` (``L`` read as ``max(L, 1)``), and
``x in I_s  <=>  sigma(x) == s``, so ``sigma(e_s) == s``: an edge lies in its own segment. A
learned row occupies ``{sigma(x) : x >= 0 in the row}``; its witnesses are the edges ``e_s`` of
the segments ``s < S_eff`` it does not occupy (none when ``L <= 0``). Witnesses are therefore
disjoint from the row, pairwise distinct, causal (``0 <= e_s < L``), and together with the row
they meet every segment.

The merge is positional: slots ``[0, keep)`` are kept bit-identical, and the witnesses in
ascending segment order overwrite slots ``keep, keep + 1, ...`` up to
``B = min(max_replacements, topk - keep)``; further witnesses are dropped. The serving entry
uses ``keep = max(topk - S, 0)`` and ``max_replacements = S``; ``S = 0`` is the off switch.

Two caveats are the source's behaviour, not defects of this port, and tests pin them so that
neither is "fixed" by accident:

* Coverage is not guaranteed after the merge. Occupancy is read from the *whole* learned row,
  including tail slots the merge then overwrites, so a segment whose sole learned token sat in
  an overwritten slot ends up uncovered (L=16, S=4: ``[0,1,2,3,4,8,-1,-1]``, coverage 0.75).
  Every segment is covered when the reserved tail is padding.
* The merge is positional: the witness set is a set function of the row, the output set is
  invariant under permutations of the retained prefix but not of the whole row.

int32 safety: JAX computes in int32, and ``x * S_eff`` or ``s * L`` overflow for large
contexts. Edges are computed as ``s * (L // S_eff) + ceil(s * (L % S_eff) / S_eff)``; the
segment of an in-range token is a float32 estimate corrected by one step against the exact
edges, compared without division or overflow; a token ``x >= L`` lands in ``min(x, S - 1)``
(the clamp of the definition).

All work is O(rows * (topk + S * min(S, topk))): occupancy is a bit mask OR-reduced over the
row (as in the fused upstream kernel), and the merge is a compare-select into the ``min(S,
topk)``-wide window of slots it can touch plus one ``dynamic_update_slice``: no scatter and no
per-element gather, which XLA's TPU cost model prices at tens of times their data. The metric
helpers and the nulls (host-side NumPy) are ``reference.witnesses.nulls``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_TOPOLOGY_SEGMENTS",
    "WitnessError",
    "RowsMismatch",
    "SegmentsOutOfRange",
    "LearnedKeepOutOfRange",
    "segment_of",
    "topology_witness_indices",
    "merge_topology_witnesses",
    "apply_topology_witnesses",
    "scatter_topology_witnesses",
    "WITNESS_FILLS",
    "check_witness_policy",
]

# The fused upstream kernel carries segment occupancy as one 64-bit mask; both paths accept the
# same inputs.
MAX_TOPOLOGY_SEGMENTS = 64


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------


class WitnessError(ValueError):
    """A malformed witness call. Keyword arguments become attributes (the offending numbers)."""

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        for key, value in attrs.items():
            setattr(self, key, value)


class RowsMismatch(WitnessError):
    """``learned`` is not 2-D, or a per-row argument does not have one entry per learned row.

    Attributes: ``argument`` (the offending argument's name), ``argument_shape``,
    ``learned_shape`` and ``rows`` (``None`` when ``learned`` itself is not 2-D).
    """

    argument: str
    argument_shape: tuple[int, ...]
    learned_shape: tuple[int, ...]
    rows: int | None


class SegmentsOutOfRange(WitnessError):
    """``num_segments`` outside ``[1, MAX_TOPOLOGY_SEGMENTS]``. Attribute: ``num_segments``."""

    num_segments: int


class LearnedKeepOutOfRange(WitnessError):
    """``learned_keep`` outside ``[0, topk]``. Attributes: ``learned_keep``, ``topk``."""

    learned_keep: int
    topk: int


def _static_int(name: str, value: Any) -> int:
    """A static Python int (jit static argument), or TypeError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}")
    return int(value)


def _check_segments(num_segments: Any) -> int:
    s = _static_int("num_segments", num_segments)
    if not 1 <= s <= MAX_TOPOLOGY_SEGMENTS:
        raise SegmentsOutOfRange(
            f"{s=} (num_segments) must be in [1, {MAX_TOPOLOGY_SEGMENTS}]", num_segments=s
        )
    return s


def _int_array(name: str, value: Any) -> jax.Array:
    """``value`` as an int32 jnp array; TypeError naming ``name`` for a non-integer dtype."""
    arr = jnp.asarray(value)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    return arr.astype(jnp.int32)


def _check_learned(learned: Any) -> jax.Array:
    arr = _int_array("learned", learned)
    if arr.ndim != 2:
        raise RowsMismatch(
            f"learned must be 2-D [rows, topk], got shape {tuple(arr.shape)}",
            argument="learned",
            argument_shape=tuple(arr.shape),
            learned_shape=tuple(arr.shape),
            rows=None,
        )
    return arr


def _check_per_row(name: str, value: Any, learned: jax.Array, ndim: int) -> jax.Array:
    """A per-row argument: ``ndim``-D with leading dim equal to ``learned``'s row count."""
    arr = _int_array(name, value)
    rows = learned.shape[0]
    if arr.ndim != ndim or arr.shape[0] != rows:
        want = "[rows]" if ndim == 1 else "[rows, num_segments]"
        raise RowsMismatch(
            f"{name} must be {ndim}-D {want} with one entry per learned row: "
            f"{name}.shape={tuple(arr.shape)}, learned.shape={tuple(learned.shape)} ({rows=})",
            argument=name,
            argument_shape=tuple(arr.shape),
            learned_shape=tuple(learned.shape),
            rows=rows,
        )
    return arr


def _check_keep_and_budget(learned_keep: Any, max_replacements: Any, topk: int) -> int:
    """Validates the merge statics; returns the replacement budget ``B``."""
    keep = _static_int("learned_keep", learned_keep)
    max_rep = _static_int("max_replacements", max_replacements)
    if not 0 <= keep <= topk:
        raise LearnedKeepOutOfRange(
            f"learned_keep={keep} must be in [0, topk={topk}]", learned_keep=keep, topk=topk
        )
    if max_rep < 0:
        raise WitnessError(f"max_replacements={max_rep} must be >= 0", max_replacements=max_rep)
    return min(max_rep, topk - keep)


# --------------------------------------------------------------------------------------------
# Segment arithmetic (int32-safe)
# --------------------------------------------------------------------------------------------


def _edge(s: jax.Array, q: jax.Array, r: jax.Array, s_eff: jax.Array) -> jax.Array:
    """``ceil(s * L / s_eff)`` for ``L = q * s_eff + r`` and ``0 <= s <= s_eff``, without
    forming ``s * L`` (``s * r < 64 * 64``; the result is at most ``L``)."""
    return s * q + (s * r + s_eff - 1) // s_eff


def _before_edge(x: jax.Array, s: jax.Array, q: jax.Array, r: jax.Array, s_eff: jax.Array):
    """``x < e_s`` for ``0 <= x``, ``0 <= s <= s_eff``, with no division and no overflow.

    ``x < ceil(s * L / s_eff)  <=>  x * s_eff < s * L  <=>  (x - s * q) * s_eff < s * r``.
    The right side lies in ``[0, 64 * s_eff)``, so ``d = x - s * q`` decides alone outside
    ``[0, 64)``; clipping it to ``[-1, 64]`` keeps the product tiny and the answer unchanged.
    """
    d = jnp.clip(x - s * q, -1, MAX_TOPOLOGY_SEGMENTS)
    return d * s_eff < s * r


def _row_geometry(context_len: jax.Array, num_segments: Any):
    """Per-row ``(L', S_eff, q, r)`` with ``L' = max(L, 1)`` and ``L' = q * S_eff + r``."""
    lp = jnp.maximum(context_len, 1)
    s_eff = jnp.minimum(lp, num_segments)
    return lp, s_eff, lp // s_eff, lp % s_eff


@jax.jit
def _segment_array(token: jax.Array, context_len: jax.Array, num_segments: Any) -> jax.Array:
    """``min(floor(x * S_eff / L'), S - 1)`` elementwise in int32, ``-1`` for ``x < 0``.

    ``num_segments`` may be traced: one compile serves every segment count. Per token this is
    a float32 estimate and two exact edge comparisons: no integer division (which does not
    vectorise on CPU) and no product that can overflow int32.
    """
    lp, s_eff, q, r = _row_geometry(context_len, num_segments)
    ratio = s_eff.astype(jnp.float32) / lp.astype(jnp.float32)  # per row, not per token
    inside = (token >= 0) & (token < lp)
    x = jnp.where(inside, token, 0)
    # float32 estimate (x >= 0, so truncation is floor): relative error a few 2**-24 on a value
    # below 64, so it is off by at most one; one step against the exact edges (x in
    # [e_s, e_{s+1}) iff segment s) corrects it.
    est = jnp.clip((x.astype(jnp.float32) * ratio).astype(jnp.int32), 0, s_eff - 1)
    below = _before_edge(x, est, q, r, s_eff)
    above = ~_before_edge(x, est + 1, q, r, s_eff)
    seg_inside = est - below.astype(jnp.int32) + above.astype(jnp.int32)
    # x >= L': floor(x * S_eff / L') is x when S_eff == L', and >= S when S_eff == S; either
    # way the clamp gives min(x, S - 1).
    seg = jnp.where(inside, seg_inside, jnp.minimum(token, num_segments - 1))
    return jnp.where(token < 0, -1, seg)


def _segment_int(token: int, context_len: int, num_segments: int) -> int:
    """Exact Python-int form of the segment map (``-1`` for a negative token)."""
    if token < 0:
        return -1
    lp = max(context_len, 1)
    s_eff = min(num_segments, lp)
    return min(token * s_eff // lp, num_segments - 1)


def segment_of(token: Any, context_len: Any, num_segments: int) -> Any:
    """Segment of ``token`` in a context of ``context_len`` tokens split into ``num_segments``.

    ``min(floor(token * S_eff / L), S - 1)`` with ``L = max(context_len, 1)`` and
    ``S_eff = min(S, L)``. A token ``>= L`` is not refused: it lands in its clamped segment,
    which lies outside the partition when ``S_eff < S``. A negative token (padding) has no
    segment and maps to ``-1``.

    Args:
      token: a Python int, or an integer array (any shape).
      context_len: a Python int, or an integer array broadcastable against ``token``.
      num_segments: static Python int in ``[1, MAX_TOPOLOGY_SEGMENTS]``.

    Returns:
      A Python int when both ``token`` and ``context_len`` are Python ints (exact); otherwise
      ``i32[broadcast shape]``, exact for all int32 inputs.
    """
    s = _check_segments(num_segments)
    scalar = (int, np.integer)
    if (
        isinstance(token, scalar)
        and isinstance(context_len, scalar)
        and not isinstance(token, bool)
        and not isinstance(context_len, bool)
    ):
        return _segment_int(int(token), int(context_len), s)
    tok = _int_array("token", token)
    ctx = _int_array("context_len", context_len)
    return _segment_array(tok, ctx, jnp.int32(s))


# --------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------


def _occupancy(seg: jax.Array, num_segments: int) -> jax.Array:
    """``bool[rows, S]``: which segments a row meets, from ``seg: i32[rows, topk]`` (``-1``
    marks nothing). Like the fused upstream kernel, occupancy is a bit mask (here 32-bit
    words), built by an OR-reduction over the row: O(rows * topk), no scatter."""
    words = []
    for base in range(0, num_segments, 32):
        shift = seg - base
        bits = jnp.left_shift(jnp.uint32(1), jnp.clip(shift, 0, 31).astype(jnp.uint32))
        words.append(jnp.where((shift >= 0) & (shift < 32), bits, jnp.uint32(0)))
    # One variadic reduction: every word in a single pass over the row.
    words = jax.lax.reduce(
        tuple(words),
        tuple(jnp.uint32(0) for _ in words),
        lambda acc, new: tuple(a | b for a, b in zip(acc, new, strict=True)),
        (1,),
    )
    mask = jnp.stack(words, axis=1)  # u32[rows, ceil(S / 32)]
    # Word s // 32 of each segment s by a static repeat (not an index gather).
    per_segment = jnp.repeat(mask, 32, axis=1)[:, :num_segments]
    shift = (np.arange(num_segments) % 32).astype(np.uint32)
    return (jnp.right_shift(per_segment, shift) & 1).astype(jnp.bool_)


# The bodies are jitted so that an eager call compiles one fused program per shape rather than
# dispatching op by op; under an outer jit or vmap they are inlined.
@functools.partial(jax.jit, static_argnums=2)
def _witnesses(learned: jax.Array, context_lens: jax.Array, num_segments: int) -> jax.Array:
    """Unchecked body of ``topology_witness_indices``."""
    ctx = context_lens[:, None]
    occupied = _occupancy(_segment_array(learned, ctx, num_segments), num_segments)
    _, s_eff, q, r = _row_geometry(ctx, num_segments)
    s = jnp.arange(num_segments, dtype=jnp.int32)[None, :]
    edges = _edge(s, q, r, s_eff)  # i32[rows, num_segments]
    emit = (s < s_eff) & (ctx > 0) & ~occupied
    return jnp.where(emit, edges, -1)


def topology_witness_indices(learned: Any, context_lens: Any, num_segments: int) -> jax.Array:
    """Witnesses of the segments each learned row misses.

    Args:
      learned: ``i32[rows, topk]`` row-relative token offsets; negative entries are padding and
        mark nothing; an entry ``x >= L`` marks its clamped segment. Occupancy is read from the
        whole row.
      context_lens: ``i32[rows]``, the context length ``L`` of each row.
      num_segments: static Python int ``S`` in ``[1, MAX_TOPOLOGY_SEGMENTS]``.

    Returns:
      ``i32[rows, S]``: column ``s`` holds ``e_s = ceil(s * L / S_eff)`` when ``s < S_eff`` and
      the row does not occupy segment ``s``, else ``-1``. A row with ``L <= 0`` is all ``-1``.

    Raises:
      RowsMismatch, SegmentsOutOfRange; TypeError for non-integer dtypes.
    """
    s = _check_segments(num_segments)
    learned = _check_learned(learned)
    context_lens = _check_per_row("context_lens", context_lens, learned, ndim=1)
    return _witnesses(learned, context_lens, s)


def _write_window(learned: jax.Array, witnesses: jax.Array, start: Any, first_rank: Any,
                  budget: Any) -> jax.Array:
    """Window slot ``p`` (absolute slot ``start + p``, ``W = min(S, topk)`` slots) takes the
    row's valid witness of rank ``first_rank + p`` when that rank is in ``[0, budget)``; every
    other slot is unchanged. ``start`` is a scalar; ``first_rank`` and ``budget`` broadcast
    against ``[rows, 1]``. A compare-select over ``[rows, W, S]``, then one
    ``dynamic_update_slice`` of the window: no scatter, no per-element gather."""
    topk, num_segments = learned.shape[1], witnesses.shape[1]
    width = min(num_segments, topk)
    valid = witnesses >= 0
    rank = jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1  # position among valid witnesses
    rank = jnp.where(valid & (rank < budget), rank, -1)  # -1: this witness is not written
    want = first_rank + jnp.arange(width, dtype=jnp.int32)  # rank each window slot takes
    want = jnp.broadcast_to(want, (learned.shape[0], width))
    hit = (rank[:, None, :] == want[:, :, None]) & (rank[:, None, :] >= 0)  # [rows, W, S]
    taken = jnp.any(hit, axis=2)
    value = jnp.max(jnp.where(hit, witnesses[:, None, :], -1), axis=2)
    window = jax.lax.dynamic_slice_in_dim(learned, start, width, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(learned, jnp.where(taken, value, window), start,
                                               axis=1)


@jax.jit
def _merge(learned: jax.Array, witnesses: jax.Array, keep: Any, budget: Any) -> jax.Array:
    """Unchecked body of the merge for ``budget >= 1`` and at least one row. ``keep`` and
    ``budget`` (validated Python ints) are traced scalars: no recompile per value.

    Scatter- and gather-free (a per-element scatter models at ~69x a copy on TPU): every slot
    the merge can write lies in one static window of ``W = min(S, topk)`` slots starting at
    ``start = min(keep, topk - W)`` (at most ``S`` valid witnesses land in ``[keep, topk)``);
    window slot ``p`` takes the valid witness of rank ``start + p - keep``.
    """
    width = min(witnesses.shape[1], learned.shape[1])
    start = jnp.minimum(keep, learned.shape[1] - width)
    return _write_window(learned, witnesses, start, start - keep, budget)


@jax.jit
def _merge_lowest(learned: jax.Array, witnesses: jax.Array) -> jax.Array:
    """Unchecked body of ``fill="lowest"`` (at least one row, ``topk >= 1``): a row with
    ``w = min(#valid witnesses, topk)`` gets its first ``w`` valid witnesses (ascending
    segment order) in slots ``[topk - w, topk)``; slots before them are unchanged. Those
    slots lie in the last ``W = min(S, topk)``, window slot ``p`` taking rank ``p - (W - w)``."""
    topk = learned.shape[1]
    width = min(witnesses.shape[1], topk)
    count = jnp.minimum(jnp.sum(witnesses >= 0, axis=1, keepdims=True), width)  # w per row
    return _write_window(learned, witnesses, topk - width, count - width, count)


def merge_topology_witnesses(
    learned: Any, witnesses: Any, learned_keep: int, max_replacements: int
) -> jax.Array:
    """Positional merge of witnesses into the tail of learned rows.

    Slots ``[0, learned_keep)`` are returned bit-identical. The valid (``>= 0``) witnesses of a
    row, in column (ascending segment) order, overwrite slots ``learned_keep, learned_keep + 1,
    ...`` up to ``B = min(max_replacements, topk - learned_keep)``; further witnesses are
    dropped and every other slot is unchanged. ``B == 0`` or zero rows is the identity (after
    validation).

    Args:
      learned: ``i32[rows, topk]``.
      witnesses: ``i32[rows, S]`` with ``S`` in ``[1, MAX_TOPOLOGY_SEGMENTS]``, ``-1`` where a
        segment has no witness (as returned by ``topology_witness_indices``).
      learned_keep: static Python int in ``[0, topk]``.
      max_replacements: static Python int ``>= 0``.

    Returns:
      ``i32[rows, topk]``.

    Raises:
      RowsMismatch, SegmentsOutOfRange (witness width), LearnedKeepOutOfRange, WitnessError
      (negative ``max_replacements``); TypeError for non-integer dtypes or non-int statics.
    """
    learned = _check_learned(learned)
    witnesses = _check_per_row("witnesses", witnesses, learned, ndim=2)
    _check_segments(witnesses.shape[1])
    budget = _check_keep_and_budget(learned_keep, max_replacements, learned.shape[1])
    if budget == 0 or learned.shape[0] == 0:
        return learned
    return _merge(learned, witnesses, jnp.int32(learned_keep), jnp.int32(budget))


def apply_topology_witnesses(
    learned: Any,
    context_lens: Any,
    learned_keep: int,
    num_segments: int,
    max_replacements: int,
) -> jax.Array:
    """``merge_topology_witnesses(learned, topology_witness_indices(...), ...)``.

    Args:
      learned: ``i32[rows, topk]`` row-relative token offsets, ``-1`` padding.
      context_lens: ``i32[rows]``.
      learned_keep: static Python int in ``[0, topk]``.
      num_segments: static Python int in ``[1, MAX_TOPOLOGY_SEGMENTS]``.
      max_replacements: static Python int ``>= 0``.

    Returns:
      ``i32[rows, topk]``.

    Raises:
      RowsMismatch, SegmentsOutOfRange, LearnedKeepOutOfRange, WitnessError; TypeError. All
      checks run before the ``B == 0`` / zero-rows identity.
    """
    s = _check_segments(num_segments)
    learned = _check_learned(learned)
    context_lens = _check_per_row("context_lens", context_lens, learned, ndim=1)
    budget = _check_keep_and_budget(learned_keep, max_replacements, learned.shape[1])
    if budget == 0 or learned.shape[0] == 0:
        return learned
    witnesses = _witnesses(learned, context_lens, s)
    return _merge(learned, witnesses, jnp.int32(learned_keep), jnp.int32(budget))


WITNESS_FILLS = ("tail", "lowest")


def check_witness_policy(num_segments: Any, topk: int, fill: Any = "tail",
                         refuse_full_overwrite: Any = False, *, topk_name: str = "topk") -> int:
    """Static checks of the serving witness options; returns ``num_segments`` as an int.

    ``fill`` must be one of ``WITNESS_FILLS`` (ValueError naming it), ``refuse_full_overwrite``
    a bool (TypeError). With ``refuse_full_overwrite=True`` and ``num_segments > 0``,
    ``num_segments >= topk`` raises ValueError naming both numbers. The reason: the witnesses
    may then take every slot, so a row can lose all of its learned entries (under the tail fill
    ``keep = max(topk - S, 0) = 0``, so every row with ``S`` missing segments does). In
    EXPERIMENTS.md, ``S = k = 32`` with the tail fill drops a trained indexer's attention-mass
    recall from 0.53 to 0.09 and costs +0.61 bits per byte.
    """
    s = _static_int("num_segments", num_segments)
    if not isinstance(fill, str) or fill not in WITNESS_FILLS:
        raise ValueError(f"fill must be one of {WITNESS_FILLS}, got fill={fill!r}")
    if not isinstance(refuse_full_overwrite, bool):
        raise TypeError("refuse_full_overwrite must be a bool, got "
                        f"{type(refuse_full_overwrite).__name__}")
    if refuse_full_overwrite and s > 0 and s >= topk:
        raise ValueError(
            f"num_segments={s} >= {topk_name}={topk} with refuse_full_overwrite=True: the "
            f"witnesses could overwrite every learned entry of a row; use num_segments < "
            f"{topk_name}, or refuse_full_overwrite=False to allow it")
    return s


def scatter_topology_witnesses(
    topk_indices: Any, context_lens: Any, num_segments: int, *, fill: str = "tail",
    refuse_full_overwrite: bool = False,
) -> jax.Array:
    """Serving entry point: each row's missing-segment witnesses written into its top-k row.

    ``fill="tail"`` (the upstream behaviour and the default): the last ``S`` slots are
    reserved, ``learned_keep = max(topk - S, 0)`` and ``max_replacements = S``, so a row with
    ``w`` valid witnesses gets them in slots ``topk - S .. topk - S + w - 1`` and the slots
    after those keep what they held (in a score-sorted row, entries scored *lower* than the
    ones overwritten). ``fill="lowest"``: the row's ``w`` valid witnesses (``w <= S``, at most
    ``topk`` of them) overwrite its *last* ``w`` slots, i.e. padding first, then the
    lowest-scored entries, and slots ``[0, topk - w)`` stay bit-identical. Both write the same
    witnesses in ascending segment order and agree on rows with ``w = S``; a row without
    padding ends with ``topk`` valid slots under either (witnesses are disjoint from the row),
    and a padded row never ends with fewer under ``"lowest"``. ``S = 0`` is the off switch
    and returns the buffer unchanged.

    JAX is functional, so the new buffer is returned; under ``jax.jit(..., static_argnums=2,
    donate_argnums=0)`` XLA updates the donated buffer in place. A refused call raises at
    trace time, before anything runs, so a donated buffer is left untouched.

    Args:
      topk_indices: ``i32[rows, topk]`` row-relative token offsets, ``-1`` padding.
      context_lens: ``i32[rows]``.
      num_segments: static Python int in ``[0, MAX_TOPOLOGY_SEGMENTS]``.
      fill: static, ``"tail"`` or ``"lowest"``.
      refuse_full_overwrite: opt-in static guard: raise ValueError when ``num_segments >=
        topk`` (the reason is in ``check_witness_policy``).

    Returns:
      ``i32[rows, topk]``.
    """
    learned = _check_learned(topk_indices)
    s = check_witness_policy(num_segments, learned.shape[1], fill, refuse_full_overwrite)
    context_lens = _check_per_row("context_lens", context_lens, learned, ndim=1)
    if s == 0:
        return learned
    topk = learned.shape[1]
    if fill == "tail":
        return apply_topology_witnesses(learned, context_lens, max(topk - s, 0), s, s)
    s = _check_segments(s)
    if topk == 0 or learned.shape[0] == 0:
        return learned
    return _merge_lowest(learned, _witnesses(learned, context_lens, s))
