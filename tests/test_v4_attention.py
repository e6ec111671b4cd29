"""DeepSeek-V4 attention (``reference.v4_attention``, ``pallas_kernels.v4``, ``dsa_jax.v4``)
against the float64 oracle written from the definition (``oracle.v4_oracle``).

Tolerances (why):
- f32 inputs: ``F32_TOL`` 2e-5 abs/rel. Both backends accumulate in f32 over at most a few
  thousand terms of O(1) values; the oracle is f64 (seen: <= 1e-6).
- bf16 inputs (q and caches rounded to bf16; the oracle gets the same rounded values, exact in
  f64): ``BF16_TOL`` 1e-2 on the output, which is rounded to bf16 (2^-9 relative, twice on the
  Pallas path: each part, then the merge) and whose probabilities the kernel multiplies in bf16;
  the LSE stays f32 (``LSE_BF16_TOL`` 1e-3: bf16 products are exact in f32, the sums are f32).
- fp8 MODEL1 caches (``Fp8V4Cache``): the oracle gets the dequantized cache (``v4_batches.
  fp8_view``); both backends decode exactly those values (e4m3 times a power of two is exact in
  bf16 and f32), so the f32 tolerances above hold, and the fused kernel equals the reference
  within ``F32_TOL`` (f32 sums in another order).
Both Pallas paths run in the strict interpreter (race detection, NaN-filled uninitialized memory,
out-of-bounds reads raise). Every slot that must not be read holds NaN (``v4_batches``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify
from oracle import v4_oracle
from strategies import batch_specs
from v4_batches import make_v4_batch

import dsa_jax
from dsa_jax import LayoutError, PagedKV, V4Layout
from pallas_kernels.v4 import v4_attention
from reference.packed_cache import pack_cache
from reference.v4_attention import v4_attention_ref

SCALE = 512 ** -0.5
F32_TOL = dict(rtol=2e-5, atol=2e-5)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)
LSE_BF16_TOL = dict(rtol=1e-3, atol=1e-3)
# per head: an ordinary sink, none (-inf), one that dominates, one far below every score
SINK = np.array([0.5, -np.inf, 30.0, -30.0], np.float32)

# name -> (q_lens, kv_lens, pad_rows, pad_seqs). "mixed": two decode rows (a long sequence whose
# early window pages are released, and kv_len 1), a zero-length sequence, rows before the window
# is full (p < window_size), and a prefill chunk at p = 125 .. 130 that crosses ratio-4 group
# boundaries ((p + 1) % 4 == 0 and just before) and the first ratio-128 boundary (p + 1 = 127,
# 128, 129); two NaN rows outside every sequence and an inactive sequence slot.
CASES = {
    "mixed": ([1, 1, 0, 3, 6], [200, 1, 0, 5, 131], 2, 1),
    "prefill": ([9, 6], [137, 22], 0, 0),
}

def _ref(*args, **kw):
    return v4_attention_ref(*args, **kw)


def _pallas(*args, **kw):
    return v4_attention(*args, **kw, interpret=True, fused=False)


def _fused(*args, tokens_per_block=16, **kw):  # fused: the default
    return v4_attention(*args, **kw, interpret=True, tokens_per_block=tokens_per_block)


# "pallas": the two-pass form (two MLA kernel calls merged in XLA, fused=False); "fused": the
# one-kernel path (the default) with small blocks (16 rows) so every row walks several blocks
# across the two sources.
BACKENDS = {"reference": _ref, "pallas": _pallas, "fused": _fused}


def batch(name, ratio, seed=0, **kw):
    q_lens, kv_lens, pad_rows, pad_seqs = CASES[name]
    return make_v4_batch([seed, ratio, sum(map(ord, name))], q_lens=q_lens, kv_lens=kv_lens,
                         ratio=ratio, pad_rows=pad_rows, pad_seqs=pad_seqs, **kw)


def bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def rounded(b):
    """The batch with q and caches rounded to bf16 (the oracle's view of a bf16 run)."""
    comp = b.compressed and (bf16(b.compressed[0]), *b.compressed[1:])
    return dataclasses.replace(b, q=bf16(b.q), window=(bf16(b.window[0]), *b.window[1:]),
                               compressed=comp)


def run(b, backend, *, dtype=jnp.float32, cast=None, sink=None, **kw):
    return BACKENDS[backend](*b.args(jnp.asarray(b.q, dtype), cast=cast), sm_scale=SCALE,
                             return_lse=True, **b.kwargs(cast=cast, sink=sink), **kw)


def check(out, lse, b, sink=None, tol=F32_TOL, lse_tol=F32_TOL):
    want, want_lse = v4_oracle(b.q, b.kv_lens, b.cu_q_lens, b.distribution, sm_scale=SCALE,
                               attn_sink=sink, **b.oracle_kwargs())
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, **tol)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], **lse_tol)


