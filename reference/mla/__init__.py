"""Sparse MLA: the token-selected (``sparse``) and page-selected (``page_sparse``) oracles, the
shared gather and attention (``attend``), attention sinks (``sinks``) and the argument checks
(``args``). Imports ``reference.core``, ``reference.quant`` and ``reference.formats``."""
