"""The scalar-core walk of the fused V4 attention kernel (``kernel``): a query row's stream of
window units then compressed units, each valid one issued as DMAs into the next free rows of a
gather buffer (``_walk``), and the select masks of the wanted rows (``_live``).

A unit is one token / listed entry (one row), or one page-run segment (``traffic.segment_plan``:
``seg`` aligned rows of one page, a window's or an HCA walk's contiguous tokens, one DMA per
cache part, of the slot's wanted rows only: ``formats.issue_run``). Each buffer keeps, per
``seg``-row slot, the wanted rows ``lo .. hi - 1`` (what the waits re-derive sizes from) and,
last, the segments issued (SMEM ``runs[b]``): segments fill slots from the block's start (the
window comes first), single rows fill slots densely after them. A released page (table entry
-1 or out of range: ``reference.batch.lookup_page``) is skipped, segment and all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.v4_attention import formats, traffic
from pallas_kernels.v4_attention.traffic import INFO_WORDS
from reference.core import batch

# row_info words per query row (INFO_WORDS of them: ``traffic``)
_WFIRST, _WN, _WSLOT0, _CN, _CSLOT0, _CLIMIT = range(INFO_WORDS)


def _units(info_ref, row, seg, window_runs, compressed_runs):
    """Row ``row``'s stream: ``(window units, compressed units)``; a unit is one token / entry,
    or one ``seg``-row segment of a page run (``traffic.segment_plan``)."""
    at = row * INFO_WORDS
    w_first, w_n, c_n = info_ref[at + _WFIRST], info_ref[at + _WN], info_ref[at + _CN]
    w_units = traffic.window_segments(w_first, w_n, seg) if window_runs else w_n
    return w_units, (c_n + seg - 1) // seg if compressed_runs else c_n


def _walk(refs, row, lslot, b, cur, *, fmt, listed, block, w_page, c_page, w_pages, c_pages,
          layer, layer_ok, seg, window_runs, compressed_runs, run_grain="tiles"):
    """Issue the DMAs of query row ``row``'s next stream units from ``cur`` into gather buffer
    ``b`` until it is full (its list is in SMEM slot ``lslot``): a token / entry into the next
    free row, a page-run segment into the next ``seg``-row slot; each records the wanted rows
    of its slot in ``runs[b]`` (``lo, hi`` per slot, then the segments issued). Returns
    ``(cursor, rows filled)``; a row's stream is its window units then its compressed units
    (module docstring); ``run_grain``: how a segment moves packed / f32 rows
    (``formats.RUN_GRAINS``)."""
    info_ref, wtab_ref, ctab_ref, w_src, c_src, bufs, ent_smem, sems, runs = refs
    at = row * INFO_WORDS
    w_first, w_n, w_slot0 = info_ref[at + _WFIRST], info_ref[at + _WN], info_ref[at + _WSLOT0]
    c_slot0, c_limit = info_ref[at + _CSLOT0], info_ref[at + _CLIMIT]
    w_units, c_units = _units(info_ref, row, seg, window_runs, compressed_runs)
    nslots = block // seg
    for j in range(2 * nslots + 2):
        runs[b, j] = jnp.int32(0)
    w_rows, c_rows = (seg if window_runs else 1), (seg if compressed_runs else 1)
    gather = listed and fmt in formats.FP8_FORMATS  # coalesced records, shared rope rows

    def body(c):
        pos, n, ns, lst = c
        in_window = pos < w_units
        j = pos - w_units
        if window_runs:
            w_start = (w_first // seg + pos) * seg
            w_lo = jnp.maximum(w_first - w_start, 0)
            w_hi = jnp.minimum(w_first + w_n - w_start, seg)
        else:
            w_start, w_lo, w_hi = w_first + pos, 0, n % seg + 1
        if compressed_runs:
            e = j * seg
            c_lo, c_hi = 0, jnp.minimum(c_limit - e, seg)
        else:
            e = ent_smem[lslot, jnp.clip(j, 0, ent_smem.shape[1] - 1)] if listed else j
            c_lo, c_hi = 0, n % seg + 1
        e_ok = (e >= 0) & (e < c_limit)
        unit = jnp.where(in_window, w_start, jnp.where(e_ok, e, 0))
        psize = jnp.where(in_window, w_page, c_page)
        slot = jnp.where(in_window, w_slot0, c_slot0) + unit // psize
        w_pid, w_ok = batch.lookup_page(wtab_ref, slot, w_pages)
        c_pid, c_ok = batch.lookup_page(ctab_ref, slot, c_pages)
        ok = jnp.where(in_window, w_ok, e_ok & c_ok) & layer_ok
        if gather:
            records, shared, lst = _listed(lst, ent_smem, lslot, j, e, c_pid, ok & ~in_window,
                                           ok & in_window, c_page, c_limit, c_units, block - n)
        for comp, (src, pid, here, rows, lo, hi) in enumerate((
                (w_src, w_pid, in_window, w_rows, w_lo, w_hi),
                (c_src, c_pid, ~in_window, c_rows, c_lo, c_hi))):
            @pl.when(ok & here)
            def _(src=src, pid=pid, rows=rows, lo=lo, hi=hi, comp=comp):
                if rows > 1:  # a segment: its wanted rows only
                    formats.issue_run(fmt, src, bufs, sems, layer, pid, unit % psize, b, n,
                                      lo, hi, rows, run_grain)
                elif gather and comp:  # a listed entry
                    formats.issue_listed(src, bufs, sems, layer, pid, unit % psize, b, n,
                                         records, shared)
                else:
                    formats.issue(fmt, src, bufs, sems, layer, pid, unit % psize, b, n)

        @pl.when(ok)
        def _():
            runs[b, 2 * (n // seg)] = jnp.where(in_window, w_lo, c_lo)
            runs[b, 2 * (n // seg) + 1] = jnp.where(in_window, w_hi, c_hi)

        size = jnp.where(in_window, w_rows, c_rows)
        is_run = jnp.where(in_window, window_runs, compressed_runs)
        return (pos + 1, n + ok.astype(jnp.int32) * size,
                ns + (ok & is_run).astype(jnp.int32), lst)

    lst0 = (jnp.int32(0),) * 4 + (jnp.int32(-1),)  # shared, left, group, page, rope row
    cur, n, ns, lst = jax.lax.while_loop(
        lambda c: (c[1] < block) & (c[0] < w_units + c_units), body,
        (cur, jnp.int32(0), jnp.int32(0), lst0))
    runs[b, 2 * nslots] = ns
    runs[b, 2 * nslots + 1] = lst[0]
    return cur, n


def _listed(lst, ent_smem, lslot, j, e, pid, listed_ok, window_ok, c_page, c_limit, c_units,
            room):
    """fp8 / CSA, list position ``j`` (entry ``e`` on page ``pid``; issued if ``listed_ok``):
    ``(records, shared, lst)`` for ``formats.issue_listed``. ``lst`` = (rows of this block
    that share the previous row's rope row, rows left of the current record run, rows in the
    current rope group, its page, its rope row). An entry a run does not cover starts one:
    the list's next positions holding ``e + 1, e + 2, ..`` on the same page, within the walk
    (``c_units``), the limit and the block's ``room`` (``traffic.listed_reads`` counts the
    same). It shares the previous issued row's rope row iff that row is a listed entry of the
    same page and rope row and the group has fewer than ``QUARTERS`` rows."""
    shared_n, left, group, g_pid, g_row = lst
    off = e % c_page
    row = off // formats.QUARTERS
    covered = left > 0
    cap = jnp.where(listed_ok & ~covered, jnp.minimum(
        jnp.minimum(room, c_page - off), jnp.minimum(c_limit - e, c_units - j)), 0)
    last = ent_smem.shape[1] - 1

    def grows(i):
        return (i < cap) & (ent_smem[lslot, jnp.clip(j + i, 0, last)] == e + i)

    length = jax.lax.while_loop(grows, lambda i: i + 1, jnp.int32(1))
    records = jnp.where(listed_ok & ~covered, length, 0)
    shared = listed_ok & (g_pid == pid) & (g_row == row) & (group < formats.QUARTERS)
    i32 = jnp.int32
    lst = (shared_n + shared.astype(i32),
           jnp.where(listed_ok, jnp.where(covered, left - 1, records - 1), left),
           jnp.where(listed_ok, jnp.where(shared, group + 1, 1), group),
           jnp.where(listed_ok, pid, jnp.where(window_ok, -1, g_pid)),
           jnp.where(listed_ok, row, jnp.where(window_ok, -1, g_row)))
    return records, shared, lst


def walk_order(entries: jax.Array) -> jax.Array:
    """``i32[T, k]`` CSA top-k lists (by score; -1 = none) -> each row's entries in ascending
    entry order, the negatives last (one XLA sort of the lists as u32). The fp8 / CSA gather
    (``_listed``) then meets adjacent entries next to each other: a rope row shared by up to 4
    selected entries is fetched once, and runs of adjacent slots of a page are one records
    DMA. Attention is order-invariant (up to f32 summation order); ``list_walk_end`` of the
    sorted lists stops after their last valid entry."""
    words = jax.lax.bitcast_convert_type(jnp.asarray(entries, jnp.int32), jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.sort(words, dimension=1), jnp.int32)


def _live(runs, b, shape, axis: int, seg: int):
    """``bool[shape]``: whether each gathered row (along ``axis``) of buffer ``b`` is a wanted
    token: rows ``lo .. hi - 1`` of each ``seg``-row slot (``runs[b]``, ``_walk``); a select
    mask, so the other rows (a run's unwanted rows, stale or never written) cannot leak."""
    r = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    live = jnp.zeros(shape, bool)
    for j in range(shape[axis] // seg):
        live = live | ((r >= j * seg + runs[b, 2 * j]) & (r < j * seg + runs[b, 2 * j + 1]))
    return live
