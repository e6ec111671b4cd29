"""Attention sinks (issue 20, ``reference.sinks``) on every V3.2 MLA op: the references, the
Pallas entries (strict interpreter: NaN-filled memory, races and out-of-bounds reads raise) in
f32, packed bf16, plain bf16 (page) and fp8 latent caches, ``dsa_jax``'s ops (both ``validate``
paths), the all-layers kernel, the step, and the context-parallel step (sink-free LSE merge, then
the sink once), plus the AOT compile of the sink kernel for v5e, v6e and tpu7x.

Two independent statements of the rule are checked: the float64 definition
``o = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))`` (``tests/oracle.py``) and
FlashMLA's ``out_sink = out * 1 / (1 + exp(sink - lse))`` with the LSE unchanged. Batches are
``tests/batches`` scenarios (unowned cache slots NaN) with junk top-k entries."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import dsa_jax
from pallas_kernels import chips, page_sparse_mla, sparse_mla
from pallas_kernels.mla import layers as mla_layers
from reference import fp8_cache, packed_cache, page_sparse_mla_ref, sparse_mla_ref
from reference.synthetic import make_ragged_batch
from tests import batches
from tests.oracle import mla_oracle
from tests.test_pallas_mla import junk_page_topk, junk_token_topk

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # the AOT gate, as test_compile_mla

SCALE = 0.125
NEG_INF = -np.inf
REF = {"token": sparse_mla_ref, "page": page_sparse_mla_ref}
PALLAS = {"token": sparse_mla, "page": page_sparse_mla}


def sink_of(heads: int, *, huge: bool = True) -> jnp.ndarray:
    """f32[H]: ordinary sinks around the rows' LSEs, head 1 ``-inf`` (no sink) and, with
    ``huge``, head 2 at 1e4 (its output ~0)."""
    vals = [0.7, NEG_INF, 1e4 if huge else 3.0, 2.5, -1.0, 0.0, 1.5, -3.0]
    return jnp.asarray((vals * heads)[:heads], jnp.float32)


# Small batches (the strict interpreter's time grows with the rows): name -> (q_lens, kv_lens,
# pad_rows, pad_seqs). "mixed": a decode row beside a 5-row prefill chunk, a padding row and
# an inactive sequence slot; "mtp": 2 and 3 draft rows; "decode": one row per sequence.
SMALL = {"mixed": ([1, 5], [30, 12], 1, 1), "mtp": ([2, 3], [17, 40], 0, 0),
         "decode": ([1, 1, 1], [9, 64, 1], 0, 0)}


def case(name, seed, *, heads=4, dim=128, mode="token", k=12, empty_row=True):
    """A ``SMALL`` batch (page_size 8, 8 pages per sequence, NaN in unowned cache slots) and
    junk selections (``tests/test_pallas_mla``); row 0 gets no valid entry (an empty row)."""
    q_lens, kv_lens, pad_rows, pad_seqs = SMALL[name]
    b = make_ragged_batch(np.random.default_rng([seed, len(name)]), q_lens=q_lens,
                          kv_lens=kv_lens, page_size=batches.PAGE_SIZE,
                          pages_per_seq=batches.PAGES_PER_SEQ, num_heads=heads, dim=dim,
                          pad_rows=pad_rows, pad_seqs=pad_seqs)
    rng = np.random.default_rng(seed)
    sel = junk_token_topk(rng, b, k) if mode == "token" else junk_page_topk(rng, b, 4)
    if empty_row:
        sel[0] = -1
    return b, sel


def meta_of(b, sel):
    return (b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)


def oracle(q, cache, b, sel, *, mode, v_dim, sink, scale=SCALE):
    return mla_oracle(np.asarray(q, np.float32), np.asarray(cache, np.float32), b.seq_lens, sel,
                      b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution,
                      sm_scale=scale, v_dim=v_dim, pages_per_seq=b.pages_per_seq,
                      page=mode == "page", attn_sink=None if sink is None else np.asarray(sink))


def check_close(out, lse, want, want_lse, tol):
    """out/lse vs f64 (``want_lse`` sink-free); everything finite, empty rows exactly 0."""
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1.0))
    lse = np.asarray(lse, np.float64)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=tol, atol=tol)
    empty = np.isneginf(want_lse).all(axis=-1)
    assert empty[0] and not out[empty].any()


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("mode", ["token", "page"])
@pytest.mark.parametrize("name", ["mixed", "mtp"])
def test_reference_meets_the_f64_definition(mode, name):
    """Decode, MTP and prefill rows, padding rows and an empty row: the float64 definition; the
    LSE is the sink-free one; the huge-sink head is ~0 and the ``-inf`` head is the no-sink
    output."""
    b, sel = case(name, 1, mode=mode, heads=8)
    sink = sink_of(8)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=96, return_lse=True)
    out, lse = REF[mode](b.q, b.cache, *meta_of(b, sel), **kw, attn_sink=sink)
    want, want_lse = oracle(b.q, b.cache, b, sel, mode=mode, v_dim=96, sink=sink)
    check_close(out, lse, want, want_lse, 1e-5)
    plain, plain_lse = REF[mode](b.q, b.cache, *meta_of(b, sel), **kw)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(plain_lse))
    assert np.abs(np.asarray(out)[:, 2]).max() < 1e-30  # sink 1e4
    np.testing.assert_array_equal(np.asarray(out)[:, 1], np.asarray(plain)[:, 1])  # -inf


def flashmla_rule(out_nosink, lse, sink):
    """FlashMLA's sink rule in float64: ``out * 1 / (1 + exp(sink - lse))`` (0 where the row is
    empty; its output is 0 anyway)."""
    lse = np.asarray(lse, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = 1.0 / (1.0 + np.exp(np.asarray(sink, np.float64)[None, :] - lse))
    f = np.where(np.isneginf(lse), 0.0, f)
    return np.asarray(out_nosink, np.float64) * f[..., None]


@pytest.mark.parametrize("mode", ["token", "page"])
def test_reference_follows_the_flashmla_rule(mode):
    b, sel = case("mixed", 2, mode=mode)
    sink = sink_of(4)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=128, return_lse=True)
    plain, lse0 = REF[mode](b.q, b.cache, *meta_of(b, sel), **kw)
    out, lse = REF[mode](b.q, b.cache, *meta_of(b, sel), **kw, attn_sink=sink)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))
    np.testing.assert_allclose(np.asarray(out, np.float64), flashmla_rule(plain, lse0, sink),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["token", "page"])
def test_reference_minus_inf_sink_is_exactly_no_sink(mode):
    b, sel = case("mtp", 3, mode=mode)
    none = jnp.full((4,), -jnp.inf, jnp.float32)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=128, return_lse=True)
    want = REF[mode](b.q, b.cache, *meta_of(b, sel), **kw)
    got = REF[mode](b.q, b.cache, *meta_of(b, sel), **kw, attn_sink=none)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ----------------------------------------------------------------------------- Pallas


def fp8_case(seed):
    """A decode+prefill batch with the fp8 latent cache: (batch, cache, dequantized f32)."""
    b, sel = case("mixed", seed, dim=576)
    cache = fp8_cache.quantize_latent_cache(b.cache)  # NaN slots give NaN codes
    return b, sel, cache, np.asarray(fp8_cache.dequantize_latent_cache(cache))


def pallas(mode, q, cache, b, sel, kw, sink):
    """The Pallas entry in the strict interpreter (small blocks: several per row)."""
    knob = {"tokens_per_block": 8} if mode == "token" else {"pages_per_block": 2}
    return PALLAS[mode](q, cache, *meta_of(b, sel), **kw, **knob, interpret=True,
                        attn_sink=sink)


# (mode, cache format, q dtype, scenario): f32 token / page, packed bf16 token, plain bf16
# page, fp8 latent token and page; decode, MTP and prefill rows among them.
PALLAS_CASES = [("token", "f32", jnp.float32, "mixed"),
                ("page", "f32", jnp.float32, "mtp"),
                ("token", "packed", jnp.bfloat16, "mtp"),
                ("page", "bf16", jnp.bfloat16, "mixed"),
                ("token", "fp8", jnp.float32, None),
                ("page", "fp8", jnp.bfloat16, None)]


def pallas_case(mode, fmt, dtype, name):
    """(batch, selections, q, cache as the kernel takes it, its values, sm_scale, v_dim)."""
    if fmt == "fp8":
        b, sel, cache, values = fp8_case(4)
        if mode == "page":
            sel = junk_page_topk(np.random.default_rng(4), b, 4)
            sel[0] = -1
        return b, sel, jnp.asarray(b.q, dtype), cache, values, 576 ** -0.5, 512
    b, sel = case(name, 5, mode=mode)
    values = jnp.asarray(b.cache, dtype)
    cache = packed_cache.pack_cache(values) if fmt == "packed" else values
    return b, sel, jnp.asarray(b.q, dtype), cache, values, SCALE, 96


@pytest.mark.kernel_gate
@pytest.mark.parametrize("mode,fmt,dtype,name", PALLAS_CASES)
def test_pallas_sink_matches_reference_and_oracle(mode, fmt, dtype, name):
    """The in-kernel sink (finalize) = the reference (f32: 1e-5; bf16 2e-2) = the float64
    definition on the values the cache holds; the LSE is sink-free; empty rows 0, no NaN."""
    b, sel, q, cache, values, scale, v_dim = pallas_case(mode, fmt, dtype, name)
    sink = sink_of(4)
    kw = dict(sm_scale=scale, pages_per_seq=b.pages_per_seq, v_dim=v_dim, return_lse=True)
    out, lse = pallas(mode, q, cache, b, sel, kw, sink)
    assert out.dtype == dtype and out.shape == (q.shape[0], 4, v_dim)
    ref_out, ref_lse = REF[mode](q, cache if fmt == "fp8" else values, *meta_of(b, sel), **kw,
                                 attn_sink=sink)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    check_close(out, lse, np.asarray(ref_out, np.float64), np.asarray(ref_lse, np.float64), tol)
    want, want_lse = oracle(q, values, b, sel, mode=mode, v_dim=v_dim, sink=sink, scale=scale)
    check_close(out, lse, want, want_lse, tol)


@pytest.mark.kernel_gate
@pytest.mark.parametrize("mode", ["token", "page"])
def test_pallas_flashmla_rule_minus_inf_and_huge_sinks(mode):
    """Against the kernel's own no-sink output: FlashMLA's rule (LSE identical), a ``-inf``
    sink gives exactly the no-sink kernel's output, a 1e4 sink on every head gives exact zeros
    (exp(sink - m) = inf in the finalize, never NaN), empty and padding rows 0 / LSE -inf."""
    b, sel, q, cache, _, scale, v_dim = pallas_case(mode, "f32", jnp.float32,
                                                    "mixed" if mode == "token" else "mtp")
    kw = dict(sm_scale=scale, pages_per_seq=b.pages_per_seq, v_dim=v_dim, return_lse=True)
    plain, lse0 = pallas(mode, q, cache, b, sel, kw, None)
    sink = sink_of(4)
    out, lse = pallas(mode, q, cache, b, sel, kw, sink)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))
    np.testing.assert_allclose(np.asarray(out, np.float64), flashmla_rule(plain, lse0, sink),
                               rtol=1e-5, atol=1e-5)
    got, got_lse = pallas(mode, q, cache, b, sel, kw, jnp.full((4,), -jnp.inf, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(lse0))
    huge, huge_lse = pallas(mode, q, cache, b, sel, kw, jnp.full((4,), 1e4, jnp.float32))
    assert not np.asarray(huge).any()
    np.testing.assert_array_equal(np.asarray(huge_lse), np.asarray(lse0))
    assert np.isneginf(np.asarray(lse0)[0]).all()  # the empty row


# ----------------------------------------------------------------------------- dsa_jax ops


@pytest.mark.parametrize("backend,validate", [("reference", False), ("pallas", True)])
def test_dsa_jax_ops_pass_the_sink_on_both_validate_paths(backend, validate):
    """``dsa_jax.sparse_mla`` / ``page_sparse_mla`` with a stacked cache read at a layer: the
    sink goes through ``_call``'s plain and checkify paths as a traced operand."""
    b, sel = case("decode", 7, empty_row=False)
    stack = jnp.stack([jnp.asarray(b.cache), jnp.asarray(b.cache) * 0.5])
    sink = sink_of(4, huge=False)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=128, return_lse=True,
              backend=backend, validate=validate, layer=1)
    out, lse = dsa_jax.sparse_mla(b.q, stack, *meta_of(b, sel), **kw, attn_sink=sink)
    want, want_lse = oracle(b.q, stack[1], b, sel, mode="token", v_dim=128, sink=sink)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
    if backend == "reference":  # the page op through the same (plain) path
        psel = junk_page_topk(np.random.default_rng(7), b, 3)
        out, _ = dsa_jax.page_sparse_mla(b.q, stack, *meta_of(b, psel), **kw, attn_sink=sink)
        want, _ = oracle(b.q, stack[1], b, psel, mode="page", v_dim=128, sink=sink)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _bad_sinks(heads):
    return [(np.zeros(heads + 1, np.float32), ValueError,
             rf"attn_sink must have shape \(H,\) = \({heads},\).*got shape \({heads + 1},\)"),
            (np.zeros((1, heads), np.float32), ValueError,
             rf"attn_sink must have shape \(H,\) = \({heads},\).*got shape \(1, {heads}\)"),
            (np.zeros(heads, jnp.bfloat16), TypeError,
             "attn_sink must be float32.*got dtype bfloat16")]


