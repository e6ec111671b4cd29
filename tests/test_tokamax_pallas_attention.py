"""``dsa_jax.engines.tokamax.attention``'s ``implementation="pallas"`` (issue 29): ``mla_swa``,
``sparse_mla`` and ``hca_mla`` by ``pallas_kernels.v4_attention.state`` (the strict interpreter
off TPU) against the ``"xla"`` path on the same inputs (every cache slot no row may read holds
NaN): the updated window cache bytes exactly equal, the outputs and states to f32 order noise
plus a bf16 rounding; the refusals; and (kernel_gate) the ``mla_swa`` + ``sparse_mla``
adapters AOT-compile at the V4-Flash decode shape with the donated window cache written in
place (no cache-sized result in the compiled HLO)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engines_tokamax_attention import SM, close, hca_case, make_case

from dsa_jax.engines.tokamax import attention as tk
from pallas_kernels import chips
from pallas_kernels.measure import hlo, xla_cost
from reference.formats import tokamax_v4 as tv

P = dict(implementation="pallas")


def _live_rows(case):
    return np.array([rf is not None for rf in case.rows])


def _scale(q_dtype):
    """The kernel feeds the MXU bf16 ``e^(s - m)`` when q is bf16 (``"xla"`` keeps f32): one
    bf16 rounding of each weight, up to ``2**-8`` of the largest output."""
    return 2 ** -8 if q_dtype == jnp.bfloat16 else 1e-5


@pytest.mark.parametrize(("name", "unnormalized", "q_dtype"), [
    ("decode", False, jnp.bfloat16), ("mixed", True, jnp.bfloat16),
    ("prefill", False, jnp.float32)])
def test_mla_swa_pallas_is_the_xla_path(name, unnormalized, q_dtype):
    case = make_case(11, name, q_dtype=q_dtype)
    kw = case.swa_kw(unnormalized_output=unnormalized)
    want = tk.mla_swa(*case.swa_args(), **kw)
    got = tk.mla_swa(*case.swa_args(), **kw, **P)
    assert got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the cache bytes
    assert got[0].dtype == case.q.dtype
    close(got[0], want[0], scale=_scale(q_dtype))
    close(got[2], want[2], rel=1e-5, scale=0)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-5, atol=1e-5)
    dead = ~_live_rows(case)
    for x in got[0], got[2], got[3]:
        assert not np.asarray(x, np.float32)[dead].any()


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_sparse_mla_pallas_is_the_xla_path(q_dtype):
    case = make_case(12, "mixed", q_dtype=q_dtype)
    win, _, l_, m = tk.mla_swa(*case.swa_args(), **case.swa_kw(unnormalized_output=True))
    # rows 0, 1 resume an empty state as "xla"'s mla_swa returns it (l = 0, m = -inf); row 1
    # lists nothing either (its output: zeros)
    win, l_, m = win.at[:2].set(0), l_.at[:2].set(0.0), m.at[:2].set(-jnp.inf)
    topk = case.topk.copy()
    topk[1] = -1
    args = case.sparse_args((win, l_, m), topk)
    want = tk.sparse_mla(*args, sm_scale=SM)
    got = tk.sparse_mla(*args, sm_scale=SM, **P)
    assert got.dtype == q_dtype
    close(got, want, scale=_scale(q_dtype))
    assert not np.asarray(got, np.float32)[~_live_rows(case)].any()


def _hca(case, rng):
    hca, table, n, _ = hca_case(case, rng)
    counts = np.array([0 if rf is None else rng.integers(0, n[rf[0]] + 1)
                       for rf in case.rows], np.int32)
    return hca, table, counts


def test_hca_mla_pallas_is_the_xla_path():
    case = make_case(13, "mixed")
    hca, table, counts = _hca(case, np.random.default_rng(13))
    state = tk.mla_swa(*case.swa_args(), **case.swa_kw(unnormalized_output=True))
    state = (state[0], state[2], state[3])
    args = (case.q, hca.words, jnp.asarray(counts), jnp.asarray(table),
            jnp.asarray(case.cu_q_lens), jnp.asarray(case.distribution), case.sinks, *state)
    kw = dict(logical_page_size=hca.logical_page_size, sm_scale=SM)
    want = tk.hca_mla(*args, **kw)
    got = tk.hca_mla(*args, **kw, **P)
    close(got, want, scale=_scale(case.q.dtype))
    with pytest.raises(NotImplementedError, match="slab view"):
        tk.hca_mla(*args[:1], tv.words_to_slabs(hca.words), *args[2:], **kw, **P)


def test_pallas_refusals_fall_through_to_xla():
    case = make_case(14, "decode")
    args = case.swa_args()
    with pytest.raises(NotImplementedError, match="non_causal_block"):
        tk.mla_swa(*args, **case.swa_kw(non_causal_block=True), **P)
    slab = tv.words_to_slabs(jnp.asarray(case.window))
    with pytest.raises(NotImplementedError, match="slab view"):
        tk.mla_swa(*case.swa_args(slab), **case.swa_kw(), **P)
    got = tk.mla_swa(*case.swa_args(slab), **case.swa_kw(), implementation=["pallas", "xla"])
    assert got[1].dtype == jnp.uint8
    with pytest.raises(ValueError, match="kernel_options \\['tile'\\]"):
        tk.mla_swa(*args, **case.swa_kw(), **P, kernel_options={"tile": 8})


# ----------------------------------------------------------------------------- AOT (kernel_gate)

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
ROWS, CONTEXT, HEADS, K, WINDOW, LPS = 64, 8192, 64, 512, 128, 64  # V4-Flash CSA decode
COMPILED = dict(implementation="pallas", kernel_options={"interpret": False})


def _adapter_specs():
    """``mla_swa``'s (window words argument 2, to donate) and ``sparse_mla``'s specs."""
    sd = jax.ShapeDtypeStruct
    pps, cpps = CONTEXT // LPS, CONTEXT // 4 // LPS
    meta = [sd((ROWS,), jnp.int32), sd((ROWS * pps,), jnp.int32), sd((ROWS + 1,), jnp.int32),
            sd((3,), jnp.int32)]
    q, sink = sd((ROWS, HEADS, 512), jnp.bfloat16), sd((HEADS,), jnp.float32)
    swa = [q, sd((ROWS, 512), jnp.bfloat16), sd((ROWS * pps, 2 * LPS, 128), jnp.int32), *meta,
           sink]
    state = [q, sd((ROWS, HEADS), jnp.float32), sd((ROWS, HEADS), jnp.float32)]
    csa = [q, sd((ROWS * cpps, LPS, 128), jnp.int32), sd((ROWS * cpps, LPS // 4, 128), jnp.int32),
           sd((ROWS, K), jnp.int32), sd((ROWS * cpps,), jnp.int32), *meta[2:], sink, *state]
    return swa, csa


@pytest.mark.kernel_gate
@pytest.mark.parametrize("chip", [chips.DEFAULT, chips.NEWEST])
def test_adapters_compile_with_the_window_cache_written_in_place(chip):
    """The ``mla_swa`` (unnormalized, donated window cache) and ``sparse_mla`` adapters
    AOT-compile at the V4-Flash decode shape; no XLA op yields a cache-sized result (the rows
    are written in place, no copy or relayout of either cache)."""
    swa, csa = _adapter_specs()
    compiled = xla_cost.compile_program(
        lambda *a: tk.mla_swa(*a, sliding_window=WINDOW, logical_page_size=LPS, sm_scale=SM,
                          unnormalized_output=True, **COMPILED), swa, chip, donate_argnums=(2,),
        case="tokamax.mla_swa")
    cache_bytes = int(np.prod(swa[2].shape)) * 4
    assert not hlo.parse_large_results(compiled.as_text(), cache_bytes)
    compiled = xla_cost.compile_program(
        lambda *a: tk.sparse_mla(*a, sm_scale=SM, **COMPILED), csa, chip,
        case="tokamax.sparse_mla")
    assert not hlo.parse_large_results(compiled.as_text(), int(np.prod(csa[2].shape)) * 4)
