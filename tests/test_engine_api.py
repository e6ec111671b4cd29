"""The engine-ready API (issue 28): ``dsa_jax.Batch`` in place of the metadata arrays on both
page-table forms, ``implementation=`` by name (equal to ``backend=`` bit for bit, ordered
lists, ``NotImplementedError`` passing to the next), typed ``config=``, and empty batches on the
ops and both steps. The Pallas implementation runs in the strict interpreter (no TPU here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batches import fixed_stride_table
from v4_batches import make_v4_batch

import dsa_jax
from dsa_jax import BatchMeta, PagedKV, StepInputs
from dsa_jax.v4_attention import V4Layout
from dsa_jax.v4_step import v4_step
from reference.synthetic import make_ragged_batch
from tests import test_step as ts
from tests import test_v4_step as tv

PAGE, PAGES, K, V_DIM, SCALE = 8, 4, 6, 64, 0.1
NO_RACES = tv.INTERPRET_NO_RACES  # equality of call forms is checked here, not races


@pytest.fixture(scope="module")
def b():
    """Decode, MTP and prefill rows, a padding row and an inactive slot; D = 128."""
    rng = np.random.default_rng(281)
    return make_ragged_batch(rng, q_lens=[1, 2, 4], kv_lens=[9, 30, 13], page_size=PAGE,
                             pages_per_seq=PAGES, num_heads=2, dim=128, pad_rows=1,
                             pad_seqs=1)


def fixed_stride(b):
    """The batch's packed table as a fixed-stride ``i32[S, PAGES]`` table (unused slots -1)
    and the equal ``Batch``es of both forms."""
    table = fixed_stride_table(b)
    fixed = dsa_jax.Batch.from_fixed_stride(b.seq_lens, table, b.cu_q_lens, b.distribution,
                                            page_size=PAGE)
    packed = dsa_jax.Batch.from_packed(*b.meta(), page_size=PAGE, pages_per_seq=PAGES)
    return fixed, packed


def test_the_fixed_stride_batch_is_the_packed_form_of_its_table(b):
    fixed, _ = fixed_stride(b)
    np.testing.assert_array_equal(fixed.cu_kv_lens, np.arange(5) * PAGES * PAGE)
    assert fixed.page_indices.shape == (4 * PAGES,)
    assert (fixed.page_size, fixed.pages_per_seq, fixed.num_seqs) == (PAGE, PAGES, 4)
    with pytest.raises(ValueError, match=r"page_table must have shape \[4, \*\], got \[3, 4\]"):
        dsa_jax.Batch.from_fixed_stride(b.seq_lens, np.zeros((3, 4), np.int32), b.cu_q_lens,
                                        b.distribution, page_size=PAGE)


def _ops(b, sel, pages):
    """op name -> (function, positional args, keyword args without the metadata)."""
    return {
        "indexer_topk": (dsa_jax.indexer_topk, (b.q, b.weights, b.cache), dict(k=K)),
        "page_topk": (dsa_jax.page_topk, (b.q, b.weights, b.cache), dict(k_pages=2)),
        "sparse_mla": (dsa_jax.sparse_mla, (b.q, b.cache, sel),
                       dict(sm_scale=SCALE, v_dim=V_DIM, return_lse=True)),
        "page_sparse_mla": (dsa_jax.page_sparse_mla, (b.q, b.cache, pages),
                            dict(sm_scale=SCALE, v_dim=V_DIM, return_lse=True)),
    }


def _positional(fn, args, kw, b, **extra):
    meta = b.meta()
    if fn in (dsa_jax.sparse_mla, dsa_jax.page_sparse_mla):
        q, cache, sel = args
        return fn(q, cache, meta[0], sel, *meta[1:], **kw, pages_per_seq=PAGES, **extra)
    return fn(*args, *meta, **kw, pages_per_seq=PAGES, **extra)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("op", ["indexer_topk", "page_topk", "sparse_mla", "page_sparse_mla"])
def test_batch_equals_the_positional_form_on_both_page_table_forms(b, op, impl):
    sel = np.asarray(dsa_jax.indexer_topk(b.q, b.weights, b.cache, *b.meta(), k=K,
                                          pages_per_seq=PAGES, backend="reference"))
    pages = np.asarray(dsa_jax.page_topk(b.q, b.weights, b.cache, *b.meta(), k_pages=2,
                                         pages_per_seq=PAGES, backend="reference"))
    fn, args, kw = _ops(b, sel, pages)[op]
    opts = {} if impl == "xla" else {"kernel_options": NO_RACES}
    want = _positional(fn, args, kw, b, backend="reference" if impl == "xla" else "pallas",
                       **opts)
    # the packed Batch holds the positional arrays themselves: once, on the jnp path
    for batch in fixed_stride(b)[:1 if impl == "pallas" else 2]:
        got = fn(*args, **kw, batch=batch, implementation=impl, **opts)
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)),
                        strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("op", ["indexer_topk", "page_topk", "sparse_mla", "page_sparse_mla"])
def test_implementation_xla_is_backend_reference_bit_for_bit(b, op):
    sel = np.zeros((b.q.shape[0], 3), np.int32) + np.arange(3, dtype=np.int32)
    fn, args, kw = _ops(b, sel, sel[:, :2] // 2)[op]
    got = _positional(fn, args, kw, b, implementation="xla")
    want = _positional(fn, args, kw, b, backend="reference")
    for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)), strict=True):
        np.testing.assert_array_equal(g, w)


def test_config_is_the_typed_blocks_of_the_kernel(b):
    blocks = dsa_jax.IndexerBlocks(block_pages=2)
    got = dsa_jax.indexer_topk(b.q, b.weights, b.cache, *b.meta(), k=K, pages_per_seq=PAGES,
                               implementation="pallas", config=blocks, kernel_options=NO_RACES)
    want = dsa_jax.indexer_topk(b.q, b.weights, b.cache, *b.meta(), k=K, pages_per_seq=PAGES,
                                backend="pallas", kernel_options={"blocks": blocks, **NO_RACES})
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="config= or kernel_options"):
        dsa_jax.indexer_topk(b.q, b.weights, b.cache, *b.meta(), k=K, pages_per_seq=PAGES,
                             config=blocks, kernel_options={"blocks": blocks})


# ----------------------------------------------------------------------------- V4 attention


def _v4_case():
    vb = make_v4_batch(11, q_lens=[1, 3], kv_lens=[21, 40], ratio=0, heads=2)
    layout = V4Layout(compress_ratio=0, window_page_size=4, window_size=vb.window_size,
                      window_pages_per_seq=vb.window_pages_per_seq)
    return vb, layout


def test_v4_attention_takes_a_batch_whose_table_is_the_window_cache(b):
    vb, layout = _v4_case()
    want = dsa_jax.v4_attention(*vb.args(), layout=layout, backend="reference")
    cache, pages, cu = vb.window
    batch = dsa_jax.Batch.from_packed(vb.kv_lens, pages, vb.cu_q_lens, cu, vb.distribution,
                                      page_size=4, pages_per_seq=vb.window_pages_per_seq)
    for window in (cache, PagedKV(cache, pages, cu)):
        got = dsa_jax.v4_attention(vb.q, window, layout=layout, batch=batch,
                                   implementation="xla")
        np.testing.assert_array_equal(got, want)


def test_an_ordered_list_passes_not_implemented_to_the_next_and_groups_all_failures():
    vb, layout = _v4_case()
    args = dict(layout=layout, precision="bf16")
    want = dsa_jax.v4_attention(*vb.args(), **args, implementation="xla")
    got = dsa_jax.v4_attention(*vb.args(), **args, implementation=["pallas_two_pass", "xla"])
    np.testing.assert_array_equal(got, want)  # the two-pass form refuses bf16: next one
    with pytest.raises(ExceptionGroup) as info:
        dsa_jax.v4_attention(*vb.args(), **args, implementation=["pallas_two_pass"])
    assert info.group_contains(NotImplementedError, match="bf16")
    with pytest.raises(ValueError, match="implementation= or backend="):
        dsa_jax.v4_attention(*vb.args(), **args, implementation="xla", backend="reference")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_v4_attention_serves_an_empty_batch(impl):
    vb, layout = _v4_case()
    cache, pages, cu = vb.window
    out = dsa_jax.v4_attention(vb.q[:0], vb.args()[1], vb.kv_lens, np.zeros_like(vb.cu_q_lens),
                               np.zeros(3, np.int32), layout=layout, implementation=impl,
                               return_lse=True)
    assert [x.shape for x in out] == [(0, 2, 512), (0, 2)]
    none = dsa_jax.v4_attention(vb.q, PagedKV(cache, np.zeros(0, np.int32), np.zeros(1,
                                                                                      np.int32)),
                                np.zeros(0, np.int32), np.zeros(1, np.int32),
                                np.zeros(3, np.int32), layout=layout, implementation=impl)
    assert none.shape == vb.q.shape and np.all(np.asarray(none) == 0)


# ----------------------------------------------------------------------------- the steps


def test_dsa_step_takes_a_batch_and_implementation_and_an_idle_step_does_nothing():
    sb, inputs, latent, index = ts._step_case()
    want = ts._step(sb, inputs, latent, index, backend="reference")
    batch = dsa_jax.Batch.from_packed(*sb.meta(), page_size=ts.LAYOUT.page_size,
                                      pages_per_seq=ts.LAYOUT.pages_per_seq)
    got = dsa_jax.dsa_step(inputs, latent.copy(), index.copy(), batch, layout=ts.LAYOUT,
                           indexer_types=ts.TYPES, k=6, sm_scale=ts.SM_SCALE, exact=True,
                           implementation="xla")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    idle = StepInputs(*(x[:, :0] for x in inputs[:5]))
    meta = BatchMeta(sb.seq_lens, sb.page_indices, np.zeros_like(sb.cu_q_lens),
                     sb.cu_kv_lens, np.zeros(3, np.int32))
    res = dsa_jax.dsa_step(idle, jnp.asarray(latent), jnp.asarray(index), meta,
                           layout=ts.LAYOUT, indexer_types=ts.TYPES, k=6, sm_scale=ts.SM_SCALE,
                           implementation="xla")
    assert res.out.shape == (len(ts.TYPES), 0, 2, ts.LAYOUT.latent_dim)
    assert res.topk.shape == (ts.TYPES.count("full"), 0, 6)
    np.testing.assert_array_equal(res.latent_caches, latent)
    np.testing.assert_array_equal(res.index_caches, index)


def test_an_idle_v4_step_does_nothing():
    inputs, sp, pm, meta = tv._one_step_args()
    idle = inputs._replace(**{n: x[:, :0] for n, x in inputs._asdict().items()
                              if x is not None and n != "attn_sink"})
    meta = meta._replace(cu_q_lens=np.zeros_like(meta.cu_q_lens),
                         distribution=np.zeros(3, np.int32))
    res = v4_step(idle, sp, pm.caches, pm.states, meta, layout=pm.layout, implementation="xla")
    assert res.out.shape == (len(tv.RATIOS), 0, inputs.q.shape[2], 512)
    assert res.topk.shape[1] == 0
    for got, given in ((res.caches, pm.caches), (res.states, pm.states)):
        assert all(a is b for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(given),
                                          strict=True))  # as given: no copy, no write


def test_v4_batch_meta_from_batches_is_the_step_metadata():
    _, _, pm, meta = tv._one_step_args()
    lay = pm.layout

    def fam(pages, cu, ps, pps):
        return dsa_jax.Batch.from_packed(meta.kv_lens, pages, meta.cu_q_lens, cu,
                                         meta.distribution, page_size=ps, pages_per_seq=pps)

    got = dsa_jax.V4BatchMeta.from_batch(
        fam(meta.window_page_indices, meta.window_cu_lens, lay.window_page_size,
            lay.window_pages_per_seq), meta.state_slots,
        csa=fam(meta.csa_page_indices, meta.csa_cu_lens, lay.csa_page_size,
                lay.csa_pages_per_seq),
        hca=fam(meta.hca_page_indices, meta.hca_cu_lens, lay.hca_page_size,
                lay.hca_pages_per_seq))
    for field, g, w in zip(meta._fields, got, meta, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=field)
    with pytest.raises(TypeError, match=r"meta must be a V4BatchMeta \(V4BatchMeta.from_batch"):
        v4_step(*tv._one_step_args()[:2], pm.caches, pm.states, got.kv_lens, layout=lay)
    with pytest.raises(TypeError, match="csa must be a dsa_jax.Batch"):
        dsa_jax.V4BatchMeta.from_batch(fam(meta.window_page_indices, meta.window_cu_lens,
                                           lay.window_page_size, lay.window_pages_per_seq),
                                       meta.state_slots, csa=(1, 2))


def test_a_step_without_sequences_writes_nothing_and_reads_nothing():
    """S = 0: every row lies outside every sequence (the drop rule writes nothing; top-k rows
    -1, attention rows zero), on the V3.2 step; the V4 step's S = 0 metadata is padded too."""
    sb, inputs, latent, index = ts._step_case()
    none = BatchMeta(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32),
                     np.zeros(1, np.int32), np.zeros(3, np.int32))
    res = dsa_jax.dsa_step(inputs, jnp.asarray(latent), jnp.asarray(index), none,
                           layout=ts.LAYOUT, indexer_types=ts.TYPES, k=6, sm_scale=ts.SM_SCALE,
                           implementation="xla")
    assert np.all(np.asarray(res.topk) == -1) and np.all(np.asarray(res.out) == 0)
    np.testing.assert_array_equal(res.latent_caches, latent)
    np.testing.assert_array_equal(res.index_caches, index)
    inputs4, sp, pm, meta = tv._one_step_args()
    idle = inputs4._replace(**{n: x[:, :0] for n, x in inputs4._asdict().items()
                               if x is not None and n != "attn_sink"})
    empty = {f: (np.zeros(1 if f.endswith("cu_lens") or f == "cu_q_lens" else
                          3 if f == "distribution" else 0, np.int32)
                 if getattr(meta, f) is not None else None) for f in meta._fields}
    res4 = v4_step(idle, sp, pm.caches, pm.states, dsa_jax.V4BatchMeta(**empty),
                   layout=pm.layout, implementation="xla")
    assert res4.out.shape[1] == 0 and res4.topk.shape[1] == 0