OPS = [sparse_mla_ref, page_sparse_mla_ref, functools.partial(sparse_mla, interpret=True),
       functools.partial(page_sparse_mla, interpret=True),
       functools.partial(dsa_jax.sparse_mla, backend="pallas"),
       functools.partial(dsa_jax.page_sparse_mla, backend="reference", validate=True)]


@pytest.mark.parametrize("op", OPS, ids=["ref", "page_ref", "pallas", "page_pallas",
                                         "dsa_jax", "dsa_jax_page_validate"])
@pytest.mark.parametrize("bad", range(3), ids=["H+1", "1xH", "bf16"])
def test_bad_sink_is_refused_with_the_numbers(op, bad):
    b, sel = case("decode", 8, empty_row=False)
    sink, exc, match = _bad_sinks(4)[bad]
    with pytest.raises(exc, match=match):
        op(b.q, b.cache, *meta_of(b, sel), sm_scale=SCALE, pages_per_seq=b.pages_per_seq,
           v_dim=64, attn_sink=sink)


def test_bad_layer_sinks_are_refused_with_the_numbers():
    b, sel = case("decode", 9, empty_row=False)
    q, cache = jnp.stack([b.q] * 2), jnp.stack([jnp.asarray(b.cache)] * 2)
    args = (q, cache, b.seq_lens, jnp.stack([sel] * 2), *b.meta()[1:])
    kw = dict(mode="token", sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=64,
              interpret=True)
    with pytest.raises(ValueError, match=r"\(L, H\) = \(2, 4\) or \(H,\) = \(4,\).*\(3, 4\)"):
        mla_layers.sparse_mla_layers(*args, **kw, attn_sink=np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"\(H,\) = \(4,\).*got shape \(5,\)"):
        mla_layers.sparse_mla_layers(*args, **kw, attn_sink=np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="float32.*bfloat16"):
        mla_layers.sparse_mla_layers(*args, **kw, attn_sink=np.zeros((2, 4), jnp.bfloat16))


