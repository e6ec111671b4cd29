"""The tree stays ruff-clean and imports flow one way (reference <- pallas_kernels <- dsa_jax)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"reference": 0, "pallas_kernels": 1, "dsa_jax": 2}


def test_ruff_is_clean():
    # ruff is in the test extra; a missing ruff fails here rather than skipping.
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_imports_flow_one_way():
    bad = []
    for pkg, level in LAYERS.items():
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if LAYERS.get(top, -1) > level:
                        bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad
