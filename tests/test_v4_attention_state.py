"""The fused V4 attention kernel on tokamax's cache formats and its flash-state protocol
(``pallas_kernels.v4_attention.formats`` / ``state``), in the strict interpreter:

- ``PlaneCache`` (window / HCA rows) and ``CsaCache`` (CSA entries) read natively equal
  ``reference.v4_attention_ref`` on the plain f32 caches holding the same values (a local
  encoder written from ``reference.formats.tokamax_v4``'s docstring; the plain cache is the
  encoding decoded here, so every value is exact and the f32 tolerance holds);
- the state entries against a float64 NumPy oracle of the flash state (``m`` the max scaled
  logit, ``l`` and ``acc`` relative to it), the sink applied exactly once;
- the window-only pass to a state then the CSA entries from it (tokamax's ``mla_swa`` ->
  ``sparse_mla`` split) equals the one-call reference;
- the HBM bytes the interpreter counts equal ``kernel.fused_traffic``'s kernel side.

Tolerance: ``TOL`` 2e-5 (f32 q: f32 operands, f32 sums in another order than the oracle's f64;
a bf16 state's ``acc`` enters the oracle as the same bf16 values), ``BF16_TOL`` 1e-2 on the
output of a bf16 q (P rounded to bf16 before ``P @ V``).
Every slot that must not be read holds NaN bits (``v4_batches``; a plane page's spare rows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from oracle import row_sequences, token_keys
from v4_batches import make_v4_batch

from pallas_kernels import tpu
from pallas_kernels.v4_attention import formats, kernel, traffic, walk
from pallas_kernels.v4_attention import v4_attention as v4_pallas
from pallas_kernels.v4_attention.state import (
    FlashState,
    v4_attention_state,
    v4_entries_from_state,
)
from reference.formats import tokamax_v4
from reference.v4_attention import PagedKV, v4_attention_ref

SCALE = 512 ** -0.5
TOL = dict(rtol=2e-5, atol=2e-5)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)  # a bf16 q: P rounded to bf16 before P @ V
SINK = np.array([0.5, -np.inf, 3.0], np.float32)
NO_RACES = {"interpret": pltpu.InterpretParams(**dict(tpu.STRICT_INTERPRET,
                                                      detect_races=False))}
BLOCK = 8
NAN_WORD = np.int32(-1)  # 0xFFFFFFFF: NaN in every byte / half
SPARE_ROWS = 2  # plane pages hold 2 rows more than their tokens use (never read)


# ----------------------------------------------------------------------------- local encoders


def _bf16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def to_plane(x) -> tokamax_v4.PlaneCache:
    """``f32[..., P, ps, 512]`` -> ``PlaneCache`` (bf16 rows, two 128-word rows per token,
    ``SPARE_ROWS`` NaN rows at the end of each page)."""
    b = _bf16_bits(x)
    rows = [b[..., 0:128] | b[..., 128:256] << 16, b[..., 256:384] | b[..., 384:512] << 16]
    words = np.stack(rows, axis=-2).reshape(*x.shape[:-2], 2 * x.shape[-2], 128)
    pad = np.full((*x.shape[:-2], SPARE_ROWS, 128), 0xFFFFFFFF, np.uint32)
    words = np.concatenate([words, pad], axis=-2).view(np.int32)
    return tokamax_v4.PlaneCache(words, logical_page_size=x.shape[-2])


def plane_values(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def to_csa(x) -> tokamax_v4.CsaCache:
    """``f32[..., P, ps, 512]`` (``ps % 4 == 0``) -> ``CsaCache``: feature ``i < 448`` the e4m3
    code of ``x_i / 2**e_j`` (``j = i % 64``, ``e_j = ceil(log2(max(amax_j, 1e-4) / 448))`` over
    the 7 features of that lane) in byte ``i // 128`` of word ``i % 128``, the exponent byte
    ``e_j + 127`` in byte 3 of word ``64 + j``; the rope bf16 pairs ``(k, k + 32)`` in words
    ``32 (t % 4) + k`` of row ``t // 4``. A token holding NaN: every word NaN."""
    x = np.asarray(x, np.float32)
    nope = x[..., :448].reshape(*x.shape[:-1], 7, 64)
    amax = np.abs(np.nan_to_num(nope, nan=0.0)).max(axis=-2)  # NaN tokens: NaN words below
    e = np.ceil(np.log2(np.maximum(amax, 1e-4) / 448)).astype(np.int32)
    codes = (nope / np.exp2(e)[..., None, :].astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    rec = np.zeros((*x.shape[:-1], 512), np.uint8)
    rec[..., :448] = codes.reshape(*x.shape[:-1], 448).view(np.uint8)
    rec[..., 448:] = (e + 127).astype(np.uint8)
    words = rec.reshape(*x.shape[:-1], 4, 128).astype(np.uint32)
    nope_w = sum(words[..., j, :] << (8 * j) for j in range(4)).astype(np.uint32)
    rb = _bf16_bits(x[..., 448:])
    rope = rb[..., :32] | rb[..., 32:] << 16
    bad = np.isnan(x).any(axis=-1)
    nope_w[bad], rope[bad] = 0xFFFFFFFF, 0xFFFFFFFF
    *lead, ps, _ = rope.shape
    return tokamax_v4.CsaCache(nope_w.view(np.int32),
                               rope.reshape(*lead, ps // 4, 128).view(np.int32))


def csa_values(c: tokamax_v4.CsaCache) -> np.ndarray:
    """The values a ``CsaCache`` holds, decoded from the bytes (NaN where the words are)."""
    nope = np.asarray(c.nope).view(np.uint32)
    rec = np.stack([(nope >> (8 * j)) & 0xFF for j in range(4)], axis=-2).astype(np.uint8)
    rec = rec.reshape(*nope.shape[:-1], 512)
    vals = rec[..., :448].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    byte = rec[..., 448:].astype(np.int32)
    scale = np.where(byte == 0xFF, np.nan, np.exp2(np.minimum(byte, 254).astype(np.float32) - 127))
    vals = (vals.reshape(*vals.shape[:-1], 7, 64) * scale[..., None, :]).reshape(vals.shape)
    rope = np.asarray(c.rope).view(np.uint32).reshape(*nope.shape[:-1], 32)
    halves = np.concatenate([rope & 0xFFFF, rope >> 16], axis=-1).astype(np.uint16)
    return np.concatenate([vals, halves.view(ml_dtypes.bfloat16).astype(np.float32)], axis=-1)


def test_local_encoders_round_trip_and_csa_placement():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 512)).astype(np.float32)
    x[1, 2] = np.nan
    np.testing.assert_array_equal(csa_values(to_csa(x)), csa_values(to_csa(csa_values(to_csa(x)))))
    y = csa_values(to_csa(x))
    assert np.isnan(y[1, 2]).all() and not np.isnan(y[0]).any()
    np.testing.assert_allclose(y[0], x[0], rtol=2 ** -3)  # e4m3: 3 mantissa bits
    p = to_plane(x)
    assert p.words.shape == (2, 2 * 4 + SPARE_ROWS, 128) and p.logical_page_size == 4
    w = np.asarray(p.words).view(np.uint32)[0, 2 * 3 + 1, 5]  # token 3, row 2k+1, word 5
    bits = _bf16_bits(x[0, 3])
    assert w == bits[256 + 5] | bits[384 + 5] << 16


# ----------------------------------------------------------------------------- batches


def batch(ratio, seed=0, **kw):
    """A small ragged batch (``v4_batches``): decode rows (one whose early window pages are
    released), a short sequence, a prefill chunk, a NaN padding row; H = 3."""
    return make_v4_batch([seed, ratio], q_lens=[1, 1, 3], kv_lens=[41, 9, 24], ratio=ratio,
                         heads=3, pad_rows=1, window_size=16, window_page_size=4,
                         comp_page_size=4, k=6, **kw)


def with_values(b, fn):
    """``b`` with both caches replaced by ``fn(cache)`` (the values a format holds)."""
    comp = b.compressed and (fn(b.compressed[0]), *b.compressed[1:])
    return dataclasses.replace(b, window=(fn(b.window[0]), *b.window[1:]), compressed=comp)


def csa_view(x):
    return csa_values(to_csa(x))


def ref(b, sink=None, **kw):
    return v4_attention_ref(*b.args(), sm_scale=SCALE, return_lse=True, **b.kwargs(sink=sink),
                            **kw)


# ----------------------------------------------------------------------------- (a) formats


@pytest.mark.kernel_gate
@pytest.mark.parametrize("ratio,dtype", [(0, jnp.float32), (128, jnp.bfloat16)])
def test_plane_caches_match_the_reference(ratio, dtype):
    """Window and HCA caches as tokamax ``PlaneCache`` (two rows per token, spare NaN rows per
    page): the fused kernel equals the reference on the bf16 values they hold (a bf16 q: the
    kernel rounds P to bf16 for ``P @ V``, the reference's f32 regime does not: 1e-2)."""
    b = with_values(batch(ratio, seed=1), plane_values)
    b = dataclasses.replace(b, q=np.asarray(jnp.asarray(b.q, dtype).astype(jnp.float32)))
    out, lse = v4_pallas(*b.args(jnp.asarray(b.q, dtype), cast=to_plane), sm_scale=SCALE,
                         return_lse=True, **b.kwargs(cast=to_plane, sink=SINK),
                         tokens_per_block=BLOCK, **NO_RACES)
    assert out.dtype == dtype
    want, want_lse = ref(b, SINK)
    tol = TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), **tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **TOL)


@pytest.mark.kernel_gate
def test_csa_caches_match_the_reference_stacked_at_a_traced_layer():
    """Both caches tokamax ``CsaCache`` (lane-periodic ue8m0 scales), stacked 2 layers (layer 0
    noise), read at a traced layer, with races detected: equals the reference on the decoded
    values."""
    b = with_values(batch(4, seed=2), csa_view)
    noise = np.random.default_rng(9)

    def stacked(x):
        return np.stack([noise.standard_normal(x.shape).astype(np.float32), x])

    def cast(x):
        return to_csa(stacked(x))

    out, lse = v4_pallas(*b.args(cast=cast), sm_scale=SCALE, return_lse=True,
                         **b.kwargs(cast=cast, sink=SINK), tokens_per_block=BLOCK,
                         interpret=True, layer=jnp.int32(1))
    want, want_lse = ref(b, SINK)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **TOL)


def test_format_refusals_name_the_numbers():
    b = batch(4)
    plane = to_plane(b.window[0])
    kw = dict(sm_scale=SCALE, **b.kwargs(cast=to_csa))
    bad = tokamax_v4.PlaneCache(plane.words, logical_page_size=6)
    with pytest.raises(ValueError, match=r"logical_page_size=6 needs 12 rows .* has 10"):
        v4_pallas(b.q, PagedKV(bad, *b.window[1:]), *b.args()[2:], **kw, interpret=True)
    with pytest.raises(NotImplementedError, match=r"window.cache plane \(tokamax PlaneCache\) "
                                                  r"and compressed.cache csa .*state"):
        v4_pallas(b.q, PagedKV(plane, *b.window[1:]), *b.args()[2:], **kw, interpret=True)
    csa = to_csa(b.compressed[0])
    odd = tokamax_v4.CsaCache(csa.nope[:, :3], csa.rope)
    with pytest.raises(ValueError, match="page size 3 must be a multiple of 4"):
        v4_pallas(*b.args(cast=to_csa), **dict(kw, compressed=PagedKV(odd, *b.compressed[1:])),
                  interpret=True)
    with pytest.raises(NotImplementedError, match="csa .tokamax CsaCache.: the two-pass"):
        v4_pallas(*b.args(cast=to_csa), **kw, interpret=True, fused=False)


# ----------------------------------------------------------------------------- state oracle


def _window_rows(b, r, rs):
    seq, p = rs
    keys = token_keys(seq, b.window[0], b.kv_lens, b.window[1], b.window[2],
                      b.window_pages_per_seq)
    return [keys[s] for s in range(max(0, p - b.window_size + 1), p + 1) if s in keys]


def _listed_rows(b, r, rs, idx):
    """Rows of the listed entries with no position mask: ``0 <= e <`` the sequence's entry
    capacity, page present (``v4_entries_from_state``)."""
    seq, _ = rs
    cache, table, cu = b.compressed
    cap = min(b.comp_pages_per_seq * cache.shape[1], int(cu[seq + 1] - cu[seq]))
    keys = token_keys(seq, cache, np.full(len(b.kv_lens), cap), table, cu, b.comp_pages_per_seq)
    return [keys[int(e)] for e in idx[r] if int(e) in keys]


def state_oracle(q, rows_of, start=None):
    """float64 ``(acc, l, m)`` per row and head over ``rows_of(r)`` (a list of value rows, or
    None for a row outside every sequence), merged with ``start`` (a state or None)."""
    q = np.asarray(q, np.float64)
    t, h, d = q.shape
    acc, den, mx = np.zeros((t, h, d)), np.zeros((t, h)), np.zeros((t, h))
    for r in range(t):
        vals = rows_of(r) or []
        logits = [SCALE * np.einsum("hd,nd->hn", q[r], np.stack(vals))] if vals else []
        parts = []
        if start is not None:  # a head with l <= 0 holds nothing: its m and acc are not read
            has = np.asarray(start[1])[r] > 0
            parts.append((np.where(has[:, None], np.asarray(start[0], np.float64)[r], 0.0),
                          np.where(has, np.asarray(start[1], np.float64)[r], 0.0),
                          np.where(has, np.asarray(start[2], np.float64)[r], -np.inf)))
        if logits:
            m = logits[0].max(axis=-1)
            e = np.exp(logits[0] - m[:, None])
            parts.append((e @ np.stack(vals), e.sum(-1), m))
        if not parts:
            continue
        m = np.max([p[2] for p in parts], axis=0)
        safe = np.where(np.isfinite(m), m, 0.0)
        for a, lsum, pm in parts:
            w = np.exp(pm - safe)
            acc[r] += a * w[:, None]
            den[r] += lsum * w
        mx[r] = safe
    return acc, den, mx


