"""What the experiment notebooks (``scripts/*.ipynb``) share: the setup cell and the writer.

Setup cell: in a checkout where dsa-jax is installed it installs nothing; it finds ``scripts/``
next to the notebook and puts the repository root (for ``experiments/``) and ``scripts/`` on
``sys.path``. On a fresh Colab runtime, with ``REPO_URL`` set, it clones the repository and
pip-installs the package (jax, numpy and matplotlib are preinstalled on Colab; nothing else is
downloaded).
"""

from __future__ import annotations

from pathlib import Path

_TEMPLATE = '''\
# Setup. In a checkout where dsa-jax is installed (`pip install -e '.[experiments]'`) this cell
# installs nothing: it only puts the repository root (for experiments/) and scripts/ on
# sys.path. On a fresh Colab runtime, set REPO_URL to this repository's git URL: the cell clones
# it and pip-installs the package (jax, numpy and matplotlib are preinstalled on Colab; nothing
# else is downloaded).
import importlib
import importlib.util
import sys
from pathlib import Path

REPO_URL = ""  # e.g. "https://github.com/<owner>/dsa-jax.git" (Colab only)
_here = Path.cwd().resolve()
_candidates = [_here, _here / "scripts", _here.parent / "scripts", _here / "dsa-jax" / "scripts"]
SCRIPTS = next((p for p in _candidates if (p / "{script}").exists()), None)
if SCRIPTS is None:
    if not REPO_URL:
        raise RuntimeError("scripts/{script} not found: set REPO_URL (Colab)")
    !git clone -q --depth 1 {{REPO_URL}} dsa-jax
    SCRIPTS = _here / "dsa-jax" / "scripts"
ROOT = SCRIPTS.parent
if importlib.util.find_spec("dsa_jax") is None:  # not installed: Colab
    %pip install -q {{ROOT}}
    importlib.invalidate_caches()
for _p in (ROOT, SCRIPTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
'''


def setup_cell(script: str) -> str:
    """The setup cell's source for the notebook of ``scripts/<script>``."""
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
