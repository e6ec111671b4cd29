"""This step's window rows written into a tokamax ``PlaneCache`` by the fused V4 attention
kernel itself, in place, before it attends (tokamax's ``mla_swa``: "writes this step's rows
first, then attends over the updated cache"; ``docs/engines/tokamax.md`` section 3.3).

Row ``j`` of sequence ``s`` (``new_kv bf16[T, 512]``) is the token at its own position ``p =
kv_len - q_len + j``: it is stored at page ``table[first_slot(s) + p // lps]``, rows ``2 (p %
lps)``, ``2 (p % lps) + 1`` (``formats``' plane layout). XLA packs the ``T`` rows into plane
words (``pack_rows``: elementwise, ``i32[2 T, 128]``, no gather); the kernel, at grid step 0
before any gather, issues one HBM -> HBM DMA of each row's two words-rows to its slot and waits
for all of them, so every read of the call sees them (the window of a row reaches back to its
own position only; the writes precede every row). A row outside every sequence, at a position
past the window cache's capacity, on a missing page or at a layer outside the stack writes
nothing. The cache is the call's output aliased to its input (``input_output_aliases``): in
place when the caller donates it, else XLA copies it first.

Traffic: each written token reads its 1 KB of packed words and writes 1 KB (``WRITE_BYTES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.v4_attention import formats
from reference import v4_attention as v4
from reference.core import batch, checks

WRITE_BYTES = 2 * formats.PLANE_ROW_BYTES  # per written token: 1 KB read + 1 KB written


def pack_rows(new_kv) -> jax.Array:
    """``new_kv f32|bf16[T, 512]`` -> ``i32[2 T, 128]``: each row as bf16 plane words (row
    ``2 j`` word ``w`` = ``f_w | f_{128 + w} << 16``, row ``2 j + 1`` = ``f_{256 + w} |
    f_{384 + w} << 16``)."""
    bits = jax.lax.bitcast_convert_type(new_kv.astype(jnp.bfloat16), jnp.uint16)
    bits = bits.astype(jnp.uint32).reshape(new_kv.shape[0], 2, 2, formats.LANES)
    words = bits[:, :, 0] | (bits[:, :, 1] << 16)  # [T, 2, 128]
    return jax.lax.bitcast_convert_type(words, jnp.int32).reshape(-1, formats.LANES)


def check_new_kv(new_kv, q, window_cache) -> None:
    """``new_kv`` is ``f32|bf16[T, 512]`` with q's ``T``, and the window cache a
    ``PlaneCache`` (ValueError / TypeError / NotImplementedError naming them)."""
    checks.rank("new_kv", new_kv, 2)
    checks.floating("new_kv", new_kv)
    checks.dim("new_kv", new_kv, 0, q.shape[0], "q.shape[0] (T)")
    checks.dim("new_kv", new_kv, 1, v4.HEAD_DIM, "the V4 head dim")
    if formats.kernel_format(window_cache) != "plane":
        raise NotImplementedError(
            f"new_kv: the kernel writes this step's rows into a tokamax PlaneCache window "
            f"cache only, got window.cache {formats.describe(window_cache)}")


def write_positions(rows: batch.RowFacts, wb: batch.RaggedBatch) -> jax.Array:
    """``i32[T]``: each row's own token position where it is written (inside a sequence and the
    window cache's capacity), else ``-1``."""
    ok = rows.in_seq & (rows.abs_pos >= 0) & (rows.abs_pos < wb.capacity_tokens)
    return jnp.where(ok, rows.abs_pos, -1).astype(jnp.int32)


def write_rows(info_ref, wtab_ref, new_hbm, cache_out, sem, *, base: int, info_words: int,
               slot_word: int, num_rows: int, w_page: int, w_pages: int, layer, layer_ok):
    """Kernel side (grid step 0): DMA each written row's two word-rows ``new_hbm[2 r : 2 r +
    2]`` into ``cache_out[layer, pid, 2 off : 2 off + 2]`` and wait for all. ``info_ref[base +
    r]`` is row ``r``'s position (``write_positions``), ``info_ref[r * info_words + slot_word]``
    its sequence's first window page slot."""
    rows2 = formats.PLANE_ROWS

    def body(r, n):
        pos = info_ref[base + r]
        slot = info_ref[r * info_words + slot_word] + jnp.maximum(pos, 0) // w_page
        pid, ok = batch.lookup_page(wtab_ref, slot, w_pages)
        ok = ok & (pos >= 0) & layer_ok

        @pl.when(ok)
        def _():
            pltpu.make_async_copy(new_hbm.at[pl.ds(rows2 * r, rows2)],
                                  cache_out.at[layer, pid, pl.ds(rows2 * (pos % w_page), rows2)],
                                  sem).start()

        return n + ok.astype(jnp.int32)

    issued = jax.lax.fori_loop(0, num_rows, body, jnp.int32(0))
    copy = pltpu.make_async_copy(new_hbm.at[pl.ds(0, rows2)],
                                 cache_out.at[0, 0, pl.ds(0, rows2)], sem)

    def wait(i, c):
        copy.wait()
        return c

    jax.lax.fori_loop(0, issued, wait, 0)
