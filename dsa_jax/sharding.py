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

``shard_map`` runs the single-device ``dsa_step`` body per shard, so the sharded result equals
the single-device step applied to each local batch.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsa_jax import step as _step_mod
from dsa_jax.step import BatchMeta, StepInputs, StepResult
from pallas_kernels import IndexerBlocks, MlaBlocks
from reference.selection import DEFAULT_RECALL_TARGET


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # older jax

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def check_mesh(mesh: Mesh, data_axis: str, model_axis: str | None, *, num_local: int,
               heads: int) -> None:
    """Refuse a mesh that does not match the stacked batch, naming the numbers."""
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
                     num_segments: int = 0, granularity: str = "token",
                     one_token_per_seq: bool = False,
                     recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
                     backend: str | None = None, kernel_options: dict | None = None,
                     indexer_blocks: IndexerBlocks | None = None,
                     mla_blocks: MlaBlocks | None = None) -> StepResult:
    """``dsa_step`` on ``mesh`` (module docstring). Every array has a leading axis of size
    ``mesh.shape[data_axis]``; ``model_axis=None`` keeps heads unsplit. Returns a
    ``StepResult`` with the same leading axis (``out`` split over heads on the model axis)."""
    num_local, heads = int(np.shape(inputs.q_mla)[0]), int(np.shape(inputs.q_mla)[3])
    check_mesh(mesh, data_axis, model_axis, num_local=num_local, heads=heads)
    statics = _step_mod.step_statics(
        latent_caches, layout=layout, indexer_types=indexer_types, k=k, sm_scale=sm_scale,
        num_segments=num_segments, granularity=granularity,
        one_token_per_seq=one_token_per_seq, recall_target=recall_target, exact=exact,
        backend=backend, kernel_options=kernel_options, indexer_blocks=indexer_blocks,
        mla_blocks=mla_blocks, layer_axis=1)
    return _sharded(mesh, data_axis, model_axis, tuple(sorted(statics.items())))(
        StepInputs(*inputs), latent_caches, index_caches, BatchMeta(*meta))


@functools.lru_cache(maxsize=16)
def _sharded(mesh, data_axis, model_axis, statics):
    d = P(data_axis)
    heads = P(data_axis, None, None, model_axis)  # [D, L, T, H, ...]
    in_specs = (StepInputs(heads, d, d, d, d), d, d, BatchMeta(d, d, d, d, d))
    out_specs = StepResult(heads, d, d, d)

    def body(inputs, latent_caches, index_caches, meta):
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)
        res = _step_mod.step_body(first(inputs), first(latent_caches), first(index_caches),
                                  first(meta), **dict(statics))
        return jax.tree.map(lambda x: x[None], res)

    fn = _shard_map(body, mesh, in_specs, out_specs)
    return jax.jit(fn, donate_argnums=(1, 2))
