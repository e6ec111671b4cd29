"""``dsa_jax.engines.tokamax.attention`` and ``reference.formats.tokamax_v4`` without tokamax
(issue 29): the encoders against their definitions (NumPy, ml_dtypes), the writers and gathers,
``mla_swa`` (write, then attend the window) and the ``sparse_mla`` / ``hca_mla`` resume against
float64 oracles with one softmax and the sink once, the protocol identity, the chain against
the package's own ``dsa_jax.v4_attention``, and the refusals. Every cache slot no row may read
holds NaN. The builders here are shared with ``tests/test_tokamax_parity_attention.py``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsa_jax
from dsa_jax.engines.tokamax import attention as tk
from dsa_jax.v4_attention import V4Layout
from reference.formats import tokamax_v4 as tv
from reference.v4_attention import PagedKV

H, D = 4, 512
SM = D ** -0.5
NAN_WORD = np.int32(0x7FC07FC0)  # two bf16 NaNs: a plane cache slot nobody may read
# name -> (q_lens, kv_lens, distribution); one padded sequence slot and 2 padded rows follow
SCENARIOS = {
    "decode": ([1, 1, 1], [9, 30, 4], (3, 3, 3)),
    "prefill": ([7, 12], [7, 20], (0, 2, 2)),
    "mixed": ([1, 6, 3], [17, 12, 26], (1, 2, 3)),
}


@dataclasses.dataclass
class Case:
    """One batch in tokamax's arguments, with the values an oracle needs (float64)."""

    q: jnp.ndarray
    new_kv: jnp.ndarray
    window: np.ndarray  # i32[P, S, 128]: old tokens in reach of the window, NaN elsewhere
    kv_lens: np.ndarray
    page_indices: np.ndarray
    cu_q_lens: np.ndarray
    distribution: np.ndarray
    sinks: jnp.ndarray
    tokens: list  # per sequence f64[kv_len, 512]: every token's row (NaN where unwritten)
    rows: list  # per query row (seq, position) or None
    window_size: int
    lps: int
    csa: tv.CsaCache = None
    csa_pages: np.ndarray = None
    entries: list = None  # per sequence f64[n, 512], the CSA entries' decoded values
    topk: np.ndarray = None

    def swa_args(self, cache=None):
        return (self.q, self.new_kv, jnp.asarray(self.window) if cache is None else cache,
                *(jnp.asarray(x) for x in (self.kv_lens, self.page_indices, self.cu_q_lens,
                                           self.distribution)), self.sinks)

    def swa_kw(self, **kw):
        return dict(sliding_window=self.window_size, logical_page_size=self.lps, sm_scale=SM,
                    **kw)

    def sparse_args(self, state, topk=None):
        topk = self.topk if topk is None else topk
        return (self.q, self.csa.nope, self.csa.rope, jnp.asarray(topk),
                jnp.asarray(self.csa_pages), jnp.asarray(self.cu_q_lens),
                jnp.asarray(self.distribution), self.sinks, *state)


def _pad_meta(q_lens, kv_lens, pad_seqs):
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs]).astype(np.int32)
    return cu, np.asarray(list(kv_lens) + [0] * pad_seqs, np.int32)


