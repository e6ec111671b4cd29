"""Facts about TPUs shared by every kernel and the command-line tools, each declared once.

- Layout: ``LANES`` / ``SUBLANES``, ``round_up``, ``tile_bytes`` (VMEM padding).
- Chip detection: ``device_chip`` (honours ``jax.default_device``, so an AOT compile inside
  ``jax.default_device(topology device)`` sees the chip it compiles for) and ``resolve_chip``.
- The VMEM policy: ``vmem_limit`` (one rule for every kernel) and ``chip_vmem``.
- What ``interpret=True`` means: ``interpret_params`` (the strict interpreter, one meaning for
  every kernel: race detection, NaN-filled uninitialised memory, out-of-bounds reads raise).

- ``skip_tpu_probe_without_tpu``: on a machine with libtpu installed (the ``tpu`` extra, for AOT
  compiles) but no TPU attached, JAX's first backend query initialises libtpu, which prints a
  block of "Failed to find host bounds ..." / "TPU_WORKER_HOSTNAMES" errors before any output.
  The CLI and scripts call this first: with no TPU on the PCI bus (Google's vendor id, as JAX's
  own ``hardware_utils`` checks) and no NVIDIA GPU, and no platform chosen by the user, JAX is
  told to use the CPU. AOT compiles for TPU topologies still work (they load libtpu directly).
- ``dmas`` / ``overlap_rows`` / ``align_slot`` / ``sublanes_to_lanes``: the gathered-row
  idioms of the V4.1 kernels (row DMAs started in one grid step and waited in the next, one row
  ahead; a row's slot moved to lane 0 by selects over rolls; a per-row flag from sublanes onto
  lanes by a one-hot matmul).
- ``smem_page_table``: the page table as the kernels scalar-prefetch it into SMEM, where they
  look pages up on the scalar core (as jax's ragged paged attention does) instead of XLA
  gathering one page id per entry (a per-element gather XLA's TPU cost model prices at
  thousands of bytes per index: issue 13).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, chips


def smem_page_table(page_indices: jax.Array) -> jax.Array:
    """``page_indices i32[N]`` as is; one ``-1`` entry when ``N == 0`` (SMEM cannot hold a
    zero-size array, and ``-1`` is an invalid page id, so nothing is read through it)."""
    table = page_indices.astype(jnp.int32)
    return table if table.shape[0] else jnp.full((1,), -1, jnp.int32)


GOOGLE_PCI_VENDOR_ID = "0x1ae0"  # TPU chips on the PCI bus (jax._src.hardware_utils)
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def in_hbm(x):
    """``x`` pinned to HBM for a kernel call that reads it there (a DMA source or a blocked
    operand). Without it XLA's memory-space assignment may prefetch an operand small enough for
    VMEM into VMEM in its own copies, which its cost model then counts as XLA bytes (an MTP
    indexer cache of 16.8 MB: 79 MB of copies; a stacked query and output: their whole size,
    twice) for data the kernel moves itself."""
    return pltpu.with_memory_space_constraint(x, pltpu.HBM)


def tpu_attached() -> bool:
    """True when a Google PCI device (a TPU chip) is attached; reads ``/sys`` only."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR_ID:
                return True
        except OSError:
            continue
    return False


