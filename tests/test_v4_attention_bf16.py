"""DeepSeek-V4 attention in the official bf16 regime (``precision="bf16"``, issue 27 step 27):
the reference (``reference.v4_attention_ref``), the fused Pallas kernel and the public op against
a float64 oracle of the official ``sparse_attn`` rounding points, written here from
docs/V4_OFFICIAL_REGIME.md section 6 (not from the package: its rounding is ml_dtypes').

The oracle: one softmax over a row's window tokens and visible compressed entries (the sets of
``oracle.v4_oracle``), q and every row rounded to bf16, logits in f64, ``P = exp(s - m)`` with
``m`` the FINAL max over the union, ``P`` rounded to bf16 (from its f32 value, as the official
f32 ``P``) for ``P @ V``, the denominator the unrounded ``P`` plus ``exp(sink - m)``, the output
rounded to bf16.

Tolerance (``BF16_ULPS``): 2 bf16 ulps of each output row's largest absolute value (row = one
query row and head, 512 features). Why: the reference rounds ``P`` relative to each part's max
(window, compressed) and the fused kernel relative to its running max per gathered block, while
the oracle (and the official kernel's blocks of 64 keys) use another max, so a rounded ``P``
may move by 1 ulp; the output is then rounded once more. Window-only rows (ratio 0) have one
part, so the reference's max is the oracle's: there the reference equals the oracle bit for bit
except at bf16 rounding boundaries (``test_one_part_matches_the_oracle_almost_exactly``, the test
that goes red if ``P`` is not rounded; the 2-ulp bound alone would not see that).

The Pallas kernel runs in the strict interpreter (NaN-filled uninitialized memory, out-of-bounds
reads raise); every slot that must not be read holds NaN (``v4_batches``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from oracle import row_sequences, token_keys
from v4_batches import make_v4_batch

import dsa_jax
from dsa_jax import V4Layout
from pallas_kernels.v4_attention import v4_attention
from reference.packed_cache import pack_cache
from reference.v4_attention import v4_attention_ref

SCALE = 512 ** -0.5
BF16_ULPS = 2
# per head: an ordinary sink, none (-inf), one that dominates, one far below every score
SINK = np.array([0.5, -np.inf, 30.0, -30.0], np.float32)
# "mixed" of test_v4_attention: decode rows (one whose early window pages are released, kv_len
# 1), an empty sequence, rows before the window is full, a prefill chunk crossing ratio-4 and
# the first ratio-128 group boundaries, 2 NaN rows outside every sequence, an inactive slot
MIXED = dict(q_lens=[1, 1, 0, 3, 6], kv_lens=[200, 1, 0, 5, 131], pad_rows=2, pad_seqs=1)
# tiny, for the interpreter: a decode row past 128 tokens and a short prefill
TINY = dict(q_lens=[1, 3], kv_lens=[133, 9], pad_rows=1, pad_seqs=0)


def bf16(x) -> np.ndarray:
    """f32 values rounded to bf16 (ties to even), as f64."""
    return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


def oracle(b, sink) -> np.ndarray:
    """``f64[T, H, 512]``: the official bf16 regime over ``b`` (module docstring)."""
    q = bf16(b.q)
    num_rows, heads, dim = q.shape
    kv = np.asarray(b.kv_lens)
    out = np.zeros((num_rows, heads, dim))
    for r, rs in enumerate(row_sequences(num_rows, b.cu_q_lens, kv, b.distribution)):
        if rs is None:
            continue
        seq, p = rs
        wkeys = token_keys(seq, bf16(b.window[0]), kv, b.window[1], b.window[2],
                           b.window_pages_per_seq)
        vals = [wkeys[s] for s in range(max(0, p - b.window_size + 1), p + 1) if s in wkeys]
        if b.ratio:
            ckeys = token_keys(seq, bf16(b.compressed[0]), kv // b.ratio, b.compressed[1],
                               b.compressed[2], b.comp_pages_per_seq)
            visible = (p + 1) // b.ratio
            listed = (b.compressed_indices[r].tolist() if b.ratio == 4 else range(visible))
            vals += [ckeys[j] for j in listed if 0 <= j < visible and j in ckeys]
        if not vals:
            continue
        c = np.stack(vals)  # [n, 512]: keys and values, bf16 values
        logits = SCALE * np.einsum("hd,nd->hn", q[r], c)
        m = logits.max(axis=-1, keepdims=True)  # the final max over the union
        e = np.exp(logits - m)
        with np.errstate(over="ignore"):
            den = e.sum(axis=-1) + np.exp(np.asarray(sink, np.float64) - m[:, 0])
        out[r] = bf16((bf16(e) @ c) / den[:, None])
    return out


def ulp_bound(want, ulps=BF16_ULPS) -> np.ndarray:
    """``ulps`` bf16 ulps of each row's largest ``|want|`` (0 for an all-zero row)."""
    top = np.abs(want).max(axis=-1, keepdims=True)
    exp = np.floor(np.log2(np.where(top > 0, top, 1.0)))
    return np.where(top > 0, ulps * 2.0 ** (exp - 7), 0.0)  # bf16: 8 significant bits


def assert_close(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want)
    bound = ulp_bound(want)
    assert (err <= bound).all(), (err.max(), np.unravel_index(np.argmax(err - bound), err.shape))


