"""The DeepSeek-V4 compressor on TPU (Pallas): ``compress_step`` with the semantics of
``reference.v4_compressor.compress_step`` (its module docstring: the state contract, the
masking rules, the entry order and tail, chunk invariance).

Why a kernel: the reference's XLA form pools a fixed ``E = max_entries(T, S, r) = T // r + S``
entries per step, each gathering its ``R = coff * r`` slot rows whatever completes, and XLA
copies the state pool once per step around its gather-then-scatter. Here only the entries that
complete move data, and the pool is updated in place.

Two ``pallas_call``s per step, in this order (the second takes the first's output, so XLA runs
them in order and keeps one pool buffer):

1. **pool** (grid over the ``E`` output slots; per-slot facts scalar-prefetched,
   ``entry_facts``). A slot that is not a completing entry writes a zero row and moves nothing
   else. Entry ``j`` pools tokens ``q = r j - (coff - 1) r + k``, ``k < R``: slots ``k >= k_c``
   (``q >= kv_old``) from this step's rows, one row DMA per slot, kv and score each (Mosaic
   slices a tiled dimension at a dynamic offset one row at a time, or whole tiles), except
   that a run of all ``R`` slots starting at a multiple of 8 moves in one DMA (a prefill whose
   rows start aligned: every ratio-128 entry, every other ratio-4 entry), and at ratio 128
   another run of more than 8 rows whose aligned window (the run's first row rounded down to
   8, ``R + 8`` rows) lies inside the step moves as that window, 2 DMAs, rotated into place in
   VMEM (a prefill entry: 2 DMAs instead of 256); slots ``k_s <= k < k_c`` (``0 <= q <
   kv_old``) from the sequence's ring slot, one whole-slot DMA each for kv and gate when there
   is any (ratio 4: rolled by half a slot in VMEM when the ring starts mid-slot, so buffer row
   ``k`` holds ring row ``q % R``); slots ``k < k_s`` (``q < 0``, ratio 4's group 0) are gate
   ``-inf``, kv 0. Chunk slots add ``ape[k % r]`` (the ring already holds gate = score +
   ape). Ratio 4 takes channel half ``k // r`` of slot ``k``. Then per channel the softmax over the
   ``R`` slots and the weighted sum, ``f32[1, d]`` per slot, every sum and max a fixed pairwise
   tree over slot halves (the reference's ``_tree``): each entry's arithmetic is the same
   whatever the step's shapes, so any split of a sequence gives bit-identical entries.
   Selections are ``where`` on the buffers: rows a DMA did not fill (NaN in the strict
   interpreter) cannot leak.
2. **state** (grid over the ``S`` sequences, ``write_facts``; pool aliased in and out): the last
   ``min(q_len, R)`` tokens of each sequence that is not skipped go to ring row ``p % R`` of
   its slot: kv one HBM-to-HBM row DMA, score read into VMEM, ``+ ape[p % r]``, written back.
   It must follow every pool read: a later token of a prefill chunk can overwrite a ring row
   that an entry completing earlier in the chunk reads.

The pool call also finishes each entry (``finish``: the weighted RMSNorm and RoPE at ``r j``,
the tables read through their free transposed view, one ``[h, 128]`` tile per table and run of
entries in a tile, or, given ``rope_rows`` (the tables in the kernel's row layout, a model
constant), one 512-B row per entry) and writes its row by one row DMA into ``f32[E, d]``, so
the glue (XLA) only computes the per-slot facts (``reference.v4_compressor.seq_facts``,
``enumerate_slots``: elementwise over ``E`` and ``S``, a compare-and-count search and one-hot
reads, no gather: XLA's TPU model prices a scalar gather at kilobytes per index) and masks
``seq`` / ``entry``: ~1.2 MB per V4-Flash decode call in XLA's model (was ~22 MB with the
finish in XLA). When
``finish.fusable`` is false (``d`` not a power of two of whole lane rows, or the tables' width
not a multiple of 8) the glue finishes the rows with ``finish_entries`` as before.

Precision: f32 throughout; versus the reference, the entries agree to f32 rounding (the same
trees of the same ops in the same order; measured bit-identical under the strict interpreter
on CPU, both precisions), the state bit for bit (data movement and the same ``score + ape``
add).

Not measured on a TPU (none here): the pool call issues its DMAs per entry and waits before
pooling (no overlap across entries); a prefill of ``T`` tokens runs ``T / r`` such round trips
(ratio 4: 2 or 16 DMAs each).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from pallas_kernels.v4_compressor import blocks, finish, traffic
from reference import v4_compressor as vc
from reference.quant.bf16 import check_precision

# words of one output slot's facts (``entry_facts``)
_VALID, _BASE, _KS, _KC, _SLOT, _OFF, _POS, ENTRY_WORDS = range(8)
# words of one sequence's state-write facts (``write_facts``)
_ROW0, _POS0, _COUNT, _WSLOT, SEQ_WORDS = range(5)


# ----------------------------------------------------------------------------- facts (XLA)


def _take(x, onehot):
    """``x[seq]`` for ``x i32[S]`` as a masked sum over the one-hot ``onehot bool[E, S]`` (exact
    for integers): XLA's TPU model prices a scalar gather per index at kilobytes."""
    return jnp.sum(jnp.where(onehot, x[None, :].astype(jnp.int32), 0), axis=1)


