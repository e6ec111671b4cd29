"""Which implementation runs an op: the jnp reference or the Pallas kernels.

``backend`` is ``"reference"``, ``"pallas"`` or ``None``. ``None`` means Pallas on a TPU and the
reference elsewhere; the environment variable ``DSA_USE_PALLAS=1`` / ``0`` overrides that
default (and only the default: an explicit ``backend=`` always wins). Off TPU, ``"pallas"`` runs
the kernels in interpret mode.

The dispatch tables below name the functions themselves (no lookup by string), so a reader
(or an IDE) can follow a call from ``dsa_jax.sparse_mla`` straight to the kernel entry.
"""

from __future__ import annotations

import inspect
import os

import jax

from pallas_kernels import (
    page_sparse_mla,
    sparse_mla,
    streamindex_page_topk,
    streamindex_topk,
    v4_attention,
)
from pallas_kernels.v4_compressor import compress_step as v4_compress_step
from reference import (
    page_sparse_mla_ref,
    sparse_mla_ref,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
    v4_attention_ref,
)
from reference.v4_compressor import compress_step as v4_compress_step_ref

BACKENDS = ("reference", "pallas")
ENV_VAR = "DSA_USE_PALLAS"

# op -> (the jnp reference, the Pallas entry); both take the same arguments.
OPS = {
    "indexer_topk": (streamindex_topk_ref, streamindex_topk),
    "page_topk": (streamindex_page_topk_ref, streamindex_page_topk),
    "sparse_mla": (sparse_mla_ref, sparse_mla),
    "page_sparse_mla": (page_sparse_mla_ref, page_sparse_mla),
    "v4_attention": (v4_attention_ref, v4_attention),
    "v4_compressor": (v4_compress_step_ref, v4_compress_step),
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


def _keyword_only(fn) -> frozenset[str]:
    return frozenset(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


def kernel_knobs(op: str) -> frozenset[str]:
    """The keyword knobs of ``op``'s Pallas entry (block sizes, ``chip``, ``interpret``...):
    its keyword-only parameters that the reference does not take."""
    reference_fn, pallas_fn = OPS[op]
    return _keyword_only(pallas_fn) - _keyword_only(reference_fn)


def split_kernel_options(ops: tuple[str, ...], kernel_options: dict | None) -> dict[str, dict]:
    """Route one ``kernel_options`` dict to several ops (``dsa_step``): each op gets the knobs
    its Pallas entry takes (``interpret`` goes to all, ``block_rows`` to the indexer,
    ``tokens_per_block`` to the token MLA...). A knob no op takes raises ``ValueError``."""
    opts = dict(kernel_options or {})
    if "blocks" in opts:  # one typed config per kernel family: no guessing which op it is for
        raise ValueError("kernel_options['blocks'] is ambiguous in a step; pass "
                         "indexer_blocks=IndexerBlocks(...) and/or mla_blocks=MlaBlocks(...)")
    known = {op: kernel_knobs(op) for op in ops}
    unknown = sorted(set(opts) - set().union(*known.values()))
    if unknown:
        raise ValueError(f"kernel_options {unknown} are not knobs of any of {list(ops)}; "
                         f"their knobs: {sorted(set().union(*known.values()))}")
    return {op: {k: v for k, v in opts.items() if k in known[op]} for op in ops}


def implementation(op: str, backend: str | None, kernel_options: dict | None = None):
    """``(fn, extra_kwargs)`` for ``op`` under ``backend``.

    ``kernel_options`` (block sizes, chip, VMEM limit...) go to the Pallas entry only; the
    reference has no knobs and ignores them, so flipping the backend never breaks a call. A
    knob the Pallas entry does not take raises ``ValueError`` naming it and the entry's knobs.
    Off TPU the Pallas entry gets ``interpret=True`` unless ``kernel_options`` sets it.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(OPS)}")
    reference_fn, pallas_fn = OPS[op]
    extra = dict(kernel_options or {})
    unknown = sorted(set(extra) - kernel_knobs(op))
    if unknown:
        raise ValueError(f"kernel_options {unknown} are not knobs of the Pallas {op}; its "
                         f"knobs: {sorted(kernel_knobs(op))}")
    if resolve_backend(backend) == "reference":
        return reference_fn, {}
    if not on_tpu():
        extra.setdefault("interpret", True)
    return pallas_fn, extra
