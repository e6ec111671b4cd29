"""Pure-jnp DeepSeek Sparse Attention: the oracles for the Pallas kernels and the flag-off
serving path. Every op is jittable with static shapes.

One folder per op family, imports flowing one way (tests/test_lint.py checks it):

- ``statements`` (the dense DeepSeek-V4 layer and V4.1 stack statements), ``v4_attention`` (the
  paged V4 step);
  neither imports the other;
- ``indexer`` (top-k, page top-k, scores, selection, index share), ``mla`` (sparse MLA, page
  sparse MLA, the gather, sinks), ``v4_compressor``;
- ``v41`` (DeepSeek-V4.1: the per-layer resolution map and its fp8 / fp4 cache formats);
- ``formats`` (how caches are stored: packed bf16, fp8, MODEL1, stacked layers);
- ``quant`` (fp8 scale rules, the V4 QAT simulations);
- ``core`` (the ragged batch layout, argument checks, synthetic batches), and beside it
  ``witnesses`` (the segment-witness policy, and the nulls and statistics of its experiments).

The modules at the top of this folder (``batch``, ``indexer_topk``, ``deepseek_v4``, ...) are
shims kept so old imports work; new code imports the new paths."""

from reference.indexer.index_share import build_index_share_map, glm_index_share_pattern
from reference.indexer.page_topk import streamindex_page_topk_ref
from reference.indexer.selection import DEFAULT_RECALL_TARGET, finish_selection, select_topk
from reference.indexer.topk import streamindex_topk_ref
from reference.mla.page_sparse import page_sparse_mla_ref
from reference.mla.sparse import sparse_mla_ref
from reference.v4_attention.ref import PagedKV, v4_attention_ref

__all__ = [
    "DEFAULT_RECALL_TARGET",
    "PagedKV",
    "build_index_share_map",
    "finish_selection",
    "glm_index_share_pattern",
    "page_sparse_mla_ref",
    "select_topk",
    "sparse_mla_ref",
    "streamindex_page_topk_ref",
    "streamindex_topk_ref",
    "v4_attention_ref",
]
