"""Pallas indexer score kernels (token and page top-k) in strict interpret mode (races detected,
uninitialised memory NaN, out-of-bounds reads raising) against the float64 oracle and the jnp
reference, on randomized ragged batches with NaN in every cache slot no row may read and
``page_indices`` without tail padding. Block sizes and the VMEM budget per chip are checked too.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from batches import PAGES_PER_SEQ, indexer_args, rounded_to_bf16, scenario
from jax.experimental.pallas import tpu as pltpu
from oracle import check_page_topk, check_token_topk, token_candidates

from pallas_kernels import aot, streamindex_page_topk, streamindex_scores, streamindex_topk
from pallas_kernels.indexer import blocks as iblocks
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.indexer import kernel as ikernel
from pallas_kernels.indexer import work_list
from pallas_kernels.indexer.blocks import default_blocks, vmem_budget, vmem_estimate
from reference import batch, streamindex_page_topk_ref, streamindex_topk_ref
from reference.batch import row_facts
from reference.synthetic import make_ragged_batch

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

STRICT = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                               out_of_bounds_reads="raise")
# H=8 heads (a sublane multiple, like the real 64), D=128 (one lane tile)
HEADS, DIM = 8, 128


def _batch(name, seed):
    return scenario(name, seed, num_heads=HEADS, dim=DIM)


_bf16 = rounded_to_bf16
_args = indexer_args


CASES = [("decode", jnp.float32), ("mtp", jnp.float32), ("prefill", jnp.float32),
         ("mixed_padding", jnp.float32), ("short_context", jnp.float32),
         ("decode", jnp.bfloat16), ("mixed_padding", jnp.bfloat16)]


@pytest.mark.parametrize("name,dtype", CASES)
def test_token_topk_selects_the_highest_scoring_causal_tokens(name, dtype):
    b = _batch(name, 1)
    otp = name == "decode"
    # block_pages=2: several key stages per item and cross-item prefetch; block_rows=4 splits
    # the MTP/prefill sequences into several row blocks.
    idx = streamindex_topk(*_args(b, dtype), k=24, pages_per_seq=PAGES_PER_SEQ,
                           one_token_per_seq=otp, block_rows=None if otp else 4, block_pages=2,
                           interpret=STRICT)
    check_token_topk(np.asarray(idx), _bf16(b) if dtype == jnp.bfloat16 else b, 24,
                     rtol=1e-4 if dtype == jnp.float32 else 2e-3)


@pytest.mark.parametrize("name,dtype", CASES)
def test_page_topk_selects_the_highest_scoring_pages(name, dtype):
    b = _batch(name, 2)
    otp = name == "decode"
    idx = streamindex_page_topk(*_args(b, dtype), k_pages=3, pages_per_seq=PAGES_PER_SEQ,
                                one_token_per_seq=otp, block_rows=None if otp else 8,
                                block_pages=4, interpret=STRICT)
    check_page_topk(np.asarray(idx), _bf16(b) if dtype == jnp.bfloat16 else b, 3,
                    rtol=1e-4 if dtype == jnp.float32 else 2e-3)


def test_kernel_scores_equal_the_definition_and_minus_inf_elsewhere():
    b = _batch("mixed_padding", 3)
    s = np.asarray(streamindex_scores(*b.args(), pages_per_seq=PAGES_PER_SEQ, block_rows=2,
                                      block_pages=2, interpret=STRICT))
    cands = token_candidates(*b.args(), PAGES_PER_SEQ)
    assert s.shape == (b.q.shape[0], PAGES_PER_SEQ * b.page_size)
    for r, cand in enumerate(cands):
        finite = {int(i) for i in np.flatnonzero(np.isfinite(s[r]))}
        assert not np.any(np.isnan(s[r])), f"row {r} has NaN scores"
        assert finite == set(cand or {}), f"row {r}: candidate set differs"
        for i, v in (cand or {}).items():
            np.testing.assert_allclose(s[r, i], v, rtol=1e-5, atol=1e-4)
        assert np.all(s[r][~np.isfinite(s[r])] == -np.inf)


def test_page_scores_are_the_max_over_each_pages_candidates():
    b = _batch("mtp", 4)
    s = np.asarray(streamindex_scores(*b.args(), pages_per_seq=PAGES_PER_SEQ, page_mode=True,
                                      block_pages=2, interpret=STRICT))
    cands = token_candidates(*b.args(), PAGES_PER_SEQ)
    for r, cand in enumerate(cands):
        want = np.full(PAGES_PER_SEQ, -np.inf)
        for i, v in (cand or {}).items():
            want[i // b.page_size] = max(want[i // b.page_size], v)
        np.testing.assert_allclose(s[r], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("op,ref,kw", [
    (streamindex_topk, streamindex_topk_ref, {"k": 20}),
    (streamindex_page_topk, streamindex_page_topk_ref, {"k_pages": 5})])
@pytest.mark.parametrize("fill", ["tail", "lowest"])
def test_equals_reference_exactly_with_segment_witnesses(op, ref, kw, fill):
    # S = 6: on this batch the two fills give different rows (token and page), so an entry
    # that dropped ``fill`` would fail.
    b = _batch("mixed_padding", 5)
    want = ref(*b.args(), pages_per_seq=PAGES_PER_SEQ, num_segments=6, fill=fill, exact=True,
               **kw)
    got = op(*b.args(), pages_per_seq=PAGES_PER_SEQ, num_segments=6, fill=fill, exact=True,
             block_rows=4, interpret=STRICT, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_row_chunks_inside_a_loop_give_the_same_result():
    # score_chunk_bytes of 5 rows: the 9 MTP rows run as 2 kernel calls in a fori_loop, the
    # last chunk clamped back over a row already done (rows 4..8). The same loop and clamp as
    # the 53 prefill rows' 11 calls, at a fifth of the interpreter's kernel calls.
    b = _batch("mtp", 6)
    cap = PAGES_PER_SEQ * b.page_size
    got = streamindex_topk(*b.args(), k=16, pages_per_seq=PAGES_PER_SEQ, exact=True,
                           score_chunk_bytes=5 * 4 * cap, block_rows=4, interpret=True)
    check_token_topk(np.asarray(got), b, 16)


def test_corrupt_page_ids_are_never_read_and_their_tokens_never_selected():
    b = _batch("mtp", 7)
    table = b.page_indices.copy()
    table[1] = b.cache.shape[0] + 5  # out of range: its tokens do not exist
    table[-1] = -3
    cu_kv = b.cu_kv_lens.copy()
    cu_kv[1] = (table.shape[0] - 1) * b.page_size  # sequence 1's later page slots: off the table
    bad = dataclasses.replace(b, page_indices=table, cu_kv_lens=cu_kv)
    idx = streamindex_topk(*bad.args(), k=24, pages_per_seq=PAGES_PER_SEQ, block_rows=2,
                           block_pages=2, interpret=STRICT)
    check_token_topk(np.asarray(idx), bad, 24)
    pages = streamindex_page_topk(*bad.args(), k_pages=3, pages_per_seq=PAGES_PER_SEQ,
                                  block_rows=2, block_pages=2, interpret=STRICT)
    check_page_topk(np.asarray(pages), bad, 3)


def test_inactive_sequences_rows_are_all_minus_one():
    b = _batch("mixed_padding", 8)
    dist = b.distribution.copy()
    dist[2] = 2  # only the first two (decode) sequences are active
    idx = np.asarray(streamindex_topk(*b.args()[:7], dist, k=8, pages_per_seq=PAGES_PER_SEQ,
                                      interpret=True))
    assert np.all(idx[2:] == -1)
    check_token_topk(idx, dataclasses.replace(b, distribution=dist), 8)


# ----------------------------------------------------------------------------- mixed batches

# The serving case through the general path: 6 decode rows, an MTP sequence of 3 rows and a
# 19-row prefill chunk (no padding rows: the prefill's 3-row remainder sits at the end of q, so
# its 4-row q block is shifted back one row). Default block_rows 16 -> ladder (1, 4, 16).
MIXED_Q, MIXED_KV = [1, 1, 1, 1, 1, 1, 3, 19], [9, 64, 30, 17, 41, 1, 12, 50]


def _mixed(seed):
    return make_ragged_batch(np.random.default_rng([seed, 77]), q_lens=MIXED_Q,
                             kv_lens=MIXED_KV, page_size=8, pages_per_seq=PAGES_PER_SEQ,
                             num_heads=HEADS, dim=DIM, pad_seqs=1)


def test_mixed_batch_decode_rows_take_one_row_items():
    b = _mixed(0)
    args = _args(b, jnp.float32)
    blocks = iblocks.resolve_blocks(None, block_rows=16, block_pages=2, chip=None,
                                one_token_per_seq=False, pages_per_seq=PAGES_PER_SEQ)
    cfgs = ikernel.make_configs(args[0], args[2], rows=28, num_seqs=len(MIXED_Q) + 1,
                            pages_per_seq=PAGES_PER_SEQ, blocks=blocks, page_mode=False,
                            one_token_per_seq=False)
    assert [c.block_rows for c in cfgs] == [1, 4, 16]
    kv, cu_q, dist = (jnp.asarray(x) for x in (b.seq_lens, b.cu_q_lens, b.distribution))
    rb = batch.RaggedBatch.of(args[2], *args[3:], pages_per_seq=PAGES_PER_SEQ)
    items, slot, pos, _ = work_list.work_list(rb, row0=jnp.int32(0), cfgs=cfgs,
                                              one_token_per_seq=False)
    starts = np.cumsum([0] + [c.num_items * c.block_rows for c in cfgs])
    level = np.searchsorted(starts, np.asarray(slot), side="right") - 1
    np.testing.assert_array_equal(level, [0] * 6 + [1] * 3 + [2] * 16 + [1] * 3)
    real = [np.asarray(i)[np.asarray(i)[:, 2] > 0] for i in items]  # n > 0
    assert [len(r) for r in real] == [6, 2, 1]
    # the prefill remainder (rows 25..27 of T=28): q block at row 24, its rows from slot 1
    np.testing.assert_array_equal(real[1][1, [1, 2, 7, 8]], [25, 3, 1, 24])
    facts = row_facts(28, kv, cu_q, dist)
    assert bool(jnp.all(facts.in_seq))
    np.testing.assert_array_equal(np.asarray(pos), np.asarray(facts.abs_pos))


@pytest.mark.parametrize("op,ref,kw,check", [
    (streamindex_topk, streamindex_topk_ref, {"k": 20}, check_token_topk),
    (streamindex_page_topk, streamindex_page_topk_ref, {"k_pages": 3}, check_page_topk)])
def test_mixed_batch_equals_reference_and_oracle(op, ref, kw, check):
    b = _mixed(1)
    want = ref(*b.args(), pages_per_seq=PAGES_PER_SEQ, exact=True, **kw)
    got = op(*b.args(), pages_per_seq=PAGES_PER_SEQ, exact=True, block_rows=16, block_pages=2,
             interpret=STRICT, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    check(np.asarray(got), b, next(iter(kw.values())))


# ----------------------------------------------------------------------------- arguments

@pytest.mark.parametrize("kw,match", [
    ({"block_rows": 3}, "block_rows"),
    ({"block_pages": 256}, "block_pages"),
    ({"block_pages": 6}, "block_pages"),
    ({"k": 0}, "k=0"),
    ({"chip": "v9"}, "chip"),
    ({"score_chunk_bytes": 0}, "score_chunk_bytes"),
    ({"vmem_limit_bytes": -1}, "vmem_limit_bytes"),
])
def test_bad_knobs_are_refused_by_name(kw, match):
    b = _batch("decode", 0)
    args = dict(k=4, pages_per_seq=PAGES_PER_SEQ, interpret=True) | kw
    with pytest.raises(ValueError, match=match):
        streamindex_topk(*b.args(), **args)


def test_bad_shapes_are_refused_by_name():
    b = _batch("mtp", 0)
    with pytest.raises(ValueError, match="weights"):
        streamindex_page_topk(b.q, b.weights[:, :3], *b.args()[2:], k_pages=2,
                              pages_per_seq=PAGES_PER_SEQ, interpret=True)
    with pytest.raises(ValueError, match="one_token_per_seq"):
        streamindex_topk(*b.args(), k=2, pages_per_seq=PAGES_PER_SEQ, one_token_per_seq=True,
                         interpret=True)
    with pytest.raises(ValueError, match="k_pages"):
        streamindex_page_topk(*b.args(), k_pages=-1, pages_per_seq=PAGES_PER_SEQ,
                              interpret=True)


# ----------------------------------------------------------------------------- blocks / VMEM

@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_default_blocks_fit_half_the_vmem_at_every_gate_shape(chip):
    budget = vmem_budget(chip)
    for name, (_q_lens, kv_lens, otp) in icases.GATE_SHAPES.items():
        pps = -(-max(kv_lens) // icases.GATE_PAGE)
        blocks = default_blocks(chip, one_token_per_seq=otp)
        assert (blocks.block_pages * icases.GATE_PAGE) % 128 == 0, (chip, name)
        for page_mode in (False, True):
            est = vmem_estimate(block_rows=blocks.block_rows, block_pages=blocks.block_pages,
                                num_heads=icases.GATE_HEADS, dim=icases.GATE_DIM,
                                page_size=icases.GATE_PAGE, pages_per_seq=pps, key_itemsize=4,
                                q_itemsize=2, page_mode=page_mode)
            assert est < budget, f"{chip} {name} page_mode={page_mode}: {est} >= {budget}"
