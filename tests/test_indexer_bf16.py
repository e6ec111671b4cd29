"""``precision="bf16"`` of the lightning indexer (issue 27, deliverable 2): DeepSeek-V4's official
scoring (docs/V4_OFFICIAL_REGIME.md steps 20-25) on the reference and Pallas token / page top-k
and on ``dsa_jax``'s ``indexer_topk`` / ``page_topk``.

The oracle is here, in float64 with ml_dtypes' bf16 rounding (nothing of the package's rounding):
q, keys and weights rounded to bf16, ``dot = bf16(q_h . k_j)``, ``prod = bf16(relu(dot) * w_h)``,
``score = bf16(sum_h prod)``. It rounds the exact f64 values; the implementations round f32 sums,
so the oracle batches have q and keys on a grid of quarters in ``[-2, 2]`` (every dot exact in
f32) and the oracle asserts that each head sum it rounds is exact in f32 too: on those batches
the only roundings are the defined ones, and the scores must agree exactly. Rows are checked by
score (the selected scores are the oracle's top-k multiset, descending): ties are compared by
score, not index, except in the test built on ties. Batches leave NaN in every unowned cache
slot and page (``tests/batches.py``, ``test_compressed_indexer.compressed_batch``); Pallas runs
in the strict interpreter (``test_compressed_indexer.STRICT``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from batches import scenario
from oracle import page_candidates, row_sequences, token_keys
from test_compressed_indexer import STRICT, compressed_batch

import dsa_jax
from pallas_kernels import streamindex_page_topk, streamindex_scores, streamindex_topk
from reference import fp8_cache, streamindex_page_topk_ref, streamindex_topk_ref

BF16 = {"precision": "bf16"}


# ----------------------------------------------------------------------------- the oracle


def _bf16(x) -> np.ndarray:
    """Each value rounded to the nearest bf16 (ties to even, ml_dtypes), as float64."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def oracle_score(q_row, w_row, key) -> float:
    """The official bf16 score of one row (``q_row f[H, D]``, ``w_row f[H]``) and one key
    ``f[D]``, from exact float64 sums; asserts the test's premise (each sum it rounds is exact in
    f32, so an f32 accumulation in any order rounds to the same value)."""
    q, w, k = _bf16(q_row), _bf16(w_row), _bf16(key)
    dots = q @ k
    prods = _bf16(np.maximum(_bf16(dots), 0.0) * w)
    total = prods.sum()
    exact = np.concatenate([dots, [total]])
    assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact), \
        "oracle batch: a dot or head sum is not exact in f32 (use the quarter grid)"
    return float(_bf16(total))


