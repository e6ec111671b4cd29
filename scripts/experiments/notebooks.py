"""What the experiment notebooks (``scripts/experiments/*.ipynb``) share: the setup cell and
the writer.

Setup cell (no ``sys.path`` edits): the notebook imports its script as a module of the
``scripts`` package, so the cell finds the repository root (the working directory or a folder
above it, e.g. ``scripts/experiments/`` where Jupyter starts the kernel) and makes it the
working directory, which a notebook kernel imports from. In a checkout where dsa-jax is
installed (``pip install -e '.[experiments]'``) it installs nothing. On a fresh Colab runtime,
with ``REPO_URL`` set, it clones the repository and runs ``pip install -e`` on the clone (jax,
numpy and matplotlib are preinstalled on Colab; nothing else is downloaded).
"""

from __future__ import annotations

from pathlib import Path

_TEMPLATE = '''\
# Setup. The notebook imports its script from the `scripts` package of the repository, so this
# cell makes the repository root the working directory (a notebook kernel imports from there;
# no sys.path edits). In a checkout where dsa-jax is installed (`pip install -e
# '.[experiments]'` in the root) it installs nothing. On a fresh Colab runtime, set REPO_URL to
# this repository's git URL: the cell clones it and runs `pip install -e` on the clone (jax,
# numpy and matplotlib are preinstalled on Colab; nothing else is downloaded).
import importlib
import importlib.util
import os
from pathlib import Path

REPO_URL = ""  # e.g. "https://github.com/<owner>/dsa-jax.git" (Colab only)
SCRIPT = "scripts/experiments/{script}"
_here = Path.cwd().resolve()
ROOT = next((p for p in (_here, *_here.parents, _here / "dsa-jax") if (p / SCRIPT).exists()),
            None)
if ROOT is None:
    if not REPO_URL:
        raise RuntimeError(f"{{SCRIPT}} not found: set REPO_URL (Colab)")
    !git clone -q --depth 1 {{REPO_URL}} dsa-jax
    ROOT = _here / "dsa-jax"
if importlib.util.find_spec("dsa_jax") is None:  # not installed: Colab
    %pip install -q -e {{ROOT}}
    importlib.invalidate_caches()
os.chdir(ROOT)  # `from scripts.experiments import ...` resolves from the repository root
'''


def setup_cell(script: str) -> str:
    """The setup cell's source for the notebook of ``scripts/experiments/<script>``."""
    return _TEMPLATE.format(script=script)


def write_notebook(path: Path, cells: list[tuple[str, str]], id_prefix: str) -> Path:
    """Writes a notebook without outputs with nbformat: ``cells`` are ``("markdown" | "code",
    source)``, cell ids ``f"{id_prefix}-{i}"`` (deterministic, so a rebuilt notebook is
    byte-identical and a staleness test can compare)."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    make = {"markdown": new_markdown_cell, "code": new_code_cell}
    nb = new_notebook(cells=[make[kind](source) for kind, source in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{id_prefix}-{i}"
    nbformat.validate(nb)
    nbformat.write(nb, str(path))
    return path