# ----------------------------------------------------------------------------- vs the oracle


@pytest.mark.kernel_gate
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_matches_the_oracle_with_sink(ratio, backend):
    b = batch("mixed", ratio)  # SINK has a "no sink" (-inf) head: on and off in one call
    out, lse = run(b, backend, sink=SINK)
    check(out, lse, b, SINK)


@pytest.mark.kernel_gate
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio,fmt", [(4, "packed"), (128, "bf16")])
def test_bf16_query_with_packed_and_plain_bf16_caches(ratio, fmt, backend):
    b = batch("prefill", ratio, seed=1)
    cast = pack_cache if fmt == "packed" else (lambda x: jnp.asarray(x, jnp.bfloat16))
    out, lse = run(b, backend, dtype=jnp.bfloat16, cast=cast, sink=SINK)
    assert out.dtype == jnp.bfloat16
    check(out, lse, rounded(b), SINK, tol=BF16_TOL, lse_tol=LSE_BF16_TOL)


@pytest.mark.parametrize("backend", ["reference", "fused"])  # "pallas" applies the sink with
def test_sink_scales_the_output_and_leaves_the_lse_sink_free(backend):  # the reference's code
    b = batch("mixed", 4)
    out0, lse0 = run(b, backend)  # no sink
    check(out0, lse0, b)
    heads = b.q.shape[1]
    out_inf, lse_inf = run(b, backend, sink=np.full(heads, -np.inf, np.float32))
    np.testing.assert_array_equal(np.asarray(out_inf), np.asarray(out0))  # -inf: no sink
    big = np.full(heads, 1e4, np.float32)  # e^(sink - lse) overflows f32: factor 0, never NaN
    out_big, lse_big = run(b, backend, sink=big)
    np.testing.assert_array_equal(np.asarray(out_big), 0.0)
    for lse in (lse_inf, lse_big):
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))
    sink = np.full(heads, 0.25, np.float32)
    out_s, _ = run(b, backend, sink=sink)
    factor = 1.0 / (1.0 + np.exp(np.float64(0.25) - np.asarray(lse0, np.float64)))
    np.testing.assert_allclose(np.asarray(out_s), np.asarray(out0) * factor[..., None],
                               **F32_TOL)


