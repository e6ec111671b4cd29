"""``dsa_jax.engines.tokamax.indexer`` and ``reference.formats.tokamax_index`` (issue 29; no
tokamax needed): the 256-byte record against a float64 quantizer / decoder written from
``docs/engines/tokamax.md`` section 2.2; ``lightning_indexer`` against a float64 oracle of its
score and of both visibility rules (``tests/oracle.py``'s top-k contract), with NaN and garbage
in every byte it must not read; ``top_k`` against a NumPy definition; the refusals."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracle import check_topk_rows

from dsa_jax.engines.tokamax import indexer as tk
from reference.formats import tokamax_index as ti

D, PS, PPS, H = 128, 8, 2, 3  # entries per page, pages per sequence (capacity 16 entries)
NAN_BYTE = 0xFF  # e4m3 NaN code, and e8m0 NaN scale


def f64_decode(entry: np.ndarray, quant_block: int = 128) -> np.ndarray:
    """The record's key, float64: e4m3 code times ``2**(scale byte - 127)`` per block."""
    codes = entry[:D].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    nb = D // quant_block
    scales = 2.0 ** (entry[D:D + nb].astype(np.float64) - 127)
    return codes * np.repeat(scales, quant_block)


def f64_encode(x: np.ndarray, quant_block: int = 128) -> np.ndarray:
    """The quantizer from its rule, float64: the smallest power of two ``s >= max(amax, 1e-4)
    / 448`` per block, codes ``e4m3(x / s)`` (RNE), scale byte ``log2(s) + 127``."""
    out = np.zeros((x.shape[0], 256), np.uint8)
    for i, row in enumerate(x.astype(np.float64)):
        blocks = row.reshape(-1, quant_block)
        amax = np.maximum(np.abs(blocks).max(axis=1), 1e-4)
        e = np.ceil(np.log2(amax / 448.0)).astype(int)
        codes = (blocks / 2.0 ** e[:, None]).astype(ml_dtypes.float8_e4m3fn)
        out[i, :D] = codes.reshape(-1).view(np.uint8)
        out[i, D:D + len(e)] = e + 127
    return out


# ------------------------------------------------------------------------------ the record

