"""Test environment: CPU only (libtpu is installed for AOT compiles, not for running), 8 host
devices for the sharding tests. Set before jax is imported anywhere."""

import os

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# pytest-xdist workers each load libtpu for the AOT compile gates.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# 8 host devices, and XLA:CPU's quick compile (LLVM at -O0, its expensive passes off): the suite
# compiles thousands of small CPU programs and runs most of them once; a 241-test subset took
# 18% less time with these flags, passing the same (issue 26; BENCHMARKS.md, session 13). They
# leave the TPU AOT compiles alone (same program text, same cost analysis) and fast-math off.
QUICK_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# XLA's defaults: what tests/isolated.py's ``optimized=True`` children compile with (a long run
# of the same few programs, where -O0's slower code costs more than the compiles it saves)
OPTIMISED_COMPILE = ("--xla_backend_optimization_level=3",
                     "--xla_llvm_disable_expensive_passes=false")
_FLAGS = ("--xla_force_host_platform_device_count=8", *QUICK_COMPILE)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# One persistent compilation cache per run, shared by the pytest-xdist workers and the
# processes tests start (they inherit the environment the controller sets here before it starts
# the workers): an XLA:CPU program that another worker, another test's jit wrapper or an
# isolated child already compiled is read back instead of compiled again (a compile-bound
# 307-test subset: 113 s -> 102 s, session 19). Fresh per run (a temporary folder removed at
# exit), so no run reads another's entries. TPU AOT compiles write nothing to it
# (``pallas_kernels.aot.compiling_on``: libtpu's compile-only client cannot load an entry
# back). A cache given in the environment is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _CACHE_DIR = tempfile.mkdtemp(prefix="dsa-jax-test-jit-cache-")
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# The strict Pallas interpreter's callbacks take NumPy copies instead of jax's per-call
# device_put (tests/interpret_callbacks.py: the device_put was over half of every interpreter
# callback; a 40-decode V4 Pallas run went 45.7 s -> 29.8 s, the same output). The processes
# tests start import this file too (tests/isolated.py), so they run the same path.
from tests import interpret_callbacks  # noqa: E402

interpret_callbacks.install()

def pytest_collection_modifyitems(config, items):
    """The long tests (``@pytest.mark.slow``) first, the rest in collection order (a stable
    sort, the same on every pytest-xdist worker). With the README's ``--dist worksteal`` the
    workers split the queue and an idle one steals from the other's tail, so a long test that
    started first ends while the short ones are shared; started last it would be the suite's
    tail (issue 26: the lock-step run alone is ~8 min on 2 cores)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# ----------------------------------------------------------------------------- worker crashes
# A pytest-xdist worker has segfaulted inside XLA:CPU's compile (jaxlib 0.10.2,
# ``backend_compile_and_load``) in about one full run in three since session 8, each time in a
# different test that passes in a fresh process (issue 26; BENCHMARKS.md, "The test suite's
# time"). The crashed test is run once more, on the replacement worker; a second crash of the
# same test fails it, and every crash is listed at the end of the run.
MAX_CRASH_RERUNS = 3  # per run: more crashes than this fail as they are
_crashed: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """pytest-xdist's hook: reschedule a test whose worker crashed, once."""
    if crashitem in _crashed or len(_crashed) >= MAX_CRASH_RERUNS:
        return
    _crashed.append(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if _crashed:
        terminalreporter.section("worker crashes (each test rerun once on a new worker)")
        for nodeid in _crashed:
            terminalreporter.line(f"worker crashed while running {nodeid}")