def normalized(state, sink=None):
    acc, den, m = (np.asarray(x, np.float64) for x in state)
    extra = 0.0 if sink is None else np.exp(np.asarray(sink, np.float64)[None, :] - m)
    total = den + extra
    out = np.where(total[..., None] > 0, acc / np.where(total > 0, total, 1)[..., None], 0.0)
    return out


def check_state(got: FlashState, want):
    acc, den, m = want
    live = den > 0
    np.testing.assert_allclose(np.asarray(got.m)[live], m[live], **TOL)
    np.testing.assert_array_equal(np.asarray(got.m)[~live], 0.0)
    np.testing.assert_allclose(np.asarray(got.l), den, **TOL)
    np.testing.assert_allclose(np.asarray(got.acc, np.float64), acc, **TOL)


# ----------------------------------------------------------------------------- (b) state


def _rows(b):
    return row_sequences(b.q.shape[0], b.cu_q_lens, b.kv_lens, b.distribution)


@pytest.mark.kernel_gate
def test_window_pass_returns_the_flash_state_and_resumes_from_one():
    """The window alone on a ``PlaneCache`` (ratio 0) returns the oracle's state (f32 acc); a
    second call starting from a given state (empty rows hold NaN m / acc: not read) returns
    the merged state, and normalizing from it applies the sink once."""
    b = with_values(batch(0, seed=3), plane_values)
    rows = _rows(b)
    win = lambda r: rows[r] and _window_rows(b, r, rows[r])  # noqa: E731
    args, kw = b.args(cast=to_plane), b.kwargs(cast=to_plane)
    got = v4_attention_state(*args, sm_scale=SCALE, **kw, return_state=True, block=BLOCK,
                             acc_dtype=jnp.float32, **NO_RACES)
    check_state(got, state_oracle(b.q, win))
    rng = np.random.default_rng(4)
    t, h, d = b.q.shape
    start = FlashState(rng.standard_normal((t, h, d)).astype(np.float32),
                       rng.uniform(0.5, 2, (t, h)).astype(np.float32),
                       rng.uniform(-1, 1, (t, h)).astype(np.float32))
    start.l[0, 1] = 0.0
    start.m[0, 1], start.acc[0, 1] = np.nan, np.nan  # l = 0: nothing, never read
    got2 = v4_attention_state(*args, sm_scale=SCALE, **kw, state=start, return_state=True,
                              block=BLOCK, acc_dtype=jnp.float32, **NO_RACES)
    want2 = state_oracle(b.q, win, start)
    check_state(got2, want2)
    out, lse = v4_attention_state(*args, sm_scale=SCALE, **dict(kw, attn_sink=SINK),
                                  state=start, return_lse=True, block=BLOCK, **NO_RACES)
    np.testing.assert_allclose(np.asarray(out), normalized(want2, SINK), **TOL)
    live = want2[1] > 0
    np.testing.assert_allclose(np.asarray(lse)[live], (want2[2] + np.log(want2[1]))[live], **TOL)
    assert np.isneginf(np.asarray(lse)[~live]).all()


