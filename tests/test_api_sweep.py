"""A sweep of bad and edge inputs over the public API, on both implementations (issue 28).

Every case is one mutation of a valid call. Its expected outcome is either a clear error (a
``TypeError`` / ``ValueError`` whose message names the argument of the op it was given to) or a
documented masking rule whose result is checked here (empty batches, rows outside every
sequence, a budget past the context, unread ``-1`` entries). Static refusals happen before an
implementation runs, so both implementations must give the same error; results are checked on
each. The Pallas implementation runs in the strict interpreter (no TPU here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batches import fixed_stride_table
from v4_batches import make_v4_batch

import dsa_jax
from dsa_jax import backend as backend_mod
from dsa_jax.v4_attention import V4Layout
from reference.synthetic import make_ragged_batch
from tests.test_v4_step import INTERPRET_NO_RACES

PAGE, PAGES, K, V_DIM, SCALE = 8, 4, 6, 64, 0.1
IMPLEMENTATIONS = ("xla", "pallas")
NO_RACES = INTERPRET_NO_RACES  # answers, not races, are checked here (race tests: their own)


@pytest.fixture(scope="module")
def b():
    """Two sequences (decode 1 row, prefill 3 rows) plus a padding row and an inactive slot."""
    rng = np.random.default_rng(28)
    return make_ragged_batch(rng, q_lens=[1, 3], kv_lens=[9, 20], page_size=PAGE,
                             pages_per_seq=PAGES, num_heads=2, dim=128, pad_rows=1,
                             pad_seqs=1)


class Err:
    """A refusal: ``kind`` raised, its message naming ``names`` (a regex of alternatives)."""

    def __init__(self, kind, names: str):
        self.kind, self.names = kind, names


class Ok:
    """A served call whose result ``check(result, batch)`` asserts."""

    def __init__(self, check):
        self.check = check


# ----------------------------------------------------------------------------- the calls


def meta_kw(b, **over):
    kw = dict(page_indices=b.page_indices, cu_q_lens=b.cu_q_lens, cu_kv_lens=b.cu_kv_lens,
              distribution=b.distribution)
    return {**kw, **over}


def indexer(b, impl, *, op="indexer_topk", **over):
    kw = dict(q=b.q, weights=b.weights, cache_kv=b.cache, seq_lens=b.seq_lens, **meta_kw(b),
              pages_per_seq=PAGES)
    kw.update({"k": K} if op == "indexer_topk" else {"k_pages": 2})
    kw.update(over)
    return getattr(dsa_jax, op)(**kw, implementation=impl)


def mla(b, impl, *, op="sparse_mla", selected=None, **over):
    name = "topk_indices" if op == "sparse_mla" else "topk_pages"
    sel = selected if selected is not None else np.tile(
        np.arange(2, dtype=np.int32), (b.q.shape[0], 1))
    kw = dict(q=b.q, cache_kv=b.cache, kv_lens=b.seq_lens, **meta_kw(b), sm_scale=SCALE,
              pages_per_seq=PAGES, v_dim=V_DIM)
    kw[name] = sel
    kw.update(over)
    return getattr(dsa_jax, op)(**kw, implementation=impl)


def batched(b, impl, *, op="indexer_topk", batch_over=None, **over):
    """The op called with ``batch=`` (fixed-stride table) instead of the five arrays."""
    table = fixed_stride_table(b)  # tests.batches
    bk = dict(kv_lens=b.seq_lens, page_table=table, cu_q_lens=b.cu_q_lens,
              distribution=b.distribution, page_size=PAGE)
    bk.update(batch_over or {})
    batch = dsa_jax.Batch.from_fixed_stride(**bk)
    if op == "indexer_topk":
        kw = dict(q=b.q, weights=b.weights, cache_kv=b.cache, k=K)
    else:
        kw = dict(q=b.q, cache_kv=b.cache, topk_indices=np.zeros((b.q.shape[0], 2), np.int32),
                  sm_scale=SCALE, v_dim=V_DIM)
    kw.update(over)
    return getattr(dsa_jax, op)(**kw, batch=batch, implementation=impl)


def no_seqs(b):
    """S = 0 sequence slots: every row lies outside every sequence."""
    return dict(seq_lens=np.zeros(0, np.int32), page_indices=np.zeros(0, np.int32),
                cu_q_lens=np.zeros(1, np.int32), cu_kv_lens=np.zeros(1, np.int32),
                distribution=np.zeros(3, np.int32))


# ----------------------------------------------------------------------------- the checks


def shape_is(*shapes):
    def check(res, b):
        got = [tuple(x.shape) for x in (res if isinstance(res, tuple) else (res,))]
        assert got == [tuple(s) for s in shapes]
    return Ok(check)


def all_minus_one(res, b):
    assert np.all(np.asarray(res) == -1)


def all_zero(res, b):
    out = res[0] if isinstance(res, tuple) else res
    assert np.all(np.asarray(out) == 0) and not np.isnan(np.asarray(out)).any()


def budget_past_context(res, b):
    """k = 64 > every context: each row holds its visible keys once, then -1."""
    res = np.asarray(res)
    rows = [(0, 9)] + [(1 + j, 20 - 3 + 1 + j) for j in range(3)]  # (row, visible keys)
    for r, n in rows:
        assert sorted(res[r, :n]) == list(range(n)) and np.all(res[r, n:] == -1)
    assert np.all(res[4] == -1)  # the padding row


def mla_unread_is_zero(res, b):
    out, lse = res
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


# ----------------------------------------------------------------------------- the cases

I = indexer  # noqa: E741


def _cases():  # noqa: C901 - a table
    f16 = lambda x: np.asarray(x, np.float16)
    cases = {
        # indexer: shapes, dtypes, statics
        "idx q rank 2": (I, dict(q=lambda b: b.q[:, 0]), Err(ValueError, "q")),
        "idx q f16": (I, dict(q=lambda b: f16(b.q)), Err((TypeError, ValueError), "q")),
        "idx q int": (I, dict(q=lambda b: b.q.astype(np.int32)), Err((TypeError, ValueError),
                                                                     "q")),
        "idx weights heads": (I, dict(weights=lambda b: b.weights[:, :1]),
                              Err(ValueError, "weights")),
        "idx weights rows": (I, dict(weights=lambda b: b.weights[:2]),
                             Err(ValueError, "weights")),
        "idx cache dim": (I, dict(cache_kv=lambda b: b.cache[..., :64]),
                          Err(ValueError, "cache")),
        "idx seq_lens float": (I, dict(seq_lens=lambda b: b.seq_lens.astype(np.float32)),
                               Err((TypeError, ValueError), "seq_lens")),
        "idx seq_lens length": (I, dict(seq_lens=lambda b: b.seq_lens[:2]),
                                Err(ValueError, "seq_lens|cu_q_lens|cu_kv_lens")),
        "idx cu_q_lens length": (I, dict(cu_q_lens=lambda b: b.cu_q_lens[:-1]),
                                 Err(ValueError, "cu_q_lens")),
        "idx cu_kv_lens length": (I, dict(cu_kv_lens=lambda b: b.cu_kv_lens[:-1]),
                                  Err(ValueError, "cu_kv_lens")),
        "idx distribution length": (I, dict(distribution=lambda b: b.distribution[:2]),
                                    Err(ValueError, "distribution")),
        "idx page_indices 2-D": (I, dict(page_indices=lambda b: b.page_indices[:, None]),
                                 Err(ValueError, "page_indices")),
        "idx cu_q_lens float": (I, dict(cu_q_lens=lambda b: b.cu_q_lens.astype(np.float32)),
                                Err((TypeError, ValueError), "cu_q_lens")),
        "idx k 0": (I, dict(k=0), Err(ValueError, "k")),
        "idx k negative": (I, dict(k=-3), Err(ValueError, "k")),
        "idx k float": (I, dict(k=2.5), Err((TypeError, ValueError), "k")),
        "idx pages_per_seq 0": (I, dict(pages_per_seq=0), Err(ValueError, "pages_per_seq")),
        "idx pages_per_seq missing": (I, dict(pages_per_seq=None),
                                      Err(TypeError, "pages_per_seq")),
        "idx fill": (I, dict(fill="middle"), Err(ValueError, "fill")),
        "idx num_segments negative": (I, dict(num_segments=-1), Err(ValueError, "num_segments")),
        "idx num_segments past k": (I, dict(num_segments=K + 1, refuse_full_overwrite=True),
                                    Err(ValueError, "num_segments")),
        "idx precision": (I, dict(precision="fp16"), Err(ValueError, "precision")),
        "idx index_quant": (I, dict(index_quant="fp8"), Err(ValueError, "index_quant")),
        "idx compression_ratio 0": (I, dict(compression_ratio=0),
                                    Err(ValueError, "compression_ratio")),
        "idx kernel_options knob": (I, dict(kernel_options={"warp_size": 32}),
                                    Err(ValueError, "kernel_options")),
        "idx config type": (I, dict(config=dsa_jax.MlaBlocks()), Err(TypeError, "config")),
        "idx layer past a single-layer cache": (I, dict(layer=1), Err(ValueError, "layer")),
        "idx metadata missing": (I, dict(distribution=None), Err(TypeError, "distribution")),
        "idx layout disagrees": (I, dict(layout=dsa_jax.PagedLayout(page_size=PAGE,
                                                                    pages_per_seq=2)),
                                 Err(ValueError, "pages_per_seq")),
        "idx layout page size": (I, dict(layout=dsa_jax.PagedLayout(page_size=16,
                                                                    pages_per_seq=PAGES)),
                                 Err(ValueError, "layout.page_size = 16")),
        "mla layout gives the stride and v_dim": (mla, dict(
            layout=dsa_jax.PagedLayout(page_size=PAGE, pages_per_seq=PAGES, latent_dim=V_DIM,
                                       rope_dim=0), pages_per_seq=None, v_dim=None),
            shape_is((5, 2, V_DIM))),
        # indexer: documented results
        "idx no rows": (I, "no_rows_idx", shape_is((0, K))),
        "idx no sequences": (I, "no_seqs", Ok(all_minus_one)),
        "idx no active sequence": (I, dict(distribution=lambda b: np.zeros(3, np.int32)),
                                   Ok(all_minus_one)),
        "idx budget past context": (I, dict(k=64), Ok(budget_past_context)),
        "idx page id out of range, validate": (
            I, dict(page_indices=lambda b: np.full_like(b.page_indices, 10_000), validate=True),
            Err(ValueError, "page")),
        "page_topk k_pages 0": ((lambda b, i, **o: I(b, i, op="page_topk", **o)),
                                dict(k_pages=0), Err(ValueError, "k_pages")),
        "page_topk no rows": ((lambda b, i, **o: I(b, i, op="page_topk", **o)), "no_rows_idx",
                              shape_is((0, 2))),
        # MLA
        "mla sm_scale nan": (mla, dict(sm_scale=float("nan")), Err(ValueError, "sm_scale")),
        "mla sm_scale array": (mla, dict(sm_scale=np.ones(2, np.float32)),
                               Err(TypeError, "sm_scale")),
        "mla v_dim past head": (mla, dict(v_dim=256), Err(ValueError, "v_dim")),
        "mla v_dim missing": (mla, dict(v_dim=None), Err(TypeError, "v_dim")),
        "mla topk float": (mla, dict(topk_indices=lambda b: np.zeros((b.q.shape[0], 2),
                                                                      np.float32)),
                           Err((TypeError, ValueError), "topk_indices")),
        "mla topk rows": (mla, dict(topk_indices=lambda b: np.zeros((2, 2), np.int32)),
                          Err(ValueError, "topk_indices")),
        "mla q/cache dims": (mla, dict(cache_kv=lambda b: b.cache[..., :64]),
                             Err(ValueError, "cache_kv|q")),
        "mla attn_sink shape": (mla, dict(attn_sink=np.zeros(3, np.float32)),
                                Err(ValueError, "attn_sink")),
        "mla q f16": (mla, dict(q=lambda b: f16(b.q)), Err((TypeError, ValueError), "q")),
        "mla unknown implementation": (mla, dict(implementation="triton"),
                                       Err(ValueError, "implementation")),
        "mla config type": (mla, dict(config=dsa_jax.IndexerBlocks()),
                            Err(TypeError, "config")),
        "mla layer out of range": (mla, dict(cache_kv=lambda b: b.cache[None], layer=3),
                                   Err(ValueError, "layer")),
        "mla no rows": (mla, dict(q=lambda b: b.q[:0], cu_q_lens=lambda b: np.zeros_like(
            b.cu_q_lens), distribution=lambda b: np.zeros(3, np.int32), return_lse=True,
            topk_indices=lambda b: np.zeros((0, 2), np.int32)),
            shape_is((0, 2, V_DIM), (0, 2))),
        "mla no sequences": (mla, "no_seqs", Ok(all_zero)),
        "mla nothing selected": (mla, dict(topk_indices=lambda b: np.full((b.q.shape[0], 3), -1,
                                                                           np.int32),
                                           return_lse=True), Ok(mla_unread_is_zero)),
        "mla selection past kv_len": (mla, dict(topk_indices=lambda b: np.full(
            (b.q.shape[0], 2), 60, np.int32), return_lse=True), Ok(mla_unread_is_zero)),
        "page_mla pages float": ((lambda b, i, **o: mla(b, i, op="page_sparse_mla", **o)),
                                 dict(topk_pages=lambda b: np.zeros((b.q.shape[0], 2),
                                                                    np.float32)),
                                 Err((TypeError, ValueError), "topk_pages")),
        "page_mla no sequences": ((lambda b, i, **o: mla(b, i, op="page_sparse_mla", **o)),
                                  "no_seqs", Ok(all_zero)),
        # Batch
        "batch page size vs cache": (batched, dict(batch_over=dict(page_size=4)),
                                     Err(ValueError, "page_size")),
        "batch and positional": (batched, dict(seq_lens=lambda b: b.seq_lens),
                                 Err(TypeError, "batch")),
        "batch pages_per_seq disagrees": (batched, dict(pages_per_seq=2),
                                          Err(ValueError, "pages_per_seq")),
        "batch kv_lens float": (batched, dict(batch_over=dict(
            kv_lens=np.zeros(3, np.float32))), Err(TypeError, "kv_lens")),
        "batch table 1-D": (batched, dict(batch_over=dict(page_table=np.zeros(12, np.int32))),
                            Err(ValueError, "page_table")),
        "batch table rows": (batched, dict(batch_over=dict(page_table=np.zeros((2, 4),
                                                                               np.int32))),
                             Err(ValueError, "page_table")),
        "batch page_size 0": (batched, dict(batch_over=dict(page_size=0)),
                              Err(ValueError, "page_size")),
        "batch page_size array": (batched, dict(batch_over=dict(page_size=jnp.int32(8))),
                                  Err(TypeError, "page_size")),
        "batch cu_q_lens length": (batched, dict(batch_over=dict(
            cu_q_lens=np.zeros(2, np.int32))), Err(ValueError, "cu_q_lens")),
        "batch not a Batch": (I, dict(batch=lambda b: b.meta(), seq_lens=None,
                                      page_indices=None, cu_q_lens=None, cu_kv_lens=None,
                                      distribution=None), Err(TypeError, "batch")),
        "batch mla selection third": (batched, dict(op="sparse_mla"),
                                      shape_is((5, 2, V_DIM))),
    }
    return cases


CASES = _cases()


def _resolve(over, b):
    if over == "no_seqs":
        return dict(no_seqs(b), q=b.q, weights=b.weights)
    if over == "no_rows_idx":
        return dict(q=b.q[:0], weights=b.weights[:0], cu_q_lens=np.zeros_like(b.cu_q_lens),
                    distribution=np.zeros(3, np.int32))
    return {k: (v(b) if callable(v) and not isinstance(v, type) else v) for k, v in
            over.items()}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_sweep(b, name, impl):
    call, over, want = CASES[name]
    over = _resolve(over, b)
    if "mla" in name:  # the MLA ops take no weights and call seq_lens kv_lens
        over.pop("weights", None)
        if "seq_lens" in over:
            over["kv_lens"] = over.pop("seq_lens")
    if "implementation" in over:
        impl = over.pop("implementation")
    if impl == "pallas" and "kernel_options" not in over:
        over["kernel_options"] = NO_RACES
    if isinstance(want, Err):
        with pytest.raises(want.kind, match=want.names):
            call(b, impl, **over)
    else:
        want.check(call(b, impl, **over), b)


def test_sweep_is_at_least_100_inputs():
    assert len(CASES) * len(IMPLEMENTATIONS) >= 100


# ----------------------------------------------------------------------------- traced statics


def test_a_traced_sm_scale_is_refused_by_name(b):
    @jax.jit
    def f(scale):
        return mla(b, "xla", sm_scale=scale)

    with pytest.raises(TypeError, match="sm_scale"):
        f(jnp.float32(0.1))


def test_a_concrete_jax_sm_scale_is_the_float(b):
    a = mla(b, "xla", sm_scale=jnp.float32(0.25))
    np.testing.assert_array_equal(a, mla(b, "xla", sm_scale=float(np.float32(0.25))))


# ----------------------------------------------------------------------------- V4 attention


def _v4(impl, over=None):
    vb = make_v4_batch(5, q_lens=[1, 2], kv_lens=[19, 33], ratio=0, heads=2)
    layout = V4Layout(compress_ratio=0, window_page_size=4, window_size=vb.window_size,
                      window_pages_per_seq=vb.window_pages_per_seq)
    args = dict(zip(("q", "window", "kv_lens", "cu_q_lens", "distribution"), vb.args(),
                    strict=True))
    kw = dict(layout=layout, **args)
    kw.update(over(vb) if over else {})
    opts = {"kernel_options": NO_RACES} if impl == "pallas" else {}
    return dsa_jax.v4_attention(**kw, implementation=impl, **opts)


V4_CASES = {
    "layout type": (lambda vb: dict(layout="csa"), Err(TypeError, "layout")),
    "window head dim": (lambda vb: dict(window=vb.args()[1]._replace(
        cache=vb.window[0][..., :256])), Err(ValueError, "window")),
    "precision": (lambda vb: dict(precision="fp8"), Err(ValueError, "precision")),
    "sm_scale nan": (lambda vb: dict(sm_scale=float("nan")), Err(ValueError, "sm_scale")),
    "no rows": (lambda vb: dict(q=vb.q[:0], cu_q_lens=np.zeros_like(vb.cu_q_lens),
                                distribution=np.zeros(3, np.int32)),
                shape_is((0, 2, 512))),
    "no active sequence": (lambda vb: dict(distribution=np.zeros(3, np.int32)), Ok(all_zero)),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(V4_CASES))
def test_v4_sweep(name, impl):
    over, want = V4_CASES[name]
    if isinstance(want, Err):
        with pytest.raises(want.kind, match=want.names):
            _v4(impl, over)
    else:
        want.check(_v4(impl, over), None)


def test_implementation_names_are_per_op_and_unknown_ones_list_them():
    with pytest.raises(ValueError, match="pallas_two_pass"):
        _v4("two_pass")
    with pytest.raises(ValueError, match=r"unknown implementation 'pallas_two_pass'.*'xla'"):
        backend_mod.candidates("indexer_topk", "pallas_two_pass", None)


# ----------------------------------------------------------------------------- V4 step, writers


def _step_case(change):
    from tests import test_v4_step as tv

    inputs, params, pm, meta = tv._one_step_args()
    args = dict(inputs=inputs, params=params, caches=pm.caches, states=pm.states, meta=meta)
    args.update(change(args))
    return args, pm.layout


def _shorter_pool(st):
    return type(st)(*[None if s is None else s._replace(**{f: getattr(s, f)[:1] for f in
                                                          s._fields}) for s in st])


STEP_CASES = {
    "meta table rank": (lambda a: dict(meta=a["meta"]._replace(
        csa_page_indices=np.asarray(a["meta"].csa_page_indices)[:, None])),
        "meta.csa_page_indices"),
    "meta cu_lens length": (lambda a: dict(meta=a["meta"]._replace(
        hca_cu_lens=np.asarray(a["meta"].hca_cu_lens)[:-1])), "meta.hca_cu_lens"),
    "meta state_slots length": (lambda a: dict(meta=a["meta"]._replace(
        state_slots=np.asarray(a["meta"].state_slots)[:1])), "meta.state_slots"),
    "rope table short": (lambda a: dict(params=a["params"]._replace(
        cos=a["params"].cos[:8], sin=a["params"].sin[:8])), "params.cos has 8 positions"),
    "state pool fewer slots than sequences": (lambda a: dict(states=_shorter_pool(
        a["states"])), "1 slots per layer, fewer than the batch's S = 2"),
    "unknown implementation": (lambda a: dict(implementation="triton"), "implementation"),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(STEP_CASES))
def test_v4_step_sweep(name, impl):
    from dsa_jax.v4_step import v4_step

    change, match = STEP_CASES[name]
    args, layout = _step_case(change)
    impl = args.pop("implementation", impl)
    with pytest.raises(ValueError, match=match):
        v4_step(**args, layout=layout, implementation=impl)


def test_update_kv_cache_refuses_rows_no_op_reads(b):
    layout = dsa_jax.PagedLayout(page_size=PAGE, pages_per_seq=PAGES, index_dim=128,
                                 latent_dim=96, rope_dim=32)
    latent = np.zeros((b.cache.shape[0], PAGE, layout.padded_dim), np.float32)
    rows = np.zeros((b.q.shape[0], layout.qk_dim), np.float16)
    with pytest.raises(ValueError, match="update_kv_cache: new_latent has dtype float16"):
        dsa_jax.update_kv_cache(latent, None, rows, None, *b.meta(), layout=layout)


def test_fp8_to_cache_refuses_nonzero_latent_padding():
    layout = dsa_jax.PagedLayout(page_size=32, pages_per_seq=1, latent_cache_format="fp8")
    values = np.zeros((2, 32, layout.padded_dim), np.float32)
    layout.to_cache(values, "latent")  # zero padding: dropped, as documented
    values[0, 3, layout.qk_dim + 5] = 1.0
    with pytest.raises(ValueError, match=r"nonzero numbers past qk_dim = 576"):
        layout.to_cache(values, "latent")
    with pytest.raises(ValueError, match=r"qk_dim = 576 or padded_dim = 640, got 600"):
        layout.to_cache(values[..., :600], "latent")
