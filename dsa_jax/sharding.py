"""The DSA step on a ``jax.sharding.Mesh``: sequences on a data axis, MLA heads on a model axis.

Data axis (attention data parallelism, as TPU serving engines run DSA): each data shard owns
its own sequences, its own pages and its own page table: a complete local ragged batch. Every
argument of ``dsa_step`` therefore gets a leading axis of size ``D = mesh.shape[data_axis]``
(local batch ``d`` is ``x[d]``); page ids are local to the shard's cache. No data moves
between data shards.

Model axis: the MLA query heads ``H`` are split over it (``H % M == 0``); each model shard
attends its heads against the full latent cache (replicated across the model axis, as MLA's
single latent head is). The indexer (its heads are summed into one score) and the cache update
run on every model shard redundantly, so every replica of the caches and top-k stays identical.

Context axis (optional, ``ctx_axis``): one sequence's KV pages spread over ``C`` shards by the
layout's rule (page ``j`` on shard ``j % C``, ``dsa_jax.context``). The caches and the page
table then carry a second leading axis of size ``C`` (``[D, C, ...]``: each context shard's own
cache and local table, ``dsa_jax.context.shard_pages`` / ``shard_cache`` build them from the
single-device form); every other argument is shared by the context shards. Top-k and sparse MLA
merge over the axis; each cache write lands on the shard owning the page.

``shard_map`` runs the single-device ``dsa_step`` body per shard, so the sharded result equals
the single-device step applied to each local batch.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsa_jax import backend as _backend
from dsa_jax import step as _step_mod
from dsa_jax.step import BatchMeta, StepInputs, StepResult
from dsa_jax.v4_model import (
    V4BatchMeta,
    V4Caches,
    V4States,
    V4StepInputs,
    V4StepParams,
    V4StepResult,
)
from dsa_jax.v4_step import v4_step_body
from pallas_kernels import IndexerBlocks, MlaBlocks
from reference.indexer.selection import DEFAULT_RECALL_TARGET
from reference.quant.bf16 import V4_DEFAULT_PRECISION, check_precision


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # older jax

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def check_mesh(mesh: Mesh, data_axis: str, model_axis: str | None, *, num_local: int,
               heads: int, ctx_axis: str | None = None) -> None:
    """Refuse a mesh that does not match the stacked batch, naming the numbers."""
    if ctx_axis is not None and ctx_axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {ctx_axis!r} (axes {dict(mesh.shape)})")
    if data_axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {data_axis!r} (axes {dict(mesh.shape)})")
    if mesh.shape[data_axis] != num_local:
        raise ValueError(f"the leading (local batch) axis has {num_local} batches but mesh axis "
                         f"{data_axis!r} has {mesh.shape[data_axis]} devices; they must match")
    if model_axis is not None:
        if model_axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {model_axis!r} (axes {dict(mesh.shape)})")
        m = mesh.shape[model_axis]
        if heads % m:
            raise ValueError(f"MLA heads H={heads} must be divisible by the {model_axis!r} axis "
                             f"size {m} (H % {m} = {heads % m})")


def sharded_dsa_step(mesh: Mesh, inputs: StepInputs, latent_caches, index_caches,
                     meta: BatchMeta, *, layout, indexer_types, k: int, sm_scale: float,
                     data_axis: str = "data", model_axis: str | None = "model",
                     num_segments: int = 0, fill: str = "tail",
                     refuse_full_overwrite: bool = False, granularity: str = "token",
                     one_token_per_seq: bool = False,
                     recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
                     backend: str | None = None, kernel_options: dict | None = None,
                     indexer_blocks: IndexerBlocks | None = None,
                     mla_blocks: MlaBlocks | None = None,
                     ctx_axis: str | None = None) -> StepResult:
    """``dsa_step`` on ``mesh`` (module docstring). Every array has a leading axis of size
    ``mesh.shape[data_axis]``; ``model_axis=None`` keeps heads unsplit; ``ctx_axis`` (e.g.
    ``"ctx"``) spreads each sequence's pages over that axis (caches and ``meta.page_indices``
    then ``[D, C, ...]``). ``inputs.attn_sink`` (optional) is ``f32[D, L, H]``, heads split on
    the model axis like ``q_mla``'s; under ``ctx_axis`` it is applied once, after the merge.
    Returns a ``StepResult`` with the same leading axes (``out`` split
    over heads on the model axis)."""
    num_local, heads = int(np.shape(inputs.q_mla)[0]), int(np.shape(inputs.q_mla)[3])
    check_mesh(mesh, data_axis, model_axis, num_local=num_local, heads=heads,
               ctx_axis=ctx_axis)
    if ctx_axis is not None:
        _check_context(mesh, ctx_axis, layout, latent_caches, index_caches, BatchMeta(*meta))
    statics = _step_mod.step_statics(
        latent_caches, layout=layout, indexer_types=indexer_types, k=k, sm_scale=sm_scale,
        num_segments=num_segments, fill=fill, refuse_full_overwrite=refuse_full_overwrite,
        granularity=granularity, one_token_per_seq=one_token_per_seq,
        recall_target=recall_target, exact=exact,
        backend=backend, kernel_options=kernel_options, indexer_blocks=indexer_blocks,
        mla_blocks=mla_blocks, layer_axis=2 if ctx_axis else 1)
    inputs = StepInputs(*inputs)
    return _sharded(mesh, data_axis, model_axis, ctx_axis, tuple(sorted(statics.items())),
                    inputs.attn_sink is not None)(inputs, latent_caches, index_caches,
                                                  BatchMeta(*meta))


def _check_context(mesh, ctx_axis, layout, latent_caches, index_caches, meta) -> None:
    """Refuse context-sharded arguments that do not match the mesh or the layout's rule."""
    c = mesh.shape[ctx_axis]
    if c > layout.pages_per_seq:
        raise ValueError(f"the {ctx_axis!r} axis has {c} shards but a sequence has at most "
                         f"pages_per_seq={layout.pages_per_seq} pages: shards would hold none")
    for name, x in (("latent_caches", latent_caches), ("index_caches", index_caches),
                    ("meta.page_indices", meta.page_indices)):
        shape = tuple(x.shape)
        if len(shape) < 2 or shape[1] != c:
            raise ValueError(f"{name} must be [D, C={c}, ...] with {ctx_axis!r} axis size {c} "
                             f"on dim 1, got shape {shape}")
    def concrete(x):  # host arrays, or device arrays this process holds whole
        if isinstance(x, jax.Array):
            return not isinstance(x, jax.core.Tracer) and x.is_fully_addressable
        return isinstance(x, (np.ndarray, list, tuple))

    tables = meta.page_indices
    if not all(concrete(x) for x in meta):
        return  # traced, or spread over processes: check the host tables before placing them
        #         (``dsa_jax.context.check_local_tables``, as
        #         scripts/bench/multiprocess_step.py does)
    local_pages = int(latent_caches.shape[-3])
    from dsa_jax import context

    for d in range(np.shape(tables)[0]):
        local_meta = [np.asarray(x[d]) for x in meta]
        context.check_local_tables(layout, local_meta[1], local_meta, local_pages)


