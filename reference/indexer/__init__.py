"""The indexer: top-k token selection (``topk``), page top-k (``page_topk``), the index scores
(``scores``), the selection finish shared by both (``selection``), their argument checks
(``args``) and the cross-layer index-share map (``index_share``). Imports ``reference.core``,
``reference.quant``, ``reference.formats`` and ``reference.witnesses``."""