@pytest.mark.kernel_gate
def test_csa_entries_from_state_have_no_position_mask():
    """``v4_entries_from_state`` on a ``CsaCache`` from a bf16-acc state: every listed entry
    inside the sequence's entry capacity is read (entries past ``(p + 1) // 4`` and past
    ``kv_len // 4`` too), -1 / negative / past capacity / missing pages are none; the state
    returned (f32) and the normalized output (sink once) match the oracle."""
    b = batch(4, seed=5, comp_pages_per_seq=4)
    cache, table, _ = b.compressed
    cache, tail = cache.copy(), np.isnan(cache[table]).any(axis=-1)  # past kv_len // 4
    cache[table] = np.where(tail[..., None], 0.5, cache[table])  # in a sequence's own pages
    b = with_values(dataclasses.replace(b, compressed=(cache, *b.compressed[1:])), csa_view)
    rows = _rows(b)
    idx = b.compressed_indices.copy()
    idx[0, :2] = [10, 13]  # row 0 (kv 41: 10 entries, 3 pages): 10 is read, 13 past them
    listed = lambda r: rows[r] and _listed_rows(b, r, rows[r], idx)  # noqa: E731
    comp = PagedKV(to_csa(b.compressed[0]), *b.compressed[1:])
    rng = np.random.default_rng(6)
    t, h, d = b.q.shape
    acc0 = rng.standard_normal((t, h, d)).astype(ml_dtypes.bfloat16)
    start = FlashState(jnp.asarray(acc0), jnp.asarray(rng.uniform(0.5, 2, (t, h)), jnp.float32),
                       jnp.asarray(rng.uniform(-1, 1, (t, h)), jnp.float32))
    common = (b.q, comp, b.cu_q_lens, b.distribution, idx, start)
    kw = dict(sm_scale=SCALE, compressed_pages_per_seq=b.comp_pages_per_seq, block=BLOCK,
              **NO_RACES)
    want = state_oracle(b.q, listed, (acc0.astype(np.float32), start.l, start.m))
    got = v4_entries_from_state(*common, return_state=True, acc_dtype=jnp.float32, **kw)
    check_state(got, want)
    out = v4_entries_from_state(*common, attn_sink=SINK, **kw)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), normalized(want, SINK), **TOL)
    masked = idx.copy()
    masked[0, :2] = -1  # without entry 10 (past kv_len // 4) row 0 differs: it was read
    no10 = state_oracle(b.q, lambda r: rows[r] and _listed_rows(b, r, rows[r], masked),
                        (acc0.astype(np.float32), start.l, start.m))
    assert not np.allclose(normalized(no10, SINK)[0], np.asarray(out)[0], **TOL)


@pytest.mark.kernel_gate
def test_window_state_then_csa_entries_is_the_one_call_op():
    """tokamax's split on tokamax's formats: the window pass on a ``PlaneCache`` returns the
    state (acc in q's dtype, f32 here), the CSA pass on a ``CsaCache`` resumes from it over the
    visible entries (the indices masked by ``j < (p + 1) // 4``, as the indexer gives them) and
    normalizes with the sink: the reference's one-call V4 attention on the plain values."""
    b = with_values(batch(4, seed=7), csa_view)
    b = dataclasses.replace(b, window=(plane_values(b.window[0]), *b.window[1:]))
    rows = _rows(b)
    idx = np.array([[e if rs and 0 <= e < (rs[1] + 1) // 4 else -1 for e in b.compressed_indices[r]]
                    for r, rs in enumerate(rows)], np.int32)
    w_kw = dict(b.kwargs(cast=to_plane), compress_ratio=0, compressed=None,
                compressed_indices=None, compressed_pages_per_seq=0)
    st = v4_attention_state(*b.args(cast=to_plane), sm_scale=SCALE, **w_kw, return_state=True,
                            block=BLOCK, **NO_RACES)
    assert st.acc.dtype == jnp.float32
    out, lse = v4_entries_from_state(b.q, PagedKV(to_csa(b.compressed[0]), *b.compressed[1:]),
                                     b.cu_q_lens, b.distribution, idx, st, sm_scale=SCALE,
                                     compressed_pages_per_seq=b.comp_pages_per_seq,
                                     attn_sink=SINK, return_lse=True, block=BLOCK, **NO_RACES)
    want, want_lse = ref(b, SINK)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), **TOL)


