"""Context parallelism (``dsa_jax.context``): each sequence's pages spread over a ``ctx`` mesh
axis; the sharded step equals the single-device step (exact top-k index for index, outputs
within f32 round-off, caches identical after the write). conftest.py gives 8 CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import dsa_jax
from dsa_jax import BatchMeta, PagedLayout, StepInputs, context
from pallas_kernels import chips
from reference.synthetic import make_ragged_batch

LAYOUT = PagedLayout(page_size=8, pages_per_seq=8, index_dim=16, latent_dim=100, rope_dim=12)
TYPES = ("full", "shared")
HEADS, INDEX_HEADS = 4, 2
AXES = ("data", "ctx", "model")
# decode rows, an MTP pair, a 5-row prefill chunk; kv_len 3 < 8 shards (one page); 50 and 17
# tokens: 7 and 3 pages, which no shard count here divides evenly; padding rows and an
# inactive sequence slot (make_ragged_batch's pad_rows / pad_seqs)
Q_LENS, KV_LENS = [1, 5, 1, 2], [3, 50, 64, 17]


def _local_batch(seed, layout=LAYOUT, q_lens=Q_LENS, kv_lens=KV_LENS, pad_seqs=1):
    rng = np.random.default_rng(seed)
    b = make_ragged_batch(rng, q_lens=q_lens, kv_lens=kv_lens, page_size=layout.page_size,
                          pages_per_seq=layout.pages_per_seq, num_heads=INDEX_HEADS,
                          dim=layout.index_dim, pad_rows=2 if len(set(q_lens)) > 1 else 0,
                          pad_seqs=pad_seqs)
    t, p = b.q.shape[0], b.cache.shape[0]
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inputs = StepInputs(f32(2, t, HEADS, layout.qk_dim), f32(2, t, layout.qk_dim),
                        f32(1, t, INDEX_HEADS, layout.index_dim), f32(1, t, INDEX_HEADS),
                        f32(1, t, layout.index_dim))
    latent = f32(2, p, layout.page_size, layout.padded_dim)
    latent[..., layout.qk_dim:] = 0.0
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    return (inputs, host(layout.to_cache(latent, "latent")),
            host(layout.to_cache(f32(1, p, layout.page_size, layout.index_dim), "index")),
            BatchMeta(*b.meta()))


def _shard(local, ctx, layout):
    """The context-sharded arguments of ``local`` data batches (the documented helpers)."""
    shards = [context.shard_pages(layout, ctx, m, lat.shape[-3]) for _, lat, _, m in local]
    width = max(s.local_pages for s in shards)
    shards = [context.ContextShards(s.tables, np.pad(s.pages, ((0, 0), (0, width - s.local_pages)),
                                                     constant_values=-1)) for s in shards]
    stack = lambda trees: jax.tree.map(lambda *xs: np.stack(xs), *trees)  # noqa: E731
    pairs = list(zip(shards, local, strict=True))
    latent = stack([context.shard_cache(s, x[1], page_axis=1) for s, x in pairs])
    index = stack([context.shard_cache(s, x[2], page_axis=1) for s, x in pairs])
    inputs = stack([x[0] for x in local])
    meta = stack([x[3] for x in local])._replace(page_indices=np.stack([s.tables
                                                                         for s in shards]))
    return shards, inputs, latent, index, meta


# The single-device steps (the oracle) depend on the seed, the step's keywords and the batch,
# not on the mesh: the parametrized meshes share them (seed 0 and 1 are every case's batches), so
# each is computed once per process instead of once per mesh (the Pallas ones run the strict
# interpreter).
_WANT: dict = {}


def _single_device_step(seed, local, kw, batch_kw):
    key = (seed, repr(sorted(kw.items())), repr(sorted(batch_kw.items())))
    if key not in _WANT:
        got = dsa_jax.dsa_step(*jax.tree.map(np.copy, local), **kw)
        _WANT[key] = jax.tree.map(np.asarray, got)
    return _WANT[key]


def _check(shape, *, backend="reference", granularity="token", layout=LAYOUT, seeds=None,
           one_token_per_seq=False, fill="tail", **batch_kw):
    data, ctx, _ = shape
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), AXES)
    kw = dict(layout=layout, indexer_types=TYPES, k=10 if granularity == "token" else 3,
              sm_scale=0.12, exact=True, num_segments=2, fill=fill, backend=backend,
              granularity=granularity, one_token_per_seq=one_token_per_seq,
              kernel_options={"interpret": True} if backend == "pallas" else None)
    local = [_local_batch(s, layout, **batch_kw) for s in (seeds or range(data))]
    want = [_single_device_step(s, x, kw, batch_kw)
            for s, x in zip(seeds or range(data), local, strict=True)]
    shards, *args = _shard(local, ctx, layout)
    got = dsa_jax.sharded_dsa_step(mesh, *args, ctx_axis="ctx", **kw)
    for d, w in enumerate(want):
        np.testing.assert_array_equal(np.asarray(got.topk[d]), np.asarray(w.topk))
        np.testing.assert_allclose(np.asarray(got.out[d]), np.asarray(w.out), rtol=2e-6,
                                   atol=2e-6)
        for name, i in (("latent_caches", 1), ("index_caches", 2)):
            mine = jax.tree.map(lambda x, d=d: np.asarray(x[d]), getattr(got, name))
            back = context.unshard_cache(shards[d], mine, local[d][i], page_axis=1)
            for a, b in zip(jax.tree_util.tree_leaves(back),
                            jax.tree_util.tree_leaves(getattr(w, name)), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    return got


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)])
def test_context_sharded_step_equals_the_single_device_step(shape):
    _check(shape)


def test_page_granularity_over_context_shards():
    _check((1, 4, 2), granularity="page")


@pytest.mark.parametrize("granularity", ["token", "page"])
def test_the_lowest_witness_fill_over_context_shards(granularity):
    # Witnesses merge after the exact candidate merge, with the global context length.
    _check((2, 2, 2), granularity=granularity, fill="lowest")


def test_decode_batch_one_token_per_seq_over_eight_context_shards():
    _check((1, 8, 1), one_token_per_seq=True, q_lens=[1, 1, 1], kv_lens=[3, 64, 29],
           pad_seqs=0)


# Three meshes that carry every crossing of the reference test's five: data only (ctx 1, no
# cross-shard merge; 2 shards, not 8: the same crossing at a quarter of the interpreter's work),
# the widest ctx axis (8 shards: more shards than the kv_len-3 sequence has pages, 7 and 3 pages
# that 8 does not divide), and data x ctx x model at once (2 x 2 x 2: the heads split over model
# while the top-k and LSE merge over ctx, per data shard). (2, 4, 1) and (1, 4, 2) added no
# crossing of their own for the kernels (each is a sub-combination of these); the reference test
# above still runs all five meshes. The single-device Pallas steps are shared (_WANT).
@pytest.mark.parametrize("shape", [(2, 1, 1), (1, 8, 1), (2, 2, 2)])
def test_pallas_kernels_under_shard_map_over_context_shards(shape):
    _check(shape, backend="pallas")


def test_fp8_caches_over_context_shards():
    layout = PagedLayout(page_size=32, pages_per_seq=4, index_cache_format="fp8",
                         latent_cache_format="fp8")
    _check((1, 4, 2), layout=layout, kv_lens=[3, 100, 128, 40])


def test_shard_and_unshard_cache_round_trip_and_the_rule():
    (_, latent, _, meta), = [_local_batch(5)]
    shards = context.shard_pages(LAYOUT, 3, meta, latent.shape[1])
    local = context.shard_cache(shards, latent, page_axis=1)
    assert local.shape[:3] == (3, 2, shards.local_pages)
    back = context.unshard_cache(shards, local, latent, page_axis=1)
    np.testing.assert_array_equal(back, latent)
    for _, j, slot in context.used_slots(LAYOUT, meta):
        owner = LAYOUT.context_shard(j, 3)
        assert j % 3 == owner and shards.tables[owner, slot] >= 0
        assert all(shards.tables[n, slot] == context.ABSENT for n in range(3) if n != owner)
        np.testing.assert_array_equal(local[owner, :, shards.tables[owner, slot]],
                                      latent[:, meta.page_indices[slot]])


def test_bad_context_arguments_are_refused_before_anything_runs():
    mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 2), AXES)
    local = [_local_batch(0)]
    shards, inputs, latent, index, meta = _shard(local, 4, LAYOUT)
    kw = dict(layout=LAYOUT, indexer_types=TYPES, k=10, sm_scale=0.1, backend="reference")
    with pytest.raises(ValueError, match="mesh has no axis 'seq'"):
        dsa_jax.sharded_dsa_step(mesh, inputs, latent, index, meta, ctx_axis="seq", **kw)
    bad = meta.page_indices.copy()
    slot = next(s for _, j, s in context.used_slots(LAYOUT, local[0][3]) if j == 1)
    bad[0, 0, slot] = 0  # page 1 of a sequence claimed by shard 0
    with pytest.raises(ValueError, match=r"puts page 1 on shard 1 % 4 = 1"):
        dsa_jax.sharded_dsa_step(mesh, inputs, latent, index, meta._replace(page_indices=bad),
                                 ctx_axis="ctx", **kw)
    with pytest.raises(ValueError, match=r"\[D, C=4, \.\.\.\]"):
        dsa_jax.sharded_dsa_step(mesh, inputs, latent[:, :2], index, meta, ctx_axis="ctx",
                                 **kw)
    wide = Mesh(np.array(jax.devices()).reshape(1, 8, 1), AXES)
    small = PagedLayout(page_size=8, pages_per_seq=4, index_dim=16, latent_dim=100, rope_dim=12)
    with pytest.raises(ValueError, match="8 shards but a sequence has at most pages_per_seq=4"):
        dsa_jax.sharded_dsa_step(wide, inputs, latent, index, meta, ctx_axis="ctx",
                                 **{**kw, "layout": small})
    odd = Mesh(np.array(jax.devices()[:6]).reshape(1, 2, 3), AXES)
    with pytest.raises(ValueError, match="H=4 must be divisible"):
        dsa_jax.sharded_dsa_step(odd, inputs, latent, index, meta, ctx_axis="ctx", **kw)
    # The Pallas context path checks the indexer's kernel knobs as its entries do.
    with pytest.raises(ValueError, match="score_chunk_bytes must be a positive int"):
        dsa_jax.sharded_dsa_step(mesh, inputs, latent, index, meta, ctx_axis="ctx",
                                 **{**kw, "backend": "pallas",
                                    "kernel_options": {"interpret": True,
                                                       "score_chunk_bytes": 0}})


@pytest.mark.parametrize("chip", chips.NAMES)
def test_the_context_sharded_pallas_step_compiles_for_a_multi_chip_topology(chip):
    """AOT through libtpu on CPU: the step with the Pallas kernels inside ``shard_map`` over
    ``pallas_kernels.aot.topology_devices`` (v5e:2x2, v6e:2x2: 4 chips; tpu7x:2x2x1: 8
    devices), pages spread over a ctx axis of 2, heads over a model axis of 2; the merges
    become cross-chip collectives."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import aot

    devs = aot.topology_devices(chip)
    shape = (len(devs) // 4, 2, 2)
    mesh = Mesh(np.array(devs).reshape(shape), AXES)
    d_, c_, _ = shape
    layout = PagedLayout(page_size=64, pages_per_seq=64, packed_latent=True)
    seqs, rows, heads, index_heads = 4, 4, 16, 64
    local_pages = seqs * layout.pages_per_seq // c_

    def spec(shape, dtype, *axes):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))

    bf16, f32, i32 = jax.numpy.bfloat16, np.float32, np.int32
    d, dc = ("data",), ("data", "ctx")
    inputs = StepInputs(spec((d_, 2, rows, heads, 576), bf16, "data", None, None, "model"),
                        spec((d_, 2, rows, 576), bf16, *d),
                        spec((d_, 1, rows, index_heads, 128), bf16, *d),
                        spec((d_, 1, rows, index_heads), f32, *d),
                        spec((d_, 1, rows, 128), bf16, *d))
    latent = spec((d_, c_, 2, local_pages, 64, layout.latent_cache_width), np.uint32, *dc)
    index = spec((d_, c_, 1, local_pages, 64, 128), bf16, *dc)
    meta = BatchMeta(spec((d_, seqs), i32, *d), spec((d_, c_, seqs * 64), i32, *dc),
                     spec((d_, seqs + 1), i32, *d), spec((d_, seqs + 1), i32, *d),
                     spec((d_, 3), i32, *d))

    def step(*args):
        return dsa_jax.sharded_dsa_step(
            mesh, *args, layout=layout, indexer_types=TYPES, k=256, sm_scale=0.1,
            one_token_per_seq=True, backend="pallas", ctx_axis="ctx",
            kernel_options={"interpret": False, "chip": chip})

    with aot.compiling_on(devs[0]):
        compiled = jax.jit(step).trace(inputs, latent, index, meta).lower().compile()
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo  # the Pallas kernels
    assert "all-gather" in hlo and "all-reduce" in hlo  # the top-k and LSE merges
