"""The compressed-key indexer (DeepSeek-V4, issue 21 item 2): ``compression_ratio = r`` on the
reference and Pallas token / page top-k and on ``dsa_jax``, against the float64 oracle of the
definition (``tests/oracle.py``: ``L // r`` entries per sequence of ``L`` tokens, entry ``j``
visible to the row at token position ``p`` iff ``j < (p + 1) // r``).

Batches hold entries on the cache side (cache, page table, ``cu_kv_lens``, ``page_size``) and
tokens in ``seq_lens``; every cache slot past a sequence's complete entries (the incomplete
group's slot among them) and every unowned page is NaN, so a row that read an entry that does
not exist would show. Pallas runs in the strict interpreter (races, NaN-filled uninitialised
memory, out-of-bounds reads raise). The revert check is
``test_rows_inside_an_incomplete_group_do_not_see_its_entry``: it shows that the ``j <= p // r``
rule (tpu-inference's) fails the oracle's contract on this suite's prefill rows.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from batches import scenario
from jax.experimental.pallas import tpu as pltpu
from oracle import (
    check_token_topk,
    check_topk_rows,
    page_candidates,
    row_sequences,
    token_candidates,
    token_keys,
)

import dsa_jax
from pallas_kernels import streamindex_page_topk, streamindex_scores, streamindex_topk
from reference import fp8_cache, streamindex_page_topk_ref, streamindex_topk_ref
from reference.synthetic import make_ragged_batch
from reference.witnesses import scatter_topology_witnesses

STRICT = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                               out_of_bounds_reads="raise")
HEADS, DIM = 8, 128

# name -> (ratio, q_lens, kv_lens in tokens, pad_rows, pad_seqs, page_size (entries),
# pages_per_seq, one_token_per_seq)
SCENARIOS = {
    # decode rows at and beside group boundaries: kv_len 3 has no entry yet, 4 one, 7 one, 8 two
    "decode_r4": (4, [1] * 8, [3, 4, 5, 7, 8, 9, 255, 256], 0, 0, 8, 8, True),
    # prefill chunks whose rows sit inside groups that complete within the chunk (the rows the
    # j <= p // r rule gets wrong), an MTP sequence, padding rows and sequences
    "prefill_r4": (4, [6, 11, 3], [22, 37, 130], 2, 1, 8, 8, False),
    "mixed_r4": (4, [1, 1, 9, 2], [4, 14, 41, 64], 3, 2, 8, 8, False),
    # ratio 128 (HCA's grouping): rows on both sides of p = 1023 (entry 7 completes there)
    "mixed_r128": (128, [1, 1, 5, 10], [127, 128, 300, 1030], 0, 0, 8, 2, False),
}


def compressed_batch(name: str, seed: int = 0, *, page_size: int | None = None):
    """``(batch, ratio, one_token_per_seq)``: a ``SyntheticBatch`` whose cache side holds
    ``kv_len // ratio`` entries per sequence and whose ``seq_lens`` are the tokens."""
    ratio, q_lens, kv_lens, pad_rows, pad_seqs, ps, pps, otp = SCENARIOS[name]
    ps = page_size or ps
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    entries = make_ragged_batch(rng, q_lens=[0] * len(q_lens),
                                kv_lens=[kv // ratio for kv in kv_lens], page_size=ps,
                                pages_per_seq=pps, num_heads=HEADS, dim=DIM, pad_seqs=pad_seqs)
    num_rows = sum(q_lens) + pad_rows
    cu_q = np.concatenate([[0], np.cumsum(q_lens + [0] * pad_seqs)]).astype(np.int32)
    pad_kv = list(rng.integers(1, pps * ps * ratio, pad_seqs))
    decode_end = next((i for i, ql in enumerate(q_lens) if ql != 1), len(q_lens))
    b = dataclasses.replace(
        entries, q=rng.standard_normal((num_rows, HEADS, DIM)).astype(np.float32),
        weights=rng.standard_normal((num_rows, HEADS)).astype(np.float32),
        seq_lens=np.array(kv_lens + pad_kv, np.int32), cu_q_lens=cu_q,
        distribution=np.array([decode_end, len(q_lens), len(q_lens)], np.int32))
    return b, ratio, otp


def _buggy_candidates(b, ratio):
    """The candidate sets under tpu-inference's rule ``j <= p // r`` (what the revert check must
    tell apart from the oracle), scored as the oracle scores: ``{entry: f64 score}`` per row."""
    q, w = (np.asarray(x, np.float64) for x in (b.q, b.weights))
    entry_lens = np.maximum(b.seq_lens, 0) // ratio
    out = []
    for r, rs in enumerate(row_sequences(q.shape[0], b.cu_q_lens, b.seq_lens, b.distribution)):
        if rs is None:
            out.append(None)
            continue
        seq, p = rs
        keys = token_keys(seq, b.cache, entry_lens, b.page_indices, b.cu_kv_lens,
                          b.pages_per_seq)
        out.append({j: float(np.sum(w[r] * np.maximum(q[r] @ key, 0.0)))
                    for j, key in keys.items() if j <= p // ratio})
    return out


def _positions(b):
    """Each row's absolute token position (rows of active sequences only)."""
    rows = row_sequences(b.q.shape[0], b.cu_q_lens, b.seq_lens, b.distribution)
    return {r: rs[1] for r, rs in enumerate(rows) if rs is not None}


def _ref(b, ratio, otp, **kw):
    return np.asarray(streamindex_topk_ref(*b.args(), pages_per_seq=b.pages_per_seq,
                                           one_token_per_seq=otp, compression_ratio=ratio,
                                           **kw))


def _pallas(b, ratio, otp, **kw):
    kw.setdefault("block_rows", None if otp else 4)
    return np.asarray(streamindex_topk(*b.args(), pages_per_seq=b.pages_per_seq,
                                       one_token_per_seq=otp, compression_ratio=ratio,
                                       block_pages=2, interpret=STRICT, **kw))


@pytest.mark.kernel_gate
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_selects_the_highest_scoring_visible_entries(name):
    b, ratio, otp = compressed_batch(name, 1)
    for k in (6, 80):  # some rows have n > k; with 80 every row selects all its n entries
        check_token_topk(_ref(b, ratio, otp, k=k, exact=True), b, k, compression_ratio=ratio)
    check_token_topk(_ref(b, ratio, otp, k=6), b, 6, compression_ratio=ratio)  # approx (CPU)


@pytest.mark.kernel_gate
@pytest.mark.parametrize("name", ["decode_r4", "prefill_r4", "mixed_r128"])
def test_pallas_equals_the_oracle_and_the_reference(name):
    b, ratio, otp = compressed_batch(name, 2)
    got = _pallas(b, ratio, otp, k=6, exact=True)
    check_token_topk(got, b, 6, compression_ratio=ratio)
    np.testing.assert_array_equal(got, _ref(b, ratio, otp, k=6, exact=True))


@pytest.mark.kernel_gate
def test_pallas_scores_are_the_definition_on_entries_and_minus_inf_elsewhere():
    b, ratio, _ = compressed_batch("mixed_r4", 3)
    s = np.asarray(streamindex_scores(*b.args(), pages_per_seq=b.pages_per_seq, block_rows=4,
                                      block_pages=2, interpret=STRICT, compression_ratio=ratio))
    cands = token_candidates(*b.args(), b.pages_per_seq, ratio)
    assert s.shape == (b.q.shape[0], b.pages_per_seq * b.page_size)
    for r, cand in enumerate(cands):
        assert not np.any(np.isnan(s[r])), f"row {r} has NaN scores"
        assert {int(i) for i in np.flatnonzero(np.isfinite(s[r]))} == set(cand or {}), r
        for i, v in (cand or {}).items():
            np.testing.assert_allclose(s[r, i], v, rtol=1e-5, atol=1e-4)


@pytest.mark.kernel_gate
def test_rows_inside_an_incomplete_group_do_not_see_its_entry():
    # Revert check of the visibility rule. Under ``j <= p // r`` a prefill row at p with
    # (p + 1) % r != 0 also sees entry p // r, which exists when its group completes later in
    # the same chunk. k = 80 > every row's n: each implementation selects exactly the visible
    # set, so the oracle's contract (``check_topk_rows``) fails for the buggy sets and passes
    # for ours; and entry p // r is in no such row.
    b, ratio, otp = compressed_batch("prefill_r4", 4)
    good = token_candidates(*b.args(), b.pages_per_seq, ratio)
    bad = _buggy_candidates(b, ratio)
    pos = _positions(b)
    differ = [r for r in range(len(good)) if good[r] is not None and good[r] != bad[r]]
    assert len(differ) >= 6, "the batch must hold rows the two rules tell apart"
    assert all((pos[r] + 1) % ratio != 0 for r in differ)
    for idx in (_ref(b, ratio, otp, k=80, exact=True), _pallas(b, ratio, otp, k=80, exact=True)):
        check_topk_rows(idx, good, 80)
        with pytest.raises(AssertionError, match="expected min"):
            check_topk_rows(idx, bad, 80)
        for r in differ:
            assert pos[r] // ratio not in set(idx[r].tolist()), (r, pos[r], idx[r])


@pytest.mark.kernel_gate
@pytest.mark.parametrize("fill", ["tail", "lowest"])
def test_witnesses_use_the_visible_entry_count(fill):
    # The witness context of a row is its visible entry count (the oracle's n), not its tokens.
    b, ratio, otp = compressed_batch("mixed_r4", 5)
    plain = _ref(b, ratio, otp, k=6, exact=True)
    cands = token_candidates(*b.args(), b.pages_per_seq, ratio)
    context = np.array([0 if c is None else len(c) for c in cands], np.int32)
    merge = lambda ctx: np.asarray(scatter_topology_witnesses(  # noqa: E731
        jnp.asarray(plain), jnp.asarray(ctx, jnp.int32), 4, fill=fill))
    want = merge(context)
    got = _ref(b, ratio, otp, k=6, exact=True, num_segments=4, fill=fill)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, plain)  # the witnesses changed something
    pos = _positions(b)
    tokens = [pos[r] + 1 if r in pos else 0 for r in range(len(cands))]
    assert not np.array_equal(merge(tokens), want)  # a token context would show
    np.testing.assert_array_equal(
        _pallas(b, ratio, otp, k=6, exact=True, num_segments=4, fill=fill), want)


@pytest.mark.kernel_gate
def test_page_topk_max_pools_the_visible_entries():
    b, ratio, otp = compressed_batch("prefill_r4", 6)
    cands = page_candidates(token_candidates(*b.args(), b.pages_per_seq, ratio), b.page_size)
    ref = np.asarray(streamindex_page_topk_ref(*b.args(), k_pages=3, pages_per_seq=b.pages_per_seq,
                                               exact=True, compression_ratio=ratio))
    check_topk_rows(ref, cands, 3, what="page row")
    got = np.asarray(streamindex_page_topk(*b.args(), k_pages=3, pages_per_seq=b.pages_per_seq,
                                           exact=True, compression_ratio=ratio, block_rows=4,
                                           block_pages=2, interpret=STRICT))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.kernel_gate
def test_fp8_index_keys_with_compressed_entries():
    b, ratio, otp = compressed_batch("mixed_r4", 7, page_size=32)
    cache = fp8_cache.quantize_index_cache(b.cache)
    deq = dataclasses.replace(b, cache=np.asarray(fp8_cache.dequantize_index_cache(cache)))
    args = (b.q, b.weights, cache, *b.meta())
    ref = np.asarray(streamindex_topk_ref(*args, k=6, pages_per_seq=b.pages_per_seq,
                                          exact=True, compression_ratio=ratio))
    check_token_topk(ref, deq, 6, compression_ratio=ratio, rtol=1e-4)
    got = np.asarray(streamindex_topk(*args, k=6, pages_per_seq=b.pages_per_seq, exact=True,
                                      compression_ratio=ratio, block_rows=4, interpret=STRICT))
    np.testing.assert_array_equal(got, ref)


@pytest.mark.kernel_gate
def test_ratio_one_is_the_token_indexer():
    # r = 1 keeps the V3.2 path: the entry rule j < (p + 1) // 1 is s <= p, kv_len // 1 = kv_len.
    b = scenario("mixed_padding", 8, num_heads=HEADS, dim=DIM)
    for fn, kw in ((streamindex_topk_ref, {}),
                   (streamindex_topk, dict(block_rows=4, interpret=STRICT))):
        default = np.asarray(fn(*b.args(), k=6, pages_per_seq=b.pages_per_seq, exact=True, **kw))
        one = np.asarray(fn(*b.args(), k=6, pages_per_seq=b.pages_per_seq, exact=True,
                            compression_ratio=1, **kw))
        np.testing.assert_array_equal(one, default)
        check_token_topk(default, b, 6)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_dsa_jax_indexer_topk_takes_the_ratio_and_validates_in_entries(backend):
    b, ratio, otp = compressed_batch("prefill_r4", 9)
    opts = {"interpret": True, "block_rows": 4} if backend == "pallas" else None
    got = dsa_jax.indexer_topk(*b.args(), k=6, pages_per_seq=b.pages_per_seq, exact=True,
                               compression_ratio=ratio, backend=backend, validate=True,
                               kernel_options=opts)
    check_token_topk(np.asarray(got), b, 6, compression_ratio=ratio)
    # 65 entries past a capacity of 64: the message counts tokens and entries
    over = dataclasses.replace(b, seq_lens=b.seq_lens.copy())
    over.seq_lens[0] = 65 * ratio
    with pytest.raises(ValueError, match=r"kv_len=260 tokens = 65 entries .* = 64 entries"):
        dsa_jax.indexer_topk(*over.args(), k=6, pages_per_seq=b.pages_per_seq,
                             compression_ratio=ratio, backend="reference", validate=True)


@pytest.mark.parametrize("bad,err,match", [
    (0, ValueError, "compression_ratio must be positive, got compression_ratio=0"),
    (-4, ValueError, "compression_ratio=-4"),
    (2.0, TypeError, "compression_ratio must be a static Python int"),
    (True, TypeError, "compression_ratio must be a static Python int"),
    (2**26, ValueError, r"compression_ratio=67108864 .* 64 entries is 4294967296 tokens"),
])
@pytest.mark.parametrize("fn", [streamindex_topk_ref, streamindex_topk,
                                streamindex_page_topk_ref, streamindex_page_topk])
def test_bad_ratios_are_refused_by_name(fn, bad, err, match):
    b, _, _ = compressed_batch("decode_r4")
    kw = {"k_pages": 2} if "page" in fn.__name__ else {"k": 2}
    with pytest.raises(err, match=match):
        fn(*b.args(), pages_per_seq=b.pages_per_seq, compression_ratio=bad, **kw)
