"""The pooling geometry of DeepSeek's compressors: ``coff`` (the overlap) and ``R = coff * r``
(the rows one entry pools) for V4's ratios and DeepSeek-V4.1's non-overlapping pair, the
geometries the Pallas pool kernel (``pallas_kernels.v4_compressor``) serves."""

from __future__ import annotations

from reference.v4_compressor.ref import RATIOS

# The pooling geometries the Pallas pool kernel serves: V4's ratios and DeepSeek-V4.1's
# non-overlapping pair (ratio 2: ``reference.v41.compressor``, no ape). V4's own entry points
# keep refusing every ratio outside ``RATIOS`` (``compressor_coff``).
POOL_RATIOS = (2, *RATIOS)


def pool_coff(ratio: int) -> int:
    """``compressor_coff`` over ``POOL_RATIOS``: 2 for ratio 4, else 1 (ValueError outside)."""
    if isinstance(ratio, bool) or ratio not in POOL_RATIOS:
        raise ValueError(f"pooling ratio must be one of {POOL_RATIOS}, got ratio={ratio!r}")
    return 2 if ratio == 4 else 1


def pool_rows(ratio: int) -> int:
    """``state_rows`` over ``POOL_RATIOS``: the ``R = coff * r`` slot rows of one entry."""
    return pool_coff(ratio) * ratio
