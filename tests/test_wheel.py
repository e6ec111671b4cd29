"""The installable package: the wheel ``pip install .`` builds holds every module of the three
trees (``reference``, ``pallas_kernels``, ``dsa_jax``) and nothing of ``tests/`` or
``scripts/``, and, unzipped outside the checkout, every module imports from it and ``python -m
dsa_jax --help`` runs.

The wheel is built with this interpreter's pip and setuptools (``--no-build-isolation``: no
download; setuptools >= 77 is in the test extra) from a copy of the checkout, so no ``build/``
or ``*.egg-info`` is written into the checkout and no stale ``build/lib`` of an earlier build can
leak removed modules into it. The imports run in a child process whose working directory is
outside the checkout and whose ``PYTHONPATH`` is only the unzipped wheel: that comes before
site-packages, so an editable install of a checkout in the same venv cannot answer instead (the
child checks every module's ``__file__``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("reference", "pallas_kernels", "dsa_jax")
# Never copied into the build folder: VCS data, caches and earlier build outputs (.gitignore).
_NOT_COPIED = (".git", "__pycache__", "*.egg-info", "build", "dist", "out", "venv", ".venv",
               ".pytest_cache", ".ruff_cache", ".hypothesis")
MIN_SETUPTOOLS = 77  # pyproject.toml's build-system requirement (PEP 639 license string)


def _package_files() -> list[str]:
    """Every file of the three trees a wheel must hold, relative to the root: the modules and
    any data file beside them (none today; one would need ``[tool.setuptools.package-data]``).
    """
    files = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            rel = path.relative_to(ROOT)
            if (path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc"
                    and not path.name.startswith(".")):
                files.append(rel.as_posix())
    return files


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if _setuptools_major() < MIN_SETUPTOOLS:
        pytest.skip(f"building the wheel needs setuptools >= {MIN_SETUPTOOLS} in this "
                    "interpreter (--no-build-isolation, no download): pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = dist.glob("dsa_jax-*.whl")
    return whl


def test_the_wheel_holds_every_module_of_the_three_trees_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _package_files()
    assert sum(f.endswith(".py") for f in expected) > 100  # the trees were found
    missing = sorted(set(expected) - names)
    assert not missing, f"files of the three trees missing from {wheel.name}: {missing}"
    tops = {n.split("/")[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and tops - dist_info == set(TREES), sorted(tops)
    assert not [n for n in names if n.startswith(("tests/", "scripts/"))]


_IMPORT_ALL = """
import importlib, json, sys
from pathlib import Path

root = Path(sys.argv[1]).resolve()
outside = {}
for name in json.loads(sys.argv[2]):
    where = Path(importlib.import_module(name).__file__).resolve()
    if not where.is_relative_to(root):
        outside[name] = str(where)
print(json.dumps(outside))
"""


def test_every_module_imports_from_the_unzipped_wheel_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    modules = [_module_name(f) for f in _package_files() if f.endswith(".py")]
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(site), json.dumps(modules)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    outside = json.loads(out.stdout.strip().splitlines()[-1])
    assert not outside, f"imported from outside the unzipped wheel: {outside}"
    cli = subprocess.run([sys.executable, "-m", "dsa_jax", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "python -m dsa_jax" in cli.stdout and "run" in cli.stdout, cli.stdout
