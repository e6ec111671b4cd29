"""tokamax 0.0.17's DeepSeek-V4 ops, with tokamax's names, arguments, results and cache bytes,
computed by this package's kernels and references (issue 29; ``docs/engines/tokamax.md``).

Adopt by changing the import: ``from dsa_jax.engines import tokamax as ops`` where the engine
had ``tokamax.ops``. Submodules: ``indexer`` (``lightning_indexer``, ``top_k``), ``attention``
(``mla_swa``, ``sparse_mla``, the HCA op), ``compressor`` (``proj_and_save_state``,
``dsv4_compressor``).
"""
