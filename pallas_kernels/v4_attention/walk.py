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
    for j in range(2 * nslots + 1):
        runs[b, j] = jnp.int32(0)
    w_rows, c_rows = (seg if window_runs else 1), (seg if compressed_runs else 1)

    def body(c):
        pos, n, ns = c
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
        for src, pid, here, rows, lo, hi in ((w_src, w_pid, in_window, w_rows, w_lo, w_hi),
                                             (c_src, c_pid, ~in_window, c_rows, c_lo, c_hi)):
            @pl.when(ok & here)
            def _(src=src, pid=pid, rows=rows, lo=lo, hi=hi):
                if rows > 1:  # a segment: its wanted rows only
                    formats.issue_run(fmt, src, bufs, sems, layer, pid, unit % psize, b, n,
                                      lo, hi, rows, run_grain)
                else:
                    formats.issue(fmt, src, bufs, sems, layer, pid, unit % psize, b, n)

        @pl.when(ok)
        def _():
            runs[b, 2 * (n // seg)] = jnp.where(in_window, w_lo, c_lo)
            runs[b, 2 * (n // seg) + 1] = jnp.where(in_window, w_hi, c_hi)

        size = jnp.where(in_window, w_rows, c_rows)
        is_run = jnp.where(in_window, window_runs, compressed_runs)
        return (pos + 1, n + ok.astype(jnp.int32) * size,
                ns + (ok & is_run).astype(jnp.int32))

    cur, n, ns = jax.lax.while_loop(lambda c: (c[1] < block) & (c[0] < w_units + c_units),
                                    body, (cur, jnp.int32(0), jnp.int32(0)))
    runs[b, 2 * nslots] = ns
    return cur, n


def _live(runs, b, shape, axis: int, seg: int):
    """``bool[shape]``: whether each gathered row (along ``axis``) of buffer ``b`` is a wanted
    token: rows ``lo .. hi - 1`` of each ``seg``-row slot (``runs[b]``, ``_walk``); a select
    mask, so the other rows (a run's unwanted rows, stale or never written) cannot leak."""
    r = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    live = jnp.zeros(shape, bool)
    for j in range(shape[axis] // seg):
        live = live | ((r >= j * seg + runs[b, 2 * j]) & (r < j * seg + runs[b, 2 * j + 1]))
    return live