def skip_tpu_probe_without_tpu() -> bool:
    """Use the CPU backend when no platform was chosen and no TPU or NVIDIA GPU is attached.

    Call before anything asks JAX for devices. Returns True when it chose the CPU."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return False
    if tpu_attached() or any(os.path.exists(f) for f in NVIDIA_DEVICE_FILES):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


# ----------------------------------------------------------------------------- layout facts

LANES = 128  # last-dim tile of every TPU generation (vregs are [8, 128] x 32-bit)
SUBLANES = 8  # second-to-last dim tile for 32-bit values (16 for bf16, 32 for 8-bit)


def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple``."""
    return -(-x // multiple) * multiple


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """VMEM bytes of a 2-D ``[rows, cols]`` buffer padded to ``(8 * 4 / itemsize, 128)`` tiles."""
    return round_up(rows, SUBLANES * 4 // itemsize) * round_up(cols, LANES) * itemsize


# ----------------------------------------------------------------------------- chip detection

# ``device_kind`` substring -> our chip name: ``pallas_kernels.chips`` (``Chip.kind_tag``)
_KIND_TAGS = tuple((c.name, c.kind_tag) for c in chips.CHIPS.values())


def chip_of(device) -> str | None:
    """Our name of ``device``'s chip when it is a TPU we know, else None."""
    if device is None or getattr(device, "platform", "") != "tpu":
        return None
    return chips.of_kind(device.device_kind)


def device_chip() -> str | None:
    """The chip Pallas compiles for: ``jax.default_device`` when set (an AOT topology device
    included), else the default backend's first device; None off TPU. Every kernel's block
    table and VMEM cap follow this one answer."""
    dev = jax.config.jax_default_device
    if dev is None:
        try:
            dev = jax.devices()[0]
        except RuntimeError:
            return None
    return chip_of(dev)


def resolve_chip(chip: str | None) -> str | None:
    """An explicit ``chip`` (checked against the known chips), else ``device_chip()``."""
    return aot.check_chip(chip) if chip is not None else device_chip()


# ----------------------------------------------------------------------------- VMEM policy


def chip_vmem(chip: str | None) -> int | None:
    """VMEM bytes of ``chip`` (``pltpu.get_tpu_info_for_chip``), None when unknown."""
    return aot.chip_info(chip).vmem_capacity_bytes if chip in aot.CHIPS else None


MIN_VMEM_LIMIT = 32 << 20  # every chip's scoped default is 16 or 32 MiB; never ask for less


def vmem_limit(estimate: int, chip: str | None, override: int | None = None) -> int:
    """The scoped VMEM limit a kernel requests (one policy for every kernel): ``override`` when
    given, else twice the kernel's own estimate (Mosaic's temporaries are not in it), at least
    32 MiB, and at most 3/4 of the chip's VMEM when the chip is known."""
    if override is not None:
        return int(override)
    want = max(MIN_VMEM_LIMIT, 2 * estimate)
    capacity = chip_vmem(chip)
    return min(want, capacity * 3 // 4) if capacity else want


def check_vmem_limit(vmem_limit_bytes) -> None:
    """``vmem_limit_bytes`` is None or a positive int (``ValueError`` naming the value)."""
    v = vmem_limit_bytes
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise ValueError(f"vmem_limit_bytes must be a positive int or None, got "
                         f"vmem_limit_bytes={v!r}")


# ----------------------------------------------------------------------------- interpret mode

# What ``interpret=True`` means for every kernel: the Pallas TPU interpreter with race
# detection, NaN-filled uninitialised memory and out-of-bounds reads raising.
STRICT_INTERPRET = dict(detect_races=True, uninitialized_memory="nan",
                        out_of_bounds_reads="raise")


def interpret_params(interpret):
    """``False`` -> compile with Mosaic; ``True`` -> the strict ``InterpretParams``
    (``STRICT_INTERPRET``); an ``InterpretParams`` as given. Anything else: ``TypeError``."""
    if interpret is True:
        return pltpu.InterpretParams(**STRICT_INTERPRET)
    if interpret is False or isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise TypeError(f"interpret must be a bool or pltpu.InterpretParams, got {interpret!r}")


def round_bf16(x: jax.Array) -> jax.Array:
    """``f32 -> f32``, each value rounded to bf16, inside a kernel: ``reference.quant.bf16.
    round_bf16``'s rule (RNE) written as the convert pair Mosaic lowers (it has no
    ``reduce_precision``, the form the reference takes because XLA may drop the pair). In the
    interpreter the pair rounds too (the kernels' bf16 tests compare bit for bit)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def rounding(precision: str):
    """A kernel's activation rounding of a regime: ``round_bf16`` for ``"bf16"``, the identity
    for ``"f32"`` (``reference.quant.bf16.rounding``'s, in the form Mosaic lowers)."""
    return round_bf16 if precision == "bf16" else (lambda x: x)


def lanes_to_column(w: jax.Array) -> jax.Array:
    """``f32[L, 1, H] -> f32[L * H, 1]`` (row ``l H + h`` = ``w[l, 0, h]``), inside a kernel: each
    row's lane vector onto sublanes by a diagonal select and a lane max over ``-inf`` (exact:
    ``-0`` and NaN kept). The indexer takes its head weights lane-dense (``[T, 1, H]``): as
    ``[T, H, 1]`` XLA padded each weight to a 128-lane row (a 2 MB relayout per decode call at
    64 x 64)."""
    r, _, h = w.shape
    diag = (jax.lax.broadcasted_iota(jnp.int32, (r, h, h), 1)
            == jax.lax.broadcasted_iota(jnp.int32, (r, h, h), 2))
    wide = jnp.where(diag, jnp.broadcast_to(w, (r, h, h)), -jnp.inf)
    return jnp.max(wide, axis=2, keepdims=True).reshape(r * h, 1)


# ------------------------------------------------------------------------- gathered-row idioms

def dmas(cond, pairs, sem, wait: bool) -> None:
    """Inside a kernel: start (or, ``wait=True``, wait for) the copies ``pairs [(src, dst)]`` on
    ``sem`` where ``cond`` (a traced bool). Start and wait rebuild the same descriptors, so a
    row's reads can be started in one grid step and waited in the next."""
    @pl.when(cond)
    def _():
        for src, dst in pairs:
            copy = pltpu.make_async_copy(src, dst, sem)
            copy.wait() if wait else copy.start()


def overlap_rows(meta_hbm, meta, sem, issue, slots: int = 2):
    """Inside a kernel whose sequential grid walks query rows: each row's meta (``meta_hbm[t]``,
    HBM) loaded into ``meta.at[slot]`` (SMEM, one DMA on ``sem``, waited) and its DMAs started by
    ``issue(slot, wait=False)``, one row ahead: step 0 fetches row 0 into slot 0, step ``t``
    fetches row ``t + 1`` into slot ``(t + 1) % slots`` before it waits for its own
    (``issue(slot, wait=True)``), so the next row's reads fly while this one computes. Returns
    this row's slot."""
    t, n = pl.program_id(0), pl.num_programs(0)

    def fetch(row, slot):
        load = pltpu.make_async_copy(meta_hbm.at[row], meta.at[slot], sem)
        load.start()
        load.wait()
        issue(slot, wait=False)

    slot = t % slots
    pl.when(t == 0)(lambda: fetch(0, 0))
    pl.when(t + 1 < n)(lambda: fetch(t + 1, (t + 1) % slots))
    issue(slot, wait=True)
    return slot


def align_slot(rows: jax.Array, slot: jax.Array, words: int) -> jax.Array:
    """Inside a kernel: ``rows u32[N, W]`` of ``W / words`` slots of ``words`` lanes -> each row's
    slot ``slot i32[N, 1]`` moved to lanes ``0 .. words - 1`` (the other lanes junk) by a select
    over the static lane rolls (a select: another slot's NaN cannot leak)."""
    width = rows.shape[-1]
    out = rows
    for s in range(1, width // words):
        out = jnp.where(slot == s, pltpu.roll(rows, width - s * words, 1), out)
    return out


def sublanes_to_lanes(ok: jax.Array) -> jax.Array:
    """Inside a kernel: ``i32[N, 128]`` 0 / 1 (each row equal along lanes) -> ``bool[1, N]``: a
    one-hot matmul on the MXU (0 / 1 values: exact), a sublane vector onto lanes."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (SUBLANES, LANES), 1)
    e0 = jnp.where(lane == 0, 1.0, 0.0)
    got = jax.lax.dot_general(e0, ok.astype(jnp.float32), (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return got[0:1] > 0.5
