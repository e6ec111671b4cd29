"""``lightning_indexer(implementation="pallas")`` (issue 29): the package's Pallas token indexer
reading tokamax's 256-byte records in place (``pallas_kernels.indexer.records``), in the strict
interpreter, against the adapter's ``"xla"`` path on the same inputs: the same visible entries
and picks, the scores equal to f32 summation order (the kernel's dot and head sum are not
XLA's: a few ulps), both causal rules, NaN bytes in every record no row may read. And the
kernel AOT-compiled for ``chips.DEFAULT`` and ``chips.NEWEST`` at a V4-Flash decode shape, with
no copy of the cache in the compiled HLO (no tokamax needed)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax.engines.tokamax import indexer as tk
from pallas_kernels import aot, chips
from pallas_kernels.indexer import records
from pallas_kernels.indexer.token import streamindex_topk_records
from reference.formats import tokamax_index as ti

D, PS, PPS, H, NUM_PAGES = 128, 8, 3, 2, 10
NAN_BYTE = 0xFF  # e4m3 NaN code, e8m0 NaN scale


def _slots(table, s, n_ent):
    """The flat record slots of sequence ``s``'s entries ``0 .. n_ent - 1`` (fixed stride
    ``PPS`` pages a sequence, ``PS`` entries a page)."""
    return np.array([int(table[s * PPS + j // PS]) * PS + j % PS for j in range(n_ent)], int)


def make_case(rng, *, ratio, q_lens, seq_lens, q_dtype=np.float32):
    """Positional arguments of ``lightning_indexer``: a fixed-stride table (a padding sequence
    and a padding row at the end), every record no row may read all NaN bytes."""
    m = len(q_lens) + 1
    table = np.full(m * PPS, 10 ** 6, np.int32)
    perm = rng.permutation(NUM_PAGES)
    flat = np.full((NUM_PAGES * PS, 256), NAN_BYTE, np.uint8)
    p_next = 0
    for s, n_tok in enumerate(seq_lens):
        n_ent = n_tok // ratio
        used = -(-n_ent // PS)
        table[s * PPS:s * PPS + used] = perm[p_next:p_next + used]
        p_next += used
        slots = _slots(table, s, n_ent)
        if n_ent:
            keys = rng.standard_normal((n_ent, D)) * np.exp(rng.uniform(-3, 3, (n_ent, 1)))
            rec = np.asarray(ti.encode_index_records(keys.astype(np.float32)))
            flat[slots, :129] = rec[:, :129]
            flat[slots, 129:] = rng.integers(0, 256, (n_ent, 127))  # padding: never read
    cache = flat.reshape(ti.cache_shape(NUM_PAGES, PS))
    t = sum(q_lens) + 1
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    sl = np.concatenate([seq_lens, [5]]).astype(np.int32)
    q = rng.standard_normal((t, H, D)).astype(np.float32)
    q[-1] = np.nan  # the padding row
    w = rng.standard_normal((t, H)).astype(np.float32)
    dist = np.array([0, 0, len(q_lens)], np.int32)
    return (jnp.asarray(q, q_dtype), jnp.asarray(w), jnp.asarray(cache), sl, table, cu, dist)


CASES = [  # (ratio, q_lens, seq_lens, q dtype, causal rule, k); rows 9 and 6: prefill (the
    # rules differ), row 1: decode; about 15 s of strict-interpreter compile each
    (4, [9, 1, 6], [36, 70, 22], jnp.bfloat16, "tpu_inference", PPS * PS + 4),
    (4, [9, 1, 6], [44, 93, 3], np.float32, "official", 5),
]


def _f32(bits):
    return np.asarray(bits).view(np.float32)


def _close(a, b, tol):
    """Equal up to f32 summation order (the kernel's dot and head sum are not XLA's): within
    ``tol`` (``_summation_tol``)."""
    with np.errstate(invalid="ignore"):  # -inf - -inf
        return (a == b) | (np.abs(a - b) <= tol)


def _summation_tol(args, ratio):
    """Per row: the bound on two f32 summation orders of one score, ``2 (D + H) 2**-24
    max_j sum_h |w_h| sum_d |q_hd k_jd|`` over the row's visible entries (float64, the keys
    decoded from their records): each order is within ``(D + H) 2**-24`` of that sum of
    magnitudes of the exact value, whatever the cancellation (a relative bound on the score
    itself fails where the terms cancel: 1.1e-4 apart at a score of 50, seen once)."""
    q, w, cache, sl, table, cu = (np.asarray(a, np.float64) if i < 2 else np.asarray(a)
                                  for i, a in enumerate(args[:6]))
    flat = np.asarray(cache).reshape(NUM_PAGES * PS, -1)
    tol = np.zeros(q.shape[0])
    for s in range(len(sl) - 1):  # the last sequence pads
        n_ent = int(sl[s]) // ratio
        if not n_ent:
            continue
        slots = _slots(table, s, n_ent)
        keys = np.abs(np.asarray(ti.decode_index_records(flat[slots]), np.float64))
        for r in range(int(cu[s]), int(cu[s + 1])):
            cond = np.abs(w[r]) @ (np.abs(q[r]) @ keys.T)  # [n_ent]
            tol[r] = 2 * (D + H) * 2.0 ** -24 * cond.max()
    return tol


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[4]}-k{c[5]}")
def test_pallas_equals_the_xla_path(case):
    """Each row's picks are the xla path's (its scores to f32 rounding; a different pick only
    where two scores are within rounding), taken from the xla path's every visible entry
    (``k`` past the capacity: the ``-1`` suffix)."""
    ratio, q_lens, seq_lens, q_dtype, rule, k = case
    args = make_case(np.random.default_rng(), ratio=ratio, q_lens=q_lens, seq_lens=seq_lens,
                     q_dtype=q_dtype)
    kw = dict(compression_ratio=ratio, return_scores=True, causal_rule=rule)
    all_idx, all_bits = (np.asarray(x) for x in tk.lightning_indexer(
        *args, k=PPS * PS + 4, implementation="xla", **kw))
    got_idx, got_bits = (np.asarray(x) for x in tk.lightning_indexer(
        *args, k=k, implementation="pallas", **kw))
    tol = _summation_tol(args, ratio)
    for r in range(all_idx.shape[0]):
        ref = dict(zip(all_idx[r], _f32(all_bits[r]), strict=True))
        ref.pop(-1, None)
        want = _f32(all_bits[r])[:k]
        got = _f32(got_bits[r])
        assert np.all(_close(got, want, tol[r])), (r, got, want, tol[r])  # the k best scores
        assert np.array_equal(got_idx[r] < 0, all_idx[r][:k] < 0), r  # the -1 suffix
        for j, v in zip(got_idx[r], got, strict=True):  # each pick is its entry's score
            assert j == -1 or _close(v, ref[j], tol[r]), (r, j, v, ref.get(j), tol[r])
        assert len(set(got_idx[r][got_idx[r] >= 0])) == (got_idx[r] >= 0).sum()
        if k > PPS * PS:  # every visible entry, in the same order but for near ties
            assert set(got_idx[r]) == set(all_idx[r]), r
    assert (got_idx[:-1, 0] >= 0).sum() >= 2 and np.all(got_idx[-1] == -1)


def test_pallas_refusals():
    args = make_case(np.random.default_rng(), ratio=4, q_lens=[1], seq_lens=[16])
    with pytest.raises(NotImplementedError, match="seq_along_lane"):
        seq = jnp.zeros(ti.cache_shape(NUM_PAGES, PS, ti.SEQ_ALONG_LANE), jnp.uint8)
        tk.lightning_indexer(*args[:2], seq, *args[3:], k=2, compression_ratio=4,
                             kv_layout=ti.SEQ_ALONG_LANE, implementation="pallas")
    with pytest.raises(ValueError, match="causal_rule"):
        streamindex_topk_records(*args[:4], args[4], args[5], jnp.zeros(3, jnp.int32),
                                 args[6], k=2, pages_per_seq=PPS, causal_rule="nope")


def test_scale_bits_exact():
    b = jnp.arange(256, dtype=jnp.int32)
    got = np.asarray(jax.lax.bitcast_convert_type(records.scale_bits(b), jnp.float32))
    want = np.asarray(jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e8m0fnu)
                      ).astype(np.float32)
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------- AOT gate

GATE_ROWS, GATE_TOKENS, GATE_RATIO, GATE_K, GATE_HEADS, GATE_PAGE = 64, 8192, 4, 512, 64, 64


def _gate_fn(q, w, cache, seq_lens, table, cu_q, cu_kv, dist):
    return streamindex_topk_records(q, w, cache, seq_lens, table, cu_q, cu_kv, dist,
                                    k=GATE_K, pages_per_seq=table.shape[0] // seq_lens.shape[0],
                                    compression_ratio=GATE_RATIO, chip=_gate_fn.chip)


@pytest.mark.kernel_gate
@pytest.mark.parametrize("chip", [chips.DEFAULT, chips.NEWEST])
def test_records_compile_without_a_cache_copy(chip):
    entries = GATE_TOKENS // GATE_RATIO
    pps = entries // GATE_PAGE
    num_pages = GATE_ROWS * pps
    i32 = jnp.int32
    specs = [jax.ShapeDtypeStruct((GATE_ROWS, GATE_HEADS, D), jnp.bfloat16),
             jax.ShapeDtypeStruct((GATE_ROWS, GATE_HEADS), jnp.float32),
             jax.ShapeDtypeStruct(ti.cache_shape(num_pages, GATE_PAGE), jnp.uint8),
             jax.ShapeDtypeStruct((GATE_ROWS,), i32),
             jax.ShapeDtypeStruct((GATE_ROWS * pps,), i32),
             jax.ShapeDtypeStruct((GATE_ROWS + 1,), i32),
             jax.ShapeDtypeStruct((GATE_ROWS + 1,), i32), jax.ShapeDtypeStruct((3,), i32)]
    _gate_fn.chip = chip
    compiled = aot.aot_compile(_gate_fn, specs, chip, "tokamax records decode")
    text = compiled.as_text()
    dims = ",".join(str(d) for d in specs[2].shape)
    cache_sized = re.compile(r"=\s*\(?u8\[(1,)?" + dims + r"\]")  # the cache, maybe stacked
    producers = [ln for ln in text.splitlines() if cache_sized.search(ln)
                 and not re.search(r"\b(parameter|bitcast)\(", ln)]  # bitcasts are free
    assert not producers, producers[:3]
    assert "tpu_custom_call" in text and any(cache_sized.search(ln) for ln in text.splitlines())