@pytest.mark.parametrize("backend", ["reference", "fused"])  # the MLA kernel's own tests cover
def test_all_compressed_indices_invalid_is_the_window_alone(backend):  # junk entries for "pallas"
    b = batch("mixed", 4)
    rows = b.q.shape[0]
    junk = np.tile(np.array([-1, -7, 10**6, np.iinfo(np.int32).max, 9999, -1], np.int32),
                   (rows, 1))
    out, lse = run(dataclasses.replace(b, compressed_indices=junk), backend, sink=SINK)
    w_out, w_lse = run(dataclasses.replace(b, ratio=0, compressed=None, compressed_indices=None,
                                           comp_pages_per_seq=0), backend, sink=SINK)
    np.testing.assert_allclose(np.asarray(out), np.asarray(w_out), **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(w_lse), **F32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_releasing_pages_outside_every_window_changes_nothing(backend):
    kept = batch("mixed", 128, release=False)
    released = batch("mixed", 128, release=True)
    assert (released.window[1] != kept.window[1]).any()  # some slots now hold no page
    assert np.isnan(released.window[0]).sum() > np.isnan(kept.window[0]).sum()
    a, b = run(kept, backend, sink=SINK), run(released, backend, sink=SINK)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_outside_sequences_and_empty_sequences_give_zeros(backend):
    b = batch("mixed", 4)  # a zero-length sequence, two NaN padding rows, kv_len 1
    out, lse = run(b, backend, sink=SINK)
    np.testing.assert_array_equal(np.asarray(out)[-2:], 0.0)  # rows outside every sequence
    assert np.isneginf(np.asarray(lse)[-2:]).all()
    check(out, lse, b, SINK)


# ----------------------------------------------------------------------------- stacked caches


@pytest.mark.parametrize("backend", BACKENDS)
def test_stacked_caches_read_in_place_at_layer(backend):
    b = batch("mixed", 4)
    rng = np.random.default_rng(5)

    def stack(x):  # layer 2 is the batch's cache; the others are noise (wrong if read)
        noise = rng.standard_normal((3, *x.shape)).astype(np.float32)
        noise[2] = x
        return noise

    st_b = dataclasses.replace(b, window=(stack(b.window[0]), *b.window[1:]),
                               compressed=(stack(b.compressed[0]), *b.compressed[1:]))
    out, lse = run(st_b, backend, sink=SINK, layer=jnp.int32(2))  # traced: the serving path
    check(out, lse, b, SINK)
    with pytest.raises(ValueError, match=r"layer=3 is outside \[0, 3\)"):
        run(st_b, backend, layer=3)


# ----------------------------------------------------------------------------- refusals


def _kw(b, **over):
    kw = dict(sm_scale=SCALE, **b.kwargs())
    kw.update(over)
    return kw


@pytest.mark.parametrize("backend", BACKENDS)
def test_refuses_bad_static_arguments_naming_the_numbers(backend):
    fn = BACKENDS[backend]
    b4, b0 = batch("mixed", 4), batch("mixed", 0)
    args4, args0 = b4.args(), b0.args()
    with pytest.raises(ValueError, match=r"q.shape\[2\] must be the V4 head dim 512 .*got 256"):
        fn(*b4.args(b4.q[..., :256]), **_kw(b4))
    with pytest.raises(ValueError, match=r"compress_ratio must be one of \(0, 4, 128\), got "
                                         r"compress_ratio=8"):
        fn(*args4, **_kw(b4, compress_ratio=8))
    with pytest.raises(ValueError, match="compressed_indices are the ratio-4"):
        fn(*args4, **_kw(b4, compress_ratio=128))
    with pytest.raises(ValueError, match="compress_ratio=4 needs compressed_indices"):
        fn(*args4, **_kw(b4, compressed_indices=None))
    with pytest.raises(ValueError, match="compress_ratio=0 .window only. takes no compressed"):
        fn(*args0, **_kw(b0, compressed=b4.kwargs()["compressed"]))
    with pytest.raises(ValueError, match="compress_ratio=128 needs the compressed cache"):
        fn(*args0, **_kw(b0, compress_ratio=128, compressed_pages_per_seq=2))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(H,\) = \(4,\)"):
        fn(*args4, **_kw(b4, attn_sink=np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match="attn_sink must be float32"):
        fn(*args4, **_kw(b4, attn_sink=np.zeros(4, np.float16)))
    with pytest.raises(ValueError, match="page_size=4 does not divide window_size=18"):
        fn(*args4, **_kw(b4, window_size=18))
    bad_cache = PagedKV(b4.window[0][..., :500], *b4.window[1:])
    with pytest.raises(ValueError, match=r"window.cache.shape\[2\] must equal the V4 head dim"):
        fn(b4.q, bad_cache, *args4[2:], **_kw(b4))
    with pytest.raises(ValueError, match=r"compressed_indices.shape\[0\] must equal"):
        fn(*args4, **_kw(b4, compressed_indices=b4.compressed_indices[:1]))


# ----------------------------------------------------------------------------- V4Layout / op


def test_layout_refuses_a_page_size_that_does_not_divide_the_window():
    with pytest.raises(LayoutError, match=r"window_page_size=48 does not divide "
                                          r"window_size=128 \(128 % 48 = 32\).*= 32"):
        V4Layout(compress_ratio=0, window_page_size=48, window_pages_per_seq=4)
    with pytest.raises(LayoutError, match="compress_ratio must be one of"):
        V4Layout(compress_ratio=16, window_page_size=64, window_pages_per_seq=4)
    with pytest.raises(LayoutError, match="compress_ratio=4 needs a positive "
                                          "compressed_page_size"):
        V4Layout(compress_ratio=4, window_page_size=64, window_pages_per_seq=4)
    with pytest.raises(LayoutError, match="compress_ratio=0 .window only. has no compressed"):
        V4Layout(compress_ratio=0, window_page_size=64, window_pages_per_seq=4,
                 compressed_page_size=64)
    with pytest.raises(LayoutError, match=r"window_cache_format must be one of \('plain', "
                                          r"'packed', 'fp8'\), got 'e5m2'"):
        V4Layout(compress_ratio=0, window_page_size=64, window_pages_per_seq=4,
                 window_cache_format="e5m2")
    with pytest.raises(LayoutError, match="head_dim=512"):
        V4Layout(compress_ratio=0, window_page_size=64, window_pages_per_seq=4, head_dim=576)


def test_layout_capacities_keep_tokens_and_entries_apart():
    lay = V4Layout(compress_ratio=4, window_page_size=64, window_pages_per_seq=128,
                   compressed_page_size=64, compressed_pages_per_seq=32,
                   compressed_cache_format="packed")
    assert lay.window_capacity_tokens == 8192 and lay.pages_per_window == 2
    assert lay.compressed_capacity_entries == 2048
    assert lay.compressed_capacity_tokens == 8192
    assert lay.entries_for(8191) == 2047
    assert lay.cache_shape("window", 10) == (10, 64, 512)
    assert lay.cache_shape("compressed", 10) == (10, 64, 256)
    assert hash(lay) == hash(dataclasses.replace(lay))


def _layout(b, **kw):
    comp = dict(compressed_page_size=4, compressed_pages_per_seq=b.comp_pages_per_seq)
    return V4Layout(compress_ratio=b.ratio, window_page_size=4, window_size=b.window_size,
                    window_pages_per_seq=b.window_pages_per_seq,
                    **(comp if b.ratio else {}), **kw)


def test_the_op_dispatches_validates_and_matches_the_oracle():
    from dsa_jax import backend as backend_mod

    assert backend_mod.OPS["v4_attention"] == (v4_attention_ref, v4_attention)
    b = batch("prefill", 4)
    kw = b.kwargs(sink=SINK)
    for k in ("window_size", "compress_ratio", "window_pages_per_seq",
              "compressed_pages_per_seq"):
        kw.pop(k)
    out, lse = dsa_jax.v4_attention(*b.args(), layout=_layout(b), return_lse=True,
                                    backend="reference", validate=True, **kw)
    check(out, lse, b, SINK)
    table = b.window[1].copy()
    table[-1] = -1  # the last page of a sequence: inside its window
    with pytest.raises(checkify.JaxRuntimeError, match="inside a row's window"):
        dsa_jax.v4_attention(b.q, PagedKV(b.window[0], table, b.window[2]), *b.args()[2:],
                             layout=_layout(b), backend="reference", validate=True, **kw)
    with pytest.raises(ValueError, match="window_cache_format='packed'"):
        dsa_jax.v4_attention(*b.args(), layout=_layout(b, window_cache_format="packed"),
                             backend="reference", **kw)


# ----------------------------------------------------------------------------- property


@pytest.mark.kernel_gate
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=batch_specs(page_sizes=(2, 4, 8), capacity=96, max_rows=10, max_seqs=3),
       ratio=st.sampled_from([0, 4, 128]), window=st.sampled_from([8, 16]),
       sink=st.booleans(), backend=st.sampled_from(sorted(BACKENDS)))
def test_property_ragged_batches_match_the_oracle(spec, ratio, window, sink, backend):
    b = make_v4_batch(spec.seed, q_lens=list(spec.q_lens), kv_lens=list(spec.kv_lens),
                      ratio=ratio, window_size=window, window_page_size=spec.page_size,
                      comp_page_size=spec.page_size, pad_rows=spec.pad_rows,
                      pad_seqs=spec.pad_seqs, heads=2, k=5)
    s = np.array([0.3, -np.inf], np.float32) if sink else None
    out, lse = run(b, backend, sink=s)
    check(out, lse, b, s)


# ----------------------------------------------------------------------------- model dims


@pytest.mark.parametrize("heads,ratio,topk,kv,backend", [
    (64, 4, 512, 2400, "reference"), (128, 4, 1024, 4300, "reference"),
    (64, 4, 512, 2400, "fused"), (64, 128, None, 2400, "reference"),
    (64, 128, None, 2400, "fused"), (128, 4, 1024, 4300, "fused")],
    ids=["v4_flash", "v4_pro", "v4_flash_fused", "v4_flash_hca", "v4_flash_hca_fused",
         "v4_pro_fused"])
def test_model_dims_decode(heads, ratio, topk, kv, backend):
    """The fused kernel walks blocks of 128 rows here (not ``_fused``'s 16): a row still walks
    several blocks (1 window block, then 4 or 8 of its 512 / 1024 listed entries, or 1 of HCA
    entries), at an eighth of the 16-row blocks' loop steps in the strict interpreter."""
    b = make_v4_batch(7, q_lens=[1, 1], kv_lens=[kv, 300], heads=heads, ratio=ratio, k=topk,
                      window_size=128, window_page_size=64, comp_page_size=64)
    blk = {"tokens_per_block": 128} if backend == "fused" else {}
    out, lse = run(b, backend, sink=np.linspace(-2, 2, heads).astype(np.float32), **blk)
    check(out, lse, b, np.linspace(-2, 2, heads).astype(np.float32))


# ----------------------------------------------------------------------------- fp8 caches


def test_layout_serves_fp8_caches_and_warns_on_transposed_rope_page_sizes():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 64 / 4 / 16 / 32: row-major rope arrays, no warning
        lay = V4Layout(compress_ratio=4, window_page_size=64, window_pages_per_seq=2,
                       compressed_page_size=32, compressed_pages_per_seq=2,
                       window_cache_format="fp8", compressed_cache_format="fp8")
    assert lay.cache_shape("window", 3) == (3, 64, 512)
    x = np.zeros((3, 64, 512), np.float32)
    cache = lay.to_cache(x, "window")
    assert isinstance(cache, dsa_jax.Fp8V4Cache)
    assert cache.nope.shape == (3, 64, 128) and cache.rope.shape == (3, 16, 128)
    lay.check_cache("window.cache", cache, "window")
    with pytest.raises(ValueError, match="declares compressed_cache_format='fp8'"):
        lay.check_cache("compressed.cache", x[:, :32], "compressed")
    with pytest.raises(ValueError, match=r"window.cache.nope must be \[..., num_pages, 64, "
                                         r"128\]"):
        lay.check_cache("window.cache", lay.to_cache(x[:, :32], "window"), "window")
    with pytest.warns(dsa_jax.V4LayoutWarning, match=r"compressed_page_size=24: .*u32\[P, 6, "
                                                     r"128\] transposed"):
        V4Layout(compress_ratio=128, window_page_size=64, window_pages_per_seq=2,
                 compressed_page_size=24, compressed_pages_per_seq=2,
                 compressed_cache_format="fp8")


def test_reference_reads_fp8_and_mixed_caches():
    from v4_batches import fp8_view, to_fp8

    b = fp8_view(batch("mixed", 4), which=("window",))  # fp8 window, plain compressed
    args = (b.q, PagedKV(to_fp8(b.window[0]), *b.window[1:]), *b.args()[2:])
    out, lse = v4_attention_ref(*args, sm_scale=SCALE, return_lse=True, **b.kwargs(sink=SINK))
    check(out, lse, b, SINK)
    kw = b.kwargs(sink=SINK)
    for k in ("window_size", "compress_ratio", "window_pages_per_seq",
              "compressed_pages_per_seq"):
        kw.pop(k)
    out2, lse2 = dsa_jax.v4_attention(*args, layout=_layout(b, window_cache_format="fp8"),
                                      return_lse=True, backend="reference", validate=True, **kw)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    bad = to_fp8(b.window[0])
    bad = dsa_jax.Fp8V4Cache(bad.nope, bad.rope[:, :-1])
    with pytest.raises(ValueError, match=r"window.cache.rope must have shape \(\d+, 1, 128\)"):
        v4_attention_ref(b.q, PagedKV(bad, *b.window[1:]), *b.args()[2:], sm_scale=SCALE,
                         **b.kwargs())


def _fp8_run(b, backend, **kw):
    from v4_batches import to_fp8

    return run(b, backend, cast=to_fp8, **kw)


def _assert_nan_words_everywhere_unread(b):
    """The fp8 caches hold NaN bit patterns in unread records, in rope rows shared by a read
    token and unread ones, and in every record's pad bytes (``v4_batches.to_fp8``)."""
    from v4_batches import NAN_WORD, PAD_WORDS, to_fp8

    for part in (b.window, b.compressed):
        c = to_fp8(part[0])
        nope, rope = np.asarray(c.nope), np.asarray(c.rope)
        dead = (nope == NAN_WORD).all(axis=-1)
        assert dead.any() and (~dead).any()
        assert ((nope[..., PAD_WORDS] >> 24) == 0xFF).all()
        quarters = rope.reshape(*rope.shape[:-1], 4, 32)
        q_dead = (quarters == NAN_WORD).all(axis=-1)
        assert (q_dead.any(axis=-1) & ~q_dead.all(axis=-1)).any()  # a row read and NaN


@pytest.mark.kernel_gate
@pytest.mark.parametrize("ratio", [4, 128])
def test_fp8_caches_match_the_reference_and_the_oracle(ratio):
    """Both caches fp8 (``Fp8V4Cache``), sink on: the fused kernel in the strict interpreter
    equals the reference (both decode the same values exactly; f32 sums in another order) and
    both match the f64 oracle on the dequantized caches. Ratio 128 reads stacked caches at a
    traced layer (the other layers noise)."""
    from v4_batches import fp8_view

    b = fp8_view(batch("mixed", ratio, seed=3))
    _assert_nan_words_everywhere_unread(b)
    run_b, layer = b, None
    if ratio == 128:
        def stack(x):
            noise = np.random.default_rng(4).standard_normal((2, *x.shape)).astype(np.float32)
            noise[1] = x
            return noise

        run_b = dataclasses.replace(b, window=(stack(b.window[0]), *b.window[1:]),
                                    compressed=(stack(b.compressed[0]), *b.compressed[1:]))
        layer = jnp.int32(1)
    out, lse = _fp8_run(run_b, "fused", sink=SINK, layer=layer)
    ref, ref_lse = _fp8_run(run_b, "reference", sink=SINK, layer=layer)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **F32_TOL)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **F32_TOL)
    check(out, lse, b, SINK)
    check(ref, ref_lse, b, SINK)


@pytest.mark.kernel_gate
def test_fp8_caches_with_a_bf16_query():
    from v4_batches import fp8_view

    b = fp8_view(batch("prefill", 4, seed=2))
    out, lse = _fp8_run(b, "fused", dtype=jnp.bfloat16, sink=SINK)
    assert out.dtype == jnp.bfloat16
    check(out, lse, rounded(b), SINK, tol=BF16_TOL, lse_tol=LSE_BF16_TOL)


@pytest.mark.kernel_gate
def test_fp8_refusals_name_the_formats():
    from v4_batches import to_fp8

    b = batch("mixed", 4)
    fp8_w = PagedKV(to_fp8(b.window[0]), *b.window[1:])
    kw = _kw(b)
    with pytest.raises(NotImplementedError, match=r"window.cache fp8 \(Fp8V4Cache\) and "
                                                  r"compressed.cache float32"):
        v4_attention(b.q, fp8_w, *b.args()[2:], **kw, interpret=True)
    with pytest.raises(NotImplementedError, match="window.cache is an fp8 Fp8V4Cache: "
                                                  "the two-pass form .fused=False"):
        v4_attention(b.q, fp8_w, *b.args()[2:], **kw, interpret=True, fused=False)
