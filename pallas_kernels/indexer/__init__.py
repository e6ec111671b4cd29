"""The lightning indexer on TPU: one score kernel (``kernel``) behind the token and page top-k
entries (``token``, ``page``), with its work list, blocks, row chunks, in-kernel FP4 simulation
(``fp4``), traffic model and compile-gate cases in their own modules."""

from pallas_kernels.indexer.blocks import IndexerBlocks
from pallas_kernels.indexer.page import streamindex_page_topk
from pallas_kernels.indexer.token import streamindex_scores, streamindex_topk

__all__ = ["IndexerBlocks", "streamindex_page_topk", "streamindex_scores", "streamindex_topk"]
