"""Every fact about a TPU generation the package uses, declared once.

Everything else reads this file: AOT topologies (``pallas_kernels.aot``), chip detection from a
device's ``device_kind`` (``pallas_kernels.tpu``), the kernels' dtype choices, the block tables
(each family's ``blocks.py`` keys its rows by these names), and the scripts' chip lists and
roofline denominators. Adding a chip is one ``Chip(...)`` entry below plus its rows in the
block tables (a chip without rows takes each table's fallback).

VMEM bytes, HBM bytes / bandwidth, peak rates per dtype and the SparseCore shape come from
jax's TPU table (``pltpu.get_tpu_info_for_chip``, ``chip_info``; no TPU or libtpu needed): they
are not restated here, and ``Chip``'s properties (``vmem_bytes``, ``sparsecore_lanes``,
``fp8_mxu``, ``mxu_dtypes``) read them. What that table does not say is declared per chip: the
AOT topology, the ``device_kind`` tag, TensorCores per chip, the public spec page's HBM and ICI
figures (what the context-parallel cost model quotes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jax.experimental.pallas import tpu as pltpu


@dataclass(frozen=True)
class Chip:
    """One TPU generation.

    - ``name``: our name (the key in ``CHIPS``; CLI ``--chips`` values, block-table keys).
    - ``topology``: the ``topologies.get_topology_desc`` name AOT compiles use (4 chips).
    - ``version``: the ``pltpu.ChipVersion`` member name (``chip_info`` asks jax's table with it).
    - ``kind_tag``: the lower-case substring of ``jax.Device.device_kind`` that names it.
    - ``devices_per_chip``: TensorCores JAX sees per chip.
    - ``hbm_doc`` / ``hbm_bw_gbps`` / ``ici_bidir_gbps`` / ``url``: the public spec page's
      figures (what the context-parallel cost model quotes beside jax's table).
    """

    name: str
    topology: str
    version: str
    kind_tag: str
    devices_per_chip: int
    hbm_doc: str
    hbm_bw_gbps: float
    ici_bidir_gbps: float
    url: str

    @property
    def chip_version(self) -> pltpu.ChipVersion:
        return getattr(pltpu.ChipVersion, self.version)

    @property
    def info(self):
        """jax's TPU facts for this chip (``chip_info``)."""
        return chip_info(self.name)

    @property
    def vmem_bytes(self) -> int:
        return int(self.info.vmem_capacity_bytes)

    @property
    def sparsecore_lanes(self) -> int:
        """SparseCore vector lanes (0: no SparseCore)."""
        sc = self.info.sparse_core
        return int(sc.num_lanes) if sc is not None else 0

    @property
    def fp8_mxu(self) -> bool:
        """The MXU multiplies fp8 faster than bf16 (tpu7x: 2.3e15 vs 1.155e15 ops/s in jax's
        table); elsewhere an fp8 operand is upcast in VMEM (e4m3 is exact in bf16; v6e's fp8
        rate equals its bf16 rate, v5e has none)."""
        return self.info.fp8_ops_per_second > self.info.bf16_ops_per_second

    @property
    def mxu_dtypes(self) -> tuple[str, ...]:
        """The input dtypes the MXU takes natively (a nonzero peak rate in jax's table)."""
        rates = (("bfloat16", "bf16"), ("float8_e4m3fn", "fp8"), ("int8", "int8"),
                 ("int4", "int4"))
        return tuple(d for d, key in rates if getattr(self.info, f"{key}_ops_per_second", 0))


_ALL = (
    Chip("v5e", "v5e:2x2", "TPU_V5E", "v5 lite", devices_per_chip=1,
         hbm_doc="16 GB (GiB: chip_info 17.2e9 B)", hbm_bw_gbps=819, ici_bidir_gbps=400,
         url="https://docs.cloud.google.com/tpu/docs/v5e"),
    Chip("v6e", "v6e:2x2", "TPU_V6E", "v6 lite", devices_per_chip=1,
         hbm_doc="32 GB (GiB: chip_info 34.4e9 B)", hbm_bw_gbps=1638, ici_bidir_gbps=800,
         url="https://docs.cloud.google.com/tpu/docs/v6e"),
    Chip("tpu7x", "tpu7x:2x2x1", "TPU_7X", "7x", devices_per_chip=2,
         hbm_doc="192 GiB", hbm_bw_gbps=7380, ici_bidir_gbps=1200,
         url="https://docs.cloud.google.com/tpu/docs/tpu7x"),
)

CHIPS: dict[str, Chip] = {c.name: c for c in _ALL}
NAMES: tuple[str, ...] = tuple(CHIPS)  # every chip the compile gates and reports cover

# The chip a single-chip report or gate uses when none is named (the cost scripts' default,
# the whole-op gates): the first chip with an fp8-capable MXU path that is not the newest.
DEFAULT: str = "v6e"
# The newest generation, for the gates that pin a second chip beside ``DEFAULT``.
NEWEST: str = _ALL[-1].name
# The oldest generation (no fp8 MXU, smallest VMEM/HBM), for the gates that pin a third chip.
OLDEST: str = _ALL[0].name


def check(chip: str) -> str:
    """``chip`` when it is a known name, else ``ValueError`` listing the names."""
    if chip not in CHIPS:
        raise ValueError(f"unknown chip {chip!r}; expected one of {sorted(CHIPS)}")
    return chip


def get(chip: str) -> Chip:
    """The ``Chip`` named ``chip`` (``ValueError`` listing the names when unknown)."""
    return CHIPS[check(chip)]


def parse(names: str | None, default: tuple[str, ...] = NAMES) -> list[str]:
    """A comma-separated ``--chips`` value checked against ``CHIPS`` (``default`` when empty)."""
    if not names:
        return list(default)
    return [check(n.strip()) for n in names.split(",") if n.strip()]


def of_kind(device_kind: str) -> str | None:
    """Our name of the chip whose ``kind_tag`` is in ``device_kind``, else None."""
    kind = device_kind.lower()
    return next((c.name for c in _ALL if c.kind_tag in kind), None)


@functools.cache
def chip_info(chip: str):
    """libtpu's facts for ``chip`` (``pltpu.get_tpu_info_for_chip``: VMEM bytes, HBM B/s,
    peak ops/s per dtype)."""
    return pltpu.get_tpu_info_for_chip(get(chip).chip_version, 1)
