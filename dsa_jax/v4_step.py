"""One DeepSeek-V4 attention step over every layer of a model, on a ragged paged batch.

``dsa_jax.v4_step`` is the function (the package exports it under the module's name); import
the module's names with ``from dsa_jax.v4_step import ...``. The step's declarations
(``V4ModelLayout``, the NamedTuples of its arguments and result, ``init_v4_states``: layer
types, inputs and batch described there) live in ``dsa_jax.v4_model``, its argument checks in
``dsa_jax.v4_step_checks``, its cache writes in ``dsa_jax.v4_step_writes``; every one of those
names still imports from here.

Order of one step (every write before any read, so XLA keeps one buffer per donated stack):

1. each layer's window rows into its type's window stack (the ``V4Layout``'s slot rule); on
   the Pallas backend's fused attention (packed u32, f32 or fp8 window stacks) the attention
   kernel of the layer writes them itself, in place, before it reads (step 4;
   ``dsa_jax.v4_step_writes.attend_writing``): no XLA scatter;
2. each compressed layer's compressor (``dsa_jax.v4_compressor.compress_step`` on the step's
   backend: ``reference.v4_compressor.compress_step``, or with ``backend="pallas"`` the Pallas
   ``pallas_kernels.v4_compressor.compress_step``): the entries that complete in this step go
   into the compressed stack (CSA: also the indexer compressor's entries into the index-key
   stack), the state ring advances; the state pools are stacked ``[Lx * num_slots, R, W]`` and
   layer ``slot`` uses slots ``slot * num_slots + i``, so no layer's pool is sliced out (no
   copy);
3. the indexer top-k on every CSA layer (``dsa_jax.indexer_topk``, ``compression_ratio=4``,
   ``k = index_topk``) over the index stack read in place;
4. ``dsa_jax.v4_attention`` per layer, both caches of its type read in place at ``layer=slot``.

The output is the attention output ``q.dtype[L, T, H, 512]`` BEFORE the inverse RoPE and the
output projection (``wo_a``/``wo_b``): the caller applies them (the statement
``reference.deepseek_v4.attention_layer`` does both). ``qat=True`` applies the official
simulations to the entries the compressors emit (fp8 block 64 on the nope dims of attention
entries; Hadamard + fp4 block 32 on index entries) before they are stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsa_jax import backend as _backend
from dsa_jax.dispatch import empty_batch
from dsa_jax.indexer import indexer_topk
from dsa_jax.v4_attention import V4Layout, layout_batch, v4_attention
from dsa_jax.v4_compressor import compress_step as v4_compress_step
from dsa_jax.v4_model import (
    INDEX_DIM,
    TYPE_NAMES,
    TYPES,
    V4BatchMeta,
    V4Caches,
    V4ModelLayout,
    V4States,
    V4StepInputs,
    V4StepParams,
    V4StepResult,
    init_v4_states,
)
from dsa_jax.v4_step_checks import check_v4_step_args
from dsa_jax.v4_step_writes import attend_writing, compress_all, fuses_writes, write_windows
from reference.formats.fp8_cache import Fp8IndexCache
from reference.quant.bf16 import V4_DEFAULT_PRECISION, check_precision
from reference.v4_attention import COMPRESS_RATIOS, PagedKV

# Names this module had before the split (the declarations, checks and writes moved out); they
# still import from here.
__all__ = [
    "COMPRESS_RATIOS", "INDEX_DIM", "PagedKV", "TYPES", "TYPE_NAMES", "V4BatchMeta", "V4Caches",
    "V4Layout", "V4ModelLayout", "V4States", "V4StepInputs", "V4StepParams", "V4StepResult",
    "check_v4_step_args", "init_v4_states", "layout_batch", "v4_attention", "v4_step",
    "v4_step_body",
]


def _after(x, dep):
    """``x`` ordered after ``dep`` (``dsa_jax.step``'s chain of kernel calls; no data moves)."""
    return x if dep is None else jax.lax.optimization_barrier((x, dep))[0]


def v4_step_body(inputs: V4StepInputs, params: V4StepParams, caches: V4Caches,
                 states: V4States, meta: V4BatchMeta, *, layout: V4ModelLayout,
                 sm_scale: float | None, qat: bool, exact: bool, backend: str,
                 kernel_options: tuple,
                 precision: str = V4_DEFAULT_PRECISION) -> V4StepResult:
    """The step, unjitted (``v4_step`` jits it; ``sharded_v4_step`` runs it per shard);
    ``backend`` resolved, ``kernel_options`` a sorted tuple of items."""
    num_slots = check_v4_step_args(inputs, params, caches, states, meta, layout)
    topk_opts, attn_opts, comp_opts = _backend.split_kernel_options(
        ("indexer_topk", "v4_attention", "v4_compressor"), dict(kernel_options)).values()
    fused_writes = fuses_writes(caches, layout, backend, attn_opts)
    if not fused_writes:
        caches = write_windows(caches, inputs, meta, layout)
    caches, states = compress_all(caches, states, inputs, params, meta, layout, num_slots, qat,
                                  functools.partial(v4_compress_step, backend=backend,
                                                    precision=precision, **comp_opts),
                                  precision=precision)
    # Every write above, every read below.
    topks, dep = [], None
    for s in range(layout.count(4)):
        topks.append(indexer_topk(
            _after(inputs.index_q[s], dep), inputs.index_weights[s], caches.csa_index,
            meta.kv_lens, meta.csa_page_indices, meta.cu_q_lens, meta.csa_cu_lens,
            meta.distribution, k=layout.index_topk, pages_per_seq=layout.csa_pages_per_seq,
            compression_ratio=4, exact=exact, precision=precision, backend=backend,
            kernel_options=topk_opts, layer=s))
        dep = topks[-1]
    outs = []
    for layer, r in enumerate(layout.compress_ratios):
        name, s = TYPE_NAMES[r], layout.slot(layer)
        window = PagedKV(getattr(caches, f"{name}_window"), meta.window_page_indices,
                         meta.window_cu_lens)
        compressed = None if not r else PagedKV(
            getattr(caches, f"{name}_compressed"), getattr(meta, f"{name}_page_indices"),
            getattr(meta, f"{name}_cu_lens"))
        q = _after(inputs.q[layer], outs[-1] if outs else dep)
        common = dict(compressed=compressed, compressed_indices=topks[s] if r == 4 else None,
                      attn_sink=None if inputs.attn_sink is None else inputs.attn_sink[layer],
                      sm_scale=sm_scale, precision=precision, kernel_options=attn_opts, layer=s)
        if fused_writes:  # the kernel writes the layer's window rows first, in place
            out, cache = attend_writing(q, inputs.window_kv[layer], window, meta,
                                        layout=layout.layout_for(r), **common)
            caches = caches._replace(**{f"{name}_window": cache})
        else:
            out = v4_attention(q, window, meta.kv_lens, meta.cu_q_lens, meta.distribution,
                               layout=layout.layout_for(r), backend=backend, **common)
        outs.append(out)
    t = inputs.q.shape[1]
    topk = (jnp.stack(topks) if topks
            else jnp.zeros((0, t, layout.index_topk), jnp.int32))
    return V4StepResult(jnp.stack(outs), topk, caches, states)


_STATICS = ("layout", "sm_scale", "qat", "exact", "backend", "kernel_options", "precision")
_v4_step = jax.jit(v4_step_body, static_argnames=_STATICS, donate_argnames=("caches", "states"))


def v4_step(inputs: V4StepInputs, params: V4StepParams, caches: V4Caches, states: V4States,
            meta: V4BatchMeta, *, layout: V4ModelLayout, sm_scale: float | None = None,
            qat: bool = False, exact: bool = True, backend: str | None = None,
            kernel_options: dict | None = None,
            precision: str = V4_DEFAULT_PRECISION, implementation=None) -> V4StepResult:
    """One DeepSeek-V4 attention step over all layers (module docstring); jitted, caches and
    states donated.

    Args:
      inputs: ``V4StepInputs`` (projected activations; families absent from the model None).
      params: ``V4StepParams`` (compressor ape / norm weights per layer, entry RoPE tables).
      caches: ``V4Caches`` (stacked per layer type), states: ``V4States`` (``init_v4_states``).
      meta: ``V4BatchMeta`` (tokens, rows, page tables per family in their units).
      layout: the ``V4ModelLayout`` (every static number).
      sm_scale: attention scale (default ``512 ** -0.5``).
      qat: apply the official QAT simulations to the compressed and index entries stored.
      exact: exact indexer top-k (the official ``topk``); False allows the approximate one.
      backend: ``"reference"`` / ``"pallas"`` / ``None`` (``dsa_jax.backend``) for every op.
      kernel_options: Pallas knobs, routed to the indexer, the V4 attention and the
        compressor entries by name (``dsa_jax.backend.split_kernel_options``; ``interpret`` to
        all).
      precision: ``"bf16"`` (the default, ``reference.quant.bf16.V4_DEFAULT_PRECISION``),
        the official regime of ``reference.statements.deepseek_v4`` (``precision=``) through
        every op, or ``"f32"`` (every op in f32, as before the default changed). ``"bf16"``: the
        compressors' finished entries rounded (``reference.v4_compressor.finish_entries``),
        the index entries' Hadamard output rounded before the fp4 QAT, the indexer's bf16
        scores (``dsa_jax.indexer_topk``'s ``precision``), the attention's bf16 ``P @ V`` and
        bf16 output (``dsa_jax.v4_attention``'s). The inputs are ``v4_project``'s in the same
        regime (bf16 values, in f32 or bf16 arrays).
      implementation: ``"xla"`` / ``"pallas"`` / ``"pallas_two_pass"`` (the attention's
        two-pass form) / an ordered list / ``None`` for every op of the step
        (``dsa_jax.backend.step_candidates``); ``backend=`` is the older spelling.

    An empty batch is a step that does nothing: ``T = 0`` rows returns ``out [L, 0, H, 512]``,
    ``topk [Lc, 0, k]`` and the caches and states as given; ``S = 0`` sequences, rows outside
    every sequence (``dsa_jax.dispatch.empty_batch``).

    Returns ``V4StepResult(out [L, T, H, 512], topk [Lc, T, index_topk], caches, states)``.
    Bad shapes, a missing family argument or one given for a type the model lacks raise
    ``ValueError`` naming the argument and the numbers; so does ``"bf16"`` with an fp8 index
    cache (``caches.csa_index`` an ``Fp8IndexCache``: V3.2's fp8 keys with f32 scales are not
    the official regime's bf16 keys; that cache takes ``precision="f32"``)."""
    if not isinstance(meta, (V4BatchMeta, tuple)):
        raise TypeError(f"v4_step: meta must be a V4BatchMeta (V4BatchMeta.from_batch(batch, "
                        f"state_slots, csa=..., hca=...) builds one from dsa_jax.Batch "
                        f"objects), got {type(meta).__name__}")
    inputs, params, caches = V4StepInputs(*inputs), V4StepParams(*params), V4Caches(*caches)
    states, meta = V4States(*states), _nonempty_meta(V4BatchMeta(*meta))
    if precision == "bf16" and isinstance(caches.csa_index, Fp8IndexCache):
        raise ValueError("v4_step: precision='bf16' (the default: the official regime, bf16 "
                         "index keys) cannot score caches.csa_index, an Fp8IndexCache (fp8 "
                         "keys with f32 scales); pass precision='f32' or a bf16/f32 index cache")

    def run(payload):
        be, opts = payload
        statics = dict(layout=layout, sm_scale=None if sm_scale is None else float(sm_scale),
                       qat=bool(qat), exact=bool(exact), backend=be,
                       kernel_options=tuple(sorted((opts or {}).items())),
                       precision=check_precision(precision))
        if int(inputs.q.shape[1]) == 0:
            return _idle_v4_step(inputs, params, caches, states, meta, statics)
        return _v4_step(inputs, params, caches, states, meta, **statics)

    tried = _backend.step_candidates("v4_step", implementation, backend, kernel_options)
    return _backend.first_serving("v4_step", tried, run, group=implementation is not None)


def _nonempty_meta(meta: V4BatchMeta) -> V4BatchMeta:
    """``S = 0`` sequences padded with one inactive slot (``dsa_jax.dispatch.empty_batch``'s
    rule; its state slot ``-1``: no state is read or written)."""
    if int(meta.kv_lens.shape[0]) != 0:
        return meta
    out = {}
    for name in ("window", "csa", "hca"):
        pages, cu = getattr(meta, f"{name}_page_indices"), getattr(meta, f"{name}_cu_lens")
        if pages is not None:
            (kv, pages, cu_q, cu, dist), _ = empty_batch(
                (meta.kv_lens, pages, meta.cu_q_lens, cu, meta.distribution), 0, {})
            out.update({f"{name}_page_indices": pages, f"{name}_cu_lens": cu})
    return meta._replace(kv_lens=kv, cu_q_lens=cu_q, distribution=dist,
                         state_slots=jnp.full((1,), -1, jnp.int32), **out)


def _idle_v4_step(inputs, params, caches, states, meta, statics) -> V4StepResult:
    """A step of ``T = 0`` rows: the result shapes of a one-row step (traced, not run), empty;
    the caches and states as given."""
    row = inputs._replace(**{
        name: jnp.zeros((x.shape[0], 1, *x.shape[2:]), x.dtype)
        for name, x in inputs._asdict().items() if x is not None and name != "attn_sink"})
    shapes = jax.eval_shape(functools.partial(v4_step_body, **statics), row, params, caches,
                            states, meta)
    empty = lambda s: jnp.zeros((s.shape[0], 0, *s.shape[2:]), s.dtype)
    return V4StepResult(empty(shapes.out), empty(shapes.topk), caches, states)
