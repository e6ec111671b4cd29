"""Stacked caches read in place (``reference.stacked``): every top-k and sparse MLA entry, on
both backends (the Pallas kernels in the strict interpreter), reads layer ``l > 0`` of an
``[L, P, ps, W]`` stack exactly as the single-layer call reads that layer's cache; a traced layer
outside ``[0, L)`` reads nothing (top-k rows -1, MLA rows zeros, LSE -inf), ``validate=True``
reports it, and a Python-int layer outside the stack is refused naming both numbers.

Every layer of a stack holds different random values (NaN in the same unowned slots), so an op
that read the wrong layer, or a slice of the wrong one, gives a different answer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import dsa_jax
import pallas_kernels as pk
import reference as ref
from reference import fp8_cache, packed_cache
from tests import batches
from tests.oracle import mla_oracle

pytestmark = pytest.mark.kernel_gate  # the kernels' layer operand: also run on the newest jax

LAYERS = 3
SCALE = 0.125
V_DIM = 64
TOPK = {  # op name -> (reference, Pallas entry, budget keyword)
    "token": (ref.streamindex_topk_ref, pk.streamindex_topk, {"k": 6}),
    "page": (ref.streamindex_page_topk_ref, pk.streamindex_page_topk, {"k_pages": 3}),
}
MLA = {"token": (ref.sparse_mla_ref, pk.sparse_mla), "page": (ref.page_sparse_mla_ref,
                                                               pk.page_sparse_mla)}


def _stack(cache: np.ndarray, seed: int) -> np.ndarray:
    """``[LAYERS, P, ps, D]``: layer ``l`` is ``cache`` plus a different random offset per layer
    (NaN slots stay NaN), so every layer scores and attends differently."""
    rng = np.random.default_rng(seed)
    return np.stack([cache + i * rng.normal(size=cache.shape).astype(np.float32)
                     for i in range(LAYERS)])


def _topk(op, b, cache, backend, **kw):
    entry = TOPK[op][0] if backend == "reference" else TOPK[op][1]
    extra = {} if backend == "reference" else {"interpret": True}
    return np.asarray(entry(jnp.asarray(b.q), jnp.asarray(b.weights), cache, *b.meta(),
                            **TOPK[op][2], pages_per_seq=b.pages_per_seq, exact=True, **kw,
                            **extra))


def _small_mixed(seed, num_heads):
    """``batches``' small_mixed: mixed_padding's kinds of rows at a third of its 26 rows (two
    decode rows, a 4-row chunk, 2 padding rows, an inactive sequence slot, a 60-token sequence
    over 8 pages, NaN in every unowned cache slot; the strict interpreter's cost is per row
    step)."""
    return batches.scenario("small_mixed", seed, num_heads=num_heads, dim=128)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("op", sorted(TOPK))
def test_topk_reads_the_given_layer_of_the_stack_in_place(op, backend):
    """Layers 1 and 2 in one test (once two parametrizations): the single-layer and the
    traced-layer programs are compiled once and serve both layers (the strict interpreter's
    cost here is the compile, not the run)."""
    b = _small_mixed(31, num_heads=2)
    for layer in (1, 2):
        stack = jnp.asarray(_stack(b.cache, seed=layer))
        want = _topk(op, b, stack[layer], backend)
        got = _topk(op, b, stack, backend, layer=jnp.int32(layer))  # traced: one trace/shape
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got, _topk(op, b, stack[0], backend)), "layers must differ"
        np.testing.assert_array_equal(_topk(op, b, stack, backend, layer=layer), want)  # int


def _mla(op, b, sel, q, cache, backend, **kw):
    extra = {} if backend == "reference" else {"interpret": True}
    entry = MLA[op][0] if backend == "reference" else MLA[op][1]
    return entry(q, cache, b.seq_lens, sel, *b.meta()[1:], sm_scale=SCALE,
                 pages_per_seq=b.pages_per_seq, v_dim=V_DIM, return_lse=True, **kw, **extra)


def _selection(op, b, cache):
    if op == "token":
        return ref.streamindex_topk_ref(jnp.asarray(b.q), jnp.asarray(b.weights), cache,
                                        *b.meta(), k=12, pages_per_seq=b.pages_per_seq)
    return ref.streamindex_page_topk_ref(jnp.asarray(b.q), jnp.asarray(b.weights), cache,
                                         *b.meta(), k_pages=3, pages_per_seq=b.pages_per_seq)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("fmt", ["f32", "packed"])
@pytest.mark.parametrize("op", sorted(MLA))
def test_sparse_mla_reads_the_given_layer_and_a_stacked_query(op, fmt, backend):
    b = batches.scenario("mtp", seed=32, num_heads=4, dim=128)
    layer = 2
    stack = _stack(b.cache, seed=5)
    sel = _selection(op, b, jnp.asarray(stack[layer]))
    dtype = jnp.float32 if fmt == "f32" else jnp.bfloat16
    values = np.asarray(jnp.asarray(stack, dtype).astype(jnp.float32))  # what the cache holds
    cache = jnp.asarray(stack, dtype)
    if fmt == "packed":
        cache = packed_cache.pack_cache(cache)
    q = jnp.asarray(b.q, dtype)
    q_stack = jnp.stack([q * (i + 1) for i in range(LAYERS)])  # layer i: (i + 1) q
    out, lse = _mla(op, b, sel, q_stack, cache, backend, layer=jnp.int32(layer))
    want, want_lse = mla_oracle(np.asarray(q_stack[layer], np.float32), values[layer],
                                b.seq_lens, np.asarray(sel), b.page_indices, b.cu_q_lens,
                                b.cu_kv_lens, b.distribution, sm_scale=SCALE, v_dim=V_DIM,
                                pages_per_seq=b.pages_per_seq, page=op == "page")
    tol = 1e-5 if fmt == "f32" else 2e-2
    scale = max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol * scale)
    fin = np.isfinite(want_lse)
    assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], rtol=tol, atol=tol)
    single = _mla(op, b, sel, q_stack[layer], cache[layer], backend)[0]  # one layer, one query
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(single, np.float32))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_fp8_stacks_read_the_given_layer(backend):
    b = batches.scenario("decode", seed=33, num_heads=4, dim=576)
    stack = np.nan_to_num(_stack(b.cache, seed=7), nan=0.0)
    latent = fp8_cache.quantize_latent_cache(jnp.asarray(stack))  # leading L kept
    sel = jnp.asarray(np.tile(np.arange(8, dtype=np.int32), (b.q.shape[0], 1)))
    q = jnp.asarray(b.q, jnp.bfloat16)
    out = _mla("token", b, sel, q, latent, backend, layer=jnp.int32(1))[0]
    one = fp8_cache.Fp8LatentCache(latent.words[1])
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(_mla("token", b, sel, q, one, backend)[0],
                                             np.float32))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_a_traced_layer_outside_the_stack_reads_nothing(backend):
    """-1, L and 2^31 - 1 in one test (once three parametrizations): the layer is traced, so
    each op compiles once and runs at the three layers."""
    b = batches.scenario("mtp", seed=34, num_heads=2, dim=128)
    stack = jnp.asarray(_stack(b.cache, seed=3))
    sel = _selection("token", b, stack[0])
    for bad in (-1, LAYERS, 2**31 - 1):
        for op in TOPK:
            got = _topk(op, b, stack, backend, layer=jnp.int32(bad))
            assert (got == -1).all(), (op, bad)
        out, lse = _mla("token", b, sel, jnp.asarray(b.q), stack, backend,
                        layer=jnp.int32(bad))
        assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all(), bad


def test_validate_reports_a_layer_outside_the_stack():
    b = batches.scenario("decode", seed=35, num_heads=2, dim=128)
    stack = jnp.asarray(_stack(b.cache, seed=1))
    kw = dict(k=4, pages_per_seq=b.pages_per_seq, backend="reference", validate=True)
    args = (jnp.asarray(b.q), jnp.asarray(b.weights), stack, *b.meta())
    ok = dsa_jax.indexer_topk(*args, **kw, layer=jnp.int32(2))
    np.testing.assert_array_equal(ok, dsa_jax.indexer_topk(*args[:2], stack[2], *args[3:],
                                                           **kw))
    with pytest.raises(checkify.JaxRuntimeError, match=r"layer 3 is outside \[0, 3\)"):
        dsa_jax.indexer_topk(*args, **kw, layer=jnp.int32(3))


def test_bad_layers_and_stacks_are_refused_by_name():
    b = batches.scenario("decode", seed=36, num_heads=2, dim=128)
    stack = jnp.asarray(_stack(b.cache, seed=2))
    q, w = jnp.asarray(b.q), jnp.asarray(b.weights)
    for entry in (ref.streamindex_topk_ref, pk.streamindex_topk):
        with pytest.raises(ValueError, match=r"layer=3 is outside \[0, 3\)"):
            entry(q, w, stack, *b.meta(), k=4, pages_per_seq=b.pages_per_seq, layer=3)
        with pytest.raises(ValueError, match=r"rank 4 .*needs layer="):
            entry(q, w, stack, *b.meta(), k=4, pages_per_seq=b.pages_per_seq)
    sel = jnp.zeros((q.shape[0], 4), jnp.int32)
    mla = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=V_DIM)
    with pytest.raises(ValueError, match=r"layer=-1 is outside \[0, 3\)"):
        pk.sparse_mla(q, stack, b.seq_lens, sel, *b.meta()[1:], **mla, layer=-1)
    with pytest.raises(ValueError, match=r"q.shape\[0\] = 2 must equal .* L = 3"):
        ref.sparse_mla_ref(jnp.stack([q, q]), stack, b.seq_lens, sel, *b.meta()[1:], **mla,
                           layer=0)
    with pytest.raises(ValueError, match=r"rank 4 .*pass layer="):
        ref.sparse_mla_ref(jnp.stack([q] * 3), stack[0], b.seq_lens, sel, *b.meta()[1:],
                           **mla)
    with pytest.raises(TypeError, match="layer must be an int"):
        ref.sparse_mla_ref(q, stack, b.seq_lens, sel, *b.meta()[1:], **mla, layer=1.5)


def test_one_trace_serves_every_layer():
    """The layer is an operand, not a static argument: one compiled program reads any layer."""
    b = batches.scenario("decode", seed=37, num_heads=2, dim=128)
    stack = jnp.asarray(_stack(b.cache, seed=4))
    traces = []

    @jax.jit
    def f(layer):
        traces.append(1)
        return ref.streamindex_topk_ref(jnp.asarray(b.q), jnp.asarray(b.weights), stack,
                                        *b.meta(), k=4, pages_per_seq=b.pages_per_seq,
                                        exact=True, layer=layer)

    for layer in range(LAYERS):
        np.testing.assert_array_equal(
            f(jnp.int32(layer)), ref.streamindex_topk_ref(
                jnp.asarray(b.q), jnp.asarray(b.weights), stack[layer], *b.meta(), k=4,
                pages_per_seq=b.pages_per_seq, exact=True))
    assert len(traces) == 1


@pytest.mark.parametrize("fmt", ["f32", "packed", "fp8"])
@pytest.mark.parametrize("op", sorted(MLA))
def test_one_call_for_every_layer_equals_the_per_layer_calls(op, fmt):
    """``pallas_kernels.mla.layers.sparse_mla_layers`` (what the step runs: one kernel call, row
    ``t`` of the ``L x T`` grid reads layer ``t // T``) equals the per-layer entry on every
    layer, index for index (strict interpreter; distinct layers, NaN in unowned slots)."""
    from pallas_kernels.mla import layers

    # _small_mixed, not mixed_padding: padding rows at the end of each layer's T rows (the
    # grid's layer boundary), NaN unowned slots, at a third of the interpreter's steps.
    b = _small_mixed(38, num_heads=4)
    stack = _stack(b.cache, seed=8)
    sel = jnp.stack([_selection(op, b, jnp.asarray(stack[i])) for i in range(LAYERS)])
    q = jnp.stack([jnp.asarray(b.q) * (i + 1) for i in range(LAYERS)])
    if fmt == "fp8":
        values = np.nan_to_num(stack, nan=0.0)
        q = jnp.pad(q[..., :64], [(0, 0)] * 3 + [(0, 576 - 64)]).astype(jnp.bfloat16)
        cache = fp8_cache.quantize_latent_cache(
            jnp.pad(jnp.asarray(values), [(0, 0)] * 3 + [(0, 576 - 128)]))
    elif fmt == "packed":
        q, cache = q.astype(jnp.bfloat16), packed_cache.pack_cache(jnp.asarray(stack,
                                                                               jnp.bfloat16))
    else:
        cache = jnp.asarray(stack)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=V_DIM, interpret=True)
    got = layers.sparse_mla_layers(q, cache, b.seq_lens, sel, *b.meta()[1:], mode=op, **kw)
    assert got.shape == (LAYERS, *q.shape[1:3], V_DIM) and got.dtype == q.dtype
    for i in range(LAYERS):
        want = MLA[op][1](q[i], jax.tree.map(lambda x, i=i: x[i], cache), b.seq_lens, sel[i],
                          *b.meta()[1:], **kw)
        np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                      np.asarray(want, np.float32))
