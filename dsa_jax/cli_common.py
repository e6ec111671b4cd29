"""What ``python -m dsa_jax run`` shares between its V3.2 and V4 paths, each rule declared once.

- Flag types: ``bounded_int(low, high)`` builds the argparse ``type=`` of every size flag, so
  a zero or negative size (or a number past its bound) is an argparse error naming the flag and
  the value (exit 2), never a silent default or a traceback.
- ``time_backends``: each backend's first call (compile included) and, where it says something,
  a second (steady-state) call, timed.
- ``compare``: the Pallas run against the reference, by the tolerance the tests use
  (``SAME_STEP_TOLERANCE``), and ``verdict``: the closing lines every run prints, with the exit
  status (0 agree / reference ran cleanly, 1 disagree or NaN).
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

# Pallas vs reference, per output element: the tolerance the step tests use.
# f32 (V3.2 step, tests/test_step.py; the V4 f32 step, tests/test_v4_step.py): |diff| within
# atol + rtol * |ref|. bf16 (the V4 default regime, tests/test_v4_step.py): the outputs are
# bf16; the error in bf16 ulps of each row's largest reference output, at most 2 ulps and
# 0.5 ulps on average.
SAME_STEP_TOLERANCE = {"v3.2": ("allclose", 2e-5), "f32": ("allclose", 2e-4),
                       "bf16": ("ulps", (2.0, 0.5))}


def bounded_int(low: int, high: int | None = None, note: str = ""):
    """An argparse ``type=``: an int in ``[low, high]`` (``high=None``: no upper bound), else
    ``argparse.ArgumentTypeError`` (argparse prints ``argument --flag: ...``, exits 2)."""
    want = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}{note}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {want}{note}, got {value}")
        return value

    parse.__name__ = f"int >= {low}" if high is None else f"int in [{low}, {high}]"
    return parse


positive_int = bounded_int(1)
nonnegative_int = bounded_int(0)


def pick_size(flag: int | None, quick: bool, full: int, small: int) -> int:
    """A size flag's value if given (``None``: not given), else its default (``--quick``:
    ``small``). Zero is a value here, never "not given" (the flag types refuse it)."""
    if flag is not None:
        return flag
    return small if quick else full


class Timing(NamedTuple):
    """Seconds of a backend's first call (compile included) and of a second call (``None``
    when not run: the Pallas interpreter off TPU, where a second call says nothing)."""

    first_s: float
    steady_s: float | None
    interpret: bool


def time_backends(step, backends, progress):
    """``step(backend)`` for each backend, results as host arrays: ``(results, timings)``.
    ``progress(label)``: a context manager shown while a call runs."""
    import jax
    import numpy as np

    results, timings = {}, {}
    for backend in backends:
        with progress(f"{backend}: compile + first step"):
            t0 = time.perf_counter()
            res = jax.block_until_ready(step(backend))
            t1 = time.perf_counter()
        results[backend] = jax.tree.map(np.asarray, res)
        interp = backend == "pallas" and jax.default_backend() != "tpu"
        steady = None
        if not interp:
            with progress(f"{backend}: second step"):
                t2 = time.perf_counter()
                jax.block_until_ready(step(backend))
                steady = time.perf_counter() - t2
        timings[backend] = Timing(t1 - t0, steady, interp)
    return results, timings


def backend_line(backend: str, t: Timing, out) -> str:
    """The line printed after a backend ran: its times, its output's shape, NaN or not."""
    import numpy as np

    what = f"out {out.shape}, NaN in out: {bool(np.isnan(np.asarray(out, np.float32)).any())}"
    if t.steady_s is None:
        note = "interpret mode, not a TPU timing" if t.interpret else "incl. compile"
        return f"{backend}: one step {t.first_s:.2f} s ({note}); {what}"
    return (f"{backend}: first step {t.first_s:.2f} s (compile), then {1e3 * t.steady_s:.1f} "
            f"ms; {what}")


def timing_text(backend: str, t: Timing) -> str:
    if t.steady_s is None:
        note = "interpret mode, not a TPU timing" if t.interpret else "one call"
        return f"{backend} {t.first_s:.2f} s (one call incl. compile; {note})"
    return (f"{backend} {t.first_s:.2f} s first call (incl. compile), "
            f"{1e3 * t.steady_s:.1f} ms steady")