def is_bf16(x) -> bool:
    x = np.asarray(jnp.asarray(x, jnp.float32))
    return bool((bf16(x) == x).all())


def batch(ratio, shape=MIXED, seed=0):
    return make_v4_batch([seed, ratio, 27], ratio=ratio, **shape)


def ref(b, *, precision, cast=None, dtype=jnp.float32):
    return v4_attention_ref(*b.args(jnp.asarray(b.q, dtype), cast=cast), sm_scale=SCALE,
                            precision=precision, **b.kwargs(cast=cast, sink=SINK))


def fused(b, *, precision, cast=None, dtype=jnp.float32):
    return v4_attention(*b.args(jnp.asarray(b.q, dtype), cast=cast), sm_scale=SCALE,
                        precision=precision, **b.kwargs(cast=cast, sink=SINK), interpret=True,
                        tokens_per_block=8)


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_reference_matches_the_bf16_oracle(ratio):
    b = batch(ratio)
    out = ref(b, precision="bf16")
    assert out.dtype == jnp.float32 and is_bf16(out)  # f32 q: bf16 values held in f32
    assert_close(out, oracle(b, SINK))
    out16 = ref(b, precision="bf16", dtype=jnp.bfloat16, cast=pack_cache)
    assert out16.dtype == jnp.bfloat16
    assert_close(out16, oracle(b, SINK))  # packed rows are the same bf16 values


def test_one_part_matches_the_oracle_almost_exactly():
    """Window only: the reference's part max is the oracle's final max, so the outputs differ
    only where f32 vs f64 arithmetic lands on the other side of a bf16 rounding boundary (seen:
    none). Without the rounding of ``P`` about a quarter of the elements move by an ulp (seen:
    24%, all within 1 ulp of the row max: the 2-ulp bound alone does not see it)."""
    b = batch(0)
    want = oracle(b, SINK)
    got = np.asarray(ref(b, precision="bf16"), np.float64)
    assert np.mean(got != want) < 0.02
    assert (np.abs(got - want) <= ulp_bound(want, 1)).all()


def test_the_mode_matters_with_an_f32_cache():
    b = batch(4)
    out32, out16 = ref(b, precision="f32"), ref(b, precision="bf16")
    assert not is_bf16(out32)
    assert np.mean(np.asarray(out32) != np.asarray(out16)) > 0.5
    want = oracle(b, SINK)
    assert (np.abs(np.asarray(out32, np.float64) - want) > ulp_bound(want, 1)).any()


# ----------------------------------------------------------------------------- fused kernel


@pytest.mark.kernel_gate
@pytest.mark.parametrize("fmt,ratio", [("f32", 4), ("packed", 128)])
def test_fused_kernel_matches_the_reference_and_the_oracle(fmt, ratio):
    """f32 q; the cache f32 (rounded to bf16 in the kernel) or packed bf16 words."""
    b = batch(ratio, TINY)
    cast = pack_cache if fmt == "packed" else None
    out = fused(b, precision="bf16", cast=cast)
    assert out.dtype == jnp.float32 and is_bf16(out)
    want_ref = np.asarray(ref(b, precision="bf16", cast=cast), np.float64)
    assert_close(out, want_ref)
    assert_close(out, oracle(b, SINK))
    if fmt == "f32":  # the mode matters in the kernel too: f32 operands, P unrounded
        out32 = fused(b, precision="f32", cast=cast)
        assert not is_bf16(out32)
        assert np.mean(np.asarray(out32) != np.asarray(out)) > 0.5


# ----------------------------------------------------------------------------- op, refusals


def test_the_op_threads_precision_to_the_reference():
    b = batch(4, TINY)
    kw = b.kwargs(sink=SINK)
    for k in ("window_size", "compress_ratio", "window_pages_per_seq",
              "compressed_pages_per_seq"):
        kw.pop(k)
    layout = V4Layout(compress_ratio=4, window_page_size=4, window_size=b.window_size,
                      window_pages_per_seq=b.window_pages_per_seq, compressed_page_size=4,
                      compressed_pages_per_seq=b.comp_pages_per_seq)
    out = dsa_jax.v4_attention(*b.args(), layout=layout, backend="reference", precision="bf16",
                               **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref(b, precision="bf16")))
    with pytest.raises(ValueError, match=r"precision must be one of \('f32', 'bf16'\), got "
                                         r"precision='fp16'"):
        dsa_jax.v4_attention(*b.args(), layout=layout, backend="reference", precision="fp16",
                             **kw)


@pytest.mark.parametrize("path", ["reference", "fused", "two_pass"])
def test_bad_precision_is_refused_by_name(path):
    b = batch(4, TINY)
    fn = {"reference": v4_attention_ref,
          "fused": lambda *a, **k: v4_attention(*a, **k, interpret=True),
          "two_pass": lambda *a, **k: v4_attention(*a, **k, interpret=True, fused=False)}[path]
    kw = dict(sm_scale=SCALE, **b.kwargs())
    for bad in ("fp16", None, "BF16"):
        with pytest.raises(ValueError, match=f"got precision={bad!r}"):
            fn(*b.args(), **kw, precision=bad)
    if path == "two_pass":
        with pytest.raises(NotImplementedError, match="precision='bf16': the two-pass form"):
            fn(*b.args(), **kw, precision="bf16")
