"""XLA's TPU cost model of a compiled program, split into the Pallas kernels and the XLA glue,
and the gather / scatter ops left in the glue.

What a compiled program reports (AOT through libtpu, ``pallas_kernels.aot.aot_compile``):

- ``compiled.cost_analysis()`` (a dict, or a list of one dict) has ``"bytes accessed"``: the
  bytes of every XLA op plus, for each Pallas call, the ``bytes_accessed`` of its
  ``pl.CostEstimate`` (a call without one counts 0). A program that is only Pallas calls
  without estimates reports per-operand keys (``"bytes accessed0{}"``...) and no total.
- ``compiled.as_text()`` (optimized HLO) holds each Pallas call as
  ``custom-call(...), custom_call_target="tpu_custom_call"`` whose ``backend_config`` JSON
  carries ``"cost_estimate": {"bytes_accessed": "987654", ...}``.

So ``xla_bytes = total - sum of the custom calls' estimated bytes`` (``analyze``).

Where XLA's model is unreliable, and what this module does about it:

- A ``while`` loop's body (``fori_loop``, ``scan``, ``searchsorted``) is counted ONCE whatever
  its trip count (measured: 4 and 64 iterations report the same bytes). ``XlaCost.has_loop``
  flags such a program and ``XlaCost.loops`` gives each loop's carried state (everything its
  body reads is in that tuple). Assert a bound only where ``XlaCost.loops_negligible``: no
  loop, or only loops carrying <= 64 KiB (the decode programs' ``searchsorted`` over sequence
  offsets carries < 1 KB; a chunked prefill's ``fori_loop`` carries its whole output).
- ``optimal_seconds`` is sometimes negative (seen on v5e, v6e and tpu7x; e.g. ``select_topk``
  at 64 x 131072 on v6e: -0.9995). ``XlaCost.optimal_seconds`` is ``None`` when it is negative
  or missing; never use it as a time then.

The HLO parsing (instructions, Pallas calls, loops, gathers / scatters) is
``pallas_kernels.measure.hlo``; this module reports and judges. Gathers and scatters
(``hlo.parse_indexed_ops``): XLA's TPU model prices a per-element op at tens of times its data;
``is_per_element(op, row_limit=R)`` says "a small slice and more than ``R`` indices"; ``R`` is
the program's row count (query rows or sequences, whichever is larger). An op that is per
element but accepted needs an ``Allowed`` entry with a reason and an index bound (``classify``;
the package's list is ``HOT_PATH_ALLOWED``, empty today). ``IndexedOp.source`` names the JAX
source line of each op, and ``XlaCost.large_results`` the entry-computation ops that produce
big buffers: where to look when the XLA bytes are high.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from pallas_kernels import aot
from pallas_kernels.measure.hlo import (
    IndexedOp,
    KernelCall,
    LargeResult,
    Loop,
    estimated_cycles,
    parse_indexed_ops,
    parse_kernel_calls,
    parse_large_results,
    parse_loops,
)

# A slice with fewer elements than one 128-lane row is a per-element access.
ROW_SLICE_ELEMS = 128
# A while loop carrying at most this much state cannot hide material traffic per iteration.
NEGLIGIBLE_LOOP_STATE_BYTES = 64 * 1024


@dataclass(frozen=True)
class XlaCost:
    """XLA's cost model of one compiled program, kernels and glue apart.

    ``total_bytes``: ``"bytes accessed"`` (kernels' estimates + XLA ops); ``kernel_bytes``: the
    sum of the Pallas calls' estimates; ``xla_bytes = total_bytes - kernel_bytes``.
    ``optimal_seconds``: XLA's, ``None`` when negative or missing. ``has_loop``: the program
    has a ``while`` (its body is counted once: bytes are then a lower bound, not a total);
    ``loops`` says what each carries. ``indexed_ops``: every gather/scatter;
    ``large_results``: where big XLA buffers are made (``parse_large_results``).
    ``estimated_cycles``: the sum of XLA's per-op cycle estimates (``hlo.estimated_cycles``; 0
    where the backend gives none)."""

    total_bytes: float
    kernel_bytes: float
    xla_bytes: float
    optimal_seconds: float | None
    has_loop: bool
    indexed_ops: tuple[IndexedOp, ...]
    kernels: tuple[KernelCall, ...] = field(default=())
    loops: tuple[Loop, ...] = field(default=())
    large_results: tuple[LargeResult, ...] = field(default=())
    total_reported: bool = True
    estimated_cycles: int = 0

    @property
    def loops_negligible(self) -> bool:
        """No loop, or only loops carrying <= ``NEGLIGIBLE_LOOP_STATE_BYTES`` (a
        ``searchsorted`` over sequence offsets): the bytes are then a total to first order."""
        return self.loop_state_bytes <= NEGLIGIBLE_LOOP_STATE_BYTES

    @property
    def loop_state_bytes(self) -> int:
        """The largest carried state of any ``while`` (0 without one): what one uncounted
        iteration can touch, to first order."""
        return max((lp.state_bytes for lp in self.loops), default=0)

    @property
    def kernels_without_estimate(self) -> int:
        return sum(k.bytes_accessed is None for k in self.kernels)


# ----------------------------------------------------------------------------- cost


def compile_program(fn: Callable, specs: Sequence[jax.ShapeDtypeStruct], chip: str, *,
                    donate_argnums: tuple[int, ...] = (), case: str = ""):
    """``aot.aot_compile`` with ``donate_argnums``: a cache writer compiled without donation
    models a copy of the whole cache, which serving never pays (it donates)."""
    if not donate_argnums:
        return aot.aot_compile(fn, list(specs), chip, case)
    dev = aot.topology_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    try:
        with aot.compiling_on(dev):
            return jax.jit(fn, donate_argnums=donate_argnums).trace(*placed).lower().compile()
    except Exception as e:  # keep the compiler's message whole, as aot_compile does
        raise aot.CompileError(chip, case, f"{type(e).__name__}: {e}") from e


def cost_dict(compiled) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict (jax returns a dict or a list of one)."""
    cost: Any = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        if len(cost) != 1:
            raise ValueError(f"expected one cost dict, got {len(cost)}")
        cost = cost[0]
    return dict(cost or {})


