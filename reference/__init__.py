"""Pure-jnp DeepSeek Sparse Attention: the oracles for the Pallas kernels and the flag-off
serving path. Every op is jittable with static shapes."""

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