@pytest.mark.parametrize("quant_block", [128, 32])
def test_encode_matches_the_rule_and_decodes_exactly(quant_block):
    rng = np.random.default_rng()
    x = rng.standard_normal((24, D)) * np.exp(rng.uniform(-9, 6, (24, 1)))
    x[0] = 0.0  # the amax floor
    x = x.astype(np.float32)
    rec = np.asarray(ti.encode_index_records(x, quant_block=quant_block))
    np.testing.assert_array_equal(rec, f64_encode(x, quant_block))
    assert not rec[:, D + D // quant_block:].any()  # zero padding
    got = np.asarray(ti.decode_index_records(rec, quant_block=quant_block))
    want = np.stack([f64_decode(r, quant_block) for r in rec])
    np.testing.assert_array_equal(got, want.astype(np.float32))
    # each value within half an e4m3 step (2**-4 relative, or the subnormal step) of x
    step = np.repeat(2.0 ** (rec[:, D:D + D // quant_block].astype(np.float64) - 127),
                     quant_block, axis=1)
    err = np.abs(got - x)
    assert np.all(err <= np.maximum(np.abs(x) * 2.0 ** -4, step * 2.0 ** -9) * (1 + 1e-12))


def test_cache_write_gather_and_layouts_round_trip():
    rng = np.random.default_rng()
    num_pages = 3
    rec = np.array(ti.encode_index_records(rng.standard_normal((5, D)).astype(np.float32)))
    rec[:, 129:] = rng.integers(0, 256, (5, 127))  # padding bytes travel as they are
    slots = np.array([0, 9, 23, 17, 4], np.int32)
    dropped = np.array([-1, num_pages * PS], np.int32)
    all_slots = np.concatenate([slots, dropped])
    all_rec = np.concatenate([rec, np.full((2, 256), 7, np.uint8)])
    head = ti.write_index_records(jnp.zeros(ti.cache_shape(num_pages, PS), jnp.uint8),
                                  all_slots, all_rec)
    seq = ti.write_index_records(
        jnp.zeros(ti.cache_shape(num_pages, PS, "SEQ_ALONG_LANE"), jnp.uint8), all_slots,
        all_rec, kv_layout="seq_alone_lane")
    assert head.shape == (num_pages, PS // 4, 4, 256) and seq.shape == (num_pages, 33, 4, PS)
    h = np.asarray(head).reshape(num_pages * PS, 256)
    np.testing.assert_array_equal(h[slots], rec)  # token t of page p at [p, t // 4, t % 4]
    assert np.asarray(head)[2, 23 % PS // 4, 23 % 4, 5] == rec[2, 5]
    assert h.sum() == rec.astype(np.int64).sum()  # nothing else written (-1 / P*ps dropped)
    s3 = np.asarray(seq).reshape(num_pages, 132, PS)
    np.testing.assert_array_equal(s3[slots // PS, :, slots % PS], rec[:, :132])
    assert s3.astype(np.int64).sum() == rec[:, :132].astype(np.int64).sum()
    np.testing.assert_array_equal(np.asarray(ti.gather_index_records(head, all_slots)),
                                  np.concatenate([rec, np.zeros((2, 256), np.uint8)]))
    np.testing.assert_array_equal(
        np.asarray(ti.gather_index_records(seq, slots, kv_layout="seq_along_lane")),
        rec[:, :132])
    np.testing.assert_array_equal(np.asarray(ti.dequantize_index_cache(head)),
                                  np.asarray(ti.dequantize_index_cache(
                                      seq, kv_layout="seq_along_lane")))


# ---------------------------------------------------------------------- lightning_indexer

def make_case(rng, *, ratio, layout, q_lens, seq_lens, pad_rows=2, pad_seqs=1, num_pages=12):
    """A random batch over a fixed-stride table, the cache full of NaN / garbage bytes except
    the records the rows may read. Returns ``(args, their_keys)``: the op's positional
    arguments and, per active sequence, ``{entry: f64 key}`` of its readable entries."""
    m = len(q_lens) + pad_seqs
    perm = rng.permutation(num_pages)
    table = np.full(m * PPS, 10 ** 6, np.int32)  # unused slots: ids that name no page
    n_slots = num_pages * PS
    entries = rng.standard_normal((n_slots, D)) * np.exp(rng.uniform(-2, 2, (n_slots, 1)))
    good = np.asarray(ti.encode_index_records(entries.astype(np.float32)))
    flat = np.full((num_pages * PS, 256), NAN_BYTE, np.uint8)
    keys, p_next = [], 0
    for s, n_tok in enumerate(seq_lens):
        n_ent = n_tok // ratio
        used = -(-n_ent // PS)
        table[s * PPS:s * PPS + used] = perm[p_next:p_next + used]
        p_next += used
        keys.append({})
        for j in range(n_ent):
            slot = table[s * PPS + j // PS] * PS + j % PS
            flat[slot, :129] = good[slot, :129]
            flat[slot, 129:] = rng.integers(0, 256, 127)  # padding: never read
            keys[s][j] = f64_decode(flat[slot])
    cache = ti.write_index_records(jnp.zeros(ti.cache_shape(num_pages, PS, layout), jnp.uint8),
                                   np.arange(num_pages * PS, dtype=np.int32), flat,
                                   kv_layout=layout)
    if layout == ti.SEQ_ALONG_LANE:  # its rows 129-131: garbage too
        c3 = np.asarray(cache).reshape(num_pages, 132, PS).copy()
        c3[:, 129:] = rng.integers(0, 256, (num_pages, 3, PS))
        cache = c3.reshape(np.shape(cache))
    t = sum(q_lens) + pad_rows
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))]).astype(np.int32)
    sl = np.concatenate([seq_lens, np.full(pad_seqs, 7)]).astype(np.int32)
    q = rng.standard_normal((t, H, D)).astype(np.float32)
    w = rng.standard_normal((t, H)).astype(np.float32)
    q[sum(q_lens):] = np.nan  # padding rows
    dist = np.array([0, 0, len(q_lens)], np.int32)
    return (q, w, cache, sl, table, cu, dist), keys


def candidates(args, keys, ratio, rule):
    """Per row, ``{entry: f64 score}`` of its visible entries (None: no sequence)."""
    q, w, _, sl, _, cu, dist = args
    out = [None] * q.shape[0]
    for s in range(int(dist[2])):
        q_len = cu[s + 1] - cu[s]
        for t in range(cu[s], cu[s + 1]):
            p = int(sl[s] - q_len + (t - cu[s]))
            last = (p + 1) // ratio - 1 if rule == "official" else p // ratio
            qt, wt = q[t].astype(np.float64), w[t].astype(np.float64)
            out[t] = {j: float(np.sum(wt * np.maximum(qt @ key, 0.0)))
                      for j, key in keys[s].items() if j <= last}
    return out


CASES = {  # name: ratio, layout, rule, k, q_lens, seq_lens
    "prefill_r4_official": (4, ti.HEAD_ALONG_SUBLANE, "official", 5, [1, 9, 3], [61, 9, 40]),
    "prefill_r4_tpu_inference": (4, ti.SEQ_ALONG_LANE, "tpu_inference", 5, [1, 9, 3],
                                 [61, 9, 40]),
    "tokens_r1": (1, ti.SEQ_ALONG_LANE, "official", 6, [2, 5], [16, 7]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lightning_indexer_meets_the_float64_oracle(name):
    ratio, layout, rule, k, q_lens, seq_lens = CASES[name]
    rng = np.random.default_rng()
    args, keys = make_case(rng, ratio=ratio, layout=layout, q_lens=q_lens, seq_lens=seq_lens)
    idx, bits = tk.lightning_indexer(*args, k=k, compression_ratio=ratio, kv_layout=layout,
                                     causal_rule=rule, return_scores=True)
    cands = candidates(args, keys, ratio, rule)
    check_topk_rows(idx, cands, k, rtol=1e-5)
    vals = np.asarray(bits).view(np.float32)
    for t, cand in enumerate(cands):
        n = int(np.sum(np.asarray(idx)[t] >= 0))
        assert np.all(vals[t, n:] == -np.inf)
        if n:
            want = np.array([cand[j] for j in np.asarray(idx)[t, :n]])
            scale = max(1.0, max(abs(v) for v in cand.values()))
            np.testing.assert_allclose(vals[t, :n], want, rtol=0, atol=1e-5 * scale)
    # some rows see fewer entries than k, some more
    counts = [len(c) for c in cands if c is not None]
    assert min(counts) < k < max(counts)


def test_the_two_rules_differ_only_where_p_mod_r_is_not_r_minus_1():
    rng = np.random.default_rng()
    args, _ = make_case(rng, ratio=4, layout=ti.HEAD_ALONG_SUBLANE, q_lens=[12], seq_lens=[12],
                        pad_rows=0, pad_seqs=0)
    off = np.asarray(tk.lightning_indexer(*args, k=4, compression_ratio=4))
    tpu = np.asarray(tk.lightning_indexer(*args, k=4, compression_ratio=4,
                                          causal_rule="tpu_inference"))
    # rows p = 0..11: official sees (p + 1) // 4 entries, tokamax min(3, p // 4 + 1)
    for p in range(12):
        assert set(off[p][off[p] >= 0]) == set(range((p + 1) // 4)), p
        assert set(tpu[p][tpu[p] >= 0]) == set(range(min(3, p // 4 + 1))), p


def test_idle_rows_empty_batches_and_implementation_lists():
    rng = np.random.default_rng()
    args, _ = make_case(rng, ratio=4, layout=ti.HEAD_ALONG_SUBLANE, q_lens=[1, 2],
                        seq_lens=[20, 33])
    q, w, cache, sl, table, cu, dist = args
    idle = tk.lightning_indexer(q, w, cache, sl, table, cu, np.zeros(3, np.int32), k=3,
                                compression_ratio=4)
    np.testing.assert_array_equal(idle, -1)
    i0, b0 = tk.lightning_indexer(q[:0], w[:0], cache, sl, table, cu, dist, k=3,
                                  compression_ratio=4, return_scores=True)
    assert i0.shape == b0.shape == (0, 3)
    one = tk.lightning_indexer(*args, k=3, compression_ratio=4)
    np.testing.assert_array_equal(one[3:], -1)
    # the Pallas path reads only "head_along_sublane" (tests/test_tokamax_pallas_indexer.py)
    seq_args, _ = make_case(rng, ratio=4, layout=ti.SEQ_ALONG_LANE, q_lens=[1, 2],
                            seq_lens=[20, 33])
    seq_kw = dict(k=3, compression_ratio=4, kv_layout=ti.SEQ_ALONG_LANE)
    np.testing.assert_array_equal(
        tk.lightning_indexer(*seq_args, **seq_kw, implementation=["pallas", "xla"]),
        tk.lightning_indexer(*seq_args, **seq_kw))
    with pytest.raises(NotImplementedError, match="seq_along_lane"):
        tk.lightning_indexer(*seq_args, **seq_kw, implementation="mosaic")
    with pytest.raises(ExceptionGroup) as group:
        tk.lightning_indexer(*seq_args, **seq_kw, implementation=["pallas", "mosaic"])
    assert len(group.value.exceptions) == 2
    with pytest.raises(NotImplementedError, match="cp_size=2"):
        tk.lightning_indexer(*args, k=3, compression_ratio=4, cp_size=2)


def test_lightning_indexer_refusals_name_the_numbers():
    rng = np.random.default_rng()
    args, _ = make_case(rng, ratio=4, layout=ti.HEAD_ALONG_SUBLANE, q_lens=[1], seq_lens=[9])
    q, w, cache, sl, table, cu, dist = args

    def call(*a, **kw):
        return tk.lightning_indexer(*a, **{"k": 2, "compression_ratio": 4, **kw})

    with pytest.raises(ValueError, match="len\\(page_indices\\) = 3 .* len\\(seq_lens\\) = 2"):
        call(q, w, cache, sl, table[:3], cu, dist)
    with pytest.raises(ValueError, match="power of 2.*compression_ratio=3"):
        call(*args, compression_ratio=3)
    with pytest.raises(ValueError, match="unknown kv_layout"):
        call(*args, kv_layout="lane_along_seq")
    with pytest.raises(ValueError, match="causal_rule"):
        call(*args, causal_rule="vllm")
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        call(*args, implementation="cuda")
    with pytest.raises(ValueError, match="cache_kv.shape\\[1\\] must equal"):
        call(q, w, cache, sl, table, cu, dist, kv_layout="seq_along_lane")
    with pytest.raises(ValueError, match="q.shape\\[2\\] must equal .* = 128, got 64"):
        call(q[..., :64], w, cache, sl, table, cu, dist)
    with pytest.raises(TypeError, match="cache_kv must be uint8"):
        call(q, w, np.asarray(cache).astype(np.int8), sl, table, cu, dist)
    with pytest.raises(ValueError, match="quant_block must divide the key width 128, got "
                                         "quant_block=48"):
        ti.encode_index_records(q[0], quant_block=48)


# ------------------------------------------------------------------------------------ top_k

def test_top_k_meets_its_definition():
    rng = np.random.default_rng()
    s = rng.standard_normal((6, 11)).astype(np.float32)
    s[1, :5] = -np.inf
    s[2, 3] = np.nan
    s[3] = np.float32(0.5)  # all tied: lower column first
    lens = np.array([11, 11, 4, 11, 0, 7], np.int32)
    idx, bits = tk.top_k(s, 4, lens, return_scores=True)
    for r in range(6):
        ok = [c for c in range(min(lens[r], 11)) if np.isfinite(s[r, c]) or s[r, c] == np.inf]
        order = sorted(ok, key=lambda c: (-s[r, c], c))[:4]
        want = order + [-1] * (4 - len(order))
        np.testing.assert_array_equal(np.asarray(idx)[r], want)
        want_v = [s[r, c] for c in order] + [-np.inf] * (4 - len(order))
        np.testing.assert_array_equal(np.asarray(bits)[r].view(np.float32), want_v)
    np.testing.assert_array_equal(tk.top_k(s.view(np.int32), 4, lens), idx)
    np.testing.assert_array_equal(tk.top_k(np.array([[1, 3, 3, 2]], np.float32), 2), [[1, 2]])
    with pytest.raises(ValueError, match="k = 12 exceeds the scores' columns n = 11"):
        tk.top_k(s, 12)
    with pytest.raises(TypeError, match="float32 or int32"):
        tk.top_k(s.astype(np.float16), 2)
    with pytest.raises(NotImplementedError, match="no standalone Pallas top-k"):
        tk.top_k(s, 2, implementation="mosaic_tpu")
