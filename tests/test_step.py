"""update_kv_cache (slot rule, drop rule, donation) and the multi-layer DSA step (IndexShare)."""

from __future__ import annotations

import numpy as np
import pytest

import dsa_jax
from dsa_jax import BatchMeta, PagedLayout, StepInputs
from reference import sparse_mla_ref, streamindex_topk_ref
from reference.synthetic import make_ragged_batch
from tests.isolated import run_isolated
from tests.oracle import row_sequences

LAYOUT = PagedLayout(page_size=8, pages_per_seq=4, index_dim=16, latent_dim=100, rope_dim=12)
SM_SCALE = 0.12


def _batch(seed=3, index_dim=LAYOUT.index_dim, heads=2):
    rng = np.random.default_rng(seed)
    return make_ragged_batch(rng, q_lens=[1, 2, 6], kv_lens=[9, 17, 12],
                             page_size=LAYOUT.page_size, pages_per_seq=LAYOUT.pages_per_seq,
                             num_heads=heads, dim=index_dim, pad_rows=2, pad_seqs=1)


def _destinations(b):
    """Oracle of the slot rule: row -> (page id, offset) from the batch's own page lists."""
    dest = {}
    for r, rs in enumerate(row_sequences(b.q.shape[0], b.cu_q_lens, b.seq_lens,
                                         b.distribution)):
        if rs is not None:
            seq, pos = rs
            dest[r] = (int(b.seq_pages[seq][pos // LAYOUT.page_size]), pos % LAYOUT.page_size)
    return dest


def _nan_caches(num_pages):
    latent = np.full(LAYOUT.latent_cache_shape(num_pages), np.nan, np.float32)
    index = np.full(LAYOUT.index_cache_shape(num_pages), np.nan, np.float32)
    return latent, index


def _expect_written(before, after, rows, dest):
    want = before.copy()
    for r, (p, o) in dest.items():
        want[p, o] = rows[r]
    np.testing.assert_array_equal(np.asarray(after), want)  # NaN == NaN: nothing else moved


# ----------------------------------------------------------------------------- cache update


def test_each_row_lands_at_its_tokens_page_and_offset_and_nothing_else_changes():
    b = _batch()
    rng = np.random.default_rng(1)
    num_rows, num_pages = b.q.shape[0], b.cache.shape[0]
    latent, index = _nan_caches(num_pages)
    new_latent = rng.standard_normal((num_rows, LAYOUT.qk_dim)).astype(np.float32)
    new_index = rng.standard_normal((num_rows, LAYOUT.index_dim)).astype(np.float32)
    out_l, out_i = dsa_jax.update_kv_cache(latent.copy(), index.copy(), new_latent, new_index,
                                           *b.meta(), layout=LAYOUT)
    dest = _destinations(b)
    assert len(dest) == 9  # 1 + 2 + 6 rows; the 2 padding rows are written nowhere
    padded = np.pad(new_latent, ((0, 0), (0, LAYOUT.padded_dim - LAYOUT.qk_dim)))
    _expect_written(latent, out_l, padded, dest)  # qk_dim rows are zero-padded to 128
    _expect_written(index, out_i, new_index, dest)


def test_a_shared_layer_writes_only_its_latent_cache():
    b = _batch()
    latent, _ = _nan_caches(b.cache.shape[0])
    rows = np.ones((b.q.shape[0], LAYOUT.padded_dim), np.float32)
    out_l, out_i = dsa_jax.update_kv_cache(latent.copy(), None, rows, None, *b.meta(),
                                           layout=LAYOUT)
    assert out_i is None
    _expect_written(latent, out_l, rows, _destinations(b))
    with pytest.raises(ValueError, match="both be given or both be None"):
        dsa_jax.update_kv_cache(latent.copy(), None, rows, rows[:, :16], *b.meta(),
                                layout=LAYOUT)


def test_the_drop_rule_rows_past_capacity_or_with_bad_pages_write_nothing_anywhere():
    b = _batch()
    num_rows, num_pages = b.q.shape[0], b.cache.shape[0]
    kv, table = b.seq_lens.copy(), b.page_indices.copy()
    base1, base2 = (int(b.cu_kv_lens[i]) // LAYOUT.page_size for i in (1, 2))
    # sequence 0 (decode, row 0): kv_len past capacity puts its token at pos 35 >= 32, whose
    # slot 0 + 35 // 8 = 4 is sequence 1's page 2: without the rule it would land there
    kv[0] = LAYOUT.capacity_tokens + 4
    assert base1 + 2 == 4
    # sequence 1 (rows 1, 2 at pos 15, 16): page 1's id out of range drops row 1 only
    table[base1 + 1] = num_pages + 7
    # sequence 2 (rows 3..8 at pos 6..11): page 0 id -1 (a negative id must not wrap to the
    # last page), page 1's slot past the end of page_indices
    table[base2] = -1
    assert base2 + 2 == len(table)  # no tail padding: dropping the last entry drops page 1
    table = table[:-1]
    latent, index = _nan_caches(num_pages)
    rows = np.arange(num_rows * LAYOUT.padded_dim, dtype=np.float32).reshape(num_rows, -1)
    idx_rows = rows[:, :LAYOUT.index_dim]
    out_l, out_i = dsa_jax.update_kv_cache(latent.copy(), index.copy(), rows, idx_rows, kv,
                                           table, b.cu_q_lens, b.cu_kv_lens, b.distribution,
                                           layout=LAYOUT)
    dest = {2: _destinations(b)[2]}  # the one row with a valid destination
    _expect_written(latent, out_l, rows, dest)
    _expect_written(index, out_i, idx_rows, dest)


def test_the_caches_are_donated():
    b = _batch()
    import jax.numpy as jnp

    latent = jnp.zeros(LAYOUT.latent_cache_shape(b.cache.shape[0]))
    rows = np.ones((b.q.shape[0], LAYOUT.padded_dim), np.float32)
    new, _ = dsa_jax.update_kv_cache(latent, None, rows, None, *b.meta(), layout=LAYOUT)
    assert latent.is_deleted() and not new.is_deleted()


def test_a_cache_that_disagrees_with_the_layout_is_refused():
    b = _batch()
    rows = np.ones((b.q.shape[0], LAYOUT.padded_dim), np.float32)
    wrong = np.zeros((b.cache.shape[0], 16, LAYOUT.padded_dim), np.float32)
    with pytest.raises(ValueError, match=r"page_size\) = 16 != layout.page_size = 8"):
        dsa_jax.update_kv_cache(wrong, None, rows, None, *b.meta(), layout=LAYOUT)
    with pytest.raises(ValueError, match=r"new_latent.shape\[-1\] must be one of \[112, 128\]"):
        dsa_jax.update_kv_cache(np.zeros(LAYOUT.latent_cache_shape(b.cache.shape[0])), None,
                                rows[:, :100], None, *b.meta(), layout=LAYOUT)


# ----------------------------------------------------------------------------- the step

TYPES = ("full", "shared", "full")


def _step_case(seed=5, heads=2, index_heads=2):
    """Caches with NaN at every slot this step writes (a read-before-write would leak NaN)."""
    b = _batch(seed)
    rng = np.random.default_rng(seed + 100)
    num_rows, num_pages = b.q.shape[0], b.cache.shape[0]
    num_layers, num_full = len(TYPES), TYPES.count("full")
    latent = rng.standard_normal((num_layers, *LAYOUT.latent_cache_shape(num_pages)))
    latent[..., LAYOUT.qk_dim:] = 0.0
    index = rng.standard_normal((num_full, *LAYOUT.index_cache_shape(num_pages)))
    for p, o in _destinations(b).values():
        latent[:, p, o] = np.nan
        index[:, p, o] = np.nan
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    inputs = StepInputs(q_mla=f32(num_layers, num_rows, heads, LAYOUT.qk_dim),
                        new_latent=f32(num_layers, num_rows, LAYOUT.qk_dim),
                        q_index=f32(num_full, num_rows, index_heads, LAYOUT.index_dim),
                        index_weights=f32(num_full, num_rows, index_heads),
                        new_index=f32(num_full, num_rows, LAYOUT.index_dim))
    return b, inputs, latent.astype(np.float32), index.astype(np.float32)


def _step(b, inputs, latent, index, **kw):
    return dsa_jax.dsa_step(inputs, latent.copy(), index.copy(), BatchMeta(*b.meta()),
                            layout=LAYOUT, indexer_types=TYPES, k=6, sm_scale=SM_SCALE,
                            exact=True, **kw)


def test_the_step_is_cache_update_then_topk_on_full_layers_then_mla_with_the_source_selection():
    """Run in a process of its own (``tests/isolated.py``): a pytest-xdist worker segfaulted in
    XLA:CPU's compile inside this test in four full runs in a row (sessions 17-20; it passes
    alone), and the last crash's run did not end within CI's limit."""
    run_isolated(step_is_cache_update_then_topk_then_mla)


def step_is_cache_update_then_topk_then_mla() -> None:
    """The body of ``test_the_step_is_cache_update_then_topk_on_full_layers_then_mla_with_the_
    source_selection`` (a child process runs it)."""
    b, inputs, latent, index = _step_case()
    res = _step(b, inputs, latent, index, num_segments=2, backend="reference")
    # the same step written out with the reference ops, layer by layer
    meta = b.meta()
    lat, idx_c = latent.copy(), index.copy()
    dest = _destinations(b)
    pad = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, LAYOUT.padded_dim - x.shape[-1])])
    sel = {}
    for layer, kind in enumerate(TYPES):
        for r, (p, o) in dest.items():
            lat[layer, p, o] = pad(inputs.new_latent[layer])[r]
        if kind == "full":
            slot = TYPES[:layer].count("full")
            for r, (p, o) in dest.items():
                idx_c[slot, p, o] = inputs.new_index[slot][r]
            sel[layer] = streamindex_topk_ref(
                inputs.q_index[slot], inputs.index_weights[slot], idx_c[slot], *meta, k=6,
                pages_per_seq=LAYOUT.pages_per_seq, num_segments=2, exact=True)
            np.testing.assert_array_equal(res.topk[slot], sel[layer])
        src = max(x for x in sel if x <= layer)
        want = sparse_mla_ref(pad(inputs.q_mla[layer]), lat[layer], meta[0], sel[src],
                              *meta[1:], sm_scale=SM_SCALE, pages_per_seq=LAYOUT.pages_per_seq,
                              v_dim=LAYOUT.v_dim)
        np.testing.assert_allclose(res.out[layer], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(res.latent_caches, lat)
    np.testing.assert_array_equal(res.index_caches, idx_c)
    assert res.out.shape == (3, b.q.shape[0], 2, LAYOUT.v_dim)
    assert np.isfinite(np.asarray(res.out)).all()  # the NaN placeholders were written first


def test_the_step_passes_the_witness_fill_and_guard_to_its_top_k():
    from dsa_jax.context import context_lens

    b, inputs, latent, index = _step_case()
    plain = _step(b, inputs, latent, index, backend="reference")
    low = _step(b, inputs, latent, index, num_segments=4, fill="lowest", backend="reference")
    tail = _step(b, inputs, latent, index, num_segments=4, backend="reference")
    assert np.any(np.asarray(low.topk) != np.asarray(tail.topk))  # the case tells them apart
    rb = LAYOUT.batch(latent.shape[-3], *b.meta())
    ctx = context_lens(rb, b.q.shape[0], page_mode=False, one_token_per_seq=False)
    for slot in range(TYPES.count("full")):
        np.testing.assert_array_equal(
            low.topk[slot], dsa_jax.scatter_topology_witnesses(plain.topk[slot], ctx, 4,
                                                               fill="lowest"))
    with pytest.raises(ValueError, match="num_segments=6 >= k=6 with refuse_full_overwrite"):
        _step(b, inputs, latent, index, num_segments=6, refuse_full_overwrite=True,
              backend="reference")


def test_a_shared_layer_attends_with_its_source_layers_selection_not_its_own_cache_keys():
    b, inputs, latent, index = _step_case()
    res = _step(b, inputs, latent, index, backend="reference")
    # shared layer 1 consumes full layer 0's top-k: changing layer 2's indexer changes only
    # layer 2's selection and output
    other = inputs._replace(q_index=inputs.q_index.copy())
    other.q_index[1] *= -1.0
    res2 = _step(b, other, latent, index, backend="reference")
    np.testing.assert_array_equal(res2.topk[0], res.topk[0])
    np.testing.assert_array_equal(res2.out[:2], res.out[:2])
    assert not np.array_equal(res2.topk[1], res.topk[1])


def test_the_step_gives_the_same_outputs_on_both_backends():
    b, inputs, latent, index = _step_case()
    ref = _step(b, inputs, latent, index, num_segments=2, backend="reference")
    # Each kernel gets its own knobs from one dict (indexer blocks, MLA rows per block).
    pal = _step(b, inputs, latent, index, num_segments=2, backend="pallas",
                kernel_options={"block_rows": 4, "block_pages": 2, "tokens_per_block": 8})
    np.testing.assert_array_equal(pal.topk, ref.topk)  # exact selection, no ties in f32 noise
    np.testing.assert_allclose(pal.out, ref.out, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(pal.latent_caches, ref.latent_caches)
    np.testing.assert_array_equal(pal.index_caches, ref.index_caches)


def test_step_refusals_name_the_numbers():
    b, inputs, latent, index = _step_case()
    with pytest.raises(ValueError, match=r"index_caches.shape\[0\] must equal the number of "
                                         r"'full' layers = 2, got 1"):
        _step(b, inputs, latent, index[:1])
    with pytest.raises(ValueError, match="layer 0 is 'shared' but no 'full' layer precedes it"):
        dsa_jax.dsa_step(inputs, latent, index, BatchMeta(*b.meta()), layout=LAYOUT,
                         indexer_types=("shared", "full", "full"), k=6, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="granularity must be one of"):
        _step(b, inputs, latent, index, granularity="block")
    with pytest.raises(ValueError, match=r"kernel_options \['tile'\] are not knobs of any"):
        _step(b, inputs, latent, index, backend="pallas", kernel_options={"tile": 8})
    with pytest.raises(ValueError, match=r"\['block_rows'\] are not knobs of the Pallas "
                                         r"sparse_mla; its knobs: \['blocks', 'interpret'"):
        dsa_jax.sparse_mla(*_mla_args(b), sm_scale=SM_SCALE, pages_per_seq=LAYOUT.pages_per_seq,
                           v_dim=LAYOUT.v_dim, kernel_options={"block_rows": 4})


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_a_packed_latent_layout_stores_packed_rows_and_gives_the_bf16_result(backend):
    """Run in a process of its own (``tests/isolated.py``): in three full-suite runs in a row
    (sessions 14 and 15) the worker running the ``"reference"`` case ~25 minutes in segfaulted
    inside XLA:CPU's compile of the packed-layout ``dsa_step``; rerun on a fresh worker it
    passed every time, as it does alone."""
    run_isolated(packed_latent_layout, backend)


def packed_latent_layout(backend: str) -> None:
    """The body of ``test_a_packed_latent_layout_stores_packed_rows_and_gives_the_bf16_result``
    (a child process runs it)."""
    import dataclasses

    import jax.numpy as jnp

    from reference.packed_cache import pack_cache, unpack_cache

    b, inputs, latent, index = _step_case()
    packed_layout = dataclasses.replace(LAYOUT, packed_latent=True)
    assert packed_layout.latent_cache_width == 128  # packed_words(128): 64 rounded up to 128
    plain_cache = lambda: jnp.asarray(latent, jnp.bfloat16)  # fresh: the step donates caches
    meta = BatchMeta(*b.meta())
    kw = dict(indexer_types=TYPES, k=6, sm_scale=SM_SCALE, exact=True, backend=backend)
    plain = dsa_jax.dsa_step(inputs, plain_cache(), index.copy(), meta, layout=LAYOUT, **kw)
    packed = dsa_jax.dsa_step(inputs, pack_cache(plain_cache()), index.copy(), meta,
                              layout=packed_layout, **kw)
    assert packed.latent_caches.dtype == jnp.uint32
    np.testing.assert_array_equal(
        np.asarray(unpack_cache(packed.latent_caches, LAYOUT.padded_dim), np.float32),
        np.asarray(plain.latent_caches, np.float32))
    np.testing.assert_array_equal(packed.topk, plain.topk)
    np.testing.assert_allclose(np.asarray(packed.out, np.float32),
                               np.asarray(plain.out, np.float32), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed_latent=False"):
        dsa_jax.dsa_step(inputs, pack_cache(plain_cache()), index.copy(), meta, layout=LAYOUT,
                         **kw)


def test_update_kv_cache_packs_rows_into_a_packed_latent_cache():
    import dataclasses

    import jax.numpy as jnp

    from reference.packed_cache import pack_cache

    b = _batch()
    packed_layout = dataclasses.replace(LAYOUT, packed_latent=True)
    latent, _ = _nan_caches(b.cache.shape[0])
    rows = np.random.default_rng(2).standard_normal((b.q.shape[0], LAYOUT.qk_dim))
    plain, _ = dsa_jax.update_kv_cache(jnp.asarray(latent, jnp.bfloat16), None, rows, None,
                                       *b.meta(), layout=LAYOUT)
    packed, _ = dsa_jax.update_kv_cache(pack_cache(jnp.asarray(latent, jnp.bfloat16)), None,
                                        rows, None, *b.meta(), layout=packed_layout)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(pack_cache(plain)))


def _mla_args(b):
    meta = b.meta()
    sel = np.zeros((b.q.shape[0], 4), np.int32)
    q = np.zeros((b.q.shape[0], 2, LAYOUT.padded_dim), np.float32)
    cache = np.zeros(LAYOUT.latent_cache_shape(b.cache.shape[0]), np.float32)
    return (q, cache, meta[0], sel, *meta[1:])