@functools.lru_cache(maxsize=16)
def _sharded(mesh, data_axis, model_axis, ctx_axis, statics, has_sink=False):
    d = P(data_axis)
    heads = P(data_axis, None, None, model_axis)  # [D, L, T, H, ...]
    dc = P(data_axis, ctx_axis) if ctx_axis else d  # context-sharded: [D, C, ...]
    sink = P(data_axis, None, model_axis) if has_sink else None  # attn_sink [D, L, H]
    in_specs = (StepInputs(heads, d, d, d, d, sink), dc, dc, BatchMeta(d, dc, d, d, d))
    out_specs = StepResult(heads, d, dc, dc)
    cut = (lambda x: x[0, 0]) if ctx_axis else (lambda x: x[0])
    grow = (lambda x: x[None, None]) if ctx_axis else (lambda x: x[None])

    def body(inputs, latent_caches, index_caches, meta):
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)
        meta = BatchMeta(*first(meta))._replace(page_indices=cut(meta.page_indices))
        res = _step_mod.step_body(first(inputs), jax.tree.map(cut, latent_caches),
                                  jax.tree.map(cut, index_caches), meta, **dict(statics),
                                  ctx_axis=ctx_axis)
        return StepResult(res.out[None], res.topk[None], jax.tree.map(grow, res.latent_caches),
                          jax.tree.map(grow, res.index_caches))

    fn = _shard_map(body, mesh, in_specs, out_specs)
    return jax.jit(fn, donate_argnums=(1, 2))


