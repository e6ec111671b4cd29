"""What the experiment notebooks (``scripts/experiments/*.ipynb``) share: the install cells and
the writer.

Install cells (a markdown line, then the first code cell; no ``sys.path`` edits): the notebook
imports its script as a module of the ``scripts`` package, which the wheel does not install, so
it runs from a checkout. The code cell finds the repository root (the working directory or a
folder above it, e.g. ``scripts/experiments/`` where Jupyter starts the kernel) and makes it the
working directory, which a notebook kernel imports from. In a checkout where dsa-jax is
installed (``pip install -e '.[test,tpu,notebooks]'``, CI) it installs nothing and needs no
network. On a fresh Colab runtime it does what a Colab user would: clones ``DSA_JAX_SOURCE``
(the repository's git URL; or the path of a checkout) and runs ``pip install
'<checkout>[notebooks]'``, the README's install for the notebooks.
"""

from __future__ import annotations

from pathlib import Path

_MARKDOWN = """\
**Install.** The next cell installs dsa-jax as a Colab user would: on a fresh runtime, set
`DSA_JAX_SOURCE` to this repository's git URL (or the path of a checkout) and it clones the
repository and runs `pip install '<checkout>[notebooks]'`. In a checkout with dsa-jax installed
(`pip install -e '.[test,tpu,notebooks]'`, what CI runs) it installs nothing.
"""

_TEMPLATE = '''\
# Install, as a Colab user would. The notebook runs its script from a checkout of the repository
# (`scripts/` is not in the wheel), so on a fresh runtime the cell clones DSA_JAX_SOURCE and runs
# `pip install '<checkout>[notebooks]'` (the README's install for the notebooks). In a checkout
# with dsa-jax installed (`pip install -e '.[test,tpu,notebooks]'`, CI) it installs nothing and
# needs no network. It then makes the repository root the working directory (a notebook kernel
# imports from there; no sys.path edits).
DSA_JAX_SOURCE = "https://github.com/OWNER/dsa-jax.git"  # this repository's git URL, or a checkout

import importlib
import importlib.util
import os
from pathlib import Path

SCRIPT = "scripts/experiments/{script}"
_here = Path.cwd().resolve()
_source = Path(DSA_JAX_SOURCE).expanduser()
ROOT = next((p for p in (_here, *_here.parents, _here / "dsa-jax", _source)
             if (p / SCRIPT).exists()), None)
if ROOT is None:
    if "/OWNER/" in DSA_JAX_SOURCE:
        raise RuntimeError(f"{{SCRIPT}} not found: set DSA_JAX_SOURCE to the repository's git URL")
    !git clone -q --depth 1 {{DSA_JAX_SOURCE}} dsa-jax
    ROOT = _here / "dsa-jax"
ROOT = ROOT.resolve()
if importlib.util.find_spec("dsa_jax") is None:  # not installed: a fresh runtime
    %pip install -q "{{ROOT}}[notebooks]"
    importlib.invalidate_caches()
os.chdir(ROOT)  # `from scripts.experiments import ...` resolves from the repository root
'''


def setup_cells(script: str) -> list[tuple[str, str]]:
    """The install cells (a markdown line, then the code cell) of the notebook of
    ``scripts/experiments/<script>``, as ``write_notebook`` takes them."""
    return [("markdown", _MARKDOWN), ("code", _TEMPLATE.format(script=script))]


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
