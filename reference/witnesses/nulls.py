"""Baseline selectors, nulls and metrics for the segment-witness experiments (host-side NumPy).

The experiment side of ``reference.witnesses`` (the serving policy is
``reference.witnesses.policy``): ``random_selector`` / ``local_selector`` (whole causal
selections), ``random_null`` / ``locality_null`` (their last rows, the nulls a witness run is
compared with), and the statistics ``segment_coverage`` (the share of a row's segments that
candidates meet) and ``attention_mass_recall`` (the share of a dense attention row's mass they
select). The refusals and the segment rule are the policy's."""

from __future__ import annotations

from typing import Any

import numpy as np

from reference.witnesses.policy import SegmentsOutOfRange, WitnessError, _static_int

__all__ = [
    "random_selector",
    "local_selector",
    "random_null",
    "locality_null",
    "segment_coverage",
    "attention_mass_recall",
]


def _check_budget(budget: Any) -> int:
    k = _static_int("budget", budget)
    if k < 0:
        raise WitnessError(f"budget={k} must be >= 0", budget=k)
    return k


def _random_row(query_pos: int, budget: int, seed: int) -> np.ndarray:
    """Row ``query_pos`` of the random selector: ``min(budget, query_pos + 1)`` distinct tokens
    drawn uniformly from ``[0, query_pos]``, ascending, ``-1`` padded to ``budget``. Each row
    has its own stream keyed by ``(seed, query_pos)``, so one row costs no more than itself."""
    out = np.full(budget, -1, np.int32)
    n = min(budget, query_pos + 1)
    if n > 0:
        rng = np.random.default_rng([seed, query_pos])
        out[:n] = np.sort(rng.choice(query_pos + 1, size=n, replace=False))
    return out


def _local_rows(query_pos: np.ndarray, budget: int) -> np.ndarray:
    """Rows of the local selector: the ``budget`` most recent causal tokens, ascending."""
    start = np.maximum(query_pos + 1 - budget, 0)[:, None]
    rows = start + np.arange(budget, dtype=np.int64)[None, :]
    return np.where(rows <= query_pos[:, None], rows, -1).astype(np.int32)


def _check_seed(seed: Any) -> int:
    value = _static_int("seed", seed)
    if value < 0:
        raise WitnessError(f"seed={value} must be >= 0", seed=value)
    return value


def random_selector(context_len: int, budget: int, seed: int) -> np.ndarray:
    """Random attention selector: row ``t`` (query at ``t``) holds ``min(budget, t + 1)``
    distinct tokens drawn uniformly from ``[0, t]``, ascending, ``-1`` padded.

    Returns ``i32[max(context_len, 0), budget]`` (NumPy), deterministic in ``seed``.
    """
    length = _static_int("context_len", context_len)
    k = _check_budget(budget)
    sd = _check_seed(seed)
    out = np.full((max(length, 0), k), -1, np.int32)
    for t in range(max(length, 0)):
        out[t] = _random_row(t, k, sd)
    return out


def local_selector(context_len: int, budget: int) -> np.ndarray:
    """Local attention selector: row ``t`` holds ``[max(t + 1 - budget, 0), t]``, ascending,
    ``-1`` padded. Returns ``i32[max(context_len, 0), budget]`` (NumPy)."""
    length = _static_int("context_len", context_len)
    k = _check_budget(budget)
    return _local_rows(np.arange(max(length, 0), dtype=np.int64), k)


def random_null(context_len: int, budget: int, seed: int) -> np.ndarray:
    """The random null: row ``L - 1`` of ``random_selector(L, budget, seed)``.

    ``min(budget, L)`` distinct tokens drawn uniformly from ``[0, L)``, ascending, ``-1``
    padded to ``i32[budget]`` (NumPy). All ``-1`` when ``L <= 0``.
    """
    length = _static_int("context_len", context_len)
    k = _check_budget(budget)
    sd = _check_seed(seed)
    if length <= 0:
        return np.full(k, -1, np.int32)
    return _random_row(length - 1, k, sd)


def locality_null(context_len: int, budget: int) -> np.ndarray:
    """The locality null: row ``L - 1`` of ``local_selector(L, budget)``.

    Exactly ``[max(L - budget, 0), L)``, ascending, ``-1`` padded to ``i32[budget]`` (NumPy).
    All ``-1`` when ``L <= 0``.
    """
    length = _static_int("context_len", context_len)
    k = _check_budget(budget)
    if length <= 0:
        return np.full(k, -1, np.int32)
    return _local_rows(np.array([length - 1], dtype=np.int64), k)[0]


def _valid_candidates(candidates: Any, context_len: int) -> list[int]:
    """Distinct candidates inside ``[0, context_len)``; padding, duplicates and out-of-range
    entries count for nothing."""
    arr = np.asarray(candidates).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"candidates must have an integer dtype, got {arr.dtype}")
    return [int(x) for x in np.unique(arr).tolist() if 0 <= int(x) < context_len]


def segment_coverage(candidates: Any, context_len: int, num_segments: int) -> float:
    """Fraction of the ``S_eff = min(S, L)`` segments met by ``candidates`` inside ``[0, L)``.

    Args:
      candidates: integer array-like (any shape; flattened). Padding, duplicates and entries
        outside ``[0, L)`` count for nothing.
      context_len: Python int ``L``.
      num_segments: Python int ``S >= 0`` (no upper bound: this is a metric).

    Returns:
      ``|{sigma(x)}| / S_eff``; ``1.0`` when there are no segments (``S == 0`` or ``L <= 0``).
    """
    length = _static_int("context_len", context_len)
    s = _static_int("num_segments", num_segments)
    if s < 0:
        raise SegmentsOutOfRange(f"num_segments={s} must be >= 0", num_segments=s)
    s_eff = min(s, max(length, 0))
    if s_eff == 0:
        return 1.0
    met = {x * s_eff // length for x in _valid_candidates(candidates, length)}
    return len(met) / s_eff


def attention_mass_recall(candidates: Any, attention_row: Any) -> float:
    """Share of a dense attention row's mass that ``candidates`` select.

    Args:
      candidates: integer array-like; padding, duplicates and entries outside ``[0, L)`` count
        for nothing.
      attention_row: ``f[L]`` non-negative attention weights over ``[0, L)``.

    Returns:
      ``sum(a[C]) / sum(a)`` in float64; NaN for a row with no mass.
    """
    row = np.asarray(attention_row, dtype=np.float64).reshape(-1)
    total = float(row.sum())
    if total == 0.0:
        return float("nan")
    picked = _valid_candidates(candidates, row.shape[0])
    return float(row[picked].sum()) / total
