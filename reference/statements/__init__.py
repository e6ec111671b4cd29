"""Independent statements of whole layers, written from the model's math rather than from the
paged ops: ``deepseek_v4`` (the dense DeepSeek-V4 attention layer) and ``deepseek_v4_layer``
(its projections, output stage and RoPE tables, public for ``dsa_jax.v4_project`` /
``v4_output``). Imports ``reference.core``, ``reference.quant`` and ``reference.v4_compressor``;
never ``reference.v4_attention``, which it checks."""
