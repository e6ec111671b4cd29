"""The fp8 caches (``reference.fp8_cache``, issue 10) through the ops: the reference and Pallas
indexer top-k / scores with an ``Fp8IndexCache`` and the reference and Pallas sparse MLA with an
``Fp8LatentCache``, checked against the float64 oracle (``tests/oracle.py``) applied to the
values the cache holds (``dequantize_index_cache`` / ``dequantize_latent_cache``).

Inputs are fresh random ragged batches (``reference.synthetic``) whose unwritten cache slots are
NaN; quantizing a NaN token gives NaN codes, so its dequantized values stay NaN and a stray read
shows. Magnitudes are spread per token (index keys), per tile (latent) and per head (fp8 q) so
the scales differ and a scale applied to the wrong key, tile or head changes the result. The
scale rows' padding lanes (``>= page_size``, never read by contract) are NaN too. Pallas runs in
the strict interpreter (``interpret=True``: races, NaN-filled uninitialised memory and
out-of-bounds reads raise).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from oracle import check_page_topk, check_token_topk, mla_oracle, token_candidates

from pallas_kernels import (
    chips,
    page_sparse_mla,
    sparse_mla,
    streamindex_page_topk,
    streamindex_scores,
    streamindex_topk,
)
from reference import (
    fp8,
    index_scores,
    page_sparse_mla_ref,
    sparse_mla_ref,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
)
from reference import fp8_cache as fc
from reference.synthetic import make_ragged_batch

HEADS = 4
CAP = 256  # tokens per sequence: pages_per_seq = CAP // page_size
K, K_PAGES = 16, 3
BIG = np.iinfo(np.int32).max

# name -> (q_lens, kv_lens, pad_rows, pad_seqs)
SCENARIOS = {
    "decode": ([1, 1, 1, 1], [40, 256, 1, 97], 0, 0),  # one_token_per_seq
    "mixed": ([1, 3, 6], [33, 70, 200], 2, 1),  # padding rows and an inactive sequence slot
    "short": ([1, 2, 1], [1, 3, 5], 1, 0),  # fewer candidates than k: -1 tails
}


def _rng(*key):
    return np.random.default_rng([sum(map(ord, str(x))) if isinstance(x, str) else x
                                  for x in key])


def _batch(name, seed, page_size, dim):
    q_lens, kv_lens, pad_rows, pad_seqs = SCENARIOS[name]
    rng = _rng(seed, page_size, dim, name)
    b = make_ragged_batch(rng, q_lens=q_lens, kv_lens=kv_lens, page_size=page_size,
                          pages_per_seq=CAP // page_size, num_heads=HEADS, dim=dim,
                          pad_rows=pad_rows, pad_seqs=pad_seqs)
    return b, rng


# ----------------------------------------------------------------------------- index helpers


def index_batch(name, seed, page_size):
    """``(batch, Fp8IndexCache, dequantized keys f32[P, ps, 128])``; the batch's q and keys
    have per-(token, head) / per-token magnitudes spread over ~e^+-2 (so the ue8m0 scales
    differ), its ``cache`` is the keys before quantization."""
    b, rng = _batch(name, seed, page_size, fp8.INDEX_HEAD_DIM)
    keys = b.cache * np.exp(rng.uniform(-2, 2, (*b.cache.shape[:2], 1))).astype(np.float32)
    q = b.q * np.exp(rng.uniform(-1.5, 1.5, (*b.q.shape[:2], 1))).astype(np.float32)
    b = dataclasses.replace(b, q=q, cache=keys)
    c = fc.quantize_index_cache(keys)
    c = fc.Fp8IndexCache(c.keys, c.scales.at[:, page_size:].set(jnp.nan))  # padding: unread
    deq = np.asarray(fc.dequantize_index_cache(c))
    _check_dequantized(deq, keys)
    written = ~np.isnan(keys[..., 0])
    assert len(np.unique(np.asarray(c.scales)[:, :page_size][written])) >= 3  # they do differ
    return b, c, deq


def queries(b, deq, kind):
    """``(q, weights)`` for the op and the batch as the float64 oracle sees it: ``kind`` f32,
    bf16 (the oracle gets the bf16-rounded q) or fp8 (``quantize_fp8`` per (token, head), its
    scale folded into the weights: ``w' = w * scale``; the oracle gets the e4m3 values and
    ``w'``); the oracle's keys are the dequantized cache."""
    if kind == "f32":
        q, w = jnp.asarray(b.q), b.weights
        view_q = b.q
    elif kind == "bf16":
        q, w = jnp.asarray(b.q, jnp.bfloat16), b.weights
        view_q = np.asarray(q, np.float32)
    else:
        q, s = fp8.quantize_fp8(b.q, block_size=fp8.INDEX_HEAD_DIM)
        assert q.dtype == jnp.float8_e4m3fn and s.shape == (*b.q.shape[:2], 1)
        w = (b.weights * np.asarray(s)[..., 0]).astype(np.float32)
        view_q = np.asarray(q.astype(jnp.float32))
    return q, w, dataclasses.replace(b, q=view_q, weights=w, cache=deq)


def _pps(b):
    return b.pages_per_seq


def _check_dequantized(deq, x, block=fp8.INDEX_HEAD_DIM):
    """The cache holds ``x`` up to e4m3 rounding (computed here, not by the decoders under
    test): per block of ``block`` features, half a step is at most ``2**-4 |x|`` (normal
    codes) or ``2**-10`` times the power-of-two scale ``< 2 amax / 448`` (subnormals); and NaN
    exactly where ``x`` is NaN (unwritten slots still read as NaN)."""
    assert np.array_equal(np.isnan(deq), np.isnan(x))
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = np.where(np.isnan(blocks), 0, np.abs(blocks)).max(axis=-1, keepdims=True)
    bound = (np.abs(blocks) * 2.0**-4 + amax / 448 * 2.0**-9).reshape(x.shape)
    ok = ~np.isnan(x)
    assert np.all(np.abs(deq - x)[ok] <= bound[ok] * (1 + 1e-6))


# ----------------------------------------------------------------------------- 1. reference


REF_CASES = [("decode", 32, "fp8"), ("mixed", 32, "f32"), ("short", 32, "fp8"),
             ("mixed", 64, "fp8"), ("decode", 128, "f32")]


@pytest.mark.parametrize("name,page_size,kind", REF_CASES)
def test_reference_topk_with_fp8_index_cache_meets_the_definition(name, page_size, kind):
    """(a)/(b): token and page top-k satisfy the float64 oracle on the dequantized keys (and the
    e4m3 q with its scale in the weights); (c): token top-k equals the same op on the f32
    dequantized cache index for index (ue8m0 scales are powers of two, so scaling after the
    head sum is exact; page top-k takes the same scores)."""
    b, cache, deq = index_batch(name, 1, page_size)
    q, w, view = queries(b, deq, kind)
    kw = dict(pages_per_seq=_pps(b), one_token_per_seq=name == "decode", exact=True)
    tok = np.asarray(streamindex_topk_ref(q, w, cache, *b.meta(), k=K, **kw))
    pages = np.asarray(streamindex_page_topk_ref(q, w, cache, *b.meta(), k_pages=K_PAGES,
                                                 **kw))
    check_token_topk(tok, view, K)
    check_page_topk(pages, view, K_PAGES)
    if name == "short":  # the -1 tails are exercised
        assert (tok == -1).any() and (pages == -1).any()
    plain = (view.q, view.weights, deq, *b.meta())
    np.testing.assert_array_equal(tok, np.asarray(streamindex_topk_ref(*plain, k=K, **kw)))


@pytest.mark.parametrize("kind", ["f32", "fp8"])
def test_reference_scores_with_fp8_index_cache_equal_the_definition(kind):
    """The reference's fp8 scores (``index_scores.gather_keys`` + ``scaled_scores``, what both
    reference top-k ops rank) = ``scale[s] * sum_h w[t, h] relu(q[t, h] . k8[s])`` in float64
    at every candidate (top-k alone cannot see a score scaled by a common factor)."""
    b, cache, deq = index_batch("mixed", 7, 32)
    q, w, view = queries(b, deq, kind)
    cands = token_candidates(*view.args(), _pps(b))
    for i, pages in enumerate(b.seq_pages):
        ids = np.full(_pps(b), cache.num_pages, np.int32)  # num_pages: no page, reads nothing
        ids[:len(pages)] = pages
        keys, scale = index_scores.gather_keys(cache, jnp.asarray(ids))
        lo, hi = int(b.cu_q_lens[i]), int(b.cu_q_lens[i + 1])
        got = np.asarray(index_scores.scaled_scores(q[lo:hi], jnp.asarray(w[lo:hi]), keys,
                                                    scale))
        for r in range(lo, hi):
            cand = cands[r]
            want = np.array(list(cand.values()))
            scale_r = max(1.0, np.abs(want).max())
            np.testing.assert_allclose(got[r - lo, list(cand)], want, rtol=1e-5,
                                       atol=1e-5 * scale_r, err_msg=f"row {r}")


# ----------------------------------------------------------------------------- 2. Pallas


# A chip whose MXU multiplies fp8 (``Chip.fp8_mxu``): an fp8 q stays e4m3 there.
FP8_MXU_CHIP = next(c.name for c in chips.CHIPS.values() if c.fp8_mxu)

# (scenario, page size, q kind, chip, page mode, block_rows, block_pages): one kernel compile
# each (the strict interpreter's compile is most of a case's time). chip "tpu7x" with an fp8 q
# keeps q in e4m3 (the fp8 x fp8 dot); elsewhere the kernel upcasts it to bf16.
PALLAS_CASES = [
    ("mixed", 32, "f32", None, False, 4, 2),
    ("decode", 64, "fp8", FP8_MXU_CHIP, False, None, None),
    ("short", 32, "fp8", None, True, 1, 2),
    ("mixed", 64, "fp8", FP8_MXU_CHIP, True, 4, 2),
]


@pytest.mark.kernel_gate
@pytest.mark.parametrize("name,page_size,kind,chip,page_mode,block_rows,block_pages",
                         PALLAS_CASES)
def test_pallas_topk_with_fp8_index_cache(name, page_size, kind, chip, page_mode, block_rows,
                                          block_pages):
    """Token or page top-k (strict interpreter) satisfies the float64 oracle on the dequantized
    keys and equals the reference index for index (exact=True)."""
    b, cache, deq = index_batch(name, 2, page_size)
    q, w, view = queries(b, deq, kind)
    kw = dict(pages_per_seq=_pps(b), one_token_per_seq=name == "decode", exact=True)
    kw |= dict(k_pages=K_PAGES) if page_mode else dict(k=K)
    op, ref, check = ((streamindex_page_topk, streamindex_page_topk_ref, check_page_topk)
                      if page_mode else (streamindex_topk, streamindex_topk_ref,
                                         check_token_topk))
    got = np.asarray(op(q, w, cache, *b.meta(), **kw, chip=chip, block_rows=block_rows,
                        block_pages=block_pages, interpret=True))
    check(got, view, K_PAGES if page_mode else K)
    if name == "short":
        assert (got == -1).any()
    np.testing.assert_array_equal(got, np.asarray(ref(q, w, cache, *b.meta(), **kw)))


def _check_scores(s, cands, *, page_size=None, width):
    """Kernel scores vs the float64 candidate scores: exactly the candidates (tokens, or pages
    holding one) are finite, -inf elsewhere, values within f32 rounding of the definition."""
    assert s.shape == (len(cands), width)
    assert not np.isnan(s).any()
    for r, cand in enumerate(cands):
        want = np.full(width, -np.inf)
        for i, v in (cand or {}).items():
            j = i if page_size is None else i // page_size
            want[j] = max(want[j], v)
        fin = np.isfinite(want)
        assert np.array_equal(np.isfinite(s[r]), fin), f"row {r}: candidate set differs"
        assert np.all(s[r][~fin] == -np.inf)
        scale = max(1.0, np.abs(want[fin]).max()) if fin.any() else 1.0
        np.testing.assert_allclose(s[r][fin], want[fin], rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=f"row {r}")


@pytest.mark.kernel_gate
@pytest.mark.parametrize("name,page_size,kind,chip,page_mode", [
    ("mixed", 128, "bf16", None, False),
    ("decode", 32, "fp8", FP8_MXU_CHIP, True),
    ("mixed", 64, "f32", None, True),
])
def test_pallas_scores_with_fp8_index_cache_equal_the_definition(name, page_size, kind, chip,
                                                                  page_mode):
    """``streamindex_scores`` = ``scale[s] * sum_h w[t, h] relu(q[t, h] . k8[s])`` in float64
    (the dequantized keys; bf16: of the bf16-rounded q), -inf exactly at non-candidates."""
    b, cache, deq = index_batch(name, 3, page_size)
    q, w, view = queries(b, deq, kind)
    otp = name == "decode"
    s = np.asarray(streamindex_scores(q, w, cache, *b.meta(), pages_per_seq=_pps(b),
                                      one_token_per_seq=otp, page_mode=page_mode, chip=chip,
                                      block_pages=2, block_rows=None if otp else 4,
                                      interpret=True))
    cands = token_candidates(*view.args(), _pps(b))
    _check_scores(s, cands, page_size=page_size if page_mode else None,
                  width=_pps(b) * (1 if page_mode else page_size))


# ----------------------------------------------------------------------------- MLA helpers

LATENT = fp8.LATENT_DIM  # 576
SCALE = LATENT ** -0.5
V_DIM = fp8.LATENT_NOPE  # 512


def latent_batch(name, seed, page_size=32):
    """``(batch, Fp8LatentCache, dequantized latent f32[P, ps, 576])``: random normal latent
    rows (NaN where unwritten) with each nope tile and the rope scaled by its own factor (so
    the four tile scales differ); ``batch.q`` is ``f32[T, H, 576]``."""
    b, rng = _batch(name, seed, page_size, LATENT)
    f = np.exp(rng.uniform(-1, 1, (*b.cache.shape[:2], fp8.LATENT_TILES + 1)))
    latent = b.cache * np.repeat(f, [fp8.LATENT_TILE] * fp8.LATENT_TILES + [fp8.LATENT_ROPE],
                                 axis=-1).astype(np.float32)
    cache = fc.quantize_latent_cache(latent)
    deq = np.asarray(fc.dequantize_latent_cache(cache))
    nope = latent[..., :fp8.LATENT_NOPE]
    _check_dequantized(deq[..., :fp8.LATENT_NOPE], nope, fp8.LATENT_TILE)
    rope = latent[..., fp8.LATENT_NOPE:]
    np.testing.assert_array_equal(deq[..., fp8.LATENT_NOPE:],
                                  np.asarray(jnp.asarray(rope, jnp.bfloat16), np.float32))
    return dataclasses.replace(b, cache=latent), cache, deq


def _row_seqs(b):
    """Per row: ``(sequence, kv_len)`` or None for a row outside every sequence."""
    out = []
    for r in range(b.q.shape[0]):
        i = int(np.searchsorted(b.cu_q_lens, r, side="right")) - 1
        out.append((i, int(b.seq_lens[i])) if i < b.distribution[2] else None)
    return out


def token_entries(rng, b, k):
    """Per row: valid offsets (one duplicated), the first offset past kv_len (a NaN slot of an
    owned page when kv_len is not page aligned), -1, an offset past the capacity, huge and
    negative junk, shuffled so junk sits between valid entries."""
    cap = CAP
    rows = np.full((b.q.shape[0], k), -1, np.int32)
    for r, rs in enumerate(_row_seqs(b)):
        kv = rs[1] if rs else 8
        n = int(rng.integers(1, min(kv, k - 7) + 1))
        valid = rng.choice(kv, size=n, replace=False)
        junk = [kv, -1, cap + 3, BIG, -BIG - 1, -7]
        row = np.concatenate([valid, valid[:1], junk])
        row = np.concatenate([row, rng.choice(junk, size=k - len(row))])
        rows[r] = rng.permutation(row)
    return rows


def page_entries(rng, b, k):
    """Per row: valid page numbers (one duplicated) and -1, pages_per_seq, huge, negative junk."""
    pps = _pps(b)
    rows = np.empty((b.q.shape[0], k), np.int32)
    for r in range(b.q.shape[0]):
        valid = rng.choice(pps, size=k - 5, replace=False)
        rows[r] = rng.permutation(np.concatenate([valid, valid[:1], [-1, pps, BIG, -BIG - 1]]))
    return rows


def _pad640(q):
    return jnp.pad(jnp.asarray(q), ((0, 0), (0, 0), (0, 640 - LATENT)))


def _check_mla(out, lse, want, want_lse, tol):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()  # no NaN from an unselected / unwritten slot
    scale = max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * scale)
    lse = np.asarray(lse, np.float64)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=tol, atol=tol)


def _mla_case(mode, seed):
    """A latent batch, its entries (row 0, of an active sequence, has no valid entry) and the
    float64 oracle on the dequantized latent and the f32 q."""
    b, cache, deq = latent_batch("mixed", seed)
    rng = _rng(seed, mode)
    sel = token_entries(rng, b, 20) if mode == "token" else page_entries(rng, b, 8)
    sel[0] = -1
    want, want_lse = mla_oracle(b.q, deq, b.seq_lens, sel, *b.meta()[1:], sm_scale=SCALE,
                                v_dim=V_DIM, pages_per_seq=_pps(b), page=mode == "page")
    return b, cache, deq, sel, want, want_lse


def _assert_empty_rows(b, out, lse):
    """Row 0 (no valid entry) and the rows outside every sequence: zeros, lse -inf."""
    empty = [0] + [r for r, rs in enumerate(_row_seqs(b)) if rs is None]
    assert len(empty) == 1 + 2  # the mixed scenario has 2 padding rows
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    for r in empty:
        assert not out[r].any(), f"row {r}"
        assert np.isneginf(lse[r]).all(), f"row {r}"


# ----------------------------------------------------------------------------- 3. reference


@pytest.mark.parametrize("mode", ["token", "page"])
def test_reference_mla_with_fp8_latent_cache_meets_the_definition(mode):
    """sparse_mla_ref / page_sparse_mla_ref with an Fp8LatentCache = the float64 oracle on the
    dequantized latent (f32 tolerance), for q of dim 576 and zero-padded to 640; NaN in
    unselected slots never reaches the output; an empty row gives zeros and lse -inf."""
    b, cache, deq, sel, want, want_lse = _mla_case(mode, 4)
    if mode == "token":  # the first offset past kv_len is a NaN slot of an owned page
        for r, rs in enumerate(_row_seqs(b)):
            if rs is None or r == 0:
                continue
            i, kv = rs
            assert kv in sel[r]
            if kv % b.page_size:
                assert np.isnan(deq[b.seq_pages[i][kv // b.page_size], kv % b.page_size]).all()
    op = sparse_mla_ref if mode == "token" else page_sparse_mla_ref
    kw = dict(sm_scale=SCALE, pages_per_seq=_pps(b), v_dim=V_DIM, return_lse=True)
    for q in (jnp.asarray(b.q), _pad640(b.q)):
        out, lse = op(q, cache, b.seq_lens, sel, *b.meta()[1:], **kw)
        assert out.dtype == jnp.float32 and out.shape == (b.q.shape[0], HEADS, V_DIM)
        _check_mla(out, lse, want, want_lse, 1e-5)
        _assert_empty_rows(b, out, lse)


def test_reference_mla_v_dim_below_the_nope_width():
    """v_dim < 512 takes the first v_dim value features of the dequantized latent."""
    b, cache, deq, sel, _, _ = _mla_case("token", 5)
    want, want_lse = mla_oracle(b.q, deq, b.seq_lens, sel, *b.meta()[1:], sm_scale=SCALE,
                                v_dim=200, pages_per_seq=_pps(b))
    out, lse = sparse_mla_ref(b.q, cache, b.seq_lens, sel, *b.meta()[1:], sm_scale=SCALE,
                              pages_per_seq=_pps(b), v_dim=200, return_lse=True)
    _check_mla(out, lse, want, want_lse, 1e-5)


# ----------------------------------------------------------------------------- 4. Pallas


@pytest.mark.kernel_gate
@pytest.mark.parametrize("mode,dtype,dim", [
    ("token", jnp.float32, 576),
    ("token", jnp.bfloat16, 640),
    ("page", jnp.float32, 640),
    ("page", jnp.bfloat16, 576),
])
def test_pallas_mla_with_fp8_latent_cache(mode, dtype, dim):
    """sparse_mla / page_sparse_mla (strict interpreter) with an Fp8LatentCache match the
    reference and the float64 oracle (f32 q: 1e-5; bf16 q: 2e-2, the oracle on the bf16-rounded
    q), with duplicates, -1, out-of-range and NaN-slot entries, an empty row, and q of dim 576
    or 640."""
    b, cache, deq, sel, want, want_lse = _mla_case(mode, 6)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    q576 = jnp.asarray(b.q, dtype)
    if dtype == jnp.bfloat16:
        want, want_lse = mla_oracle(np.asarray(q576, np.float32), deq, b.seq_lens, sel,
                                    *b.meta()[1:], sm_scale=SCALE, v_dim=V_DIM,
                                    pages_per_seq=_pps(b), page=mode == "page")
    kw = dict(sm_scale=SCALE, pages_per_seq=_pps(b), v_dim=V_DIM, return_lse=True)
    meta = (b.seq_lens, sel, *b.meta()[1:])
    q = q576 if dim == LATENT else _pad640(q576)
    if mode == "token":
        out, lse = sparse_mla(q, cache, *meta, **kw, tokens_per_block=8, interpret=True)
        ref_out, ref_lse = sparse_mla_ref(q, cache, *meta, **kw)
    else:
        out, lse = page_sparse_mla(q, cache, *meta, **kw, pages_per_block=2, interpret=True)
        ref_out, ref_lse = page_sparse_mla_ref(q, cache, *meta, **kw)
    assert out.dtype == dtype and out.shape == (b.q.shape[0], HEADS, V_DIM)
    _check_mla(out, lse, np.asarray(ref_out, np.float64), np.asarray(ref_lse, np.float64), tol)
    _check_mla(out, lse, want, want_lse, tol)
    _assert_empty_rows(b, out, lse)


# ----------------------------------------------------------------------------- 5. bad input


def _bad_index(what):
    """The indexer arguments with one part made wrong (``what``) and ``pages_per_seq``."""
    b, cache, _ = index_batch("mixed", 0, 32)
    q, cache_kv, p = jnp.asarray(b.q), cache, cache.num_pages
    if what == "page_size_48":
        cache_kv = fc.Fp8IndexCache(jnp.zeros((p, 48, 128), jnp.float8_e4m3fn),
                                    jnp.zeros((p, 128), jnp.float32))
    elif what == "scales_shape":
        cache_kv = fc.Fp8IndexCache(cache.keys, cache.scales[:, :32])
    elif what == "scales_dtype":
        cache_kv = fc.Fp8IndexCache(cache.keys, cache.scales.astype(jnp.bfloat16))
    elif what == "keys_bf16":
        cache_kv = fc.Fp8IndexCache(cache.keys.astype(jnp.bfloat16), cache.scales)
    elif what == "q_dim_64":
        q = q[..., :64]
    else:
        assert what == "fp8_q_plain_cache"
        q = q.astype(jnp.float8_e4m3fn)
        cache_kv = jnp.asarray(np.nan_to_num(b.cache), jnp.bfloat16)
    return (q, b.weights, cache_kv, *b.meta()), _pps(b)


BAD_INDEX = [
    ("page_size_48", r"multiple of 32.*=48 \(48 % 32 = 16\)"),
    ("scales_shape", r"scales must have shape.*\(\d+, 128\).*got \(\d+, 32\)"),
    ("scales_dtype", r"scales must have dtype float32, got bfloat16"),
    ("keys_bf16", r"keys must have dtype float8_e4m3fn, got bfloat16"),
    ("q_dim_64", r"q.shape\[2\] must equal the fp8 index cache's head dim = 128, got 64"),
    ("fp8_q_plain_cache", r"float8_e4m3fn.*Fp8IndexCache.*bfloat16"),
]


@pytest.mark.parametrize("op", [streamindex_topk_ref, streamindex_page_topk_ref,
                                streamindex_topk, streamindex_page_topk, streamindex_scores])
@pytest.mark.parametrize("what,match", BAD_INDEX)
def test_bad_index_cache_input_is_refused_with_the_numbers(op, what, match):
    args, pps = _bad_index(what)
    kw = dict(pages_per_seq=pps)
    if op in (streamindex_topk_ref, streamindex_topk):
        kw["k"] = 4
    elif op is not streamindex_scores:
        kw["k_pages"] = 2
    if op in (streamindex_topk, streamindex_page_topk, streamindex_scores):
        kw["interpret"] = True
    with pytest.raises(ValueError, match=match):
        op(*args, **kw)


BAD_MLA = [
    (600, V_DIM, jnp.float32, ValueError, r"one of \(576, 640\).*got 600"),
    (640, 600, jnp.float32, ValueError, r"v_dim must be <= .*512.*v_dim=600 > 512"),
    (576, 513, jnp.float32, ValueError, r"v_dim=513 > 512"),
    (576, V_DIM, jnp.float8_e4m3fn, ValueError, r"float8_e4m3fn.*float32, bfloat16"),
    (576, V_DIM, jnp.int32, TypeError, r"q must be a floating array.*int32"),
]


@pytest.mark.parametrize("op", [sparse_mla_ref, page_sparse_mla_ref, sparse_mla,
                                page_sparse_mla])
@pytest.mark.parametrize("dim,v_dim,dtype,exc,match", BAD_MLA)
def test_bad_latent_cache_input_is_refused_with_the_numbers(op, dim, v_dim, dtype, exc, match):
    cache = fc.empty_latent_cache(4, 32)
    t = 3
    meta = (np.array([40], np.int32), np.zeros((t, 4), np.int32), np.arange(2, dtype=np.int32),
            np.array([0, t], np.int32), np.array([0, 64], np.int32),
            np.array([0, 1, 1], np.int32))
    kw = dict(sm_scale=SCALE, pages_per_seq=2, v_dim=v_dim)
    if op in (sparse_mla, page_sparse_mla):
        kw["interpret"] = True
    with pytest.raises(exc, match=match):
        op(jnp.zeros((t, HEADS, dim), dtype), cache, *meta, **kw)


@pytest.mark.parametrize("op", [sparse_mla_ref, sparse_mla])
@pytest.mark.parametrize("words,match", [
    (jnp.zeros((4, 32, 256), jnp.uint8), r"words must have dtype uint32, got uint8"),
    (jnp.zeros((4, 32, 164), jnp.uint32), r"LATENT_WORDS\) = 256, got 164"),
])
def test_malformed_latent_cache_is_refused(op, words, match):
    t = 3
    meta = (np.array([40], np.int32), np.zeros((t, 4), np.int32), np.arange(2, dtype=np.int32),
            np.array([0, t], np.int32), np.array([0, 64], np.int32),
            np.array([0, 1, 1], np.int32))
    kw = dict(sm_scale=SCALE, pages_per_seq=2, v_dim=V_DIM)
    if op is sparse_mla:
        kw["interpret"] = True
    with pytest.raises(ValueError, match=match):
        op(jnp.zeros((t, HEADS, LATENT)), fc.Fp8LatentCache(words), *meta, **kw)


# ----------------------------------------------------------------------------- findings


def test_a_nan_token_gets_a_nan_scale_in_a_whole_page():
    x = np.ones((1, 32, fp8.INDEX_HEAD_DIM), np.float32)
    x[0, 0] = np.nan  # one unwritten token in a page
    x[0, 1, 5] = np.nan  # one NaN feature in another token
    cache = fc.quantize_index_cache(x)
    s = np.asarray(cache.scales)[0]
    assert np.isnan(s[0]) and np.isnan(s[1]) and not np.isnan(s[2:32]).any()
    assert np.isnan(np.asarray(fc.dequantize_index_cache(cache))[0, 1]).all()
    lat = np.ones((1, 32, fp8.LATENT_DIM), np.float32)
    lat[0, 3, 130] = np.nan  # tile 1 of token 3
    nope8, scales, rope = fp8.quantize_latent_fp8(lat)
    sc = np.asarray(scales)
    assert np.isnan(sc[0, 3, 1]) and not np.isnan(np.delete(sc[0].reshape(-1), 3 * 4 + 1)).any()


def test_the_wrong_kind_of_fp8_cache_is_refused_by_name():
    rng = np.random.default_rng(77)
    b = make_ragged_batch(rng, q_lens=[1, 1], kv_lens=[20, 9], page_size=32, pages_per_seq=2,
                          num_heads=2, dim=128)
    icache = fc.quantize_index_cache(np.nan_to_num(b.cache))
    lcache = fc.quantize_latent_cache(rng.standard_normal((b.cache.shape[0], 32, 576))
                                      .astype(np.float32))
    q = jnp.asarray(b.q)
    with pytest.raises(TypeError, match="Fp8LatentCache .*the indexer takes"):
        streamindex_topk_ref(q, jnp.asarray(b.weights), lcache, *b.meta(), k=4, pages_per_seq=2)
    sel = jnp.zeros((2, 4), jnp.int32)
    qm = jnp.zeros((2, 2, 576), jnp.float32)
    for fn in (sparse_mla_ref, sparse_mla):
        with pytest.raises(TypeError, match="Fp8IndexCache"):
            fn(qm, icache, b.meta()[0], sel, *b.meta()[1:], sm_scale=0.1, pages_per_seq=2,
               v_dim=512)