def enumerate_slots(s: vc.SeqFacts, num_entries: int, ratio: int, table_len: int):
    """``reference.v4_compressor.enumerate_entries``' ``(seq, entry, valid)`` without a gather
    (``_take``), plus the one-hot ``bool[E, S]`` for ``entry_facts``."""
    first = s.kv_old // ratio
    last = jnp.minimum(s.kv_len // ratio, -(-table_len // ratio))
    count = jnp.where(s.ok, jnp.maximum(last - first, 0), 0)
    end = jnp.cumsum(count)
    e = jnp.arange(num_entries, dtype=jnp.int32)
    seq = jnp.sum(end[None, :] <= e[:, None], axis=1, dtype=jnp.int32)  # searchsorted, right
    seq = jnp.clip(seq, 0, count.shape[0] - 1)
    onehot = seq[:, None] == jnp.arange(count.shape[0], dtype=jnp.int32)[None, :]
    valid = e < end[-1]
    entry = _take(first, onehot) + e - (_take(end, onehot) - _take(count, onehot))
    return seq, entry.astype(jnp.int32), valid, onehot


def entry_facts(s: vc.SeqFacts, seq, entry, valid, ratio: int, onehot=None) -> jax.Array:
    """``i32[E * ENTRY_WORDS]`` per output slot: ``valid``; ``base``, the row of slot 0's token
    in this step's rows (``q_start + q0 - kv_old``, negative when it precedes the step; only
    rows ``base + k`` with ``k >= k_c`` are read); ``k_s`` the first slot with ``q >= 0``;
    ``k_c`` the first slot from this step's rows; the state ``slot``; ``off = q0 % R``, the ring
    row of slot 0; ``pos = r j``, the entry's RoPE position (``finish``). An unused slot has
    ``k_s = k_c = R`` (reads nothing). ``onehot`` (``enumerate_slots``): read the per-sequence
    facts without a gather."""
    coff = vc.pool_coff(ratio)
    rows = vc.pool_rows(ratio)
    take = (lambda x: x[seq]) if onehot is None else (lambda x: _take(x, onehot))  # noqa: E731
    q0 = ratio * entry - (coff - 1) * ratio
    kv_old = take(s.kv_old)
    k_c = jnp.where(valid, jnp.clip(kv_old - q0, 0, rows), rows)
    k_s = jnp.where(valid, jnp.clip(-q0, 0, rows), rows)
    fields = (valid, jnp.where(valid, take(s.q_start) + q0 - kv_old, 0), k_s, k_c,
              jnp.where(valid, take(s.slot), 0), jnp.where(valid, q0 % rows, 0),
              jnp.where(valid, ratio * entry, 0))
    return jnp.stack([jnp.asarray(f, jnp.int32) for f in fields], axis=-1).reshape(-1)


def write_facts(s: vc.SeqFacts, ratio: int) -> jax.Array:
    """``i32[S * SEQ_WORDS]`` per sequence: the row and position of its first token written to
    the ring, the count ``min(q_len, R)`` (0 for a skipped sequence), the state slot."""
    rows = vc.pool_rows(ratio)
    q_len = s.kv_len - s.kv_old
    count = jnp.where(s.ok, jnp.minimum(q_len, rows), 0)
    fields = (jnp.where(s.ok, s.q_start + q_len - count, 0),
              jnp.where(s.ok, s.kv_len - count, 0), count, jnp.where(s.ok, s.slot, 0))
    return jnp.stack([jnp.asarray(f, jnp.int32) for f in fields], axis=-1).reshape(-1)


# ----------------------------------------------------------------------------- pool kernel


def _halves(x, op):
    """Reduce the leading (slot) axis of ``x [2**n, d]`` by a fixed pairwise tree of ``op`` on
    halves (the reference's ``_tree``); ``[1, d]``."""
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = op(x[:h], x[h:])
    return x


def _chunk_rows(kv_hbm, score_hbm, cbuf, csem, base, k_c, rows):
    """Move this step's rows ``base + k`` into buffer row ``k`` for ``k_c <= k < R`` (kv into
    ``cbuf[0]``, score into ``cbuf[1]``): one row DMA each, all started, then all waited.
    Row DMAs because Mosaic slices a tiled dimension at a dynamic offset only one row at a
    time (a run of 8 rows at an unaligned row refuses to compile, HBM and VMEM alike)."""
    def copy(a, k):
        src = (kv_hbm, score_hbm)[a]
        return pltpu.make_async_copy(src.at[pl.ds(base + k, 1)], cbuf.at[a, pl.ds(k, 1)],
                                     csem.at[a])

    def start(k, c):
        copy(0, k).start()
        copy(1, k).start()
        return c

    def wait(k, c):  # one semaphore per array counts its rows
        copy(0, 0).wait()
        copy(1, 0).wait()
        return c

    jax.lax.fori_loop(k_c, rows, start, 0)
    jax.lax.fori_loop(k_c, rows, wait, 0)


def _ring_copies(skv_hbm, sscore_hbm, rbuf, rsem, slot):
    """The DMAs of ring slot ``slot`` (whole, ``[R, W]``): kv into ``rbuf[0]``, gate into
    ``rbuf[1]``."""
    return [pltpu.make_async_copy(src.at[slot], rbuf.at[a], rsem.at[a])
            for a, src in enumerate((skv_hbm, sscore_hbm))]


def _window_copies(kv_hbm, score_hbm, wbuf, wsem, first):
    """The DMAs of the aligned window of ``R + 8`` rows from row ``first`` rounded down to 8
    (kv into ``wbuf[0]``, score into ``wbuf[1]``): Mosaic moves a run of rows at a dynamic
    offset only tile-aligned."""
    start = pl.multiple_of(first // blocks.WINDOW_PAD * blocks.WINDOW_PAD, blocks.WINDOW_PAD)
    return [pltpu.make_async_copy(src.at[pl.ds(start, wbuf.shape[1])], wbuf.at[a], wsem.at[a, 0])
            for a, src in enumerate((kv_hbm, score_hbm))]


def _run_copies(kv_hbm, score_hbm, cbuf, sem, base):
    """The DMAs of a whole run that starts tile-aligned (rows ``[base, base + R)``, ``base %
    8 == 0``): straight into ``cbuf`` (kv ``[0]``, score ``[1]``), no rotation."""
    pad = blocks.WINDOW_PAD
    start = pl.multiple_of(base // pad * pad, pad)
    return [pltpu.make_async_copy(src.at[pl.ds(start, cbuf.shape[1])], cbuf.at[a], sem.at[a, 1])
            for a, src in enumerate((kv_hbm, score_hbm))]


def _chunk_values(cbuf, wbuf, use_window, k_c, first):
    """``(kv, score) f32[R, W]`` whose row ``k >= k_c`` is slot ``k``'s chunk row: from the row
    buffers, or (``use_window``) the window rolled so that row ``first`` (the run's first, slot
    ``k_c``) lands on row ``k_c`` (a dynamic sublane rotation)."""
    rows = cbuf.shape[1]
    if wbuf is None:
        return cbuf[0], cbuf[1]
    size = wbuf.shape[1]
    shift = jax.lax.rem(k_c - first % blocks.WINDOW_PAD + size, size)
    sel = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < jnp.where(use_window, rows, 0)
    return tuple(jnp.where(sel, pltpu.roll(wbuf[a], shift, 0)[:rows], cbuf[a]) for a in (0, 1))


def _pool(chunk_kv, chunk_score, rbuf, ape_ref, k_s, k_c, off, ratio: int):
    """The pooled row ``f32[1, d]`` of one entry from its slots (module docstring): rows
    ``k >= k_c`` of ``chunk_kv`` / ``chunk_score f32[R, W]``, the ring in ``rbuf``; ``off`` the
    ring row of slot 0 (ratio 4: 0 or ``r``, the ring rolled by half a slot)."""
    rows, width = chunk_kv.shape
    k = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    chunk = k >= k_c
    ring = (k >= k_s) & ~chunk
    ring_kv, ring_gate = rbuf[0], rbuf[1]
    if rows != ratio:  # buffer row k = ring row (off + k) % R
        ring_kv = jnp.where(off == 0, ring_kv, pltpu.roll(ring_kv, ratio, 0))
        ring_gate = jnp.where(off == 0, ring_gate, pltpu.roll(ring_gate, ratio, 0))
    gate = jnp.where(chunk, chunk_score + ape_ref[...], jnp.where(ring, ring_gate, -jnp.inf))
    vals = jnp.where(chunk, chunk_kv, jnp.where(ring, ring_kv, 0.0))
    if rows != ratio:  # ratio 4: slot k uses channel half k // r
        d = width // 2
        gate = jnp.where(k < ratio, gate[:, :d], gate[:, d:])
        vals = jnp.where(k < ratio, vals[:, :d], vals[:, d:])
    e = jnp.exp(gate - _halves(gate, jnp.maximum))
    w = e / _halves(e, jnp.add)
    return _halves(w * vals, jnp.add)


def _pool_kernel(facts_ref, kv_hbm, score_hbm, ape_ref, skv_hbm, sscore_hbm, weight_ref,
                 cos_hbm, sin_hbm, out_hbm, cbuf, rbuf, wbuf, tbuf, obuf, csem, rsem, wsem, tsem,
                 osem, last, *, ratio: int, window: bool, fused: bool, eps: float,
                 precision: str, row_half: int = 0):
    """One grid step = one output slot. Prefetch: ``facts`` (SMEM i32[E * ENTRY_WORDS]);
    inputs: this step's ``kv`` / ``score`` (HBM f32[T, W]), the ape tile (VMEM f32[R, W], row
    ``k`` = ``ape[k % r]``), the pool's ``kv`` / ``score`` (HBM f32[N, R, W]), the norm weight
    (VMEM f32[1, d]), the RoPE tables' transposed views (HBM f32[h, P'], ``finish``; or, with
    ``row_half`` = h, the ``rope_rows`` table HBM f32[P, 128] and an unused dummy); output
    the rows (HBM f32[E, d]: one row DMA from ``obuf`` per slot); scratch: chunk, ring, window
    and table-tile buffers (VMEM f32[2, R | R | R + 8, W], f32[2, h, 128] | f32[1, 1, 128]),
    the row, their DMA
    semaphores, the tile ``tbuf`` holds (SMEM i32[1]: a run of entries in one tile loads it
    once). With ``fused`` (static; ``finish.fusable``) the row is finished
    (``finish.finish_row``), else pooled only. A run of all ``R`` slots starting at a row that is a
    multiple of 8 moves in one DMA per array (when ``T >= R``); else, with ``window`` (static),
    a run of more than 8 chunk rows whose aligned window lies inside ``[0, T)`` moves as the
    window (2 DMAs); else row by row."""
    at = pl.program_id(0) * ENTRY_WORDS
    valid = facts_ref[at + _VALID] != 0

    @pl.when(pl.program_id(0) == 0)
    def _():
        last[0] = -1  # the table tile in tbuf: none yet

    @pl.when(~valid)
    def _():
        obuf[...] = jnp.zeros_like(obuf)

    @pl.when(valid)
    def _():
        rows = cbuf.shape[1]
        base, k_s, k_c = facts_ref[at + _BASE], facts_ref[at + _KS], facts_ref[at + _KC]
        first = base + k_c  # this step's row of slot k_c
        pad = blocks.WINDOW_PAD
        aligned = use_window = jnp.bool_(False)
        copies = [(k_s < k_c, cp) for cp in _ring_copies(skv_hbm, sscore_hbm, rbuf, rsem,
                                                         facts_ref[at + _SLOT])]
        if fused:  # the tables' tile (row), unless the previous entry loaded it
            pos = facts_ref[at + _POS]
            tile = pos if row_half else pos // finish.TILE
            copies += [(tile != last[0], cp) for cp in (
                finish.row_copies(cos_hbm, tbuf, tsem, pos) if row_half
                else finish.table_copies(cos_hbm, sin_hbm, tbuf, tsem, pos))]
        if kv_hbm.shape[0] >= rows:  # (a static slice of R rows must fit)
            aligned = (k_c == 0) & (base % pad == 0)
            copies += [(aligned, cp) for cp in _run_copies(kv_hbm, score_hbm, cbuf, wsem, base)]
        if window:
            use_window = (~aligned & (rows - k_c > pad)
                          & (first // pad * pad + wbuf.shape[1] <= kv_hbm.shape[0]))
            copies += [(use_window, cp) for cp in _window_copies(kv_hbm, score_hbm, wbuf, wsem,
                                                                 first)]
        for cond, cp in copies:
            pl.when(cond)(cp.start)
        _chunk_rows(kv_hbm, score_hbm, cbuf, csem, base,
                    jnp.where(aligned | use_window, rows, k_c), rows)
        for cond, cp in copies:
            pl.when(cond)(cp.wait)
        if fused:
            last[0] = tile
        chunk_kv, chunk_score = _chunk_values(cbuf, wbuf if window else None, use_window, k_c,
                                              first)
        row = _pool(chunk_kv, chunk_score, rbuf, ape_ref, k_s, k_c, facts_ref[at + _OFF], ratio)
        if fused:
            row = finish.finish_row(row, weight_ref[...], tbuf, facts_ref[at + _POS], eps=eps,
                                    precision=precision, half=row_half)
        obuf[...] = row

    out = pltpu.make_async_copy(obuf, out_hbm.at[pl.ds(pl.program_id(0), 1)], osem.at[0])
    out.start()  # the slot's row (one row DMA: no [E, 1, d] output to relayout)
    out.wait()


def pool_call(facts, kv, score, ape, state: vc.CompressorState, *, ratio: int,
              vmem_limit_bytes: int | None, interpret, norm_weight=None, cos=None, sin=None,
              eps: float = vc.NORM_EPS, precision: str = "f32", rope_rows=None) -> jax.Array:
    """The pool ``pallas_call`` (``_pool_kernel``): ``f32[E, d]``, zero rows for unused slots.
    ``facts`` from ``entry_facts``; ``kv``, ``score f32[T, W]``; ``ape f32[r, W]``. With
    ``norm_weight f32[d]`` and the RoPE tables ``cos`` / ``sin f32[P, h]`` given and
    ``finish.fusable(d, h)``, the rows are finished (``finish_entries``' norm and RoPE at
    ``eps`` and ``precision``), else pooled only; ``rope_rows f32[P, 128]`` (``finish.rope_rows``
    of the tables, optional): the kernel reads its rows instead of the tables' tiles."""
    num_rows, width = kv.shape
    coff = vc.pool_coff(ratio)
    rows, d = vc.pool_rows(ratio), width // coff
    fused = norm_weight is not None and finish.fusable(d, cos.shape[1])
    half = cos.shape[1] if fused else 0
    row_half = half if rope_rows is not None else 0
    slots = facts.shape[0] // ENTRY_WORDS
    c = traffic.worst_counts(num_rows, slots - num_rows // ratio, ratio)  # E = T // r + S
    window = blocks.uses_window(ratio, num_rows, tpu.device_chip())
    wshape = (2, rows + blocks.WINDOW_PAD, width) if window else (2, tpu.SUBLANES, tpu.LANES)
    tshape = ((1, 1, tpu.LANES) if row_half else (2, half, finish.TILE) if fused
              else (2, tpu.SUBLANES, tpu.LANES))
    const = lambda e, *_: (0, 0)  # noqa: E731
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(slots,),
        in_specs=[any_spec] * 2 + [pl.BlockSpec((rows, width), const)] + [any_spec] * 2
        + [pl.BlockSpec((1, d), const)] + [any_spec] * 2,
        out_specs=any_spec,
        scratch_shapes=[pltpu.VMEM((2, rows, width), jnp.float32),
                        pltpu.VMEM((2, rows, width), jnp.float32),
                        pltpu.VMEM(wshape, jnp.float32),  # unused without the window path
                        pltpu.VMEM(tshape, jnp.float32),  # unused without the fused finish
                        pltpu.VMEM((1, d), jnp.float32),  # the slot's row
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SemaphoreType.DMA((2, 2)), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SemaphoreType.DMA((1,)), pltpu.SMEM((1,), jnp.int32)])
    call = pl.pallas_call(
        functools.partial(_pool_kernel, ratio=ratio, window=window, fused=fused, eps=eps,
                          precision=precision, row_half=row_half), grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((slots, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=tpu.vmem_limit(
                traffic.vmem_bytes(ratio=ratio, d=d, window=window, half=half,
                                   row_table=bool(row_half)),
                tpu.device_chip(), vmem_limit_bytes)),
        cost_estimate=pl.CostEstimate(
            flops=6 * slots * rows * d, transcendentals=slots * rows * d,
            bytes_accessed=traffic.pool_bytes(c, ratio=ratio, d=d, half=half,
                                              row_table=bool(row_half))),
        interpret=tpu.interpret_params(interpret), name="v4_compressor_pool")
    ape_tile = jnp.tile(ape, (coff, 1))  # row k = ape[k % r]: f32[R, W], 32 KB at most x 8
    dummy = jnp.zeros((tpu.SUBLANES, tpu.LANES), jnp.float32)
    tables = ((rope_rows, dummy) if row_half
              else (finish.table_view(cos), finish.table_view(sin)) if fused else (dummy,) * 2)
    weight = norm_weight.reshape(1, d) if fused else jnp.zeros((1, d), jnp.float32)
    return call(facts, tpu.in_hbm(kv), tpu.in_hbm(score), ape_tile, tpu.in_hbm(state.kv),
                tpu.in_hbm(state.score), weight, *(tpu.in_hbm(t) for t in tables))


# ----------------------------------------------------------------------------- state kernel


def _state_kernel(facts_ref, kv_hbm, score_hbm, ape_ref, dep_hbm, skv_in, sscore_in,
                  skv_hbm, sscore_hbm, sbuf, sems, *, ratio: int):
    """One grid step = one sequence: its last ``count`` tokens into its ring (module
    docstring). Prefetch ``facts`` (SMEM i32[S * 4]); inputs this step's ``kv`` / ``score``
    (HBM f32[T, W]), ``ape`` (VMEM f32[r, W]), ``dep`` (the pool call's output: order only),
    the pool (HBM, aliased to the outputs ``skv`` / ``sscore`` f32[N, R, W]); scratch: the
    score rows (VMEM f32[R, W]), DMA semaphores (kv copies, score reads, gate writes)."""
    del dep_hbm, skv_in, sscore_in
    at = pl.program_id(0) * SEQ_WORDS
    row0, pos0 = facts_ref[at + _ROW0], facts_ref[at + _POS0]
    count, slot = facts_ref[at + _COUNT], facts_ref[at + _WSLOT]
    rows = sbuf.shape[0]

    def kv_copy(t):
        return pltpu.make_async_copy(kv_hbm.at[pl.ds(row0 + t, 1)],
                                     skv_hbm.at[slot, pl.ds((pos0 + t) % rows, 1)], sems.at[0])

    def read(t):
        return pltpu.make_async_copy(score_hbm.at[pl.ds(row0 + t, 1)], sbuf.at[pl.ds(t, 1)],
                                     sems.at[1])

    def write(t):
        return pltpu.make_async_copy(sbuf.at[pl.ds(t, 1)],
                                     sscore_hbm.at[slot, pl.ds((pos0 + t) % rows, 1)],
                                     sems.at[2])

    def each(fn):
        jax.lax.fori_loop(0, count, lambda t, c: (fn(t), c)[1], 0)

    each(lambda t: (kv_copy(t).start(), read(t).start()))
    each(lambda t: read(0).wait())  # one semaphore counts the row reads

    def add_ape(t):
        sbuf[pl.ds(t, 1), :] = sbuf[pl.ds(t, 1), :] + ape_ref[pl.ds((pos0 + t) % ratio, 1), :]
        write(t).start()

    each(add_ape)
    each(lambda t: (kv_copy(0).wait(), write(0).wait()))


def state_call(facts, kv, score, ape, dep, state: vc.CompressorState, *, ratio: int,
               vmem_limit_bytes: int | None, interpret) -> vc.CompressorState:
    """The state ``pallas_call`` (``_state_kernel``), the pool updated in place (aliased);
    ``dep`` orders it after the pool call."""
    num_rows, width = kv.shape
    rows, d = vc.pool_rows(ratio), width // vc.pool_coff(ratio)
    seqs = facts.shape[0] // SEQ_WORDS
    c = traffic.worst_counts(num_rows, seqs, ratio)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(seqs,),
        in_specs=[any_spec, any_spec, pl.BlockSpec((ratio, width), lambda i, *_: (0, 0)),
                  any_spec, any_spec, any_spec],
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.VMEM((rows, width), jnp.float32), pltpu.SemaphoreType.DMA((3,))])
    call = pl.pallas_call(
        functools.partial(_state_kernel, ratio=ratio), grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(state.kv.shape, jnp.float32)] * 2,
        input_output_aliases={5: 0, 6: 1},  # operand numbers count the prefetched facts
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=tpu.vmem_limit(traffic.vmem_bytes(ratio=ratio, d=d),
                                            tpu.device_chip(), vmem_limit_bytes)),
        cost_estimate=pl.CostEstimate(flops=c.state_rows * width, transcendentals=0,
                                      bytes_accessed=traffic.state_bytes(c, ratio=ratio, d=d)),
        interpret=tpu.interpret_params(interpret), name="v4_compressor_state")
    new_kv, new_score = call(facts, tpu.in_hbm(kv), tpu.in_hbm(score), ape, dep,
                             tpu.in_hbm(state.kv), tpu.in_hbm(state.score))
    return vc.CompressorState(new_kv, new_score)


# ----------------------------------------------------------------------------- the entry


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "precision", "vmem_limit_bytes",
                                             "interpret", "finished"))