@pytest.mark.kernel_gate
def test_window_pass_writes_this_steps_rows_in_place_first():
    """tokamax's ``mla_swa``: the window pass takes this step's rows (``new_kv``) and writes each
    into the (stacked, layer 1 of 2) ``PlaneCache`` at its own position before attending, with
    races detected: the returned cache equals the encoding of the full cache bit for bit (layer
    0, spare rows and every other slot untouched; padding rows write nothing), and the state
    equals the oracle's over the written values."""
    b = with_values(batch(0, seed=8), plane_values)
    rows = _rows(b)
    cache, table, cu = b.window
    ps = cache.shape[1]
    before, new_kv = cache.copy(), np.full((b.q.shape[0], 512), np.nan, np.float32)
    for r, rs in enumerate(rows):
        if rs:
            seq, p = rs
            pid = table[cu[seq] // ps + p // ps]
            new_kv[r], before[pid, p % ps] = cache[pid, p % ps], np.nan
    other = np.random.default_rng(3).standard_normal(cache.shape).astype(np.float32)
    full, stale = to_plane(np.stack([other, cache])), to_plane(np.stack([other, before]))
    w_kw = b.kwargs(cast=to_plane)
    st, written = v4_attention_state(b.q, PagedKV(stale, table, cu), *b.args()[2:],
                                     sm_scale=SCALE, **w_kw, return_state=True, block=BLOCK,
                                     acc_dtype=jnp.float32, interpret=True, layer=jnp.int32(1),
                                     new_kv=jnp.asarray(new_kv, jnp.bfloat16))
    assert written.logical_page_size == ps
    np.testing.assert_array_equal(np.asarray(written.words), np.asarray(full.words))
    check_state(st, state_oracle(b.q, lambda r: rows[r] and _window_rows(b, r, rows[r])))


def test_state_refusals_name_the_numbers():
    b = batch(0)
    args, kw = b.args(cast=to_plane), b.kwargs(cast=to_plane)
    with pytest.raises(ValueError, match="attn_sink is applied once"):
        v4_attention_state(*args, sm_scale=SCALE, **dict(kw, attn_sink=SINK),
                           return_state=True, interpret=True)
    t, h, d = b.q.shape
    bad = FlashState(np.zeros((t, h, d), np.float32), np.zeros((t, h + 1), np.float32),
                     np.zeros((t, h), np.float32))
    with pytest.raises(ValueError, match=r"state.l must have shape \(T, H\) = \(6, 3\), got "
                                         r"\(6, 4\)"):
        v4_attention_state(*args, sm_scale=SCALE, **kw, state=bad, interpret=True)
    bad = FlashState(np.zeros((t, h, d), np.float32), np.zeros((t, h), np.float16),
                     np.zeros((t, h), np.float32))
    with pytest.raises(TypeError, match="state.l must be float32"):
        v4_attention_state(*args, sm_scale=SCALE, **kw, state=bad, interpret=True)
    b4 = batch(4)
    with pytest.raises(ValueError, match=r"compressed_indices.shape\[0\] must equal"):
        v4_entries_from_state(b4.q, PagedKV(to_csa(b4.compressed[0]), *b4.compressed[1:]),
                              b4.cu_q_lens, b4.distribution, b4.compressed_indices[:2],
                              sm_scale=SCALE, compressed_pages_per_seq=2, interpret=True)


# ----------------------------------------------------------------------------- traffic


def _decode_batch():
    """Decode rows whose window is full and whose k listed entries all exist (every row
    gathers exactly ``W + k`` tokens, the model's count)."""
    b = make_v4_batch([11], q_lens=[1, 1], kv_lens=[80, 64], ratio=4, heads=2, window_size=16,
                      window_page_size=4, comp_page_size=4, k=8)
    idx = np.array([np.arange(8) + 3, np.arange(8)[::-1] + 1], np.int32)
    return dataclasses.replace(b, compressed_indices=idx)


def _counted(fn):
    from pallas_kernels import _interpret_counter as counter

    with counter.count_hbm_traffic() as n:
        jax.block_until_ready(fn(pltpu.InterpretParams(dma_execution_mode="eager")))
    assert n.dmas_unexecuted == 0
    return n


@pytest.mark.kernel_gate
@pytest.mark.parametrize("case", ["plane_window_state", "plane_window_writes",
                                  "csa_from_state"])
def test_counted_bytes_equal_the_model(case):
    """The interpreter's count (logical bytes) equals ``fused_traffic``'s kernel side: the model
    minus the scalar-prefetched ``row_info`` and tables (copied before the grid, uncounted),
    plus the sink block (f32[H], read once, unmodelled)."""
    b = _decode_batch()
    t, h, _ = b.q.shape
    bq = jnp.asarray(b.q, jnp.bfloat16)
    st = FlashState(jnp.zeros(b.q.shape, jnp.bfloat16), jnp.ones((t, h), jnp.float32),
                    jnp.zeros((t, h), jnp.float32))
    writes = case == "plane_window_writes"
    if case.startswith("plane_window"):
        w_kw = dict(b.kwargs(cast=to_plane), compress_ratio=0, compressed=None,
                    compressed_indices=None, compressed_pages_per_seq=0)
        extra = dict(new_kv=jnp.zeros((t, 512), jnp.bfloat16)) if writes else {}
        n = _counted(lambda ip: v4_attention_state(
            bq, *b.args(cast=to_plane)[1:], sm_scale=SCALE, **w_kw, return_state=True,
            block=BLOCK, interpret=ip, **extra))
        fmt, gathered, k, tables = "plane", b.window_size, 0, len(b.window[1]) + 1
        acc_in, acc_out = 0, 2
    else:
        comp = PagedKV(to_csa(b.compressed[0]), *b.compressed[1:])
        n = _counted(lambda ip: v4_entries_from_state(
            bq, comp, b.cu_q_lens, b.distribution, b.compressed_indices, st, sm_scale=SCALE,
            compressed_pages_per_seq=b.comp_pages_per_seq, attn_sink=SINK[:h], block=BLOCK,
            interpret=ip))
        fmt, gathered, k, tables = "csa", 8, 8, 1 + len(b.compressed[1])
        acc_in, acc_out = 2, 0
    # csa: adjacent listed entries share rope rows and record DMAs (traffic.listed_reads: the
    # exact count; each read its 512 B record, each rope DMA a 512 B row)
    reads, records, ropes = (traffic.listed_reads(
        walk.walk_order(b.compressed_indices), [99, 99], page=4, block=BLOCK)
        if fmt == "csa" else (0, 0, 0))
    listed = dict(read_rows=0, run_rows=reads, run_row_bytes=formats.run_row_bytes(fmt),
                  run_rope_rows=ropes, gather_dmas=records + ropes) if fmt == "csa" else {}
    model = kernel.fused_traffic(rows=t, heads=h, gathered_rows=gathered, meta_words=k,
                                 table_words=tables, block=BLOCK, q_itemsize=2,
                                 row_bytes=formats.row_bytes(fmt),
                                 min_row_bytes=formats.stored_bytes(fmt),
                                 fp8=fmt == "csa", acc_in_itemsize=acc_in,
                                 acc_out_itemsize=acc_out,
                                 written_rows=t * writes, **listed)
    prefetch = 4 * (t * (kernel.INFO_WORDS + writes) + tables)  # + the rows' write positions
    written = n.select("hbm", "hbm", "dma")  # a write's 1 KB read and 1 KB written: one copy
    assert [c.nbytes for c in written] == [1024] * t * writes
    assert n.bytes(lane_padded=False) + 1024 * len(written) == (
        model.bytes_moved - prefetch + 4 * h), n.table()
    gathers = n.select("hbm", "vmem", "dma")
    if fmt == "csa":  # entries 3 .. 10 and 1 .. 8: one record DMA per page, shared rope rows
        assert (reads, records, ropes) == (t * gathered, 3 + 3, 3 + 3)
        assert sum(c.nbytes for c in gathers) == 512 * (reads + ropes)
        assert len(gathers) == records + ropes
    else:
        assert sum(c.nbytes for c in gathers) == t * gathered * 1024
        assert len(gathers) == t * gathered
