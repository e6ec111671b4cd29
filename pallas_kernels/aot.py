"""AOT Mosaic compiles for real TPU generations on a CPU-only machine, and the chip facts
(VMEM, HBM bandwidth, peak rates) that size blocks and give roofline denominators.

How (see ``shared/SPEC.md``): libtpu (the ``jax[tpu]`` extra) provides TPU topologies without a
TPU. ``jax.jit(f).trace(*specs).lower().compile()`` inside ``jax.default_device(topology
device)`` runs the real Mosaic compiler, which enforces the tiling rules that interpret mode
does not check. Works under ``JAX_PLATFORMS=cpu``.

Each kernel module exposes ``compile_cases(quick: bool) -> list[CompileCase]``; the compile
gate tests and ``scripts/cost/tpu_compile_report.py`` iterate over them (one implementation).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import chips

# A minimum compile time for a persistent-cache write that no compile reaches (``compiling_on``)
NO_CACHE_WRITE_SECS = 1e30
# chip name -> (topology name for get_topology_desc, ChipVersion for get_tpu_info_for_chip),
# derived from ``pallas_kernels.chips`` (where every chip is declared)
CHIPS: dict[str, tuple[str, pltpu.ChipVersion]] = {
    c.name: (c.topology, c.chip_version) for c in chips.CHIPS.values()}


class CompileError(RuntimeError):
    """An AOT compile failed; names the chip, the case and Mosaic's message."""

    def __init__(self, chip: str, case: str, message: str):
        self.chip, self.case, self.message = chip, case, message
        super().__init__(f"[{chip}] {case}: {message}")


def check_chip(chip: str) -> str:
    """``chip`` when known (``pallas_kernels.chips``), else ``ValueError`` listing the names."""
    return chips.check(chip)


@functools.cache
def topology_devices(chip: str) -> tuple:
    """The devices of a small multi-chip topology of ``chip`` (``CHIPS``: 4 chips; no TPU
    needed, needs libtpu): AOT compiles of sharded programs place their mesh on them."""
    # Several processes (pytest-xdist workers, a notebook beside a script) may load libtpu at
    # once for AOT compiles; without this libtpu refuses with a lockfile error.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    name, _ = CHIPS[check_chip(chip)]
    with _quiet_native_stderr():
        return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def topology_device(chip: str):
    """First device of ``topology_devices(chip)`` (single-chip AOT compiles)."""
    return topology_devices(chip)[0]


@contextlib.contextmanager
def compiling_on(dev):
    """Where an AOT compile for topology device ``dev`` runs: ``jax.default_device(dev)``,
    writing nothing to jax's persistent compilation cache. libtpu's compile-only client cannot
    load a TPU executable back (jax warns "Error reading persistent compilation cache entry
    ... PjRtCompiler must be constructed with a Client to call DeserializeLoadedExecutable"
    and compiles again), so an entry written for one is never used: serializing it is wasted.
    The cache itself stays as it is (XLA:CPU programs keep it): only this compile's write is
    skipped, by a minimum compile time no compile reaches."""
    with jax.default_device(dev), _no_cache_write():
        yield


def _no_cache_write():
    """jax's ``persistent_cache_min_compile_time_secs`` (read when an entry is about to be
    written) as a context manager, set out of reach (jax 0.10 to 0.12 have it; elsewhere
    nothing changes)."""
    from jax._src import config as jax_config

    state = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    return state(NO_CACHE_WRITE_SECS) if callable(state) else contextlib.nullcontext()


@contextlib.contextmanager
def _quiet_native_stderr():
    """Hold back what native code writes to fd 2 meanwhile; replay it if the body raises.

    Loading libtpu for a topology on a host without a TPU makes it probe for TPU hosts and
    print a block of "Failed to find host bounds ..." / "TPU_WORKER_HOSTNAMES" warnings from C++
    straight to fd 2 (Python's ``sys.stderr`` cannot catch it). They say nothing about an AOT
    compile, which works; if loading fails, the held-back text is written out with the error."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def chip_info(chip: str):
    """``pltpu.get_tpu_info_for_chip`` for ``chip`` (VMEM bytes, HBM B/s, peak ops/s)."""
    return chips.chip_info(chip)


def aot_compile(fn: Callable, specs: list[jax.ShapeDtypeStruct], chip: str, case: str = ""):
    """Compile ``fn(*specs)`` for ``chip``; return the compiled object or raise CompileError."""
    dev = topology_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    placed = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), list(specs))
    try:
        with compiling_on(dev):
            return jax.jit(fn).trace(*placed).lower().compile()
    except Exception as e:  # Mosaic raises several types; keep its message whole
        raise CompileError(chip, case, f"{type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class Traffic:
    """A kernel's modelled cost: HBM bytes it moves, the minimum (each input read once, each
    output written once), flops, and the VMEM it allocates."""

    bytes_moved: int
    bytes_min: int
    flops: int
    vmem_bytes: int
    dmas: int = 0  # DMA descriptors the kernel issues (manual DMAs + pipeline block copies)

    @property
    def ratio(self) -> float:
        return self.bytes_moved / max(self.bytes_min, 1)

    def roofline_seconds(self, chip: str) -> float:
        """``max(bytes / HBM bandwidth, flops / peak bf16)`` for ``chip`` (a model)."""
        info = chip_info(chip)
        return max(self.bytes_moved / info.mem_bw_bytes_per_second,
                   self.flops / info.bf16_ops_per_second)


@dataclass(frozen=True)
class CompileCase:
    """One kernel x shape for the compile gate: ``fn(*specs)`` and its traffic model per chip.

    ``traffic(chip)`` returns the model for the blocks the kernel picks on that chip."""

    kernel: str
    shape: str
    fn_for_chip: Callable[[str], Callable]
    specs: list[jax.ShapeDtypeStruct]
    traffic: Callable[[str], Traffic]
    tags: tuple[str, ...] = field(default=())

    def compile(self, chip: str):
        return aot_compile(self.fn_for_chip(chip), self.specs, chip,
                           f"{self.kernel} {self.shape}")
