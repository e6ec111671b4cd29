"""How caches are stored: the cache-format enum (``cache_format``), packed bf16 words
(``packed_cache``), the fp8 latent and index caches (``fp8_cache``; the index cache as one
array per page: ``fp8_index_pages``), DeepSeek-V4's MODEL1 fp8
cache (``model1``) and caches stacked by layer (``stacked``). Imports only ``reference.core``
and ``reference.quant``."""