# ----------------------------------------------------------------------------- all layers


@pytest.mark.kernel_gate
@pytest.mark.parametrize("mode,shared", [("token", False), ("page", True)])
def test_all_layers_kernel_takes_per_layer_or_shared_sinks(mode, shared):
    """``sparse_mla_layers`` with ``f32[L, H]`` (row t takes layer t // T's) or a shared
    ``f32[H]`` = the reference on each layer with that layer's sink."""
    b, sel = case("decode", 10, mode=mode)
    q = jnp.stack([jnp.asarray(b.q), jnp.asarray(b.q)[:, ::-1]])
    cache = jnp.stack([jnp.asarray(b.cache), jnp.asarray(b.cache) * 0.7])
    sink = sink_of(4) if shared else jnp.stack([sink_of(4), sink_of(4)[::-1]])
    knob = {"tokens_per_block": 8} if mode == "token" else {"pages_per_block": 2}
    sels = np.stack([sel, sel[::-1]])
    out = mla_layers.sparse_mla_layers(q, cache, b.seq_lens, sels, *b.meta()[1:], mode=mode,
                                       sm_scale=SCALE, pages_per_seq=b.pages_per_seq,
                                       v_dim=128, interpret=True, attn_sink=sink, **knob)
    for layer in range(2):
        want = REF[mode](q[layer], cache[layer], *meta_of(b, sels[layer]), sm_scale=SCALE,
                         pages_per_seq=b.pages_per_seq, v_dim=128,
                         attn_sink=sink if shared else sink[layer])
        np.testing.assert_allclose(np.asarray(out[layer]), np.asarray(want), rtol=1e-5,
                                   atol=1e-5)