class Comparison(NamedTuple):
    """Pallas against the reference: ``rows`` compared, ``differ`` (rows whose top-k sets
    differ in some layer), ``overlaps`` (per (layer, row) with picks), ``max_diff`` (max
    |diff| of the outputs on the other rows), ``within`` (the tolerance holds), ``rule``."""

    rows: int
    differ: int
    overlaps: list
    max_diff: float
    within: bool
    rule: str

    @property
    def ok(self) -> bool:
        return self.differ == 0 and self.within


def row_ulp_error(got, want):
    """``|got - want|`` in bf16 ulps of each row's largest ``|want|`` (the last axis a row; a
    zero row counts in units of 2^-7)."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    peak = np.abs(want).max(axis=-1, keepdims=True)
    return np.abs(got - want) / 2.0 ** (np.floor(np.log2(np.where(peak > 0, peak, 1.0))) - 7)


def _close(got, want, kind: str):
    import numpy as np

    rule, tol = SAME_STEP_TOLERANCE[kind]
    if got.size == 0:
        return True, "no rows"
    if rule == "allclose":
        ok = bool(np.all(np.abs(got - want) <= tol + tol * np.abs(want)))
        return ok, f"atol = rtol = {tol:g}"
    err = row_ulp_error(got, want)
    worst, mean = tol
    return (bool(err.max() <= worst and err.mean() <= mean),
            f"max {err.max():.2f} <= {worst:g} and mean {err.mean():.3f} <= {mean:g} bf16 ulps")


def compare(ref_out, pal_out, ref_topk, pal_topk, kind: str) -> Comparison:
    """``*_out [L, T, ...]``, ``*_topk [F, T, k]`` (``-1`` = no pick); the outputs are
    compared on the rows whose top-k sets agree in every layer, by ``SAME_STEP_TOLERANCE``."""
    import numpy as np

    rows, overlaps, differ = ref_out.shape[1], [], set()
    for f in range(ref_topk.shape[0]):
        for r in range(ref_topk.shape[1]):
            a = set(ref_topk[f, r].tolist()) - {-1}
            b = set(pal_topk[f, r].tolist()) - {-1}
            if a != b:
                differ.add(r)
            if a:
                overlaps.append(len(a & b) / len(a))
    same = [r for r in range(rows) if r not in differ]
    got = np.asarray(pal_out, np.float64)[:, same]
    want = np.asarray(ref_out, np.float64)[:, same]
    max_diff = float(np.abs(got - want).max()) if got.size else 0.0
    within, rule = _close(got, want, kind)
    return Comparison(rows, len(differ), overlaps, max_diff, within, rule)


def verdict(ran: str, nan: dict, timings: dict, cmp: Comparison | None,
            extra_fail: str | None = None, *,
            hint: str = "add --dsa-use-pallas to compare the Pallas kernels"
            ) -> tuple[list[str], int]:
    """The closing lines of a run and its exit status. ``ran``: what ran (e.g. "the V3.2 DSA
    step"); ``nan``: backend -> NaN in its output; ``cmp``: the comparison or ``None``
    (reference only); ``extra_fail``: another failed check, described; ``hint``: what a
    reference-only verdict suggests."""
    bad = [f"NaN in the {b} output" for b, has in nan.items() if has]
    if extra_fail:
        bad.append(extra_fail)
    if cmp is not None and not cmp.ok:
        if cmp.differ:
            bad.append(f"Pallas picks other top-k sets than the reference on {cmp.differ} of "
                       f"{cmp.rows} rows (top-k overlap min {min(cmp.overlaps, default=0.0):.4f})")
        if not cmp.within:
            bad.append(f"Pallas output off the reference beyond the tolerance (max |diff| "
                       f"{cmp.max_diff:.2e}; {cmp.rule})")
    if bad:
        head = "verdict: FAILED - " + "; ".join(bad)
    elif cmp is None:
        head = f"verdict: reference only - {ran} ran on the jnp reference, no NaN ({hint})"
    else:
        head = (f"verdict: OK - {ran} ran on the reference and Pallas agrees with it (top-k "
                f"sets identical on all {cmp.rows} rows; output max |diff| {cmp.max_diff:.2e}, "
                f"within {cmp.rule})")
    lines = [head, "timings: " + "; ".join(timing_text(b, t) for b, t in timings.items())]
    return lines, 1 if bad else 0
