"""Pallas TPU kernels for DeepSeek Sparse Attention, one folder per op family:

- ``pallas_kernels.indexer``: the lightning-indexer score kernel behind token and page top-k;
- ``pallas_kernels.mla``: the sparse MLA gather kernel behind token and page sparse MLA;
- ``pallas_kernels.v4_attention``: DeepSeek-V4 attention (window + compressed: one fused kernel,
  or two passes of the token MLA kernel; ``pallas_kernels.v4`` is its old path, a shim);
- ``pallas_kernels.v4_compressor``: the DeepSeek-V4 compressor step (pool the completing
  entries, update the state pool in place);
- ``pallas_kernels.tpu``: lanes, chip detection, the VMEM policy, what ``interpret=True`` means;
- ``pallas_kernels.chips``: every fact about a TPU generation the package uses, declared once;
- ``pallas_kernels.aot``: AOT Mosaic compiles for v5e / v6e / tpu7x without a TPU;
- ``pallas_kernels.measure``: the measurement library (XLA's cost split of a compiled program,
  the interpreter's HBM byte counter; ``pallas_kernels.xla_cost`` and
  ``pallas_kernels._interpret_counter`` are old paths, shims).

Each entry takes the matching reference's arguments plus kernel knobs (typed block configs
``IndexerBlocks`` / ``MlaBlocks``) and ``interpret=`` (False: compile; True: the strict
interpreter; or a ``pltpu.InterpretParams``); selection reuses ``reference.selection``.
"""

from pallas_kernels.indexer import (
    IndexerBlocks,
    streamindex_page_topk,
    streamindex_scores,
    streamindex_topk,
)
from pallas_kernels.mla import MlaBlocks, PerformanceWarning, page_sparse_mla, sparse_mla
from pallas_kernels.v4_attention import v4_attention

__all__ = ["IndexerBlocks", "MlaBlocks", "PerformanceWarning", "page_sparse_mla", "sparse_mla",
           "streamindex_page_topk", "streamindex_scores", "streamindex_topk", "v4_attention"]