# ----------------------------------------------------------------------------- the step


def _step_args(seed, layout):
    from tests.test_context import HEADS, _local_batch

    inputs, latent, index, meta = _local_batch(seed, layout)
    rng = np.random.default_rng(seed)
    sink = rng.uniform(-1, 3, (2, HEADS)).astype(np.float32)
    sink[0, 1] = -np.inf
    return inputs._replace(attn_sink=sink), latent, index, meta


def test_step_applies_each_layers_sink():
    """``dsa_step`` with ``StepInputs.attn_sink f32[L, H]`` on the Pallas backend (one kernel
    call for all layers): layer l's output is the reference op with sink ``l`` on the step's
    updated cache and top-k. (The reference step is the want of the context test below.)"""
    from dsa_jax.step import _pad_last
    from tests.test_context import LAYOUT, TYPES

    kw = dict(layout=LAYOUT, indexer_types=TYPES, k=10, sm_scale=0.12, exact=True)
    inputs, latent, index, meta = _step_args(3, LAYOUT)
    got = dsa_jax.dsa_step(inputs, np.copy(latent), np.copy(index), meta, backend="pallas",
                           kernel_options={"interpret": True}, **kw)
    q = _pad_last(jnp.asarray(inputs.q_mla), LAYOUT.padded_dim)
    for layer in range(2):
        want = sparse_mla_ref(q[layer], got.latent_caches[layer], meta.kv_lens, got.topk[0],
                              *meta[1:], sm_scale=0.12, pages_per_seq=LAYOUT.pages_per_seq,
                              v_dim=LAYOUT.v_dim, attn_sink=jnp.asarray(inputs.attn_sink[layer]))
        np.testing.assert_allclose(np.asarray(got.out[layer]), np.asarray(want), rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ValueError, match=r"attn_sink must have shape \(L, H\) = \(2, 4\)"):
        dsa_jax.dsa_step(inputs._replace(attn_sink=inputs.attn_sink[:1]), np.copy(latent),
                         np.copy(index), meta, backend="reference", **kw)