# ----------------------------------------------------------------------------- DeepSeek-V4


def sharded_v4_step(mesh: Mesh, inputs, params, caches, states, meta, *, layout,
                    sm_scale: float | None = None, qat: bool = False, exact: bool = True,
                    data_axis: str = "data", model_axis: str | None = "model",
                    backend: str | None = None, kernel_options: dict | None = None,
                    precision: str = V4_DEFAULT_PRECISION):
    """``dsa_jax.v4_step`` on ``mesh``: sequences, their pages and their compressor state
    slots on ``data_axis`` (every array of ``inputs``, ``caches``, ``states`` and ``meta``
    gets a leading axis ``D = mesh.shape[data_axis]``: local batch ``d`` is ``x[d]``, page ids
    and state slots local to the shard); the attention heads ``H`` of ``inputs.q`` (``[D, L,
    T, H, 512]``) and ``inputs.attn_sink`` (``[D, L, H]``) split over ``model_axis`` (``None``:
    unsplit). ``params`` (compressor weights, RoPE tables) are replicated. The window /
    compressed / index caches hold one 512-wide (128-wide) head and are replicated over the
    model axis, as MLA's latent is; the cache writes, the compressors and the indexer (its
    heads summed into one score) run redundantly on every model shard, so every replica stays
    identical.

    Context parallelism is not offered: the V3.2 design (``dsa_jax.context``: pages dealt
    round-robin to context shards, local top-k then an exact merge, attention merged by LSE)
    would carry over to the window and compressed caches and to the CSA indexer, but the V4
    attention op would have to return its sink-free LSE over a shard's part of the window and
    entries (it can: ``return_lse=True``) and the compressor's state ring would have to live
    on the shard owning the sequence's current group (tokens of one group can straddle a page
    boundary, hence two shards): a state exchange per step that the V3.2 step does not have.

    ``precision`` as ``v4_step``'s. Returns a ``V4StepResult`` with the same leading axis
    (``out`` split over heads on the model axis)."""
    inputs = V4StepInputs(*inputs)
    num_local, heads = int(np.shape(inputs.q)[0]), int(np.shape(inputs.q)[3])
    check_mesh(mesh, data_axis, model_axis, num_local=num_local, heads=heads)
    statics = dict(layout=layout, sm_scale=None if sm_scale is None else float(sm_scale),
                   qat=bool(qat), exact=bool(exact),
                   backend=_backend.resolve_backend(backend),
                   kernel_options=tuple(sorted((kernel_options or {}).items())),
                   precision=check_precision(precision))
    fn = _sharded_v4(mesh, data_axis, model_axis, tuple(sorted(statics.items())),
                     inputs.attn_sink is not None)
    return fn(inputs, V4StepParams(*params), V4Caches(*caches), V4States(*states),
              V4BatchMeta(*meta))


@functools.lru_cache(maxsize=16)
def _sharded_v4(mesh, data_axis, model_axis, statics, has_sink):
    d = P(data_axis)
    heads = P(data_axis, None, None, model_axis)  # q [D, L, T, H, 512]
    sink = P(data_axis, None, model_axis) if has_sink else None
    in_inputs = V4StepInputs(heads, d, d, d, d, d, d, d, d, d, sink)
    in_specs = (in_inputs, P(), d, d, d)
    out_specs = V4StepResult(heads, d, d, d)

    def body(inputs, params, caches, states, meta):
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        res = v4_step_body(first(inputs), params, first(caches), first(states),
                               first(meta), **dict(statics))
        return jax.tree.map(lambda x: x[None], res)

    fn = _shard_map(body, mesh, in_specs, out_specs)
    return jax.jit(fn, donate_argnums=(2, 3))