def _compress(kv, score, ape, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
              distribution, rope_rows, *, ratio, eps, precision, vmem_limit_bytes, interpret,
              finished: bool = True):
    """Both calls; ``finished=False``: the pooled rows as they come out of the pool call (no norm,
    no RoPE, no table read: ``pallas_kernels.v41_compressor``'s ``"latent"`` output norms them
    in its glue)."""
    num_rows, num_seqs = kv.shape[0], kv_lens.shape[0]
    s = vc.seq_facts(kv_lens, cu_q_lens, distribution, state_slots, num_rows, state.kv.shape[0])
    seq, entry, valid, onehot = enumerate_slots(s, num_rows // ratio + num_seqs, ratio,
                                                cos.shape[0])  # vc.max_entries
    knobs = dict(ratio=ratio, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    facts = entry_facts(s, seq, entry, valid, ratio, onehot)
    pooled = pool_call(facts, kv, score, ape, state, norm_weight=norm_weight if finished else None,
                       cos=cos, sin=sin, eps=eps, precision=precision, rope_rows=rope_rows,
                       **knobs)
    new_state = state_call(write_facts(s, ratio), kv, score, ape, pooled, state, **knobs)
    if not finished or finish.fusable(norm_weight.shape[0], cos.shape[1]):  # kernel's rows
        entries = vc.CompressedEntries(pooled, jnp.where(valid, seq, -1),
                                       jnp.where(valid, entry, -1))
    else:
        entries = vc.finish_entries(pooled, norm_weight, cos, sin, seq, entry, valid,
                                    ratio=ratio, eps=eps, precision=precision)
    return entries, new_state


def compress_step(
    kv,  # f32|bf16[T, coff * d]: this step's wkv(x) rows
    score,  # f32|bf16[T, coff * d]: this step's wgate(x) rows (ape not added)
    ape,  # f32[r, coff * d]: the learned position bias, row p % r
    norm_weight,  # f32[d]: the RMSNorm weight
    cos,  # f32[num_positions, rope_dim // 2]
    sin,  # f32[num_positions, rope_dim // 2]
    state: vc.CompressorState,  # f32[num_slots, coff * r, coff * d] x 2
    state_slots,  # i32[S]
    kv_lens,  # i32[S]: tokens including this step's
    cu_q_lens,  # i32[S + 1]
    distribution,  # i32[3]
    *,
    ratio: int,
    eps: float = vc.NORM_EPS,
    vmem_limit_bytes: int | None = None,
    interpret=False,
    precision: str = "f32",
    rope_rows=None,  # f32[num_positions, 128]: finish.rope_rows(cos, sin), optional
) -> tuple[vc.CompressedEntries, vc.CompressorState]:
    """One step of the V4 compressor (``reference.v4_compressor.compress_step``'s arguments and
    results; module docstring for the kernels).

    ``precision`` as the reference's (``"bf16"``: ``finish_entries``' rounding, in the same
    glue after the kernels). Args beyond the reference's: ``vmem_limit_bytes`` overrides the
    scoped VMEM limit (``pallas_kernels.tpu.vmem_limit``); ``interpret``: False compiles with
    Mosaic, True runs the strict interpreter (``pallas_kernels.tpu.interpret_params``), or a
    ``pltpu.InterpretParams``; ``rope_rows``: the tables in the kernel's row layout
    (``finish.rope_rows(cos, sin)``, ``f32[P, 128]``; a model constant built once), read one
    512-B row per completing entry instead of two 16-KB tiles of the tables (``cos`` / ``sin``
    must still be given: the reference's checks and, when the kernel does not finish the rows,
    the glue read them); ``None``: the tables' tiles.

    Returns ``(CompressedEntries rows f32[E, d], seq / entry i32[E]; CompressorState)`` with
    ``E = max_entries(T, S, ratio)``; the pool is updated in place when the caller's jit
    donates it. Bad shapes, dtypes or ratio: ``ValueError`` naming the numbers (the
    reference's ``check_step_args``)."""
    check_precision(precision)
    vc.check_step_args(kv, score, ape, norm_weight, cos, sin, state, state_slots, kv_lens,
                       cu_q_lens, distribution, ratio)
    tpu.check_vmem_limit(vmem_limit_bytes)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    if rope_rows is not None:
        want = (cos.shape[0], tpu.LANES)
        if tuple(rope_rows.shape) != want:
            raise ValueError(f"rope_rows shape {tuple(rope_rows.shape)} != {want} (cos "
                             f"{tuple(cos.shape)}: finish.rope_rows)")
        if 4 * cos.shape[1] > tpu.LANES:
            raise ValueError(f"rope_rows needs 4 * h <= {tpu.LANES}: cos width h {cos.shape[1]}")
        rope_rows = f32(rope_rows)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return _compress(f32(kv), f32(score), f32(ape), f32(norm_weight), f32(cos), f32(sin), state,
                     i32(state_slots), i32(kv_lens), i32(cu_q_lens), i32(distribution),
                     rope_rows, ratio=ratio, eps=float(eps), precision=precision,
                     vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