@pytest.mark.parametrize("shape,backend", [((1, 4, 2), "reference"), ((2, 2, 2), "reference")])
def test_context_sharded_step_with_sinks_equals_the_single_device_step(shape, backend):
    """Over a ``ctx`` axis each shard's MLA state is sink-free; ``merge_lse`` merges them and
    applies the sink once. Equal to the single-device step (heads split on the model axis:
    the sink ``[D, L, H]`` is split with them)."""
    from tests.test_context import AXES, LAYOUT, TYPES, _shard

    data, ctx, _ = shape
    devs = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    kw = dict(layout=LAYOUT, indexer_types=TYPES, k=10, sm_scale=0.12, exact=True,
              backend=backend,
              kernel_options={"interpret": True} if backend == "pallas" else None)
    local = [_step_args(s, LAYOUT) for s in range(data)]
    want = [dsa_jax.dsa_step(*jax.tree.map(np.copy, x), **kw) for x in local]
    _, inputs, latent, index, meta = _shard(local, ctx, LAYOUT)
    got = dsa_jax.sharded_dsa_step(Mesh(devs, AXES), inputs, latent, index, meta,
                                   ctx_axis="ctx", **kw)
    for d, w in enumerate(want):
        np.testing.assert_array_equal(np.asarray(got.topk[d]), np.asarray(w.topk))
        np.testing.assert_allclose(np.asarray(got.out[d]), np.asarray(w.out), rtol=2e-6,
                                   atol=2e-6)
    nosink = [x[0]._replace(attn_sink=None) for x in local]
    plain = dsa_jax.dsa_step(nosink[0], *jax.tree.map(np.copy, local[0][1:]), **kw)
    assert not np.allclose(np.asarray(plain.out), np.asarray(want[0].out))  # the sink acts


