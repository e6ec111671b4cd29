"""Count the bytes a Pallas TPU kernel moves between memory spaces, in the TPU interpreter.

A SIMULATION count: what the Pallas TPU interpreter (``interpret=pltpu.InterpretParams(...)``)
copies while it runs a kernel on CPU, not a hardware measurement. It counts

- block copies: the grid pipeline's copy of an input block into its kernel buffer (VMEM/SMEM)
  at a grid step whose block index changed (or the first step), and of an output block back to
  HBM at a step after which its block index changes (or the last step);
- manual DMAs: every ``pltpu.make_async_copy(...).start()`` / ``pltpu.async_copy`` the kernel
  issues, counted when the interpreter executes its read: at ``start`` under
  ``dma_execution_mode="eager"`` (use it for counting: every started DMA is counted), at a
  ``wait`` on its semaphore under the default ``"on_wait"``, where a DMA nobody waits for is
  never executed; ``TrafficCount.dmas_unexecuted`` says how many were missed.

``TrafficCount.descriptors``: the DMA descriptors issued, one per block copy and one per
started manual DMA (what ``aot.Traffic.dmas`` models).

Each copy records its source and destination memory space, shape, dtype and bytes: the logical
bytes and, for copies between HBM and VMEM, the bytes with the minor dim padded to 128 lanes
(an array whose minor dim is not a multiple of 128 occupies whole 128-lane tiles there, e.g.
an ``f32[R*H, 1]`` column moves 128x its logical bytes; sublane padding is not added, because
a DMA of single rows moves only those rows; SMEM is untiled). Not counted: the scalar prefetch
operands (copied to SMEM once before the grid), the interpreter's own setup and readback, and
all XLA work outside the ``pallas_call``. Plain ``interpret=True`` runs the generic HLO
interpreter, which has no memory spaces: nothing is counted there.

This is the ONE module that hooks private JAX internals, all in
``jax._src.pallas.mosaic.interpret.interpret_pallas_call``: the functions ``get`` / ``store``
(the pipeline's block copies call them with ``input_name=`` / ``output_name=``; the
interpreter binds them when a kernel is traced, so entering a counting block clears jit caches)
and the class ``DMA`` (``dma_start`` builds one per started copy; its ``execute_read`` reads
the source). ``check_internals()`` verifies every symbol, keyword and field before use and
raises ``InternalsChanged`` (a RuntimeError naming the jax version and the missing piece);
``self_test()`` runs a tiny kernel with one block copy each way and one manual DMA per step and
checks the exact counts, so a jax upgrade cannot silently count zero. Nothing in the package
imports this module (the package must import on any jax); ``scripts/cost/hbm_traffic.py`` and its
test do.

Usage::

    with count_hbm_traffic() as counted:
        jax.block_until_ready(kernel(..., interpret=pltpu.InterpretParams(
            dma_execution_mode="eager")))
    counted.bytes("hbm", "vmem", lane_padded=True), counted.table()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
from collections.abc import Iterator

import numpy as np

TESTED_JAX_VERSIONS = ("0.10.2", "0.12.0.1")  # the CI pin and the newest-jax run (README)
INTERNALS_MODULE = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"
LANES = 128
_TILED = {"hbm", "vmem"}

# symbol -> keyword parameters the hook relies on (of the undecorated function)
_FUNCS = {"get": ("memory_space", "input_name", "transforms"),
          "store": ("memory_space", "output_name", "val")}
_DMA_FIELDS = ("src_memory_space", "dst_memory_space", "data", "state")


class InternalsChanged(RuntimeError):
    """The private interpreter internals this counter hooks are not what it was written for."""


class CountError(RuntimeError):
    """A counted run produced an impossible count (e.g. nothing at all)."""


def _jax_version() -> str:
    import jax

    return jax.__version__


def _fail(what: str) -> InternalsChanged:
    return InternalsChanged(
        f"pallas_kernels.measure.interpret_counter: jax {_jax_version()} lacks {what} (written "
        f"for jax {', '.join(TESTED_JAX_VERSIONS)}; the Pallas TPU interpreter's internals "
        f"changed, so HBM traffic cannot be counted: update the hooks in this module)")


def check_internals():
    """Return the interpreter module after checking every symbol the hooks use; raise
    ``InternalsChanged`` naming the jax version and the first missing piece otherwise."""
    try:
        mod = importlib.import_module(INTERNALS_MODULE)
    except ImportError as e:
        raise _fail(f"module {INTERNALS_MODULE} ({e})") from e
    for name, params in _FUNCS.items():
        fn = getattr(mod, name, None)
        if not callable(fn):
            raise _fail(f"{INTERNALS_MODULE}.{name}")
        inner = getattr(fn, "__wrapped__", None)
        if not callable(inner):
            raise _fail(f"{INTERNALS_MODULE}.{name}.__wrapped__ (DMAs call it directly)")
        sig = inspect.signature(inner).parameters
        for p in params:
            if p not in sig:
                raise _fail(f"parameter {p!r} of {INTERNALS_MODULE}.{name}")
    dma = getattr(mod, "DMA", None)
    if not isinstance(dma, type) or not callable(getattr(dma, "execute_read", None)):
        raise _fail(f"{INTERNALS_MODULE}.DMA.execute_read")
    fields = {f.name for f in dataclasses.fields(dma)} if dataclasses.is_dataclass(dma) else set()
    for f in _DMA_FIELDS:
        if f not in fields:
            raise _fail(f"field {f!r} of {INTERNALS_MODULE}.DMA")
    names = getattr(mod, "TPU_MEMORY_SPACE_NAMES", None)
    if not isinstance(names, dict) or "hbm" not in names.values():
        raise _fail(f"{INTERNALS_MODULE}.TPU_MEMORY_SPACE_NAMES with an 'hbm' entry")
    if not hasattr(getattr(mod, "DmaState", None), "STARTED"):
        raise _fail(f"{INTERNALS_MODULE}.DmaState.STARTED")
    return mod


# ----------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class Copy:
    """One counted copy. ``kind``: "block" (pipeline) or "dma" (manual); spaces lower-case
    interpreter names ("hbm", "vmem", "smem", ...)."""

    kind: str
    src: str
    dst: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def lane_padded_bytes(self) -> int:
        """Bytes with the minor dim rounded up to 128 lanes (the TPU tile's lane width), for
        copies between the tiled vector memories (HBM, VMEM); SMEM is scalar: logical bytes."""
        if not self.shape or not {self.src, self.dst} <= _TILED:
            return self.nbytes
        itemsize = self.nbytes // max(int(np.prod(self.shape)), 1) if self.nbytes else 0
        minor = -(-self.shape[-1] // LANES) * LANES
        return int(np.prod(self.shape[:-1])) * minor * itemsize


@dataclasses.dataclass
class TrafficCount:
    """The copies counted inside one ``count_hbm_traffic()`` block."""

    copies: list[Copy] = dataclasses.field(default_factory=list)
    dmas_started: int = 0

    @property
    def dmas_unexecuted(self) -> int:
        """DMAs started but never executed (never waited on in ``"on_wait"`` mode): their
        bytes are missing from the count. Zero under ``dma_execution_mode="eager"``."""
        return self.dmas_started - len(self.select(kind="dma"))

    @property
    def descriptors(self) -> int:
        """DMA descriptors issued: every block copy of the grid pipeline and every started
        manual DMA (each is one descriptor on a TPU); what a model's ``Traffic.dmas`` counts."""
        return self.count(kind="block") + self.dmas_started

    def select(self, src: str | None = None, dst: str | None = None,
               kind: str | None = None) -> list[Copy]:
        return [c for c in self.copies if (src is None or c.src == src)
                and (dst is None or c.dst == dst) and (kind is None or c.kind == kind)]

    def bytes(self, src: str | None = None, dst: str | None = None, kind: str | None = None,
              *, lane_padded: bool = False) -> int:
        sel = self.select(src, dst, kind)
        return sum(c.lane_padded_bytes if lane_padded else c.nbytes for c in sel)

    def count(self, src: str | None = None, dst: str | None = None,
              kind: str | None = None) -> int:
        return len(self.select(src, dst, kind))

    def table(self) -> list[dict]:
        """One row per (kind, src, dst, shape, dtype): copies, bytes, lane-padded bytes."""
        groups: dict[tuple, list[Copy]] = {}
        for c in self.copies:
            groups.setdefault((c.kind, c.src, c.dst, c.shape, c.dtype), []).append(c)
        return [dict(kind=k[0], src=k[1], dst=k[2], shape=list(k[3]), dtype=k[4],
                     copies=len(v), bytes=sum(c.nbytes for c in v),
                     lane_padded_bytes=sum(c.lane_padded_bytes for c in v))
                for k, v in sorted(groups.items(), key=lambda kv: str(kv[0]))]


# ----------------------------------------------------------------------------- hooks

_lock = threading.Lock()
_active: list[TrafficCount] = []
# per (device, core): the input block just read from HBM (waiting for its kernel buffer), and
# the memory space of the last other read (an output block store copies that buffer). Keyed by
# core, not thread: the interpreter orders one core's callbacks by a token, not by a thread.
_pending_input: dict[tuple[int, int], Copy] = {}
_last_read_space: dict[tuple[int, int], str] = {}


def _core(args) -> tuple[int, int]:
    return int(args[1]), int(args[2])


def _record(copy: Copy) -> None:
    with _lock:
        for c in _active:
            c.copies.append(copy)


def _space(mod, idx) -> str:
    return str(mod.TPU_MEMORY_SPACE_NAMES[int(idx)])


def _shape_dtype(val) -> tuple[tuple[int, ...], str, int]:
    a = np.asarray(val)
    return tuple(int(s) for s in a.shape), str(a.dtype), int(a.nbytes)


def _hook_get(mod, orig):
    @functools.wraps(orig)
    def get(*args, **kwargs):
        out = orig(*args, **kwargs)
        if _active:
            space = _space(mod, args[3])
            if kwargs.get("input_name") is not None:  # pipeline: HBM block of an input
                shape, dtype, nbytes = _shape_dtype(out[1])
                with _lock:
                    _pending_input[_core(args)] = Copy("block", space, "?", shape, dtype, nbytes)
            else:  # any other read; the last one before an output block store is its source
                with _lock:
                    _last_read_space[_core(args)] = space
        return out

    get.__wrapped__ = orig.__wrapped__  # DMA.execute_read calls get.__wrapped__ directly
    return get


def _hook_store(mod, orig):
    @functools.wraps(orig)
    def store(*args, **kwargs):
        out = orig(*args, **kwargs)
        if not _active:
            return out
        space = _space(mod, args[3])
        if kwargs.get("output_name") is not None:  # kernel output buffer -> HBM block
            shape, dtype, nbytes = _shape_dtype(args[6])
            _record(Copy("block", _last_read_space.get(_core(args), "?"), space, shape,
                         dtype, nbytes))
        else:
            with _lock:
                pend = _pending_input.pop(_core(args), None)
            if pend is not None:  # the input block read just before lands in this buffer
                _record(dataclasses.replace(pend, dst=space))
        return out

    store.__wrapped__ = orig.__wrapped__
    return store


def _hook_dma(mod, orig):
    """A subclass of the interpreter's ``DMA`` (``dma_start`` builds one per started copy)
    that records each start and the bytes of each executed read."""
    class CountedDMA(orig):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            with _lock:
                for c in _active:
                    c.dmas_started += 1

        def execute_read(self):
            before = self.state
            super().execute_read()
            if _active and before == mod.DmaState.STARTED and self.state != before:
                shape, dtype, nbytes = _shape_dtype(self.data)
                _record(Copy("dma", _space(mod, self.src_memory_space),
                             _space(mod, self.dst_memory_space), shape, dtype, nbytes))

    CountedDMA.__name__ = CountedDMA.__qualname__ = orig.__name__
    return CountedDMA


def _install(mod) -> tuple:
    """Install the three hooks; return the originals. The interpreter captures ``get`` /
    ``store`` when a kernel is traced, so jit caches are cleared (a kernel traced before would
    run unhooked)."""
    import jax

    saved = (mod.get, mod.store, mod.DMA)
    mod.get = _hook_get(mod, saved[0])
    mod.store = _hook_store(mod, saved[1])
    mod.DMA = _hook_dma(mod, saved[2])
    jax.clear_caches()
    return saved


def _uninstall(mod, saved: tuple) -> None:
    import jax

    mod.get, mod.store, mod.DMA = saved
    jax.clear_caches()  # drop the traces that hold the hooks


_saved: list[tuple] = []  # the originals while hooks are installed (nested blocks share them)


@contextlib.contextmanager
def count_hbm_traffic() -> Iterator[TrafficCount]:
    """Count every block copy and executed DMA of interpreted Pallas TPU kernels run (traced
    and executed: call ``jax.block_until_ready`` inside) within the block. Blocks may nest;
    each counts what ran inside it. Raises ``InternalsChanged`` if the hooks cannot apply."""
    mod = check_internals()
    result = TrafficCount()
    if not _saved:
        _saved.append(_install(mod))
    with _lock:
        _active.append(result)
    try:
        yield result
    finally:
        with _lock:
            _active.remove(result)
            last = not _active
            if last:
                _pending_input.clear()
                _last_read_space.clear()
        if last:
            _uninstall(mod, _saved.pop())


# ----------------------------------------------------------------------------- self test


def self_test() -> TrafficCount:
    """Run a 2-step kernel with a blocked input, a blocked output and one manual DMA per step
    and check the exact counts; raise ``CountError`` if the hooks miss anything."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(x_ref, y_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(y_hbm.at[pl.program_id(0)], buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = x_ref[...] + buf[...]

    x = jnp.arange(2 * 8 * 128, dtype=jnp.float32).reshape(2, 8, 128)
    y = jnp.ones((2, 8, 128), jnp.float32)
    call = pl.pallas_call(
        kernel, grid=(2,), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0)),
                  pl.BlockSpec(memory_space=pltpu.HBM)],
        out_specs=pl.BlockSpec((1, 8, 128), lambda i: (i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams())
    with count_hbm_traffic() as counted:
        out = jax.block_until_ready(call(x, y))
    if not np.array_equal(np.asarray(out), np.asarray(x + y)):
        raise CountError("self test kernel computed a wrong result under the hooks")
    block = 8 * 128 * 4
    want = {("block", "hbm", "vmem"): (2, 2 * block), ("block", "vmem", "hbm"): (2, 2 * block),
            ("dma", "hbm", "vmem"): (2, 2 * block)}
    got = {}
    for c in counted.copies:
        n, b = got.get((c.kind, c.src, c.dst), (0, 0))
        got[(c.kind, c.src, c.dst)] = (n + 1, b + c.nbytes)
    if got != want or counted.dmas_started != 2:
        raise CountError(f"jax {_jax_version()}: interpreter hooks counted {got} and "
                         f"{counted.dmas_started} DMA starts, expected {want} (copies, bytes) "
                         f"per (kind, src, dst) and 2 starts; the interpreter's "
                         f"internals changed: update pallas_kernels.measure.interpret_counter")
    return counted