def oracle_candidates(b, ratio: int = 1) -> list:
    """Per row: ``{entry: bf16 score}`` of its visible, existing keys (entry ``j`` visible iff
    ``j < (p + 1) // ratio``), or None outside every sequence."""
    rows = row_sequences(b.q.shape[0], b.cu_q_lens, b.seq_lens, b.distribution)
    entry_lens = np.maximum(np.asarray(b.seq_lens), 0) // ratio
    keys_of, out = {}, []
    for r, rs in enumerate(rows):
        if rs is None:
            out.append(None)
            continue
        seq, pos = rs
        if seq not in keys_of:
            keys_of[seq] = token_keys(seq, b.cache, entry_lens, b.page_indices, b.cu_kv_lens,
                                      b.pages_per_seq)
        out.append({j: oracle_score(b.q[r], b.weights[r], key)
                    for j, key in keys_of[seq].items() if j < (pos + 1) // ratio})
    return out


def check_by_score(idx, cands, k: int) -> None:
    """Each row selects ``min(n, k)`` distinct candidates, ``-1`` only in the tail, in
    descending score order, and their scores are exactly the oracle's top-k scores (so every
    unselected candidate scores at most the selected minimum); rows outside sequences all -1."""
    idx = np.asarray(idx)
    assert idx.shape == (len(cands), k)
    for r, cand in enumerate(cands):
        row = idx[r]
        if cand is None:
            assert np.all(row == -1), (r, row)
            continue
        n = min(len(cand), k)
        assert np.all(row[:n] >= 0) and np.all(row[n:] == -1), (r, row, len(cand))
        sel = [int(j) for j in row[:n]]
        assert len(set(sel)) == n and set(sel) <= set(cand), (r, sel)
        got = [cand[j] for j in sel]
        want = sorted(cand.values(), reverse=True)[:n]
        assert got == want, f"row {r}: selected scores {got} != the oracle's top-{k} {want}"


# ----------------------------------------------------------------------------- batches


def _quarters(x, rng) -> np.ndarray:
    """``x``'s finite values replaced by random quarters in ``[-2, 2]`` (NaN kept)."""
    x = np.asarray(x, np.float32)
    grid = (rng.integers(-8, 9, x.shape) / 4).astype(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), grid)


def on_grid(b, seed: int):
    """The batch with q and keys on the quarter grid and f32 weights ``+-2**u``, ``u`` uniform
    in ``[-2, 1)`` (off the bf16 grid: rounded by the mode; at least 1/4 so that no tiny
    product makes a head sum inexact in f32)."""
    rng = np.random.default_rng(seed)
    w = rng.choice([-1.0, 1.0], b.weights.shape) * 2.0 ** rng.uniform(-2, 1, b.weights.shape)
    return dataclasses.replace(b, q=_quarters(b.q, rng), cache=_quarters(b.cache, rng),
                               weights=w.astype(np.float32))


def _ratio_one(seed):
    """DeepSeek-V3.2's token keys: decode rows, an MTP row block, a 17-row prefill, padding
    rows and sequences."""
    return scenario("mixed_padding", seed, num_heads=8, dim=128), 1, False


BATCHES = {"mixed_r1": _ratio_one,
           "mixed_r4": lambda s: compressed_batch("mixed_r4", s),
           "prefill_r4": lambda s: compressed_batch("prefill_r4", s)}


def _ref(entry, b, ratio, otp, **kw):
    return np.asarray(entry(*b.args(), pages_per_seq=b.pages_per_seq, one_token_per_seq=otp,
                            compression_ratio=ratio, **kw))


def _pallas(entry, b, ratio, otp, **kw):
    return np.asarray(entry(*b.args(), pages_per_seq=b.pages_per_seq, one_token_per_seq=otp,
                            compression_ratio=ratio, block_rows=None if otp else 4,
                            block_pages=2, interpret=STRICT, **kw))


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_reference_token_topk_selects_the_oracles_bf16_top_k(name):
    b, ratio, otp = BATCHES[name](20)
    b = on_grid(b, 20)
    cands = oracle_candidates(b, ratio)
    for k in (5, 80):  # some rows have n > 5 candidates; 80 > every row's n
        check_by_score(_ref(streamindex_topk_ref, b, ratio, otp, k=k, exact=True, **BF16),
                       cands, k)
    check_by_score(_ref(streamindex_topk_ref, b, ratio, otp, k=5, **BF16), cands, 5)  # approx


@pytest.mark.parametrize("name", ["mixed_r1", "prefill_r4"])
def test_reference_page_topk_max_pools_the_bf16_scores(name):
    b, ratio, otp = BATCHES[name](21)
    b = on_grid(b, 21)
    pages = page_candidates(oracle_candidates(b, ratio), b.page_size)
    check_by_score(_ref(streamindex_page_topk_ref, b, ratio, otp, k_pages=3, exact=True, **BF16),
                   pages, 3)


def test_f32_inputs_are_rounded_to_bf16_first():
    # the mode means bf16 operands: f32 q and keys off the bf16 grid select what their bf16
    # roundings select (the weights are rounded in both calls)
    b, ratio, otp = BATCHES["mixed_r4"](22)
    rounded = dataclasses.replace(b, q=jnp.asarray(b.q, jnp.bfloat16),
                                  cache=jnp.asarray(b.cache, jnp.bfloat16))
    for entry, kw in ((streamindex_topk_ref, {"k": 5}), (streamindex_page_topk_ref,
                                                         {"k_pages": 2})):
        np.testing.assert_array_equal(_ref(entry, b, ratio, otp, exact=True, **kw, **BF16),
                                      _ref(entry, rounded, ratio, otp, exact=True, **kw, **BF16))


# ----------------------------------------------------------------------------- Pallas


@pytest.mark.kernel_gate
def test_pallas_bf16_scores_are_the_oracles_exactly():
    b, ratio, _ = BATCHES["mixed_r4"](23)
    b = on_grid(b, 23)
    s = np.asarray(streamindex_scores(*b.args(), pages_per_seq=b.pages_per_seq, block_rows=4,
                                      block_pages=2, interpret=STRICT, compression_ratio=ratio,
                                      **BF16))
    for r, cand in enumerate(oracle_candidates(b, ratio)):
        keep = sorted(cand or {})
        assert np.all(np.isneginf(np.delete(s[r], keep))), r
        np.testing.assert_array_equal(s[r, keep], [cand[j] for j in keep], err_msg=f"row {r}")


@pytest.mark.kernel_gate
@pytest.mark.parametrize("name,ref,entry,kw", [
    ("mixed_r1", streamindex_topk_ref, streamindex_topk, {"k": 5}),
    ("decode_r4", streamindex_page_topk_ref, streamindex_page_topk, {"k_pages": 3})])
def test_pallas_bf16_topk_equals_the_reference(name, ref, entry, kw):
    # plain normal data (not the oracle's grid): the kernel and the reference round the same
    # f32 dots and sums, so the index lists agree exactly (token top-k on prefill, decode and
    # padding rows of the token keys; page top-k on ratio-4 decode rows). The kernel gets f32
    # q and keys (it rounds them: the glue q, the key tiles in VMEM), the reference bf16 ones.
    b, ratio, otp = (compressed_batch(name, 24) if name.endswith("r4")
                     else BATCHES[name](24))
    rounded = dataclasses.replace(b, q=jnp.asarray(b.q, jnp.bfloat16),
                                  cache=jnp.asarray(b.cache, jnp.bfloat16))
    np.testing.assert_array_equal(_pallas(entry, b, ratio, otp, exact=True, **kw, **BF16),
                                  _ref(ref, rounded, ratio, otp, exact=True, **kw, **BF16))


# ----------------------------------------------------------------------------- the mode matters


def _near_ties(seed: int = 25):
    """``scenario("decode")`` (5 decode rows, up to 64 keys) with every head of q ``e0 + e1``,
    weights 1 and key ``j`` = ``e0 + d_j e1``, ``d_j = (j % 16) * 2**-12`` (bf16-exact): the
    f32 dots ``1 + d_j`` differ, their bf16 roundings are all 1 (``d_j <= 2**-8``, the tie
    rounding to even), so in bf16 every key of a row ties."""
    b = scenario("decode", seed, num_heads=4, dim=128)
    q = np.zeros_like(b.q)
    q[:, :, :2] = 1.0
    cache = np.where(np.isnan(b.cache), np.float32(np.nan), np.float32(0.0))
    for seq, pages in enumerate(b.seq_pages):
        for j in range(int(b.seq_lens[seq])):
            key = cache[pages[j // b.page_size], j % b.page_size]
            key[0], key[1] = 1.0, (j % 16) * 2.0**-12
    return dataclasses.replace(b, q=q, cache=cache, weights=np.ones_like(b.weights))


def _near_ties_topk(b, backend, **kw):
    opts = {"interpret": STRICT} if backend == "pallas" else None
    return np.asarray(dsa_jax.indexer_topk(*b.args(), k=4, pages_per_seq=b.pages_per_seq,
                                           one_token_per_seq=True, exact=True, backend=backend,
                                           kernel_options=opts, **kw))


def _lowest_entries(b, k: int = 4) -> np.ndarray:
    """Each row's ``k`` lowest entries, ``-1`` past its length: the bf16 tie rule's answer."""
    return np.array([[j if j < int(n) else -1 for j in range(k)] for n in b.seq_lens])


def test_bf16_and_f32_select_differently_on_near_ties():
    b = _near_ties()
    f32 = _near_ties_topk(b, "reference", validate=True)
    bf16 = _near_ties_topk(b, "reference", validate=True, **BF16)
    for r, n in enumerate(b.seq_lens):
        assert set(oracle_candidates(b)[r].values()) == {4.0}  # all tie at 4 heads x 1
        # f32: the largest d_j (j % 16 == 15) first, ties to the lower entry
        top = sorted(range(int(n)), key=lambda j: (-(j % 16), j))[:4]
        np.testing.assert_array_equal(f32[r], top + [-1] * (4 - len(top)))
    np.testing.assert_array_equal(bf16, _lowest_entries(b))  # bf16: the lowest entries
    assert not np.array_equal(f32, bf16)
    pages = np.asarray(dsa_jax.page_topk(*b.args(), k_pages=2, pages_per_seq=b.pages_per_seq,
                                         one_token_per_seq=True, exact=True, **BF16))
    n_pages = -(-b.seq_lens // b.page_size)
    np.testing.assert_array_equal(pages, [[p if p < n else -1 for p in range(2)]
                                          for n in n_pages])  # every page ties too


@pytest.mark.kernel_gate
def test_dsa_jax_passes_precision_to_the_pallas_backend():
    # the f32 answer differs on this batch (test above): the Pallas run took the bf16 rule
    np.testing.assert_array_equal(_near_ties_topk(_near_ties(), "pallas", **BF16),
                                  _lowest_entries(_near_ties()))


# ----------------------------------------------------------------------------- refusals


ENTRIES = [streamindex_topk_ref, streamindex_page_topk_ref, streamindex_topk,
           streamindex_page_topk, streamindex_scores, dsa_jax.indexer_topk, dsa_jax.page_topk]


@pytest.mark.parametrize("fn", ENTRIES, ids=lambda f: f.__name__)
def test_bad_precision_and_undefined_combinations_are_refused_by_name(fn):
    b, ratio, _ = compressed_batch("decode_r4")
    kw = ({} if fn is streamindex_scores else {"k_pages": 2} if "page" in fn.__name__
          else {"k": 2})
    call = lambda bb, **x: fn(*bb.args(), **kw, pages_per_seq=bb.pages_per_seq,  # noqa: E731
                              compression_ratio=ratio, **x)
    with pytest.raises(ValueError, match=r"precision must be one of \('f32', 'bf16'\), got "
                                         r"precision='fp16'"):
        call(b, precision="fp16")
    with pytest.raises(ValueError, match=r"precision='bf16' with index_quant='fp4_sim' is not "
                                         r"defined"):
        call(b, index_quant="fp4_sim", **BF16)
    wide, _, _ = compressed_batch("decode_r4", page_size=32)  # fp8 pages: whole (32, 128) tiles
    fp8 = dataclasses.replace(wide, cache=fp8_cache.quantize_index_cache(wide.cache))
    with pytest.raises(ValueError, match=r"precision='bf16' with an fp8 index cache "
                                         r"\(Fp8IndexCache\) is not defined"):
        call(fp8, **BF16)
