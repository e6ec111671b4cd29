"""Facts about TPUs shared by the kernels and the command-line tools.

- ``skip_tpu_probe_without_tpu``: on a machine with libtpu installed (the ``tpu`` extra, for AOT
  compiles) but no TPU attached, JAX's first backend query initialises libtpu, which prints a
  block of "Failed to find host bounds ..." / "TPU_WORKER_HOSTNAMES" errors before any output.
  The CLI and scripts call this first: with no TPU on the PCI bus (Google's vendor id, as JAX's
  own ``hardware_utils`` checks) and no NVIDIA GPU, and no platform chosen by the user, JAX is
  told to use the CPU. AOT compiles for TPU topologies still work (they load libtpu directly).
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


def smem_page_table(page_indices: jax.Array) -> jax.Array:
    """``page_indices i32[N]`` as is; one ``-1`` entry when ``N == 0`` (SMEM cannot hold a
    zero-size array, and ``-1`` is an invalid page id, so nothing is read through it)."""
    table = page_indices.astype(jnp.int32)
    return table if table.shape[0] else jnp.full((1,), -1, jnp.int32)


GOOGLE_PCI_VENDOR_ID = "0x1ae0"  # TPU chips on the PCI bus (jax._src.hardware_utils)
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


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