def make_case(seed, name, *, q_dtype=jnp.bfloat16, window_size=8, lps=4, rows=10, pps=None,
              csa_ps=8, k=128, pad_rows=2, pad_seqs=1) -> Case:
    """Scenario ``name``: a NaN-filled window cache holding only the old tokens some row's
    window reaches, a CSA cache holding each sequence's ``kv_len // 4`` entries (NaN
    elsewhere), and top-k lists of visible entries (``j < (p + 1) // 4``, a repeat included)."""
    q_lens, kv_lens, dist = SCENARIOS[name] if isinstance(name, str) else name
    rng = np.random.default_rng([seed, sum(map(ord, str(name)))])
    cu, kvl = _pad_meta(q_lens, kv_lens, pad_seqs)
    num_seqs, num_rows = len(kvl), sum(q_lens) + pad_rows
    pps = pps or -(-max(kv_lens) // lps)
    num_pages = num_seqs * pps + 2
    table = rng.permutation(num_pages)[:num_seqs * pps].astype(np.int32)
    window = tv.PlaneCache(jnp.full((num_pages, rows, 128), NAN_WORD), lps)
    new_kv = jnp.asarray(rng.standard_normal((num_rows, D)), jnp.bfloat16)
    tokens, row_facts, olds, slots = [], [None] * num_rows, [], []
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        vals = np.full((kl, D), np.nan)
        lo = max(0, kl - ql - window_size + 1)
        old = np.asarray(jnp.asarray(rng.standard_normal((kl - ql - lo, D)) * 2, jnp.bfloat16),
                         np.float32)
        pos = np.arange(lo, kl - ql)
        olds.append(old)
        slots.append(table[s * pps + pos // lps] * lps + pos % lps)
        vals[lo:kl - ql] = old
        vals[kl - ql:] = np.asarray(new_kv[cu[s]:cu[s + 1]], np.float64)
        tokens.append(vals)
        for j in range(ql):
            row_facts[cu[s] + j] = (s, kl - ql + j)
    window = tv.write_plane_rows(window, np.concatenate(olds), np.concatenate(slots))
    case = Case(jnp.asarray(rng.standard_normal((num_rows, H, D)), q_dtype), new_kv,
                np.asarray(window.words), kvl, table, cu, np.asarray(dist, np.int32),
                jnp.asarray(rng.standard_normal(H), jnp.float32), tokens, row_facts,
                window_size, lps)
    _add_csa(case, rng, kv_lens, csa_ps, k)
    return case


def _add_csa(case, rng, kv_lens, ps, k):
    num_seqs = len(case.kv_lens)
    cpps = -(-max(max(kv_lens) // 4, 1) // ps)
    num_pages = num_seqs * cpps + 1
    table = rng.permutation(num_pages)[:num_seqs * cpps].astype(np.int32)
    csa = tv.CsaCache(jnp.full((num_pages, ps, 128), -1, jnp.int32),  # NaN codes and scales
                      jnp.full((num_pages, ps // 4, 128), -1, jnp.int32))
    n = [kl // 4 for kl in kv_lens]
    slots = np.concatenate([table[s * cpps + np.arange(k) // ps] * ps + np.arange(k) % ps
                            for s, k in enumerate(n)])
    x = (rng.standard_normal((len(slots), D))
         * rng.uniform(0.01, 4, (len(slots), 1))).astype(np.float32)
    csa = tv.write_csa_rows(csa, x, slots)
    values = np.asarray(tv.gather_csa_rows(csa, slots), np.float64)
    entries = np.split(values, np.cumsum(n)[:-1])
    topk = np.full((len(case.rows), k), -1, np.int32)
    for r, rf in enumerate(case.rows):
        vis = 0 if rf is None else (rf[1] + 1) // 4
        if vis:
            pick = rng.permutation(vis)[:rng.integers(1, vis + 1)]
            pick = np.concatenate([pick, pick[:1]])  # a repeat counts twice
            topk[r, rng.permutation(k)[:len(pick)]] = pick
    case.csa, case.csa_pages, case.entries, case.topk = csa, table, entries, topk


def oracle(case, *, non_causal=False, listed=None, hca=None):
    """float64: per live row the window set (``p - W < k <= p``, or up to ``kv_len - 1`` with
    ``non_causal``) plus ``listed[r]`` (extra value rows), one softmax, the sink once. Returns
    ``(out, acc_w, l_w, m_w)``: the output and the window part's state."""
    q = np.asarray(case.q, np.float64)
    sink = np.asarray(case.sinks, np.float64)
    num_rows = q.shape[0]
    out, acc_w = np.zeros((num_rows, H, D)), np.zeros((num_rows, H, D))
    l_w, m_w = np.zeros((num_rows, H)), np.zeros((num_rows, H))
    for r, rf in enumerate(case.rows):
        if rf is None:
            continue
        s, p = rf
        end = case.kv_lens[s] if non_causal else p + 1
        win = case.tokens[s][max(0, p - case.window_size + 1):end]
        assert not np.isnan(win).any()
        for part, vals in enumerate((win, np.concatenate([win, *(listed[r] if listed else [])])
                                     .reshape(-1, D))):
            logits = SM * np.einsum("hd,nd->hn", q[r], vals)
            m = logits.max(-1)
            e = np.exp(logits - m[:, None])
            if part == 0:
                acc_w[r], l_w[r], m_w[r] = e @ vals, e.sum(-1), m
            out[r] = (e @ vals) / (e.sum(-1) + np.exp(sink - m))[:, None]
    return out, acc_w, l_w, m_w


def close(a, b, *, rel=2 ** -8, scale=1e-5):
    """``|a - b| <= rel |b| + scale * max|b|``: a bf16 rounding of an f32 value (``rel =
    2**-8``: one ulp) plus f32-order noise."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    bound = rel * np.abs(b) + scale * np.abs(b).max()
    bad = np.abs(a - b) > bound
    assert not bad.any(), (f"{bad.sum()} of {bad.size} off; worst {np.abs(a - b)[bad].max()} "
                           f"(bound there {bound[bad].min()})")


def listed_entries(case, topk):
    return [[] if rf is None else [case.entries[rf[0]][[j for j in topk[r] if j >= 0]]]
            for r, rf in enumerate(case.rows)]


# ----------------------------------------------------------------------------- formats


def test_csa_encoder_is_the_lane_periodic_rule_and_round_trips():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((24, D)) * rng.uniform(1e-7, 50, (24, 1))).astype(np.float32)
    x[3, :448:64] = 0.0  # an all-zero scale group: amax floor 1e-4 -> 2**-22
    nope, rope = tv.encode_csa_records(x)
    assert nope.dtype == rope.dtype == jnp.int32 and nope.shape == (24, 128)
    groups = np.abs(x[:, :448].astype(np.float64)).reshape(24, 7, 64).max(axis=1)
    s = 2.0 ** np.ceil(np.log2(np.maximum(groups, 1e-4) / 448))  # [24, 64]
    codes = (x[:, :448].reshape(24, 7, 64) / s[:, None, :]).astype(ml_dtypes.float8_e4m3fn)
    record = np.asarray(tv.words_to_slabs(nope)).reshape(24, 512)  # record byte i = slab i
    assert np.array_equal(record[:, :448].view(ml_dtypes.float8_e4m3fn), codes.reshape(24, 448))
    assert np.array_equal(record[:, 448:], (np.log2(s) + 127).astype(np.uint8))
    rope_bf16 = x[:, 448:].astype(ml_dtypes.bfloat16)
    words = np.asarray(rope).view(np.uint32)
    assert np.array_equal((words & 0xFFFF).astype(np.uint16), rope_bf16[:, :32].view(np.uint16))
    assert np.array_equal((words >> 16).astype(np.uint16), rope_bf16[:, 32:].view(np.uint16))
    v = np.asarray(tv.decode_csa_records(nope, rope))
    want = np.concatenate([codes.astype(np.float64) * s[:, None, :]], 1).reshape(24, 448)
    assert np.array_equal(v[:, :448], want) and np.array_equal(v[:, 448:], rope_bf16)
    assert np.array_equal(np.asarray(tv.decode_csa_records(*tv.encode_csa_records(v))), v)


def test_plane_encoder_round_trips_and_the_views_agree():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, D)).astype(np.float32)
    w = np.asarray(tv.encode_plane_rows(x)).view(np.uint32)
    b = x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    assert np.array_equal(w[:, 0], b[:, :128] | b[:, 128:256] << 16)
    assert np.array_equal(w[:, 1], b[:, 256:384] | b[:, 384:] << 16)
    v = np.asarray(tv.decode_plane_rows(w.view(np.int32)))
    assert np.array_equal(v, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.array_equal(np.asarray(tv.slabs_to_words(tv.words_to_slabs(w))), w)


@pytest.mark.parametrize("view", ["int32", "uint32", "uint8"])
def test_plane_writer_and_gather_by_slot(view):
    rng = np.random.default_rng(2)
    base = np.full((3, 6, 128), NAN_WORD, np.int32)
    words = {"int32": base, "uint32": base.view(np.uint32),
             "uint8": np.asarray(tv.words_to_slabs(base))}[view]
    cache = tv.PlaneCache(jnp.asarray(words), 2)  # 2 of the 3 tokens a page holds
    assert cache.shape == (3, 2, 512) and cache.page_size == 2
    x = rng.standard_normal((4, D)).astype(np.float32)
    cache = tv.write_plane_rows(cache, x[:2], [5, 3])  # flat slots
    cache = tv.write_plane_rows(cache, x[2:], [1, 0], pages=[0, 9])  # page 9: dropped
    assert cache.words.dtype == words.dtype and cache.words.shape == words.shape
    got = np.asarray(tv.gather_plane_rows(cache, np.array([5, 3, 1, 2, 6])))
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got[:3], want[[0, 1, 2]])
    assert np.isnan(got[3]).all() and not got[4].any()  # unwritten: NaN; outside: zeros
    stored = np.asarray(tv.slabs_to_words(cache.words) if view == "uint8" else cache.words)
    assert (stored.view(np.int32)[:, 4:] == NAN_WORD).all()  # rows past lps: untouched


def test_csa_writer_and_gather_by_slot():
    rng = np.random.default_rng(3)
    cache = tv.CsaCache(jnp.full((2, 8, 128), -1, jnp.int32), jnp.full((2, 2, 128), -1,
                                                                          jnp.int32))
    x = rng.standard_normal((3, D)).astype(np.float32)
    cache = tv.write_csa_rows(cache, x, [3, 5, 1], pages=[1, 0, 7])
    got = np.asarray(tv.gather_csa_rows(cache, np.array([11, 5, 4, 16])))
    want = np.asarray(tv.decode_csa_records(*tv.encode_csa_records(x)))
    assert np.array_equal(got[:2], want[:2])
    assert np.isnan(got[2]).all() and not got[3].any()
    assert cache.nope.dtype == jnp.int32
    assert np.array_equal(np.asarray(tv.empty_csa_cache(1, 4).rope), np.zeros((1, 1, 128)))


def test_cache_checks_name_the_numbers():
    with pytest.raises(ValueError, match="exceeds the 6 rows // 2 = 3"):
        tv.check_plane_cache("c", tv.PlaneCache(jnp.zeros((1, 6, 128), jnp.int32), 4))
    with pytest.raises(ValueError, match="int32 or uint32"):
        tv.check_plane_cache("c", tv.PlaneCache(jnp.zeros((1, 6, 128), jnp.float32), 2))
    with pytest.raises(ValueError, match=r"\[..., num_pages, rows, 4, 128\]"):
        tv.check_plane_cache("c", tv.PlaneCache(jnp.zeros((1, 6, 2, 128), jnp.uint8), 2))
    with pytest.raises(ValueError, match="multiple of 4"):
        tv.check_csa_cache("c", tv.CsaCache(jnp.zeros((1, 6, 128), jnp.int32),
                                            jnp.zeros((1, 1, 128), jnp.int32)))
    with pytest.raises(ValueError, match=r"shape \(1, 2, 128\)"):
        tv.check_csa_cache("c", tv.CsaCache(jnp.zeros((1, 8, 128), jnp.int32),
                                            jnp.zeros((1, 1, 128), jnp.int32)))
    with pytest.raises(ValueError, match="one dtype"):
        tv.check_csa_cache("c", tv.CsaCache(jnp.zeros((1, 8, 128), jnp.int32),
                                            jnp.zeros((1, 2, 128), jnp.uint32)))
    with pytest.raises(TypeError, match="must be a CsaCache"):
        tv.check_csa_cache("c", jnp.zeros((1, 8, 128), jnp.int32))


# ----------------------------------------------------------------------------- the ops


@pytest.mark.parametrize(("name", "mode"), [("decode", "normalized"), ("prefill", "unnormalized"),
                                           ("mixed", "non_causal_u8"), ("mixed", "normalized")])
def test_mla_swa_writes_then_attends_the_window(name, mode):
    case = make_case(4, name)
    slab = mode == "non_causal_u8"
    cache = tv.words_to_slabs(case.window) if slab else jnp.asarray(case.window)
    out, new_cache, l_, m = tk.mla_swa(*case.swa_args(cache), **case.swa_kw(
        unnormalized_output=mode == "unnormalized", non_causal_block=slab))
    # the cache: this step's rows at their positions, nothing else changed
    pps = len(case.page_indices) // len(case.kv_lens)
    slots = [-1 if rf is None else case.page_indices[rf[0] * pps + rf[1] // case.lps]
             * case.lps + rf[1] % case.lps for rf in case.rows]
    want = tv.write_plane_rows(tv.PlaneCache(jnp.asarray(case.window), case.lps), case.new_kv,
                               slots)
    got = tv.slabs_to_words(new_cache) if slab else new_cache
    assert new_cache.dtype == cache.dtype and new_cache.shape == cache.shape
    assert np.array_equal(np.asarray(got).view(np.int32), np.asarray(want.words))
    o, acc, lw, mw = oracle(case, non_causal=slab)
    assert out.dtype == case.q.dtype and not np.isnan(np.asarray(out, np.float32)).any()
    close(out, acc if mode == "unnormalized" else o)
    close(l_, lw, rel=1e-5, scale=0)
    np.testing.assert_allclose(np.asarray(m), mw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_sparse_mla_resumes_the_window_with_one_softmax(q_dtype):
    case = make_case(5, "mixed", q_dtype=q_dtype)
    _, l_, m = state = _window_state(case)
    out = tk.sparse_mla(*case.sparse_args(state), sm_scale=SM)
    want = oracle(case, listed=listed_entries(case, case.topk))[0]
    assert out.dtype == q_dtype and l_.dtype == m.dtype == jnp.float32
    # bf16: the window's acc is stored in bf16 between the ops (tokamax's protocol)
    close(out, want, scale=2 ** -8 if q_dtype == jnp.bfloat16 else 1e-5)
    # identity: no listed entry gives mla_swa's normalized output
    none = np.full_like(case.topk, -1)
    alone = tk.sparse_mla(*case.sparse_args(state, none), sm_scale=SM)
    normalized = tk.mla_swa(*case.swa_args(), **case.swa_kw())[0]
    close(alone, normalized, scale=2 ** -8 if q_dtype == jnp.bfloat16 else 1e-6)


def _window_state(case):
    win, _, l_, m = tk.mla_swa(*case.swa_args(), **case.swa_kw(unnormalized_output=True))
    return win, l_, m


def hca_case(case, rng, lps: int = 2, pps: int = 4):
    """An HCA ``PlaneCache`` for ``case``'s sequences (``pps`` pages of ``lps`` entries each,
    in a random table; NaN words elsewhere) holding ``n[s]`` random bf16-valued entries of
    sequence ``s``: ``(cache, table i32[S * pps], n i32[S], x f32[sum n, 512])``."""
    num_seqs = len(case.kv_lens)
    table = rng.permutation(num_seqs * pps + 1)[:num_seqs * pps].astype(np.int32)
    hca = tv.PlaneCache(jnp.full((num_seqs * pps + 1, 6, 128), NAN_WORD), lps)
    n = rng.integers(2, pps * lps + 1, num_seqs)
    slots = np.concatenate([table[s * pps + np.arange(k) // lps] * lps + np.arange(k) % lps
                            for s, k in enumerate(n)])
    x = np.asarray(jnp.asarray(rng.standard_normal((len(slots), D)), jnp.bfloat16), np.float32)
    return tv.write_plane_rows(hca, x, slots), table, n, x


def test_hca_mla_resumes_over_each_rows_visible_entries():
    case = make_case(6, "mixed")
    rng = np.random.default_rng(6)
    lps = 2
    hca, table, n, x = hca_case(case, rng, lps)
    entries = np.split(x.astype(np.float64), np.cumsum(n)[:-1])
    counts = np.array([0 if rf is None else rng.integers(0, len(entries[rf[0]]) + 1)
                       for rf in case.rows], np.int32)
    counts[0] = len(entries[case.rows[0][0]])
    state = _window_state(case)
    args = (case.q, tv.words_to_slabs(hca.words), jnp.asarray(counts), jnp.asarray(table),
            jnp.asarray(case.cu_q_lens), jnp.asarray(case.distribution), case.sinks, *state)
    out = tk.hca_mla(*args, logical_page_size=lps, sm_scale=SM)
    listed = [[] if rf is None else [entries[rf[0]][:counts[r]]]
              for r, rf in enumerate(case.rows)]
    close(out, oracle(case, listed=listed)[0], scale=2 ** -8)


@pytest.mark.parametrize("rule", tk.CAUSAL_RULES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_hca_lens_to_attend_is_the_rule(rule, ratio):
    q_lens, kv_lens = [1, 9, 3], [300, 260, 131]
    cu, kvl = _pad_meta(q_lens, kv_lens, 1)
    got = tk.hca_lens_to_attend(kvl, cu, np.array([1, 2, 3], np.int32), num_rows=15,
                                causal_rule=rule, compress_ratio=ratio)
    want = np.zeros(15, np.int32)
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for j in range(ql):
            p = kl - ql + j
            want[cu[s] + j] = ((p + 1) // ratio if rule == "official"
                               else min(p // ratio + 1, kl // ratio))
    assert np.array_equal(np.asarray(got), want)


@pytest.mark.parametrize("ratio", [4, 128])
def test_the_chain_is_the_packages_v4_attention(ratio):
    """``mla_swa`` then ``sparse_mla`` / ``hca_mla`` on tokamax's bytes equals
    ``dsa_jax.v4_attention`` on native plain caches holding the same values (f32 q)."""
    spec = ([1, 5, 2], [140, 260, 131], (1, 2, 3)) if ratio == 128 else "mixed"
    case = make_case(7, spec, q_dtype=jnp.float32)
    win, cache, l_, m = tk.mla_swa(*case.swa_args(), **case.swa_kw(unnormalized_output=True))
    num_seqs, pps = len(case.kv_lens), len(case.page_indices) // len(case.kv_lens)
    plane = tv.PlaneCache(cache, case.lps)
    window = tv.gather_plane_rows(plane, np.arange(plane.num_pages * case.lps)).reshape(
        plane.num_pages, case.lps, D)
    w_kv = PagedKV(window, jnp.asarray(case.page_indices),
                   jnp.arange(num_seqs + 1, dtype=jnp.int32) * pps * case.lps)
    if ratio == 4:
        out = tk.sparse_mla(*case.sparse_args((win, l_, m)), sm_scale=SM)
        comp, cpps, idx = case.csa, len(case.csa_pages) // num_seqs, case.topk
        comp_pages = case.csa_pages
        values = tv.gather_csa_rows(comp, np.arange(comp.num_pages * comp.page_size))
        comp_ps = comp.page_size
    else:
        comp_ps, cpps = 2, 2
        comp_pages = np.arange(num_seqs * cpps, dtype=np.int32)[::-1].copy()
        values = jnp.asarray(np.random.default_rng(7).standard_normal(
            (num_seqs * cpps * comp_ps, D)), jnp.bfloat16).astype(jnp.float32)
        counts = tk.hca_lens_to_attend(case.kv_lens, case.cu_q_lens, case.distribution,
                                       num_rows=len(case.rows))
        hca = np.asarray(tv.encode_plane_rows(values)).reshape(-1, comp_ps * 2, 128)
        out = tk.hca_mla(case.q, jnp.asarray(hca), counts, jnp.asarray(comp_pages),
                         jnp.asarray(case.cu_q_lens), jnp.asarray(case.distribution),
                         case.sinks, win, l_, m, logical_page_size=comp_ps, sm_scale=SM)
        idx = None
    c_kv = PagedKV(jnp.asarray(values).reshape(-1, comp_ps, D), jnp.asarray(comp_pages),
                   jnp.arange(num_seqs + 1, dtype=jnp.int32) * cpps * comp_ps)
    layout = V4Layout(compress_ratio=ratio, window_page_size=case.lps,
                      window_size=case.window_size, window_pages_per_seq=pps,
                      compressed_page_size=comp_ps, compressed_pages_per_seq=cpps)
    want = dsa_jax.v4_attention(case.q, w_kv, jnp.asarray(case.kv_lens),
                                jnp.asarray(case.cu_q_lens), jnp.asarray(case.distribution),
                                layout=layout, compressed=c_kv, compressed_indices=idx,
                                attn_sink=case.sinks, sm_scale=SM, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5,
                               atol=2e-5 * float(np.abs(np.asarray(want)).max()))


def test_refusals_are_named():
    case = make_case(8, "decode")
    args, kw = case.swa_args(), case.swa_kw()
    with pytest.raises(ValueError, match="len\\(page_indices\\) = 13 .* M = 4"):
        tk.mla_swa(*args[:4], jnp.zeros(13, jnp.int32), *args[5:], **kw)
    with pytest.raises(ValueError, match="new_kv must be bfloat16"):
        tk.mla_swa(case.q, case.new_kv.astype(jnp.float32), *args[2:], **kw)
    with pytest.raises(ValueError, match="logical_page_size = 6 exceeds"):
        tk.mla_swa(*args, **{**kw, "logical_page_size": 6})
    with pytest.raises(ValueError, match="int32\\[P, S, 128\\] or uint8"):
        tk.mla_swa(*args[:2], jnp.asarray(case.window.view(np.uint32)), *args[3:], **kw)
    with pytest.raises(NotImplementedError, match="pallas"):  # the kernel's window is causal
        tk.mla_swa(*args, **{**kw, "non_causal_block": True}, implementation="pallas")
    with pytest.raises(ValueError, match="unknown implementation"):
        tk.mla_swa(*args, **kw, implementation="mosaic")
    out = tk.mla_swa(*args, **{**kw, "non_causal_block": True},
                     implementation=["pallas", "xla"])[0]  # falls through to "xla"
    assert out.shape == case.q.shape
    state = _window_state(case)
    with pytest.raises(ValueError, match="positive multiple of 128"):
        tk.sparse_mla(*case.sparse_args(state, case.topk[:, :100]))
    with pytest.raises(ValueError, match="swa_accumution.dtype"):
        tk.sparse_mla(*case.sparse_args((state[0].astype(jnp.float32), *state[1:])))
    bad = list(case.sparse_args(state))
    bad[0] = case.q[..., :256]
    with pytest.raises(ValueError, match="q.shape\\[2\\] must equal"):
        tk.sparse_mla(*bad)
