"""Named ragged batch scenarios shared by the reference and kernel tests."""

from __future__ import annotations

import numpy as np

from reference.synthetic import make_ragged_batch

# name -> (q_lens, kv_lens, pad_rows, pad_seqs); page_size 8, pages_per_seq 8 (capacity 64)
SCENARIOS = {
    "decode": ([1, 1, 1, 1, 1], [9, 64, 1, 30, 17], 0, 0),
    "mtp": ([3, 2, 4], [12, 40, 64], 0, 0),
    "prefill": ([20, 33], [20, 50], 0, 0),
    "mixed_padding": ([1, 1, 4, 17], [33, 5, 20, 60], 3, 2),
    "short_context": ([1, 2, 1], [1, 3, 6], 1, 0),
}
# mixed_padding's kinds of rows on fewer rows, for the strict interpreter's costliest tests (its
# cost is per row step); not in SCENARIOS, whose every entry the parametrized sweeps run.
SMALL_SCENARIOS = {
    "mixed_padding_short": ([1, 1, 4, 3], [33, 5, 20, 60], 3, 2),  # 12 rows, not 26
    "small_mixed": ([1, 1, 4], [33, 5, 60], 2, 1),  # 8 rows
}
PAGE_SIZE = 8
PAGES_PER_SEQ = 8


def scenario(name: str, seed: int, *, num_heads: int = 4, dim: int = 16, **kw):
    """Build scenario ``name`` with a fresh generator seeded from ``seed`` and the name."""
    q_lens, kv_lens, pad_rows, pad_seqs = {**SCENARIOS, **SMALL_SCENARIOS}[name]
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    return make_ragged_batch(rng, q_lens=q_lens, kv_lens=kv_lens, page_size=PAGE_SIZE,
                             pages_per_seq=PAGES_PER_SEQ, num_heads=num_heads, dim=dim,
                             pad_rows=pad_rows, pad_seqs=pad_seqs, **kw)


def rounded_to_bf16(b):
    """The batch with q, weights and cache rounded to bf16 (kept as f32): the oracle's view of a
    bf16 run."""
    import dataclasses

    import jax.numpy as jnp

    cast = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    return dataclasses.replace(b, q=cast(b.q), weights=cast(b.weights), cache=cast(b.cache))


def indexer_args(b, dtype):
    """The indexer ops' positional arguments with q, weights and cache in ``dtype``."""
    import jax.numpy as jnp

    return (jnp.asarray(b.q, dtype), jnp.asarray(b.weights, dtype),
            jnp.asarray(b.cache, dtype)) + b.meta()


def fixed_stride_table(b, fill: int = -1) -> np.ndarray:
    """``i32[S, pages_per_seq]``: synthetic batch ``b``'s page table in the fixed-stride form
    (vLLM / tpu-inference / sglang-jax): row ``i`` holds sequence ``i``'s pages, every other
    slot ``fill`` (``-1``, or a spare page id)."""
    table = np.full((b.seq_lens.shape[0], b.pages_per_seq), fill, np.int32)
    for i, pages in enumerate(b.seq_pages):
        table[i, :len(pages)] = pages
    return table