def analyze(compiled) -> XlaCost:
    """Kernel and XLA bytes, ``optimal_seconds``, loop flag and gathers/scatters of a compiled
    program (``jax.jit(f).trace(...).lower().compile()``; see the module docstring)."""
    cost = cost_dict(compiled)
    text = compiled.as_text()
    kernels = tuple(parse_kernel_calls(text))
    kernel_bytes = float(sum(k.bytes_accessed or 0 for k in kernels))
    reported = "bytes accessed" in cost
    # No total: a program of only estimate-less Pallas calls (XLA then models nothing).
    total = float(cost["bytes accessed"]) if reported else kernel_bytes
    secs = cost.get("optimal_seconds")
    secs = float(secs) if secs is not None and secs >= 0 else None
    loops = tuple(parse_loops(text))
    return XlaCost(total_bytes=total, kernel_bytes=kernel_bytes, xla_bytes=total - kernel_bytes,
                   optimal_seconds=secs, has_loop=bool(loops),
                   indexed_ops=tuple(parse_indexed_ops(text)), kernels=kernels, loops=loops,
                   large_results=tuple(parse_large_results(text)), total_reported=reported,
                   estimated_cycles=estimated_cycles(text))


# ----------------------------------------------------------------------------- verdicts


def is_per_element(op: IndexedOp, *, row_limit: int) -> bool:
    """True for a gather/scatter that moves less than a 128-lane row per index
    (``slice_elems < ROW_SLICE_ELEMS``) with more than ``row_limit`` indices: the pattern XLA's
    TPU model prices at tens of times its data. ``row_limit`` is the program's per-row count
    (query rows or sequences): up to that many scalar indices is per-row metadata."""
    return op.slice_elems < ROW_SLICE_ELEMS and op.num_indices > row_limit


@dataclass(frozen=True)
class Allowed:
    """A per-element gather/scatter accepted on a hot path, and why.

    Matches an op of ``kind`` whose recorded stack has a frame of ``function`` and at most
    ``max_indices`` indices (``None``: no bound). Keep the bound tight: it is what stops an
    allowed metadata op from growing into a per-entry one."""

    name: str
    reason: str
    kind: str
    function: str
    max_indices: int | None = None

    def matches(self, op: IndexedOp) -> bool:
        """Kind, function (a recorded name equal to it or ending in ``.function``: Python
        records ``outer.<locals>.inner``) and index bound all agree."""
        in_stack = any(f == self.function or f.endswith("." + self.function)
                       for f in op.functions)
        return (op.kind == self.kind and in_stack
                and (self.max_indices is None or op.num_indices <= self.max_indices))


@dataclass(frozen=True)
class Verdict:
    """``status``: ``"row"`` (big slice), ``"metadata"`` (<= row_limit indices),
    ``"allowed"`` (per element, matched an ``Allowed``), ``"per-element"`` (a failure);
    ``reason`` says which rule decided."""

    status: str
    reason: str

    @property
    def ok(self) -> bool:
        return self.status != "per-element"


def classify(op: IndexedOp, *, row_limit: int, allowed: Sequence[Allowed] = ()) -> Verdict:
    """The verdict on one op (see ``Verdict``)."""
    if op.slice_elems >= ROW_SLICE_ELEMS:
        return Verdict("row", f"{op.slice_elems} elems per index (a row)")
    if not is_per_element(op, row_limit=row_limit):
        return Verdict("metadata", f"{op.num_indices} indices <= {row_limit} rows")
    for a in allowed:
        if a.matches(op):
            return Verdict("allowed", f"{a.name}: {a.reason}")
    return Verdict("per-element", f"{op.num_indices} indices x {op.slice_elems} elems "
                                  f"> {row_limit} rows")



# Per-element gathers/scatters accepted on the package's hot paths; every entry needs a reason
# and a tight index bound. Deliberately NOT here: the indexer's page-table gather
# (``reference.batch.seq_pages`` over ``S * pages_per_seq`` slots, one scalar per index): XLA
# models it at ~35 MB for a 16 KB table at 64 x 4096 (0.53x the kernel's key bytes by itself),
# and a page table belongs in SMEM via scalar prefetch (``shared/SPEC.md``).
HOT_PATH_ALLOWED: tuple[Allowed, ...] = ()
