"""Which implementation runs an op: the jnp reference or the Pallas kernels.

``implementation=`` (every op and both steps; the tokamax convention) names it: ``"xla"`` (the
jnp reference), ``"pallas"``, an op's named alternatives (``v4_attention``'s
``"pallas_two_pass"``), an ordered list of names (an implementation that cannot serve a call
raises ``NotImplementedError`` and the next is tried; when all fail, an ``ExceptionGroup`` of
their reasons), or ``None`` (the platform default below). An unknown name is a ``ValueError``
listing the op's names (``implementation_names``). ``backend=`` is the older spelling of the
same choice (``"reference"`` = ``"xla"``); passing both is a ``ValueError``.

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
    return _implementation_of(op, resolve_backend(backend), kernel_options)


def _implementation_of(op: str, resolved: str, kernel_options: dict | None):
    """``implementation``'s body for a resolved backend (``"reference"`` / ``"pallas"``)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(OPS)}")
    reference_fn, pallas_fn = OPS[op]
    extra = dict(kernel_options or {})
    unknown = sorted(set(extra) - kernel_knobs(op))
    if unknown:
        raise ValueError(f"kernel_options {unknown} are not knobs of the Pallas {op}; its "
                         f"knobs: {sorted(kernel_knobs(op))}")
    if resolved == "reference":
        return reference_fn, {}
    if not on_tpu():
        extra.setdefault("interpret", True)
    return pallas_fn, extra


# ------------------------------------------------------------- implementation= (tokamax's way)

IMPLEMENTATIONS = ("xla", "pallas")  # every op; "xla" is the jnp reference
# op -> {alternative name: the Pallas kernel_options that select it}
ALTERNATIVES = {"v4_attention": {"pallas_two_pass": {"fused": False}}}


def implementation_names(op: str) -> tuple[str, ...]:
    """The names ``implementation=`` accepts for ``op``."""
    return IMPLEMENTATIONS + tuple(ALTERNATIVES.get(op, {}))


def candidates(op: str, implementation, backend: str | None,
               kernel_options: dict | None = None) -> list[tuple[str, object, dict]]:
    """``[(name, fn, extra_kwargs)]`` to try in order for one call of ``op``.

    ``implementation``: ``None`` (the platform default, as ``backend=None``: Pallas on TPU, the
    reference elsewhere, ``DSA_USE_PALLAS`` honoured), a name of ``implementation_names(op)``,
    or an ordered sequence of names. ``backend=`` is the older spelling (``"reference"`` is
    ``"xla"``); giving both is a ``ValueError``. An unknown name is a ``ValueError`` listing
    the names.
    """
    chosen = chosen_names(op, implementation_names(op), implementation, backend)
    if chosen is None:
        chosen = [("xla" if resolve_backend(backend) == "reference" else "pallas")]
    out = []
    for name in chosen:
        opts = {**(kernel_options or {}), **ALTERNATIVES.get(op, {}).get(name, {})}
        fn, extra = _implementation_of(op, "reference" if name == "xla" else "pallas", opts)
        out.append((name, fn, extra))
    return out


def run(op: str, implementation, backend: str | None, kernel_options: dict | None, call):
    """``call(fn, extra)`` with the first of ``candidates(...)`` that serves it: one that raises
    ``NotImplementedError`` passes to the next; when all do, an ``ExceptionGroup`` of their
    reasons. Any other error is the caller's (raised at once)."""
    tried = candidates(op, implementation, backend, kernel_options)
    return first_serving(op, [(name, (fn, extra)) for name, fn, extra in tried],
                         lambda payload: call(*payload), group=implementation is not None)


def first_serving(op: str, tried: list, call, *, group: bool = True):
    """``call(payload)`` for the first ``(name, payload)`` of ``tried`` that does not raise
    ``NotImplementedError``; all failing: ``ExceptionGroup`` of their reasons (``group=False``,
    the ``backend=`` spelling: the one implementation's ``NotImplementedError`` itself, as
    before ``implementation=``)."""
    errors = []
    for name, payload in tried:
        try:
            return call(payload)
        except NotImplementedError as e:
            if not group:
                raise
            e.add_note(f"(implementation {name!r} of {op})")
            errors.append(e)
    raise ExceptionGroup(f"{op}: no implementation of {[n for n, _ in tried]} can serve "
                         f"this call", errors)


def chosen_names(where: str, names: tuple[str, ...], implementation,
                 backend: str | None) -> list[str] | None:
    """The names ``implementation=`` asks for (``None``: the platform default), checked
    against ``names``; ``implementation=`` with ``backend=`` is a ``ValueError``."""
    if implementation is None:
        return None
    if backend is not None:
        raise ValueError(f"{where}: pass implementation= or backend=, not both (got "
                         f"implementation={implementation!r}, backend={backend!r})")
    chosen = [implementation] if isinstance(implementation, str) else list(implementation)
    bad = [n for n in chosen if n not in names]
    if bad or not chosen:
        raise ValueError(f"{where}: unknown implementation {bad[0] if bad else chosen!r}; "
                         f"expected one of {names}, an ordered list of them, or None")
    return chosen


STEP_OPS = {"dsa_step": "indexer_topk", "v4_step": "v4_attention"}  # whose names a step takes


def step_candidates(step: str, implementation, backend: str | None,
                    kernel_options: dict | None) -> list[tuple[str, tuple[str, dict | None]]]:
    """``[(name, (backend, kernel_options))]`` for a step's ``implementation=`` (one
    implementation for every op of the step; ``candidates``' rules and names: the V4 step also
    takes ``"pallas_two_pass"``, its attention's alternative)."""
    op = STEP_OPS[step]
    chosen = chosen_names(step, implementation_names(op), implementation, backend)
    if chosen is None:
        return [("default", (resolve_backend(backend), kernel_options))]
    return [(name, ("reference" if name == "xla" else "pallas",
                    {**(kernel_options or {}), **ALTERNATIVES.get(op, {}).get(name, {})}
                    or kernel_options)) for name in chosen]


def with_config(op: str, kernel_options: dict | None, config) -> dict | None:
    """``kernel_options`` with the typed block config ``config=`` as its ``"blocks"``
    (``IndexerBlocks`` for the indexer ops, ``MlaBlocks`` for MLA and V4 attention)."""
    if config is None:
        return kernel_options
    from pallas_kernels import IndexerBlocks, MlaBlocks

    want = IndexerBlocks if op in ("indexer_topk", "page_topk") else MlaBlocks
    if not isinstance(config, want):
        raise TypeError(f"{op}: config must be a {want.__name__}, got "
                        f"{type(config).__name__}")
    if "blocks" in (kernel_options or {}):
        raise ValueError(f"{op}: pass the blocks as config= or kernel_options['blocks'], not "
                         f"both")
    return {**(kernel_options or {}), "blocks": config}
