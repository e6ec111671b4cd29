"""Which implementation runs an op: the jnp reference or the Pallas kernels.

``backend`` is ``"reference"``, ``"pallas"`` or ``None``. ``None`` means Pallas on a TPU and the
reference elsewhere; the environment variable ``DSA_USE_PALLAS=1`` / ``0`` overrides that
default (and only the default: an explicit ``backend=`` always wins). Off TPU, ``"pallas"`` runs
the kernels in interpret mode.

The kernels are looked up when an op is called, not when ``dsa_jax`` is imported, so the API
works (reference-only) before a kernel exists; a missing kernel raises ``NotImplementedError``
naming the op.
"""

from __future__ import annotations

import importlib
import os
import types

import jax

BACKENDS = ("reference", "pallas")
ENV_VAR = "DSA_USE_PALLAS"

# op -> (reference attribute in ``reference``, kernel attribute in ``pallas_kernels``, the
# kernel's module inside ``pallas_kernels`` for a package that does not re-export it yet)
OPS = {
    "indexer_topk": ("streamindex_topk_ref", "streamindex_topk", "indexer_topk"),
    "page_topk": ("streamindex_page_topk_ref", "streamindex_page_topk", "page_topk"),
    "sparse_mla": ("sparse_mla_ref", "sparse_mla", "sparse_mla"),
    "page_sparse_mla": ("page_sparse_mla_ref", "page_sparse_mla", "page_sparse_mla"),
}


def on_tpu() -> bool:
    """True when the default JAX backend is a TPU."""
    return jax.default_backend() == "tpu"


def resolve_backend(backend: str | None) -> str:
    """``"reference"`` or ``"pallas"`` for ``backend`` (see module docstring)."""
    if backend is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if env in ("1", "0"):
            return "pallas" if env == "1" else "reference"
        if env:
            raise ValueError(f"{ENV_VAR} must be '1' (Pallas) or '0' (reference) when set, got "
                             f"{ENV_VAR}={env!r}")
        return "pallas" if on_tpu() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None "
                         f"(Pallas on TPU, the reference elsewhere)")
    return backend


def reference_impl(op: str):
    """The reference function of ``op``."""
    return getattr(importlib.import_module("reference"), OPS[op][0])


def pallas_impl(op: str):
    """The Pallas entry of ``op``, or ``NotImplementedError`` naming the op if it is missing."""
    _, attr, module = OPS[op]
    try:
        pkg = importlib.import_module("pallas_kernels")
        fn = getattr(pkg, attr, None)
        # ``pallas_kernels.sparse_mla`` is also a submodule's name: a module is not the entry
        if fn is None or isinstance(fn, types.ModuleType):
            fn = getattr(importlib.import_module(f"pallas_kernels.{module}"), attr)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            f"backend='pallas' has no kernel for {op} yet (pallas_kernels.{attr} is missing: "
            f"{e}); use backend='reference'") from e
    return fn


def implementation(op: str, backend: str | None, kernel_options: dict | None = None):
    """``(fn, extra_kwargs)`` for ``op`` under ``backend``.

    ``kernel_options`` (block sizes, chip, VMEM limit...) go to the Pallas entry only; the
    reference has no knobs and ignores them, so flipping the backend never breaks a call.
    Off TPU the Pallas entry gets ``interpret=True`` unless ``kernel_options`` sets it.
    """
    if resolve_backend(backend) == "reference":
        return reference_impl(op), {}
    extra = dict(kernel_options or {})
    if not on_tpu():
        extra.setdefault("interpret", True)
    return pallas_impl(op), extra
