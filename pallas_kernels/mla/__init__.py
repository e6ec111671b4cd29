"""Sparse absorbed MLA on TPU: one gather kernel (``kernel``) behind the token and page entries
(``token``, ``page``), with their shared tail (``common``), blocks, traffic model, compile-gate
cases and the token-packed page-cache format (``pool``) in their own modules."""

from pallas_kernels.mla.blocks import MlaBlocks
from pallas_kernels.mla.common import PerformanceWarning
from pallas_kernels.mla.page import page_sparse_mla
from pallas_kernels.mla.pool import TokenPackedCache
from pallas_kernels.mla.token import sparse_mla

__all__ = ["MlaBlocks", "PerformanceWarning", "TokenPackedCache", "page_sparse_mla",
           "sparse_mla"]
