"""The pooling geometry of DeepSeek's compressors: ``coff`` (the overlap) and ``R = coff * r``
(the rows one entry pools), declared once here for V4's ratios and DeepSeek-V4.1's
non-overlapping pair, the geometries the Pallas pool kernel (``pallas_kernels.v4_compressor``)
serves. V4's own entry points accept only V4's ratios (``ref.RATIOS``, ``ref.compressor_coff``,
which read this table)."""

from __future__ import annotations

# ratio -> coff: V4's overlapping ratio 4 and its ratio 128, V4.1's pair (ratio 2: no overlap, no
# ape; ``reference.v41.compressor``)
COFF = {2: 1, 4: 2, 128: 1}
POOL_RATIOS = tuple(sorted(COFF))


def pool_coff(ratio: int) -> int:
    """``coff`` of a pooling ratio in ``POOL_RATIOS`` (ValueError outside)."""
    if isinstance(ratio, bool) or ratio not in POOL_RATIOS:
        raise ValueError(f"pooling ratio must be one of {POOL_RATIOS}, got ratio={ratio!r}")
    return COFF[ratio]


def pool_rows(ratio: int) -> int:
    """The ``R = coff * r`` slot rows one entry pools."""
    return pool_coff(ratio) * ratio
