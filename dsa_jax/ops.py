"""Compatibility shim: the DSA ops moved to ``dsa_jax.indexer`` (``indexer_topk``,
``page_topk``) and ``dsa_jax.mla`` (``sparse_mla``, ``page_sparse_mla``); their shared call
path (the common arguments ``backend`` / ``validate`` / ``kernel_options`` / ``layer``) to
``dsa_jax.dispatch``. Every name this module had still imports from here (``_call`` is
``dsa_jax.dispatch.call``); new code imports from the modules above."""

from __future__ import annotations

from dsa_jax.dispatch import _checked  # noqa: F401
from dsa_jax.dispatch import call as _call  # noqa: F401
from dsa_jax.indexer import indexer_topk, page_topk
from dsa_jax.mla import _mla, page_sparse_mla, sparse_mla  # noqa: F401
from reference.indexer.selection import DEFAULT_RECALL_TARGET

__all__ = ["DEFAULT_RECALL_TARGET", "indexer_topk", "page_sparse_mla", "page_topk",
           "sparse_mla"]
