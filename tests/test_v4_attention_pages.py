"""Page runs of the fused V4 attention kernel (``pallas_kernels.v4_attention``; issue 30): the
window tokens and the HCA entries read as aligned segments of a page (``traffic.segment_plan``,
one DMA per segment), in the strict interpreter against the float64 oracle
(``oracle.v4_oracle``), and the interpreter's counts of bytes and DMA starts against the model
(``traffic.fused_traffic`` with ``traffic.run_reads``).

Edge cases (one batch, every unread slot NaN: ``v4_batches``): a decode row with one window
token (``kv_len 1``), a window starting on a page's last row (``w_first = 7``, pages of 8),
HCA rows with 0, 1, exactly a page (8) and a page + 1 visible entries (all entries in one page,
and a run over two pages), prefill rows beside decode rows, window pages no row sees released
(a page-run never reads them). Tolerance ``F32_TOL`` as ``test_v4_attention`` (f32 sums in
another order than the oracle's f64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from oracle import v4_oracle
from test_v4_attention_state import to_plane
from v4_batches import fp8_view, make_v4_batch, to_fp8

from pallas_kernels.v4_attention import formats, kernel, traffic
from reference.packed_cache import pack_cache
from reference.v4_attention import v4_attention_ref

pytestmark = pytest.mark.kernel_gate

SCALE = 512 ** -0.5
F32_TOL = dict(rtol=2e-5, atol=2e-5)
SINK = np.array([0.5, -np.inf], np.float32)
BLOCK, PAGE = 16, 8  # segments of 8 rows (a page), 2 slots a block
# decode rows: kv_len 1 (w_n = 1), 23 (w_first = 7: a page's last row), 130 / 1030 / 1160 (HCA
# entries 1, 8 = one page, 9 = a page + 1); then 3 prefill rows at 297 .. 299 (2 entries)
Q_LENS, KV_LENS = [1, 1, 1, 1, 1, 3], [1, 23, 130, 1030, 1160, 300]


def _batch(seed, page=PAGE, kv_lens=KV_LENS, ratio=128):
    return make_v4_batch([30, seed], q_lens=Q_LENS[-len(kv_lens):], kv_lens=kv_lens, ratio=ratio,
                         heads=2, window_size=max(16, page), window_page_size=page,
                         comp_page_size=page)


def _run(b, cast, interpret=True, block=BLOCK, run_grain="tiles"):
    return kernel.v4_attention_fused(
        jnp.asarray(b.q), *b.args(cast=cast)[1:], sm_scale=SCALE, return_lse=True,
        block=block, interpret=interpret, run_grain=run_grain,
        **b.kwargs(cast=cast, sink=SINK))


def test_segment_plan_runs_the_contiguous_sources_only():
    assert traffic.segment_plan("packed", 256, 64, 64, listed=True) == (64, True, False)
    assert traffic.segment_plan("packed", 256, 64, 64, listed=False) == (64, True, True)
    assert traffic.segment_plan("plane", 16, 8, 8, listed=False) == (8, True, True)
    assert traffic.segment_plan("packed", 16, 4, 4, listed=False) == (16, False, False)
    assert traffic.segment_plan("fp8", 256, 64, 64, listed=False) == (64, True, True)
    assert traffic.segment_plan("csa", 256, 64, 64, listed=True) == (64, True, False)
    assert traffic.segment_plan("fp8", 16, 8, 8, listed=False) == (16, False, False)
    assert traffic.segment_plan("packed", 256, 1, 1, listed=False) == (256, False, False)
    # the bounds of the issue: window <= ceil(W / ps) + 1 segments, HCA <= n / ps + 2
    for w_first in range(130):
        n = traffic.window_segments(w_first, 128, 64)
        assert n <= 128 // 64 + 1 and n * 64 >= 128
    assert traffic.run_bound(window=128, entries=64, seg=64, window_runs=True,
                             compressed_runs=True) == (0, 128 + 64, 4)  # tokens once
    # rope rows: 128 tokens anywhere touch <= 33 rows of 4, 64 entries from 0 exactly 16
    assert traffic.run_rope_bound(window=128, entries=64, window_runs=True,
                                  compressed_runs=True) == 33 + 16
    assert max(traffic.run_rope_rows(f, 128, 0, window_runs=True, compressed_runs=True)
               for f in range(8)) == 33


@pytest.mark.parametrize("fmt,block,ratio", [
    ("packed", BLOCK, 128), ("plain", 8, 128), ("plane", BLOCK, 128), ("fp8", 64, 128),
    ("packed", BLOCK, 4), ("fp8", 64, 4)])
def test_page_runs_match_the_oracle(fmt, block, ratio):
    """Packed, f32 and tokamax plane rows (2 slots a block; f32: block 8, one slot) at every
    edge case; fp8 MODEL1 at pages of 32 and window 32 (its runs' seg: a multiple of 32;
    w_first = 31 is a page's last row, HCA entries in one page). Ratio 4: window runs then CSA
    entries one row each in the same blocks (fp8: run rope rows beside per-entry ones)."""
    b = (_batch(len(fmt), ratio=ratio) if fmt != "fp8"
         else _batch(4, page=32, kv_lens=[1, 63, 130, 300], ratio=ratio))
    cast = {"packed": pack_cache, "plain": None, "plane": to_plane, "fp8": to_fp8}[fmt]
    out, lse = _run(b, cast, block=block)
    if fmt == "fp8":  # the oracle on the values the fp8 cache holds
        b = fp8_view(b)
    want, want_lse = v4_oracle(b.q, b.kv_lens, b.cu_q_lens, b.distribution, sm_scale=SCALE,
                               attn_sink=SINK, **b.oracle_kwargs())
    if fmt in ("packed", "plane"):  # the oracle on the bf16 values their words hold
        rounded = dict(b.oracle_kwargs())
        for key in ("window_cache", "comp_cache"):
            rounded[key] = np.asarray(jnp.asarray(rounded[key], jnp.bfloat16), np.float32)
        want, want_lse = v4_oracle(b.q, b.kv_lens, b.cu_q_lens, b.distribution,
                                   sm_scale=SCALE, attn_sink=SINK, **rounded)
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, **F32_TOL)


def _counted(fn):
    from pallas_kernels import _interpret_counter as counter

    with counter.count_hbm_traffic() as n:
        jax.block_until_ready(fn(pltpu.InterpretParams(dma_execution_mode="eager")))
    assert n.dmas_unexecuted == 0
    return n


def _row_fields(b):
    """Decode rows' ``row_info`` fields from the definition: window ``max(0, p - W + 1) .. p``,
    HCA entries ``(p + 1) // 128``."""
    p = np.asarray(b.kv_lens) - 1
    w_first = np.maximum(p - b.window_size + 1, 0)
    return w_first, p - w_first + 1, (p + 1) // b.ratio


# fmt -> (page, block, decode kv_lens): fp8 runs need seg % 32 == 0 (their seg / 4 rope rows)
# packed32: segments of 32 rows, runs widened to 8-row tiles inside them (formats.run_align);
# packed32-exact: run_grain="exact", the wanted rows only (ragged ends one row a DMA)
EXACT_KV = [1, 63, 300, 700]
COUNT_CASES = {"packed": (PAGE, BLOCK, KV_LENS[:5]), "fp8": (32, 64, EXACT_KV),
               "packed32": (32, 64, EXACT_KV), "packed32-exact": (32, 64, EXACT_KV)}


@pytest.mark.parametrize("case", COUNT_CASES)
def test_counted_bytes_and_dmas_equal_the_model(case):
    """Decode rows only (each walks its whole window and visible entries): the interpreter's
    bytes equal the model's kernel side (minus the scalar-prefetched row_info and tables, plus
    the sink block it does not model), its DMA starts and block copies the model's ``dmas``;
    the issue's bounds per row and part (window <= ceil(W / ps) + 1 DMAs, HCA <= n / ps + 2);
    the runs read each wanted token once (dynamic-length DMAs: ``formats.issue_run``) and, fp8,
    its 512 B record and its share of the rope rows its run touches (<= 1.05 x 640 B)."""
    page, block, kv_lens = COUNT_CASES[case]
    fmt, exact = case.split("-")[0].rstrip("0123456789"), case.endswith("-exact")
    b = make_v4_batch([30, 2], q_lens=[1] * len(kv_lens), kv_lens=kv_lens, ratio=128,
                      heads=2, window_size=max(16, page), window_page_size=page,
                      comp_page_size=page)
    t, h = b.q.shape[:2]
    cast, parts = (to_fp8, 2) if fmt == "fp8" else (pack_cache, 1)
    n = _counted(lambda ip: _run(b, cast, interpret=ip, block=block,
                                 run_grain="exact" if exact else "tiles"))
    seg, w_runs, c_runs = traffic.segment_plan(fmt, block, page, page, listed=False)
    assert (seg, w_runs, c_runs) == (page, True, True)
    single, runs, gather_dmas = traffic.run_reads(*_row_fields(b), seg=seg, window_runs=w_runs,
                                                  compressed_runs=c_runs, dmas_per_read=parts,
                                                  align=formats.run_align(fmt), exact=exact)
    rope = traffic.run_rope_rows(*_row_fields(b), window_runs=w_runs,
                                 compressed_runs=c_runs) if fmt == "fp8" else 0
    tables = len(b.window[1]) + len(b.compressed[1])
    model = kernel.fused_traffic(rows=t, heads=h, gathered_rows=0, meta_words=0,
                                 table_words=tables, block=block, q_itemsize=4,
                                 row_bytes=formats.row_bytes(fmt),
                                 min_row_bytes=formats.stored_bytes(fmt), fp8=fmt == "fp8",
                                 read_rows=single, gather_dmas=gather_dmas, run_rows=runs,
                                 run_row_bytes=formats.run_row_bytes(fmt), run_rope_rows=rope)
    prefetch = 4 * (t * kernel.INFO_WORDS + tables)
    assert n.bytes(lane_padded=False) == model.bytes_moved - prefetch + 4 * h, n.table()
    gathers = n.select("hbm", "vmem", "dma")
    assert len(gathers) == gather_dmas and single == 0
    assert len(n.copies) == model.dmas, n.table()
    _, w_n, c_n = _row_fields(b)
    w_bound = -(-b.window_size // page) + 1
    ragged = 2 * (formats.run_align(fmt) - 1) * len(kv_lens) if exact else 0  # 1-row DMAs
    assert gather_dmas <= parts * sum(w_bound + c // page + 2 for c in c_n) + ragged
    assert gather_dmas < parts * (w_n.sum() + c_n.sum())  # fewer than one per token
    if fmt == "fp8" or exact:  # each wanted token once, no other row
        assert runs == w_n.sum() + c_n.sum()
    else:  # 256-word rows: the wanted rows widened to 8-row tiles (formats.run_align)
        assert w_n.sum() + c_n.sum() < runs <= (w_n + c_n + 14).sum()
    per_token = sum(c.nbytes for c in gathers) / runs
    assert per_token == (formats.run_row_bytes(fmt) + 512 * rope / runs if fmt == "fp8"
                         else formats.run_row_bytes(fmt))
    assert per_token <= (1.05 * 640 if fmt == "fp8" else 1024)


def test_a_run_over_a_released_window_page_skips_it_as_the_reference():
    """A window page released inside rows' windows (table -1 in one sequence, an id past the
    pool in another; the page NaN): the run reads nothing from it, its tokens drop out, as
    ``reference.v4_attention_ref`` (``reference.batch.lookup_page``)."""
    b = make_v4_batch([30, 9], q_lens=[1, 1, 2], kv_lens=[40, 45, 60], ratio=128, heads=2,
                      window_size=16, window_page_size=PAGE, comp_page_size=PAGE, release=False)
    cache, table, cu = (np.array(x) for x in b.window)
    starts = cu[:-1] // PAGE  # each sequence's first table slot
    for seq, page, bad in ((0, 3, -1), (1, 4, cache.shape[0] + 3), (2, 6, -1)):
        cache[table[starts[seq] + page]] = np.nan
        table[starts[seq] + page] = bad
    b.window = (cache, table, b.window[2])
    out, lse = _run(b, pack_cache)
    want, want_lse = v4_attention_ref(
        jnp.asarray(b.q), *b.args(cast=pack_cache)[1:], sm_scale=SCALE, return_lse=True,
        **b.kwargs(cast=pack_cache, sink=SINK))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **F32_TOL)


def _nan_outside_windows(b, page: int) -> None:
    """NaN in every window slot before a decode row's window (``b.window``'s cache, in place;
    the slots past ``kv_len`` are NaN already: ``v4_batches.paged``)."""
    cache, table, cu = b.window
    w_first, _, _ = _row_fields(b)
    for seq, first in enumerate(w_first):
        for tok in range(first):
            pid = table[cu[seq] // page + tok // page]
            if 0 <= pid < len(cache):
                cache[pid, tok % page] = np.nan


@pytest.mark.parametrize("fmt", ["packed", "plain"])
def test_exact_runs_match_the_reference(fmt):
    """``run_grain="exact"`` on packed and f32 rows: pages of 32, block 64 (segments of 32,
    8-row tiles inside), decode rows (``EXACT_KV``): a 1-token window (a run of 1 row), a
    window 31..62 (a lone head row in page 0, then one tile DMA and a 7-row tail in page 1),
    268..299 (4-row head, tiles, 4-row tail), HCA entries 0..1 and 0..4 (all in one page:
    tails only); one window page inside two rows' windows released (-1, an id past the pool;
    NaN), and NaN in every other slot no row reads, as ``reference.v4_attention_ref``."""
    b = make_v4_batch([30, 11 + len(fmt)], q_lens=[1] * 4, kv_lens=EXACT_KV, ratio=128, heads=2,
                      window_size=32, window_page_size=32, comp_page_size=32, release=False)
    cache, table, cu = (np.array(x) for x in b.window)
    for seq, page, bad in ((1, 0, -1), (2, 8, cache.shape[0] + 3)):
        cache[table[cu[seq] // 32 + page]] = np.nan
        table[cu[seq] // 32 + page] = bad
    b.window = (cache, table, cu)
    _nan_outside_windows(b, 32)
    cast = pack_cache if fmt == "packed" else None
    out, lse = _run(b, cast, block=64, run_grain="exact")
    want, want_lse = v4_attention_ref(
        jnp.asarray(b.q), *b.args(cast=cast)[1:], sm_scale=SCALE, return_lse=True,
        **b.kwargs(cast=cast, sink=SINK))
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(want)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **F32_TOL)


def test_run_grain_is_checked_and_bounded():
    """``run_grain`` not in ``formats.RUN_GRAINS``: ValueError naming it; the exact model's
    worst row at V4's shapes (window 128 anywhere, segments of 64, HCA's 64 entries from 0):
    128 + 64 tokens once in <= 3 + 1 tile DMAs and <= 14 one-row DMAs (tiles: 136 + 64 rows in
    4 DMAs)."""
    with pytest.raises(ValueError, match="run_grain"):
        formats.check_run_grain("rows")
    flags = dict(window=128, entries=64, seg=64, window_runs=True, compressed_runs=True,
                 align=8)
    assert traffic.run_bound(**flags) == (0, 136 + 64, 4)
    single, rows, dmas = traffic.run_bound(**flags, exact=True)
    assert (single, rows) == (0, 128 + 64) and dmas <= 3 + 1 + 14
    assert all(traffic.run_reads(f, 128, 64, **{k: v for k, v in flags.items()
                                              if k not in ("window", "entries")}, exact=True)
               [2] <= dmas for f in range(200))
