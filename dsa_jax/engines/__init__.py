"""Drop-in adapters: functions with an inference engine's own call names, arguments and
results, computed by this package's ops.

- ``dsa_jax.engines.tokamax``: tokamax 0.0.17's DeepSeek-V4 ops (``lightning_indexer``, ``top_k``,
  ``mla_swa``, ``sparse_mla``, the HCA op ``hca_mla``, ``proj_and_save_state``, ``dsv4_compressor``)
  on tokamax's cache bytes.
- ``dsa_jax.engines.sglang_jax``: sglang-jax's DSA kernels as ``dsa_sparse_backend.py`` calls
  them (``streamindex_topk``, ``compute_topk_pages``, the references
  ``streamindex_topk_ref`` / ``streamindex_page_topk_ref``; the MLA side
  ``sparse_mla_page_level`` / ``prefill_write_and_attend`` from ``sglang_jax_mla``).
"""
