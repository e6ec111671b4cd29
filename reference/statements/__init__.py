"""Independent statements of whole layers, written from the model's math rather than from the
paged ops: ``deepseek_v4`` (the dense DeepSeek-V4 attention layer), ``deepseek_v4_layer``
(its projections, output stage and RoPE tables, public for ``dsa_jax.v4_project`` /
``v4_output``) and ``deepseek_v41`` (the dense DeepSeek-V4.1 attention stack: every layer of a
``V41Config`` with its sharing of pools, index keys, top-k and candidate blocks). Imports
``reference.core``, ``reference.quant``, ``reference.v4_compressor`` and ``reference.v41`` (its
map, formats and candidate selection); never ``reference.v4_attention``, which it checks."""
