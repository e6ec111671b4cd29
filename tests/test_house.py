"""The house rules that keep the tree maintainable, checked on every run:

- every public name the packages exported before the one-name-per-family layout still imports,
  with its parameters (``tests/public_api.json``: module -> name -> parameter names, recorded
  from main ee9b7c1, extended with issue 28's API; new parameters may only be appended);
- no chip name as a code literal outside ``pallas_kernels/chips.py`` and the block tables
  (docstrings and comments may name chips);
- no package module over 550 lines;
- no test or script edits ``sys.path``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from pallas_kernels import chips

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference", "pallas_kernels", "dsa_jax")
CODE_TREES = PACKAGES + ("scripts", "tests")
MAX_MODULE_LINES = 550
PUBLIC_API = json.loads((ROOT / "tests" / "public_api.json").read_text())


def _py_files(trees):
    for tree in trees:
        yield from sorted((ROOT / tree).rglob("*.py"))


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_public_names_still_import_with_their_parameters(module):
    mod = importlib.import_module(module)
    bad = []
    for name, params in PUBLIC_API[module].items():
        if not hasattr(mod, name):
            bad.append(f"{name}: missing")
            continue
        if params is None:
            continue
        try:
            now = list(inspect.signature(getattr(mod, name)).parameters)
        except (TypeError, ValueError):
            continue
        if now[:len(params)] != params:
            bad.append(f"{name}: parameters {params} became {now}")
    assert not bad, f"{module}: {bad}"


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _chip_literal_allowed(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return rel == "pallas_kernels/chips.py" or (rel.startswith("pallas_kernels/")
                                               and path.name == "blocks.py")


def test_no_chip_name_as_a_code_literal_outside_chips_and_block_tables():
    """A chip is declared in ``pallas_kernels/chips.py`` (and has rows in the block tables);
    everything else reads it. A string constant naming a chip anywhere else is a second
    declaration (this test's own pattern is built from ``chips.NAMES``)."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, chips.NAMES)) + r")\b")
    bad = []
    for path in _py_files(CODE_TREES):
        if _chip_literal_allowed(path):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstring_nodes(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs and pattern.search(node.value)):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not bad, bad


def test_no_package_module_over_the_size_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _py_files(PACKAGES)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_no_test_or_script_edits_sys_path():
    bad = []
    for path in _py_files(("scripts", "tests")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def child_ok(path: str) -> None:
    Path(path).write_text("ran")


def child_crash() -> None:
    import os

    os.abort()


def test_run_isolated_runs_the_body_in_its_own_process_and_reports_a_crash(tmp_path):
    """The guard the strict interpreter's long runs use (``tests/isolated.py``): the body runs
    in a child process; a child killed by a signal fails the calling test, naming the signal,
    and leaves this process running."""
    from tests.isolated import run_isolated

    run_isolated(child_ok, str(tmp_path / "flag"))
    assert (tmp_path / "flag").read_text() == "ran"
    with pytest.raises(pytest.fail.Exception, match="killed by signal 6"):
        run_isolated(child_crash)


def child_flags(path: str) -> None:
    import os

    Path(path).write_text(os.environ.get("XLA_FLAGS", ""))


def test_an_optimized_isolated_child_compiles_with_xlas_defaults(tmp_path):
    """``run_isolated(..., optimized=True)``: the child's ``XLA_FLAGS`` carry
    ``OPTIMISED_COMPILE`` in place of the suite's ``QUICK_COMPILE`` and keep the rest (the 8
    host devices); without it, the suite's flags."""
    from tests.conftest import OPTIMISED_COMPILE, QUICK_COMPILE
    from tests.isolated import run_isolated

    for optimized, want, not_want in [(True, OPTIMISED_COMPILE, QUICK_COMPILE),
                                      (False, QUICK_COMPILE, OPTIMISED_COMPILE)]:
        run_isolated(child_flags, str(tmp_path / "flags"), optimized=optimized)
        flags = (tmp_path / "flags").read_text().split()
        assert "--xla_force_host_platform_device_count=8" in flags
        assert all(f in flags for f in want) and not any(f in flags for f in not_want), flags


def child_stall() -> None:
    import time

    time.sleep(60)


def test_a_stalled_isolated_child_shows_its_stack():
    """A child still running at 95% of ``run_isolated``'s timeout dumps its stacks, and the
    failure shows them: the line it stalled on."""
    from tests.isolated import run_isolated

    with pytest.raises(pytest.fail.Exception, match=r"(?s)ran past 6.0 s.*Timeout \(0:00:05"
                                                    r".*in child_stall"):
        run_isolated(child_stall, timeout=6.0)


CRASHING_TESTS = """
import os, pathlib, signal

def _crash_first_time(name):
    flag = pathlib.Path(os.environ["CRASH_DIR"]) / name
    if not flag.exists():
        flag.write_text("crashed")
        os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_once():
    _crash_first_time("once")

def test_crashes_always():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_fine():
    pass
"""


def test_a_crashed_xdist_worker_test_is_rerun_once_and_listed(tmp_path):
    """The suite's guard against XLA:CPU's rare worker segfault (``tests/conftest.py``): a test
    whose pytest-xdist worker crashes runs once more on the replacement worker; a second crash
    fails it; both are listed at the end."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_crash.py").write_text(CRASHING_TESTS)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "-p",
         "tests.conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_crash.py")], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env=dict(os.environ, CRASH_DIR=str(tmp_path)))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert re.search(r"1 failed, 2 passed, 2 rerun", text), text
    assert "worker crashed while running test_crash.py::test_crashes_once" in text, text
    assert re.search(r"FAILED \S*test_crash.py::test_crashes_always", text), text
