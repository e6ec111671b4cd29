"""One DSA decoding/prefill step over every layer of a model, with IndexShare.

Per layer ``l`` (in order), for the ragged paged batch of this step:

1. cache update: this step's latent rows into ``latent_caches[l]``; on a ``"full"`` layer also
   its indexer keys into ``index_caches[slot]`` (``dsa_jax.cache``'s slot and drop rule; row
   scatters into the donated stacks, every layer's before any read);
2. top-k on ``"full"`` layers only (token top-k, or page top-k with ``granularity="page"``),
   segment witnesses merged when ``num_segments > 0``;
3. sparse MLA on every layer with the selection of its source layer (``src_slot[l]`` of
   ``reference.build_index_share_map``: its own if full, the nearest preceding full layer's if
   ``"shared"``).

Every op reads the stacked caches in place at its layer (``layer=``, ``reference.stacked``):
nothing in the step copies a layer's cache out of a stack, on either backend and in every
format (plain, packed bf16, fp8).

Stacked layouts (``L`` layers, ``F`` full layers, ``T`` rows, ``H`` MLA heads, ``Hi`` indexer
heads; dims from the ``PagedLayout``):

- ``latent_caches f[L, num_pages, page_size, padded_dim]``, ``index_caches f[F, num_pages,
  page_size, index_dim]`` (donated: the step returns the updated caches);
- ``StepInputs``: ``q_mla f[L, T, H, qk_dim|padded_dim]``, ``new_latent f[L, T,
  qk_dim|padded_dim]``, ``q_index f[F, T, Hi, index_dim]``, ``index_weights f[F, T, Hi]``,
  ``new_index f[F, T, index_dim]``, optional ``attn_sink f32[L, H]`` (per-layer attention-sink
  logits, ``reference.sinks``; default ``None``: no sink);
- ``BatchMeta``: ``kv_lens i32[S]``, ``page_indices i32[N]``, ``cu_q_lens i32[S+1]``,
  ``cu_kv_lens i32[S+1]``, ``distribution i32[3]``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import backend as _backend
from dsa_jax import cache as _cache
from dsa_jax import context as _context
from dsa_jax import validate as _validate
from dsa_jax.batch import Batch
from dsa_jax.dispatch import empty_batch
from dsa_jax.indexer import indexer_topk, page_topk
from dsa_jax.layout import PagedLayout
from dsa_jax.mla import page_sparse_mla, sparse_mla
from pallas_kernels import IndexerBlocks, MlaBlocks
from pallas_kernels.mla import layers as mla_layers
from reference import build_index_share_map
from reference.formats import fp8_cache
from reference.indexer.selection import (
    DEFAULT_RECALL_TARGET,
    check_selection_args,
    finish_selection,
)
from reference.mla import sinks

GRANULARITIES = ("token", "page")


class StepInputs(NamedTuple):
    """This step's activations per layer (shapes in the module docstring); ``attn_sink``
    (optional, last, default ``None``) keeps five-field construction working."""

    q_mla: jax.Array
    new_latent: jax.Array
    q_index: jax.Array
    index_weights: jax.Array
    new_index: jax.Array
    attn_sink: jax.Array | None = None


class BatchMeta(NamedTuple):
    """The ragged paged batch metadata (``reference.batch`` conventions)."""

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    cu_kv_lens: jax.Array
    distribution: jax.Array


class StepResult(NamedTuple):
    """``out q.dtype[L, T, H, v_dim]``, ``topk i32[F, T, k]`` (token offsets or page numbers),
    and the updated caches."""

    out: jax.Array
    topk: jax.Array
    latent_caches: jax.Array
    index_caches: jax.Array


def _pad_last(x, want: int):
    got = x.shape[-1]
    return x if got == want else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, want - got)])


def check_step_args(inputs: StepInputs, latent_caches, index_caches, *, layout: PagedLayout,
                    indexer_types, granularity: str):
    """Static checks; returns ``(full_slot, src_slot, num_full)``."""
    if not isinstance(layout, PagedLayout):
        raise TypeError(f"layout must be a dsa_jax.PagedLayout, got {type(layout).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    num_layers = len(indexer_types)
    full_slot, src_slot, num_full = build_index_share_map(list(indexer_types), 0, num_layers)
    layout.check_cache("latent_caches", latent_caches, "latent")
    layout.check_cache("index_caches", index_caches, "index")
    for name, x, n, why in (
            ("latent_caches", latent_caches, num_layers, "len(indexer_types) (layers)"),
            ("q_mla", inputs.q_mla, num_layers, "len(indexer_types) (layers)"),
            ("new_latent", inputs.new_latent, num_layers, "len(indexer_types) (layers)"),
            ("index_caches", index_caches, num_full, "the number of 'full' layers"),
            ("q_index", inputs.q_index, num_full, "the number of 'full' layers"),
            ("index_weights", inputs.index_weights, num_full, "the number of 'full' layers"),
            ("new_index", inputs.new_index, num_full, "the number of 'full' layers")):
        shape = tuple(x.shape)  # arrays and the fp8 caches (reference.fp8_cache) alike
        if shape[0] != n:
            raise ValueError(f"{name}.shape[0] must equal {why} = {n}, got {shape[0]} "
                             f"(shape {shape})")
    if inputs.attn_sink is not None:
        want = (num_layers, int(inputs.q_mla.shape[2]))
        if tuple(np.shape(inputs.attn_sink)) != want:
            raise ValueError(f"attn_sink must have shape (L, H) = {want} (layers, MLA heads), "
                             f"got shape {tuple(np.shape(inputs.attn_sink))}")
        sinks.check_sink(inputs.attn_sink[0], want[1])  # the dtype rule (f32)
    if latent_caches.shape[1] != index_caches.shape[1]:
        raise ValueError(f"latent_caches has {latent_caches.shape[1]} pages, index_caches "
                         f"{index_caches.shape[1]}; both share one page table")
    return full_slot, src_slot, num_full


_STATICS = ("layout", "indexer_types", "k", "sm_scale", "num_segments", "fill",
            "refuse_full_overwrite", "granularity",
            "one_token_per_seq", "recall_target", "exact", "backend", "kernel_options",
            "indexer_blocks", "mla_blocks")


def step_statics(latent_caches, *, layout: PagedLayout, indexer_types, k: int,
                 sm_scale: float, num_segments: int, granularity: str, one_token_per_seq: bool,
                 fill: str = "tail", refuse_full_overwrite: bool = False,
                 recall_target: float, exact: bool, backend: str | None,
                 kernel_options: dict | None, indexer_blocks: IndexerBlocks | None,
                 mla_blocks: MlaBlocks | None, layer_axis: int = 0) -> dict:
    """The step's static arguments, normalised (hashable; ``backend`` resolved; ``None``
    layer types = all full, counted on ``latent_caches``' axis ``layer_axis``): the one
    statics dict of ``dsa_step`` and ``sharded_dsa_step``."""
    if indexer_types is None:
        indexer_types = ("full",) * int(latent_caches.shape[layer_axis])
    for name, blocks, cls in (("indexer_blocks", indexer_blocks, IndexerBlocks),
                              ("mla_blocks", mla_blocks, MlaBlocks)):
        if blocks is not None and not isinstance(blocks, cls):
            raise TypeError(f"{name} must be a {cls.__name__} or None, got "
                            f"{type(blocks).__name__}")
    return dict(layout=layout, indexer_types=tuple(indexer_types), k=k, sm_scale=sm_scale,
                num_segments=num_segments, fill=fill,
                refuse_full_overwrite=refuse_full_overwrite, granularity=granularity,
                one_token_per_seq=one_token_per_seq, recall_target=recall_target, exact=exact,
                backend=_backend.resolve_backend(backend),
                kernel_options=tuple(sorted((kernel_options or {}).items())),
                indexer_blocks=indexer_blocks, mla_blocks=mla_blocks)


def step_body(inputs: StepInputs, latent_caches, index_caches, meta: BatchMeta, *, layout,
              indexer_types, k, sm_scale, num_segments, granularity, one_token_per_seq,
              recall_target, exact, backend, kernel_options, indexer_blocks=None,
              mla_blocks=None, fill="tail", refuse_full_overwrite=False,
              ctx_axis: str | None = None) -> StepResult:
    """The step, unjitted (``dsa_step`` jits it; ``sharded_dsa_step`` runs it per shard).
    ``backend`` is resolved and ``kernel_options`` a sorted tuple of items. ``ctx_axis``: the
    caches and page table are one context shard's (``dsa_jax.context``); top-k and sparse MLA
    merge over that ``shard_map`` axis."""
    full_slot, src_slot, _ = check_step_args(inputs, latent_caches, index_caches, layout=layout,
                                             indexer_types=indexer_types,
                                             granularity=granularity)
    b = layout.batch(latent_caches.shape[-3], *meta)  # the one batch every op below reads
    page_id, offset = _cache.batch_write_slots(b, inputs.q_mla.shape[1])
    topk_op = indexer_topk if granularity == "token" else page_topk
    k_name = "k" if granularity == "token" else "k_pages"
    names = (("indexer_topk", "sparse_mla") if granularity == "token"
             else ("page_topk", "page_sparse_mla"))
    topk_opts, mla_opts = _backend.split_kernel_options(names, dict(kernel_options)).values()
    if indexer_blocks is not None:
        topk_opts["blocks"] = indexer_blocks
    if mla_blocks is not None:
        mla_opts["blocks"] = mla_blocks
    write = functools.partial(_cache.write_rows, page_id=page_id, offset=offset, layout=layout)
    interpreted_ctx = ctx_axis is not None and backend == "pallas" and bool(
        _backend.implementation(names[0], backend, topk_opts)[1].get("interpret"))
    # Every write first (row scatters into the donated stacks), then every read: no kernel reads
    # a stack that a later write updates, so XLA keeps one buffer per stack (no copy).
    for layer in range(len(indexer_types)):
        new_latent = _pad_last(inputs.new_latent[layer], layout.padded_dim)
        latent_caches = write(latent_caches, rows=new_latent, kind="latent", layer=layer)
    for slot in full_slot.values():
        index_caches = write(index_caches, rows=inputs.new_index[slot], kind="index", layer=slot)
    selections, dep = {}, None
    for slot in full_slot.values():  # the stacked index cache, read in place at the slot
        cache, at = _layer_arg(index_caches, slot, interpreted_ctx)
        args = (_after(inputs.q_index[slot], dep), inputs.index_weights[slot], cache, *b.arrays)
        sel_kw = dict(one_token_per_seq=one_token_per_seq, num_segments=num_segments, fill=fill,
                      refuse_full_overwrite=refuse_full_overwrite, recall_target=recall_target,
                      exact=exact, backend=backend, kernel_options=topk_opts, layer=at)
        if ctx_axis is None:
            selections[slot] = topk_op(*args, **{k_name: k}, pages_per_seq=layout.pages_per_seq,
                                       **sel_kw)
        else:
            selections[slot] = _context_topk(args, b, k=k, page_mode=granularity == "page",
                                             layout=layout, ctx_axis=ctx_axis, **sel_kw)
        dep = selections[slot]
    # The stacked query, read in place at each layer (no per-layer slice of q); the fp8 latent
    # cache takes the 576-wide query as given, the other formats the padded width.
    q_mla = _after(inputs.q_mla if layout.cache_format("latent") == "fp8"
                   else _pad_last(inputs.q_mla, layout.padded_dim), dep)
    per_layer = [selections[src_slot[layer]] for layer in range(len(indexer_types))]
    out = _attend_layers(q_mla, latent_caches, per_layer, b, layout=layout, mode=granularity,
                         sm_scale=sm_scale, backend=backend, mla_opts=mla_opts,
                         ctx_axis=ctx_axis, attn_sink=inputs.attn_sink,
                         interpreted_ctx=interpreted_ctx)
    topk = jnp.stack([selections[s] for s in range(len(selections))])
    return StepResult(out, topk, latent_caches, index_caches)


def _attend_layers(q_mla, latent_caches, per_layer, b, *, layout, mode, sm_scale, backend,
                   mla_opts, ctx_axis, attn_sink=None, interpreted_ctx=False):
    """Sparse MLA of every layer, ``[L, T, H, v_dim]``: on the Pallas backend one kernel call
    for all layers (``pallas_kernels.mla.layers``: no per-layer outputs for XLA to stack) when
    the rows' facts fit its SMEM bound and the cache is gatherable as stored; else one call per
    layer (stacked query and cache read in place) and the outputs stacked. ``attn_sink``
    (``f32[L, H]`` or None): each layer's sink, applied by the op; under ``ctx_axis`` once,
    after the sink-free LSE merge."""
    num_layers, num_rows = q_mla.shape[:2]
    one_call = (backend == "pallas" and ctx_axis is None and mla_layers.fits(num_layers, num_rows)
                and not (mode == "token" and layout.cache_format("latent") == "plain"
                         and jnp.result_type(latent_caches) == jnp.bfloat16))
    kw = dict(sm_scale=sm_scale, pages_per_seq=layout.pages_per_seq, v_dim=layout.v_dim)
    if one_call:  # the knobs as the per-layer entry gets them (interpret off TPU)
        mla_opts = _backend.implementation("sparse_mla" if mode == "token"
                                           else "page_sparse_mla", backend, mla_opts)[1]
        return mla_layers.sparse_mla_layers(q_mla, latent_caches, b.kv_lens,
                                            jnp.stack(per_layer), *b.arrays[1:], mode=mode,
                                            **kw, **mla_opts, attn_sink=attn_sink)
    mla_op = sparse_mla if mode == "token" else page_sparse_mla
    outs = []
    for layer, sel in enumerate(per_layer):
        q = _after(q_mla if ctx_axis is None else q_mla[layer], outs[-1] if outs else None)
        cache, at = _layer_arg(latent_caches, layer, interpreted_ctx)
        mla = functools.partial(mla_op, q, cache, b.kv_lens, sel, *b.arrays[1:],
                                **kw, backend=backend, kernel_options=mla_opts, layer=at)
        sink = None if attn_sink is None else attn_sink[layer]
        outs.append(mla(attn_sink=sink) if ctx_axis is None
                    else _context.merge_lse(*mla(return_lse=True), ctx_axis, sink)[0])
    return jnp.stack(outs)


def _layer_arg(caches, layer: int, interpreted_ctx: bool):
    """``(cache, layer)`` an op reads: the stack in place at ``layer``, on every backend and
    format, with or without a context axis, except one case: the Pallas kernels run by the
    *interpreter* under a context axis get the layer's cache sliced out (a copy per layer and
    shard), because the interpreter's per-call device barrier deadlocks with the stacked
    operand under ``shard_map`` on CPU (seen: tests/test_context.py's Pallas case never
    finishes; the cause is not pinned down). Compiled kernels and the reference read in place."""
    if not interpreted_ctx:
        return caches, layer
    return fp8_cache.take_layer(caches, layer), None


def _after(x, dep):
    """``x``, ordered after ``dep`` is computed (``lax.optimization_barrier``: no data moves).
    The step's kernel calls form one chain: with every cache write done first, the top-k and
    MLA calls of different layers are otherwise independent, and XLA's CPU runtime may start
    them in a different order on each device, where the Pallas interpreter's per-call barrier
    across devices (``shard_map``) then waits forever. On a TPU the calls run one after another
    anyway."""
    return x if dep is None else jax.lax.optimization_barrier((x, dep))[0]


def _context_topk(args, b, *, k, page_mode, layout, one_token_per_seq, num_segments, fill,
                  refuse_full_overwrite, recall_target, exact, backend, kernel_options,
                  ctx_axis, layer):
    """Top-k over context-sharded KV (``dsa_jax.context``): local top-k with scores, the
    exact merge over ``ctx_axis``, then the witness merge with the global context."""
    check_selection_args(k, recall_target, exact, num_segments,
                         k_name="k_pages" if page_mode else "k", fill=fill,
                         refuse_full_overwrite=refuse_full_overwrite)
    idx, vals = _context.local_topk(
        args[0], args[1], args[2], args[3:], k=k, page_mode=page_mode,
        pages_per_seq=layout.pages_per_seq, one_token_per_seq=one_token_per_seq, exact=exact,
        recall_target=recall_target, backend=backend, kernel_options=kernel_options,
        layer=layer)
    sel = _context.merge_topk(idx, vals, k, ctx_axis)
    ctx = _context.context_lens(b, sel.shape[0], page_mode=page_mode,
                                one_token_per_seq=one_token_per_seq)
    return finish_selection(sel, ctx, num_segments, fill)


_step = jax.jit(step_body, static_argnames=_STATICS,
                donate_argnames=("latent_caches", "index_caches"))


def dsa_step(inputs: StepInputs, latent_caches: jax.Array, index_caches: jax.Array,
             meta: BatchMeta, *, layout: PagedLayout, indexer_types, k: int, sm_scale: float,
             num_segments: int = 0, fill: str = "tail", refuse_full_overwrite: bool = False,
             granularity: str = "token", one_token_per_seq: bool = False,
             recall_target: float = DEFAULT_RECALL_TARGET, exact: bool = False,
             backend: str | None = None, validate: bool = False,
             kernel_options: dict | None = None, indexer_blocks: IndexerBlocks | None = None,
             mla_blocks: MlaBlocks | None = None, implementation=None) -> StepResult:
    """Run one DSA step over all layers (module docstring); jitted, caches donated.

    Args:
      inputs, latent_caches, index_caches: module docstring.
      meta: a ``BatchMeta`` (module docstring) or a ``dsa_jax.Batch`` (its page size and
        stride must be the layout's). An empty batch is a step that does nothing: ``T = 0``
        rows returns ``out [L, 0, H, v_dim]``, ``topk [F, 0, k]`` and the caches as given;
        ``S = 0`` sequences, rows outside every sequence (``dsa_jax.dispatch.empty_batch``).
      layout: the ``PagedLayout`` (page size, capacity, dims: nothing is restated here).
      indexer_types: per layer ``"full"`` / ``"shared"`` (IndexShare); ``None`` = all full
        (then ``len`` is read from ``latent_caches``).
      k: token budget (``granularity="token"``) or page budget (``"page"``).
      sm_scale: softmax scale of the absorbed MLA.
      num_segments: segment witnesses merged into every top-k row (0 = off).
      fill, refuse_full_overwrite: the witness fill (``"tail"``, upstream default, or
        ``"lowest"``) and the opt-in ``num_segments >= k`` guard, as ``indexer_topk``.
      backend: ``"reference"`` / ``"pallas"`` / ``None`` (``dsa_jax.backend``), resolved once
        here for every op of the step.
      validate: check the batch first (``dsa_jax.validate``, eager; raises on a bad batch).
      kernel_options: knobs for the Pallas entries (dict of hashable values); each op gets the
        knobs its entry takes (``block_rows``/``block_pages`` the indexer, ``tokens_per_block``
        or ``pages_per_block`` the MLA, ``interpret`` both); a knob none takes is refused.
      indexer_blocks, mla_blocks: typed block configs (``IndexerBlocks``, ``MlaBlocks``) for the
        indexer and the MLA kernels, each used by its own kernel only.
      implementation: ``"xla"`` / ``"pallas"`` / an ordered list / ``None`` for every op of the
        step (``dsa_jax.backend.step_candidates``); ``backend=`` is the older spelling.

    Returns:
      ``StepResult(out, topk, latent_caches, index_caches)``.
    """
    meta = BatchMeta(*_meta_of(meta, layout))
    inputs = StepInputs(*inputs)

    def run(payload):
        be, opts = payload
        statics = step_statics(latent_caches, layout=layout, indexer_types=indexer_types, k=k,
                               sm_scale=sm_scale, num_segments=num_segments, fill=fill,
                               refuse_full_overwrite=refuse_full_overwrite,
                               granularity=granularity, one_token_per_seq=one_token_per_seq,
                               recall_target=recall_target, exact=exact, backend=be,
                               kernel_options=opts, indexer_blocks=indexer_blocks,
                               mla_blocks=mla_blocks)
        return _run_step(inputs, latent_caches, index_caches, meta, statics, validate)

    tried = _backend.step_candidates("dsa_step", implementation, backend, kernel_options)
    return _backend.first_serving("dsa_step", tried, run, group=implementation is not None)


def _meta_of(meta, layout: PagedLayout):
    """The five batch arrays of a ``BatchMeta``, a tuple, or a ``dsa_jax.Batch`` (checked
    against ``layout``), an empty one padded (``dsa_jax.dispatch.empty_batch``)."""
    if isinstance(meta, Batch):
        for field in ("page_size", "pages_per_seq"):
            if getattr(meta, field) != getattr(layout, field):
                raise ValueError(f"dsa_step: meta.{field} = {getattr(meta, field)} but "
                                 f"layout.{field} = {getattr(layout, field)}")
        meta = meta.arrays
    return empty_batch(tuple(meta), 0, {})[0]


def _run_step(inputs: StepInputs, latent_caches, index_caches, meta: BatchMeta, statics,
              validate: bool) -> StepResult:
    """The jitted step (validated first when ``validate``); ``T = 0`` rows: nothing runs."""
    layout = statics["layout"]
    num_rows = int(np.shape(inputs.q_mla)[1])
    if num_rows == 0:
        return _idle_step(inputs, latent_caches, index_caches, meta, statics)
    if validate:
        num_pages = int(latent_caches.shape[-3])

        def checked(m):
            _validate.check_batch(num_rows, *m, page_size=layout.page_size,
                                  pages_per_seq=layout.pages_per_seq, num_pages=num_pages)
            return m

        meta = BatchMeta(*_validate.run_checked(checked, tuple(meta)))
    return _step(inputs, latent_caches, index_caches, meta, **statics)


def _idle_step(inputs: StepInputs, latent_caches, index_caches, meta: BatchMeta,
               statics) -> StepResult:
    """A step of ``T = 0`` rows: the result shapes of a one-row step (traced, not run), empty;
    the caches as given."""
    def one_row(x):
        return x if x is None or np.ndim(x) < 2 else jnp.zeros(
            (x.shape[0], 1, *x.shape[2:]), x.dtype)

    row = StepInputs(*(one_row(x) if name != "attn_sink" else x
                       for name, x in zip(StepInputs._fields, inputs, strict=True)))
    shapes = jax.eval_shape(functools.partial(step_body, **statics), row, latent_caches,
                            index_caches, meta)
    empty = lambda s: jnp.zeros((s.shape[0], 0, *s.shape[2:]), s.dtype)
    return StepResult(empty(shapes.out), empty(shapes.topk), latent_caches, index_caches)

