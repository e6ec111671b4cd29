"""Pallas TPU kernels for DeepSeek Sparse Attention.

Each entry takes the matching reference's arguments plus kernel knobs and ``interpret=``
(False, True or a ``pltpu.InterpretParams``); selection reuses ``reference.selection``.
"""

from pallas_kernels.indexer_topk import streamindex_scores, streamindex_topk
from pallas_kernels.page_sparse_mla import page_sparse_mla
from pallas_kernels.page_topk import streamindex_page_topk
from pallas_kernels.sparse_mla import sparse_mla

__all__ = ["page_sparse_mla", "sparse_mla", "streamindex_page_topk", "streamindex_scores",
           "streamindex_topk"]
