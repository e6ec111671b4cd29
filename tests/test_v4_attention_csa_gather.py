"""The fp8 / CSA gather of listed (CSA top-k) entries in the fused V4 attention kernel (issue 30,
item 2): lists in entry order (``walk.walk_order``), a rope row shared by consecutive selected
entries fetched once, adjacent slots of a page one records DMA (``walk._listed``,
``formats.issue_listed``), counted exactly by ``traffic.listed_reads``.

One strict-interpreter run (eager DMAs, counted) of a batch whose decode row selects rope rows
shared by 1, 2, 3 and 4 entries, runs of length 1, 2 and 4, an adjacent run crossing a page
boundary, a run cut by the block's end, a duplicate, -1 and out-of-range entries, in score
(shuffled) order; every compressed slot no row selects is NaN (its rope quarter too: the
selected entries' rope rows hold NaN quarters). Checked against the float64 oracle on the values
the fp8 cache holds and the jnp reference, and its DMA starts and bytes against the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from oracle import v4_oracle
from v4_batches import fp8_view, make_v4_batch, to_fp8

from pallas_kernels import tpu
from pallas_kernels.v4_attention import formats, kernel, traffic, walk
from reference.v4_attention import v4_attention_ref

pytestmark = pytest.mark.kernel_gate

SCALE = 512 ** -0.5
F32_TOL = dict(rtol=2e-5, atol=2e-5)
SINK = np.array([0.5, -np.inf], np.float32)
BLOCK, PAGE, WINDOW = 8, 8, 12  # window pages of 4: the list starts at row 4 of a block
# rope rows (4 entries) shared by 1 (0; 9, cut from 10 11 by the block's end), 2 (5 6; 24 24, a
# duplicate), 3 (20 21 23) and 4 (12 .. 15); record runs 0 | 5 6 | 9 (cut) | 10 .. 15 | 16 17
# (adjacent to 15 across the page boundary at 16) | 20 21 | 23 | 24 | 24; blocks: rows 4 .. 7
# = 0 5 6 9, then 10 .. 17, then 20 21 23 24 24
SELECTED = [0, 5, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 23, 24, 24]
INVALID = [-1, -1, -7, 25, 2 ** 31 - 1]  # none, negative, past the 25 entries, huge


def _batch(seed):
    b = make_v4_batch([31, seed], q_lens=[1, 1], kv_lens=[100, 70], heads=2, ratio=4,
                      window_size=WINDOW, window_page_size=4, comp_page_size=PAGE,
                      k=len(SELECTED) + len(INVALID))
    rng = np.random.default_rng([31, seed])
    lists = [SELECTED + INVALID,  # row 1: 17 visible entries, a random top-12 and -1s
             list(rng.choice(17, 12, replace=False)) + [-1] * 10]
    sel = np.array([rng.permutation(x) for x in lists], np.int32)  # score order
    comp, table, cu = (np.array(x) for x in b.compressed)
    for seq, chosen in enumerate(lists):  # NaN in every entry no row selects
        for e in range(cu[seq + 1] - cu[seq]):
            if e not in chosen:
                comp[table[cu[seq] // PAGE + e // PAGE], e % PAGE] = np.nan
    b.compressed, b.compressed_indices = (comp, table, b.compressed[2]), sel
    return b


def test_walk_order_sorts_each_list_negatives_last():
    x = jnp.array([[5, -1, 3, 2 ** 31 - 1, -7, 0]], jnp.int32)
    assert walk.walk_order(x).tolist() == [[0, 3, 5, 2 ** 31 - 1, -7, -1]]


def test_listed_reads_counts_runs_and_shared_rope_rows():
    # one block of 32, pages of 8: records 0 | 5 6 | 9 .. 15 | 16 17 | 20 21 | 23 | 24 | 24,
    # rope rows 0 | 5 6 | 9 10 11 | 12 .. 15 | 16 17 | 20 21 23 | 24 24
    assert traffic.listed_reads([SELECTED + INVALID], [25], page=8, block=32) == (17, 8, 7)
    # blocks of 8 from row 4 (the kernel test's): 9 | 10 cut, its run and its rope group
    assert traffic.listed_reads([SELECTED + INVALID], [25], page=8, block=8,
                                start_rows=WINDOW) == (17, 9, 8)
    # the block's end (row 4 + 4 entries) cuts the 10 .. 15 run and resets the rope group
    assert traffic.listed_reads([[10, 11, 12, 13, 14, 15]], 25, page=8, block=8,
                                start_rows=4) == (6, 2, 3)
    # worst case: no two entries adjacent or in one rope row: 2 DMAs per entry
    assert traffic.listed_reads([[0, 4, 9, 30, -1]], [40], page=8, block=8) == (4, 4, 4)
    # a rope group holds at most 4 rows (duplicates): 5 copies of entry 3 fetch 2 rope rows
    assert traffic.listed_reads([[3] * 5], [8], page=8, block=8) == (5, 5, 2)


def test_listed_gather_matches_the_oracle_and_the_count_matches_the_model():
    b = _batch(1)
    params = pltpu.InterpretParams(**tpu.STRICT_INTERPRET, dma_execution_mode="eager")
    from pallas_kernels import _interpret_counter as counter

    with counter.count_hbm_traffic() as n:
        out, lse = jax.block_until_ready(kernel.v4_attention_fused(
            jnp.asarray(b.q), *b.args(cast=to_fp8)[1:], sm_scale=SCALE, return_lse=True,
            block=BLOCK, interpret=params, **b.kwargs(cast=to_fp8, sink=SINK)))
    assert n.dmas_unexecuted == 0
    view = fp8_view(b)
    want, want_lse = v4_oracle(view.q, view.kv_lens, view.cu_q_lens, view.distribution,
                               sm_scale=SCALE, attn_sink=SINK, **view.oracle_kwargs())
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, **F32_TOL)
    ref, ref_lse = v4_attention_ref(jnp.asarray(b.q), *b.args(cast=to_fp8)[1:],
                                    sm_scale=SCALE, return_lse=True,
                                    **b.kwargs(cast=to_fp8, sink=SINK))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **F32_TOL)
    # the count: window tokens one by one (2 DMAs, 1024 B each), the lists by the model
    w_n = np.minimum(np.asarray(b.kv_lens), WINDOW)
    reads, records, ropes = traffic.listed_reads(
        np.asarray(walk.walk_order(b.compressed_indices)), np.asarray(b.kv_lens) // 4,
        page=PAGE, block=BLOCK, start_rows=w_n)
    assert reads == len(SELECTED) + 12
    gathers = n.select("hbm", "vmem", "dma")
    assert len(gathers) == 2 * w_n.sum() + records + ropes, n.table()
    row = formats.run_row_bytes("fp8")
    assert sum(c.nbytes for c in gathers) == (formats.row_bytes("fp8") * w_n.sum()
                                              + row * (reads + ropes))
    assert records + ropes < 2 * reads  # fewer descriptors than one pair per entry
