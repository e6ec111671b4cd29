"""Pallas TPU kernels for DeepSeek Sparse Attention.

Each entry takes the matching reference's arguments plus kernel knobs and ``interpret=``
(False, True or a ``pltpu.InterpretParams``); selection reuses ``reference.selection``.
"""

from pallas_kernels.indexer_topk import streamindex_scores, streamindex_topk
from pallas_kernels.page_topk import streamindex_page_topk

__all__ = ["streamindex_page_topk", "streamindex_scores", "streamindex_topk"]
