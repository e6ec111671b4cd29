"""Facts about TPU memories shared by the kernels.

- ``smem_page_table``: the page table as the kernels scalar-prefetch it into SMEM, where they
  look pages up on the scalar core (as jax's ragged paged attention does) instead of XLA
  gathering one page id per entry (a per-element gather XLA's TPU cost model prices at
  thousands of bytes per index: issue 13).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def smem_page_table(page_indices: jax.Array) -> jax.Array:
    """``page_indices i32[N]`` as is; one ``-1`` entry when ``N == 0`` (SMEM cannot hold a
    zero-size array, and ``-1`` is an invalid page id, so nothing is read through it)."""
    table = page_indices.astype(jnp.int32)
    return table if table.shape[0] else jnp.full((1,), -1, jnp.int32)
