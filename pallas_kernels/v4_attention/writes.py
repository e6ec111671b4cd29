"""This step's window rows written into the window cache by the fused V4 attention kernel
itself, in place, before it attends (tokamax's ``mla_swa``: "writes this step's rows first,
then attends over the updated cache"; ``docs/engines/tokamax.md`` section 3.3; the package's
own V4 step, ``dsa_jax.v4_step``, on its Pallas backend).

Row ``j`` of sequence ``s`` (``new_kv f32|bf16[T, 512]``) is the token at its own position
``p = kv_len - q_len + j``: it is stored at page ``table[first_slot(s) + p // ps]``, in-page
slot ``off = p % ps`` (``reference.core.batch``'s slot rule, the XLA writer's). XLA encodes the
``T`` rows in the cache's format with the reference encoders (``row_parts``: elementwise, plus
one row gather for fp8, no scatter); the kernel, at grid step 0 before any gather, issues HBM
-> HBM DMAs of each row's encoded rows to its slot and waits for all of them, so every read of
the call sees them (the window of a row reaches back to its own position only; the writes
precede every row). Formats (``formats``):

- ``"packed"`` ``u32[L, P, ps, 256]``: ``reference.formats.packed_cache.pack_cache`` of the row
  (1 KB), one DMA to row ``off``;
- ``"plain"`` ``f32[L, P, ps, 512]``: the row cast to f32 (2 KB), one DMA to row ``off`` (a
  bf16 plain cache is packed per call by the kernel, a copy: not written, ``writable``);
- ``"plane"`` tokamax ``PlaneCache``: ``pack_rows`` (1 KB), one DMA to rows ``2 off, 2 off + 1``;
- ``"fp8"`` MODEL1 ``Fp8V4Cache``: ``reference.formats.model1.quantize_v4_rows``' words; the
  512 B nope record, one DMA to row ``off``; the 32-word rope quarter lives in rope row ``off //
  4``, shared with 3 other tokens, and a DMA moves whole rows: XLA gathers each token's old
  rope row, puts in every quarter written by this step (the token's own and its neighbours'
  on the same row: the rows of one sequence in one step are contiguous, so they are within 3
  rows of each other), and the first token of each such run (a "leader") DMAs the merged row;
  the other quarters keep their old bits. Equal to ``write_v4_rows``' read-modify-write passes
  whenever no two rows share a slot (where the reference says which lands is unspecified).

A row outside every sequence, at a position past the window cache's capacity, on a missing page
or at a layer outside the stack writes nothing. The cache parts are the call's outputs aliased
to its inputs (``input_output_aliases``): in place when the caller donates them, else XLA copies
them first.

Traffic: each written token reads its encoded bytes and writes them (``written_bytes``: 2 KB
packed, plane and fp8 (nope record and, worst case, its rope row), 4 KB f32) in
``written_dmas`` HBM -> HBM DMAs (one; fp8 two: the nope record and, worst case, the rope row
of a leader).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.v4_attention import formats
from reference import v4_attention as v4
from reference.core import batch, checks
from reference.formats import model1 as v4_cache
from reference.formats import packed_cache, stacked, tokamax_v4

WRITE_BYTES = 2 * formats.PLANE_ROW_BYTES  # per written plane token: 1 KB read + 1 KB written
WRITTEN = ("packed", "plain", "fp8", "plane")  # the formats the kernel writes in place
QUARTERS = formats.QUARTERS  # fp8 tokens per rope row (declared in formats)


def writable(cache) -> bool:
    """Whether the kernel writes rows into ``cache`` (a window cache, stacked or not) in place:
    packed u32, f32, ``Fp8V4Cache`` or ``PlaneCache``; not a bf16 array (packed per call, a
    copy) nor a ``CsaCache``."""
    fmt = formats.kernel_format(cache)
    return fmt in WRITTEN and (fmt != "plain" or jnp.result_type(cache) == jnp.float32)


def written_bytes(fmt: str) -> int:
    """HBM bytes the writes of one token move: its encoded rows read and written (packed 1 KB,
    plain f32 2 KB, plane 1 KB; fp8: the 512 B nope record and the whole 512 B rope row, the
    worst case of a leader), twice (an HBM -> HBM copy reads and writes)."""
    return 2 * formats.row_bytes(fmt, v4.HEAD_DIM if fmt == "plain" else formats.WORDS)


def written_dmas(fmt: str) -> int:
    """DMA descriptors the writes of one token issue: one per cache part (``part_rows``: fp8's
    nope record and, worst case, its rope row as a leader; else one)."""
    return len(part_rows(fmt))


def part_rows(fmt: str) -> tuple[tuple[int, int], ...]:
    """Per cache part: ``(rows per written token, in-page slots per row)``: the destination of a
    token at slot ``off`` is rows ``rows * (off // per_row)`` onwards."""
    if fmt == "plane":
        return ((formats.PLANE_ROWS, 1),)
    if fmt == "fp8":
        return ((1, 1), (1, QUARTERS))
    return ((1, 1),)


def pack_rows(new_kv) -> jax.Array:
    """``new_kv f32|bf16[T, 512]`` -> ``i32[2 T, 128]``: each row as bf16 plane words (row
    ``2 j`` word ``w`` = ``f_w | f_{128 + w} << 16``, row ``2 j + 1`` = ``f_{256 + w} |
    f_{384 + w} << 16``)."""
    bits = jax.lax.bitcast_convert_type(new_kv.astype(jnp.bfloat16), jnp.uint16)
    bits = bits.astype(jnp.uint32).reshape(new_kv.shape[0], 2, 2, formats.LANES)
    words = bits[:, :, 0] | (bits[:, :, 1] << 16)  # [T, 2, 128]
    return jax.lax.bitcast_convert_type(words, jnp.int32).reshape(-1, formats.LANES)


def check_new_kv(new_kv, q, window_cache) -> None:
    """``new_kv`` is ``f32|bf16[T, 512]`` with q's ``T``, and the window cache one the kernel
    writes (``writable``; ValueError / TypeError / NotImplementedError naming them)."""
    checks.rank("new_kv", new_kv, 2)
    checks.floating("new_kv", new_kv)
    checks.dim("new_kv", new_kv, 0, q.shape[0], "q.shape[0] (T)")
    checks.dim("new_kv", new_kv, 1, v4.HEAD_DIM, "the V4 head dim")
    if not writable(window_cache):
        raise NotImplementedError(
            f"new_kv: the kernel writes this step's rows in place into a packed u32, f32, fp8 "
            f"MODEL1 or tokamax PlaneCache window cache, got window.cache "
            f"{formats.describe(window_cache)}")


def write_positions(rows: batch.RowFacts, wb: batch.RaggedBatch) -> jax.Array:
    """``i32[T]``: each row's own token position where it is written (inside a sequence and the
    window cache's capacity), else ``-1``."""
    ok = rows.in_seq & (rows.abs_pos >= 0) & (rows.abs_pos < wb.capacity_tokens)
    return jnp.where(ok, rows.abs_pos, -1).astype(jnp.int32)


def _shift(x, d: int, fill):
    """``y[r] = x[r + d]`` (``fill`` past either end), along axis 0."""
    n = x.shape[0]
    if abs(d) >= n:
        return jnp.full_like(x, fill)
    pad = jnp.full((abs(d), *x.shape[1:]), fill, x.dtype)
    return jnp.concatenate([x[d:], pad]) if d > 0 else jnp.concatenate([pad, x[:n + d]])


def _fp8_parts(words, cache: v4_cache.Fp8V4Cache, pos, rows, wb, layer):
    """``(nope u32[T, 128], merged rope rows u32[T, 128], rope positions i32[T])`` of the
    quantized rows ``words u32[T, 160]`` (module docstring: leaders only write their row)."""
    ok = pos >= 0
    pid, off, ok = wb.token_slots(rows.seq, pos, ok)
    rope_row = off // QUARTERS
    key = jnp.where(ok, pid * v4_cache.rope_rows(wb.page_size) + rope_row, -1)
    lay = jnp.clip(layer, 0, cache.rope.shape[0] - 1)
    merged = cache.rope[lay, jnp.where(ok, pid, 0), rope_row]  # [T, 128]: the old rows
    mine = jnp.tile(words[:, v4_cache.NOPE_WORDS:], (1, QUARTERS))
    quarter = jnp.arange(formats.LANES) // v4_cache.ROPE_WORDS
    for d in range(-(QUARTERS - 1), QUARTERS):
        hit = ok & (_shift(key, d, -1) == key)
        lanes = quarter[None, :] == _shift(off % QUARTERS, d, -1)[:, None]
        merged = jnp.where(hit[:, None] & lanes, _shift(mine, d, 0), merged)
    leader = ok & (_shift(key, -1, -1) != key)
    return words[:, :v4_cache.NOPE_WORDS], merged, jnp.where(leader, pos, -1)


def row_parts(new_kv, cache, rows: batch.RowFacts, wb: batch.RaggedBatch, layer):
    """XLA side: ``(the rows of each cache part to DMA, one per token in order, i32 positions
    [nparts * T])`` for a stacked writable ``cache`` read at ``layer`` (module docstring: the
    reference encoders; a position ``-1`` writes nothing)."""
    pos = write_positions(rows, wb)
    fmt = formats.kernel_format(cache)
    if fmt == "plane":
        return (pack_rows(new_kv),), pos
    if fmt == "packed":
        return (packed_cache.pack_cache(new_kv).astype(cache.dtype),), pos
    if fmt == "plain":
        return (new_kv.astype(cache.dtype),), pos
    nope, rope, rope_pos = _fp8_parts(v4_cache.quantize_v4_rows(new_kv), cache, pos, rows, wb,
                                      layer)
    return (nope, rope), jnp.concatenate([pos, rope_pos])


def updated_cache(cache, parts, given):
    """The written stacked kernel ``cache``'s new ``parts`` as the window cache was ``given``
    (its format; one layer when given unstacked)."""
    fmt = formats.kernel_format(cache)
    if fmt == "plane":
        out = tokamax_v4.PlaneCache(parts[0], cache.logical_page_size)
    elif fmt == "fp8":
        out = v4_cache.Fp8V4Cache(*parts)
    else:
        out = parts[0]
    if stacked.cache_rank(given) == stacked.CACHE_RANK:
        out = jax.tree_util.tree_map(lambda x: x[0], out)
    return out


def write_rows(info_ref, wtab_ref, new_hbm, cache_out, sem, *, base: int, info_words: int,
               slot_word: int, num_rows: int, w_page: int, w_pages: int, layer, layer_ok,
               fmt: str = "plane"):
    """Kernel side (grid step 0): for each cache part ``i`` (``part_rows(fmt)[i] = (n,
    per_row)``), DMA each written token's ``n`` rows ``new_hbm[i][n r : n r + n]`` into
    ``cache_out[i][layer, pid, n (off // per_row) ...]`` and wait for all (one part: the refs
    themselves or 1-tuples). ``info_ref[base + i T + r]`` is token ``r``'s position for part
    ``i`` (``row_parts``; ``-1``: none), ``info_ref[r * info_words + slot_word]`` its
    sequence's first window page slot."""
    one = not isinstance(new_hbm, (tuple, list))
    new_refs, cache_outs = ((new_hbm,), (cache_out,)) if one else (new_hbm, cache_out)
    issued = []
    for i, (n, per_row) in enumerate(part_rows(fmt)):
        src, dst = new_refs[i], cache_outs[i]

        def body(r, cnt, src=src, dst=dst, i=i, n=n, per_row=per_row):
            pos = info_ref[base + i * num_rows + r]
            slot = info_ref[r * info_words + slot_word] + jnp.maximum(pos, 0) // w_page
            pid, ok = batch.lookup_page(wtab_ref, slot, w_pages)
            ok = ok & (pos >= 0) & layer_ok

            @pl.when(ok)
            def _():
                row = n * ((pos % w_page) // per_row)
                pltpu.make_async_copy(src.at[pl.ds(n * r, n)],
                                      dst.at[layer, pid, pl.ds(row, n)], sem).start()

            return cnt + ok.astype(jnp.int32)

        issued.append((src, dst, n, jax.lax.fori_loop(0, num_rows, body, jnp.int32(0))))
    for src, dst, n, count in issued:
        copy = pltpu.make_async_copy(src.at[pl.ds(0, n)], dst.at[0, 0, pl.ds(0, n)], sem)

        def wait(i, c, copy=copy):
            copy.wait()
            return c

        jax.lax.fori_loop(0, count, wait, 0)
