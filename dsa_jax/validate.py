"""Opt-in runtime validation of a ragged paged batch (``jax.experimental.checkify``).

Static mistakes (shapes, dtypes, statics) raise at trace time in every op. Runtime values jit
cannot refuse are *masked* by the rules of ``reference.batch``; that keeps serving alive but
hides a broken batch. ``validate=True`` (on every op and on the step) reports them instead, as a
``checkify.JaxRuntimeError`` (a ``ValueError``) naming the first offending sequence/index and
the numbers. Rules, one check each:

1. page ids: every page a sequence uses (``ceil(min(kv_len, capacity_tokens) / page_size)``
   pages from slot ``cu_kv_lens[i] // page_size``) has a slot inside ``page_indices`` and an id
   in ``[0, num_pages)``.
2. capacity: ``0 <= kv_len <= capacity_tokens = pages_per_seq * page_size`` (active sequences).
3. monotone: ``cu_q_lens`` and ``cu_kv_lens`` start at ``>= 0`` and never decrease;
   ``cu_kv_lens`` entries are whole pages (multiples of ``page_size``).
4. distribution: ``0 <= decode_end <= prefill_end <= num_seqs <= S``; decode sequences
   (``i < decode_end``) have one query row; active rows fit in ``T``
   (``cu_q_lens[num_seqs] <= T``); an active sequence has ``q_len <= kv_len``.
5. layer (an op reading a stacked cache): ``0 <= layer < L``; a traced layer outside is masked
   by ``reference.stacked``'s rule (it reads nothing).

``check_batch`` emits the checks (call it inside your own ``checkify.checkify``-wrapped
function); ``run_checked`` wraps a call, runs it, and raises on the first failed check.
Validation syncs with the host: it is for debugging and tests, not the serving hot path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from reference.core import batch


def _first(bad: jax.Array) -> jax.Array:
    """Index of the first True of ``bad`` (0 if none)."""
    return jnp.argmax(bad).astype(jnp.int32)


def check_page_ids(b: batch.RaggedBatch) -> None:
    """Rule 1: every used page has a slot in the table and an id in ``[0, num_pages)``."""
    page_indices, page_size, pages_per_seq = b.page_indices, b.page_size, b.pages_per_seq
    num_pages = b.num_pages
    seqs = jnp.arange(b.num_seqs)
    used = (b.kv_eff(seqs) + page_size - 1) // page_size  # pages, per sequence
    j = jnp.arange(pages_per_seq, dtype=jnp.int32)
    slot = b.first_slot(seqs)[:, None] + j[None, :]  # [S, pages_per_seq]: the slot rule
    live = b.active()[:, None] & (j[None, :] < used[:, None])
    in_table = (slot >= 0) & (slot < page_indices.shape[0])
    bad_slot = (live & ~in_table).reshape(-1)
    f = _first(bad_slot)
    checkify.check(~jnp.any(bad_slot),
                   "page table: sequence {seq} needs page slot {slot} (page {page} of its "
                   "{used} pages) but page_indices has only {n} entries",
                   seq=f // pages_per_seq, page=f % pages_per_seq, slot=slot.reshape(-1)[f],
                   used=used[f // pages_per_seq], n=jnp.int32(page_indices.shape[0]))
    pid, found = batch.lookup_page(page_indices, slot, num_pages)
    bad_pid = (live & in_table & ~found).reshape(-1)
    g = _first(bad_pid)
    checkify.check(~jnp.any(bad_pid),
                   "page id out of range: sequence {seq} page {page}: page_indices[{slot}] = "
                   "{pid} is outside [0, num_pages={num_pages})",
                   seq=g // pages_per_seq, page=g % pages_per_seq, slot=slot.reshape(-1)[g],
                   pid=pid.reshape(-1)[g], num_pages=jnp.int32(num_pages))


def check_capacity(b: batch.RaggedBatch) -> None:
    """Rule 2: active ``kv_len`` within ``[0, capacity_tokens]`` (compressed keys: its
    ``kv_len // r`` entries within the capacity in entries)."""
    kv_lens, cap, r = b.kv_lens, b.capacity_tokens, b.compression_ratio
    keys = batch.entries_of_tokens(kv_lens, r)
    bad = b.active() & ((keys > cap) | (kv_lens < 0))
    i = _first(bad)
    if r == 1:
        checkify.check(~jnp.any(bad),
                       "kv_len past capacity: sequence {seq} has kv_len={kv} tokens, "
                       "capacity_tokens = pages_per_seq {pages} x page_size {ps} = {cap}",
                       seq=i, kv=kv_lens[i], pages=jnp.int32(b.pages_per_seq),
                       ps=jnp.int32(b.page_size), cap=jnp.int32(cap))
        return
    checkify.check(~jnp.any(bad),
                   "kv_len past capacity: sequence {seq} has kv_len={kv} tokens = {e} entries "
                   "of compression_ratio {r}, capacity = pages_per_seq {pages} x page_size {ps} "
                   "= {cap} entries", seq=i, kv=kv_lens[i], e=keys[i], r=jnp.int32(r),
                   pages=jnp.int32(b.pages_per_seq), ps=jnp.int32(b.page_size),
                   cap=jnp.int32(cap))


def check_monotone(cu_q_lens, cu_kv_lens, *, page_size: int) -> None:
    """Rule 3: ``cu_*`` start at >= 0 and never decrease; ``cu_kv_lens`` in whole pages."""
    for name, cu in (("cu_q_lens", cu_q_lens), ("cu_kv_lens", cu_kv_lens)):
        checkify.check(cu[0] >= 0, name + "[0] = {v} is negative", v=cu[0])
        if cu.shape[0] < 2:
            continue
        bad = cu[1:] < cu[:-1]
        i = _first(bad)
        checkify.check(~jnp.any(bad),
                       "non-monotone " + name + ": " + name + "[{i}] = {a} > " + name +
                       "[{j}] = {b}", i=i, j=i + 1, a=cu[i], b=cu[i + 1])
    bad = cu_kv_lens % page_size != 0
    i = _first(bad)
    checkify.check(~jnp.any(bad),
                   "cu_kv_lens[{i}] = {v} tokens is not a whole number of pages (page_size "
                   "{ps}, remainder {r})", i=i, v=cu_kv_lens[i], ps=jnp.int32(page_size),
                   r=cu_kv_lens[i] % page_size)


def check_distribution(num_rows: int, kv_lens, cu_q_lens, distribution) -> None:
    """Rule 4: ``distribution`` consistent with the batch (module docstring)."""
    num_seqs = kv_lens.shape[0]
    d0, d1, d2 = distribution[0], distribution[1], distribution[2]
    checkify.check((d0 >= 0) & (d0 <= d1) & (d1 <= d2) & (d2 <= num_seqs),
                   "distribution inconsistent with the batch: need 0 <= decode_end {d0} <= "
                   "prefill_end {d1} <= num_seqs {d2} <= S {s}", d0=d0, d1=d1, d2=d2,
                   s=jnp.int32(num_seqs))
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    seq = jnp.arange(num_seqs)
    bad = (seq < d0) & (q_len != 1)
    i = _first(bad)
    checkify.check(~jnp.any(bad),
                   "distribution inconsistent with the batch: sequence {seq} < decode_end {d0} "
                   "is a decode sequence but has q_len={q} rows", seq=i, d0=d0, q=q_len[i])
    last = cu_q_lens[jnp.clip(d2, 0, num_seqs)]
    checkify.check(last <= num_rows,
                   "distribution inconsistent with the batch: the {d2} active sequences end at "
                   "row cu_q_lens[{d2}] = {last} but q has only T={t} rows", d2=d2, last=last,
                   t=jnp.int32(num_rows))
    bad = (seq < d2) & (q_len > kv_lens)
    i = _first(bad)
    checkify.check(~jnp.any(bad),
                   "distribution inconsistent with the batch: active sequence {seq} has q_len="
                   "{q} > kv_len={kv} (kv_len counts this step's tokens)", seq=i, q=q_len[i],
                   kv=kv_lens[i])


def check_batch(num_rows: int, kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, *,
                page_size: int, pages_per_seq: int, num_pages: int,
                compression_ratio: int = 1) -> None:
    """All four rules (module docstring); call inside a ``checkify``-wrapped function.
    ``compression_ratio > 1``: the cache side counts entries (``reference.batch``), so rules 1-3
    read pages and capacity in entries; ``kv_len`` (rule 4's ``q_len <= kv_len``) is tokens."""
    b = batch.RaggedBatch(*(jnp.asarray(x) for x in (kv_lens, page_indices, cu_q_lens,
                                                     cu_kv_lens, distribution)),
                          page_size=page_size, pages_per_seq=pages_per_seq, num_pages=num_pages,
                          compression_ratio=compression_ratio)
    check_monotone(b.cu_q_lens, b.cu_kv_lens, page_size=page_size)
    check_distribution(num_rows, b.kv_lens, b.cu_q_lens, b.distribution)
    check_capacity(b)
    check_page_ids(b)


def check_layer(layer, num_layers: int) -> None:
    """Rule 5: the layer read from a stacked cache lies in ``[0, L)``."""
    layer = jnp.asarray(layer, jnp.int32)
    checkify.check((layer >= 0) & (layer < num_layers),
                   "layer {layer} is outside [0, {num_layers}) (the stacked cache's layers)",
                   layer=layer, num_layers=jnp.int32(num_layers))


def run_checked(fn, *args):
    """``fn(*args)`` under ``checkify``; raise ``checkify.JaxRuntimeError`` on a failed check.

    Not for use under an outer ``jax.jit`` (raising needs the values on the host): there, wrap
    your own function with ``checkify.checkify`` and call ``check_batch`` inside it.
    """
    err, out = checkify.checkify(fn)(*args)
    err.throw()
    return out
