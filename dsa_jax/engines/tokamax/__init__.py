"""tokamax 0.0.17's DeepSeek-V4 ops, with tokamax's names, arguments, results and cache bytes,
computed by this package's kernels and references (issue 29; ``docs/engines/tokamax.md``).

Adopt by changing the import: ``from dsa_jax.engines import tokamax as ops`` where the engine
had ``tokamax.ops`` (``ops.experimental.mla_swa`` is ``ops.mla_swa`` here). Submodules:
``indexer`` (``lightning_indexer``, ``top_k``), ``attention`` (``mla_swa``, ``sparse_mla``, and
this package's HCA op ``hca_mla`` with its row-count helper ``hca_lens_to_attend``; tokamax has
no HCA attention), ``compressor`` (``proj_and_save_state``, ``dsv4_compressor``). The cache
formats are ``reference.formats.tokamax_v4`` (window / HCA ``PlaneCache``, CSA ``CsaCache``) and
``reference.formats.tokamax_index`` (the 256-B fp8 index record).

Behaviour that differs from tokamax by default: the indexer's visibility is the official rule
(``causal_rule="official"``: entry ``j`` visible to position ``p`` iff ``j < (p + 1) // r``);
``causal_rule="tpu_inference"`` gives tokamax's ``j <= p // r`` for parity checks.
"""

from dsa_jax.engines.tokamax.attention import hca_lens_to_attend, hca_mla, mla_swa, sparse_mla
from dsa_jax.engines.tokamax.compressor import dsv4_compressor, proj_and_save_state
from dsa_jax.engines.tokamax.indexer import lightning_indexer, top_k

__all__ = ["dsv4_compressor", "hca_lens_to_attend", "hca_mla", "lightning_indexer", "mla_swa",
           "proj_and_save_state", "sparse_mla", "top_k"]