# ----------------------------------------------------------------------------- AOT


@pytest.mark.kernel_gate
@pytest.mark.parametrize("chip", chips.NAMES)
def test_sink_kernel_compiles_at_v32_decode_dims(chip):
    """The kernel with the sink operand, AOT through libtpu (no TPU), at ``compile_cases``'
    decode shape (64 rows x 8192 context, H=128, k=2048, D=640 packed bf16, v_dim 512): the
    token entry with ``f32[H]`` (and the LSE), and the all-layers call (L=2) with ``f32[L, H]``
    (the per-row layer index map)."""
    from pallas_kernels import aot
    from pallas_kernels.mla import blocks as mla_blocks
    from pallas_kernels.mla import compile_cases as mcases

    base = mcases.mla_case("token", "decode64x8192_h128_k2048_packed", 64, 64, 8192, 128,
                           "packed", jnp.uint32)
    fn = base.fn_for_chip(chip)
    specs = [*base.specs, jax.ShapeDtypeStruct((128,), jnp.float32)]
    one = aot.aot_compile(lambda *a: fn(*a[:-1], attn_sink=a[-1], return_lse=True), specs,
                          chip, "sparse_mla+sink")
    assert "tpu_custom_call" in one.as_text()
    s = base.specs
    st = lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype)  # noqa: E731
    specs = [st(s[0]), st(s[1]), s[2], st(s[3]), *s[4:],
             jax.ShapeDtypeStruct((2, 128), jnp.float32)]
    layers = functools.partial(mla_layers.sparse_mla_layers, mode="token",
                               tokens_per_block=mla_blocks.token_block(mcases.K_TOKENS, chip),
                               sm_scale=mcases.MLA_SCALE, pages_per_seq=8192 // mcases.MLA_PAGE,
                               v_dim=mcases.MLA_V_DIM)
    aot.aot_compile(lambda *a: layers(*a[:-1], attn_sink=a[-1]), specs, chip,
                    "sparse_mla_layers+sink")
