"""Run a long test body in a fresh Python process (the strict Pallas interpreter's long runs).

Why: those runs issue hundreds of thousands of interpreter callbacks; once a pytest-xdist worker
that had run them segfaulted later inside XLA CPU's compile of an unrelated test (main
4716d7b), taking that worker's remaining tests with it. In a process of its own a long run
returns its memory when it ends, a crash fails that test alone (with its exit signal named),
and the worker that started it stays clean.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAIL = 6000  # characters of the child's output shown when it fails


def run_isolated(fn, *args, timeout: float = 1800.0, optimized: bool = False) -> None:
    """Call ``fn(*args)`` (a module-level function of a ``tests/`` module, picklable-free
    arguments: ``repr`` round-trips them) in a new interpreter with the test environment
    (``tests/conftest.py``), from the repository root; fail the calling test with the child's
    output tail if it raises, crashes or runs past ``timeout`` seconds (the child dumps its
    stacks at 95% of it, so a stalled child shows where it stalled). ``optimized``: the child's
    XLA:CPU compiles optimise (``conftest.OPTIMISED_COMPILE``, XLA's defaults) instead of the
    suite's quick compile (``conftest.QUICK_COMPILE``): for a body that runs the same programs
    hundreds of times."""
    module = "tests." + Path(inspect.getfile(fn)).stem
    # a child still running near the timeout dumps its stacks first (shown in the failure)
    code = (f"import faulthandler\nfaulthandler.dump_traceback_later({0.95 * timeout!r})\n"
            f"import tests.conftest\nfrom {module} import {fn.__name__}\n"
            f"{fn.__name__}(*{args!r})\n")
    env = dict(os.environ)
    if optimized:
        env["XLA_FLAGS"] = optimised_flags(env.get("XLA_FLAGS", ""))
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module}.{fn.__name__}{args!r} ran past {timeout} s in its own process:\n"
                    f"{(e.stdout or '')[-TAIL:]}{(e.stderr or '')[-TAIL:]}")
    if out.returncode != 0:
        how = (f"was killed by signal {-out.returncode}" if out.returncode < 0
               else f"exited {out.returncode}")
        pytest.fail(f"{module}.{fn.__name__}{args!r} {how} in its own process:\n"
                    f"{out.stdout[-TAIL:]}\n{out.stderr[-TAIL:]}", pytrace=False)


def optimised_flags(flags: str) -> str:
    """``XLA_FLAGS`` ``flags`` with ``conftest.QUICK_COMPILE``'s flags (added or replaced) at
    ``conftest.OPTIMISED_COMPILE``'s values; every other flag kept."""
    from tests.conftest import OPTIMISED_COMPILE

    names = {f.split("=")[0] for f in OPTIMISED_COMPILE}
    kept = [f for f in flags.split() if f.split("=")[0] not in names]
    return " ".join([*kept, *OPTIMISED_COMPILE])
