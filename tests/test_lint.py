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


# Inside reference/: one folder per op family, imports flowing down (statements, v4_attention ->
# mla, indexer, v4_compressor -> formats -> quant -> core; witnesses beside core). A package may
# import itself and the packages listed for it, nothing else of reference (never the top-level
# ``reference`` package, never a shim).
REFERENCE_LAYERS = {
    "core": set(),
    "witnesses": set(),
    "quant": {"core"},
    "formats": {"core", "quant"},
    "indexer": {"core", "quant", "formats", "witnesses"},
    "mla": {"core", "quant", "formats"},
    "v4_compressor": {"core", "quant", "formats"},
    # the layer statement is the independent definition v4_attention is checked against: neither
    # imports the other; the V4.1 stack statement reads v41's map, formats and candidate selection
    "statements": {"core", "quant", "formats", "witnesses", "indexer", "mla", "v4_compressor",
                   "v41"},
    "v4_attention": {"core", "quant", "formats", "witnesses", "indexer", "mla", "v4_compressor"},
    "v41": {"core", "quant", "formats", "indexer", "mla", "v4_compressor"},
}
# The old module paths, kept as shims that re-export from the new homes so old imports work.
REFERENCE_SHIMS = {
    "_checks", "_indexer_args", "_mla_args", "attend", "batch", "cache_format", "deepseek_v4",
    "fp8", "fp8_cache", "index_scores", "index_share", "indexer_topk", "packed_cache",
    "page_sparse_mla", "page_topk", "selection", "sinks", "sparse_mla", "stacked", "synthetic",
    "v4_cache",
}


def _reference_targets(node):
    """The reference packages / top-level modules an import statement reads."""
    if isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "reference":
            return [a.name for a in node.names]
        mods = [node.module]
    else:
        return []
    return [m.split(".")[1] if "." in m else "" for m in mods if m.split(".")[0] == "reference"]


def test_reference_layers_flow_one_way():
    ref = ROOT / "reference"
    top = {p.stem for p in ref.glob("*.py")} - {"__init__"}
    assert top == REFERENCE_SHIMS, f"top-level modules of reference/ besides the shims: {top}"
    packages = {p.parent.name for p in ref.glob("*/__init__.py")}
    assert packages == set(REFERENCE_LAYERS), packages
    bad = []
    for path in ref.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if len(rel.parts) == 2:
            continue  # the top-level package and the shims
        pkg = rel.parts[1]
        allowed = REFERENCE_LAYERS[pkg] | {pkg}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad.append(f"{rel}: relative import")
            for target in _reference_targets(node):
                if target not in allowed:
                    what = ("a shim" if target in REFERENCE_SHIMS else
                            "the top-level package" if not target or target not in packages
                            else "a higher or sibling layer")
                    bad.append(f"{rel} imports reference.{target} ({what})".replace(".)", ")"))
    assert not bad, bad


def test_kernels_and_api_import_reference_by_its_new_paths():
    """``pallas_kernels`` and ``dsa_jax`` import ``reference``'s modules from their homes, never
    through the shims kept at the old paths for users (``REFERENCE_SHIMS``)."""
    bad = []
    for pkg in ("pallas_kernels", "dsa_jax"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = ([node.module] if node.module != "reference" else
                               [f"reference.{a.name}" for a in node.names])
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                for target in targets:
                    parts = target.split(".")
                    if parts[0] == "reference" and len(parts) > 1 and parts[1] in REFERENCE_SHIMS:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
    assert not bad, bad
