"""The writes of one DeepSeek-V4 step (``dsa_jax.v4_step``), every one before any read:

1. ``write_windows``: each layer's window rows into its type's window stack (the window
   ``V4Layout``'s slot rule, ``dsa_jax.cache.batch_write_slots``): an XLA scatter per layer,
   unless the attention writes them (``fuses_writes``: the Pallas backend's fused kernel, every
   window stack packed u32, f32 or fp8 MODEL1): then ``attend_writing`` runs each layer's
   attention with its window rows (``pallas_kernels.v4_attention.writes``: the kernel DMAs them
   into the stack in place at grid step 0, before any read; the same bytes at the same slots);
2. ``compress_all``: each compressed layer's compressor (``dsa_jax.v4_compressor``'s
   ``compress_step``, on the step's backend): the entries that complete in this step go into
   the compressed stack (CSA: also the indexer compressor's entries into the index-key stack),
   the state ring advances; layer ``slot`` of a family uses pool slots
   ``slot * num_slots + i``, so no layer's pool is sliced out (no copy).

``qat=True`` applies the official simulations to the entries the compressors emit (fp8 block 64
on the nope dims of attention entries; Hadamard + fp4 block 32 on index entries) before they
are stored. Caches are stacked per layer type and written in their format (plain, packed bf16,
fp8).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from dsa_jax import backend as _backend
from dsa_jax import cache as _cache
from dsa_jax.v4_attention import V4Layout, layout_batch
from dsa_jax.v4_model import TYPE_NAMES, TYPES, V4BatchMeta, V4Caches, V4ModelLayout, V4StepInputs
from pallas_kernels.v4_attention import writes as _fused_writes
from pallas_kernels.v4_attention.entry import fused_block
from pallas_kernels.v4_attention.state import v4_attention_state
from reference import v4_compressor as vc
from reference.formats import fp8_cache, packed_cache
from reference.formats import model1 as v4_cache
from reference.quant import qat as _qat
from reference.quant.bf16 import rounding
from reference.v4_attention import HEAD_DIM, PagedKV


def _store(cache, page_id, offset, rows, fmt: str, layer: int):
    """Rows ``f[T, 512]`` into layer ``layer`` of a stacked cache at ``(page_id, offset)``
    (``page_id >= num_pages`` drops the row), in the cache's format."""
    num_pages, ps = cache.shape[-3], cache.shape[-2]
    if fmt == "fp8":
        flat = jnp.where(page_id < num_pages, page_id * ps + offset, -1)
        return v4_cache.write_v4_rows(cache, flat, rows, layer=layer)
    if fmt == "packed":
        rows = packed_cache.pack_cache(rows)
    return cache.at[layer, page_id, offset].set(rows.astype(cache.dtype), mode="drop")


def write_windows(caches: V4Caches, inputs: V4StepInputs, meta: V4BatchMeta,
                  layout: V4ModelLayout) -> V4Caches:
    """Every layer's window rows into its type's window stack (the window ``V4Layout``'s
    ``RaggedBatch`` slot rule, ``dsa_jax.cache.batch_write_slots``)."""
    num_rows = inputs.q.shape[1]
    for r in TYPES:
        if not layout.count(r):
            continue
        field = f"{TYPE_NAMES[r]}_window"
        cache = getattr(caches, field)
        lay = layout.layout_for(r)
        b = layout_batch(lay, "window", cache.shape[-3], meta.kv_lens,
                         PagedKV(cache, meta.window_page_indices, meta.window_cu_lens),
                         meta.cu_q_lens, meta.distribution)
        page_id, offset = _cache.batch_write_slots(b, num_rows)
        for slot, layer in enumerate(layout.layers_of(r)):
            cache = _store(cache, page_id, offset, inputs.window_kv[layer],
                           lay.window_cache_format, slot)
        caches = caches._replace(**{field: cache})
    return caches


def fuses_writes(caches: V4Caches, layout: V4ModelLayout, backend: str,
                 attn_opts: dict) -> bool:
    """Whether every layer's attention writes its window rows (``attend_writing``): the Pallas
    backend's fused kernel (not ``fused=False``) and every window stack one it writes in place
    (``pallas_kernels.v4_attention.writes.writable``: packed u32, f32, fp8 MODEL1)."""
    if backend != "pallas" or not attn_opts.get("fused", True):
        return False
    return all(_fused_writes.writable(getattr(caches, f"{TYPE_NAMES[r]}_window"))
               for r in TYPES if layout.count(r))


def attend_writing(q, new_kv, window: PagedKV, meta: V4BatchMeta, *, layout: V4Layout,
                   compressed: PagedKV | None, compressed_indices, attn_sink,
                   sm_scale: float | None, precision: str, kernel_options: dict, layer: int):
    """``dsa_jax.v4_attention`` on the Pallas fused kernel (``q f32|bf16[T, H, 512]``, both
    caches stacked, read at ``layer``), the kernel first writing ``new_kv f32|bf16[T, 512]``,
    each row at its own position, into the window stack in place. Returns ``(out q.dtype[T, H,
    512], the updated window stack)``."""
    _, opts = _backend.implementation("v4_attention", "pallas", kernel_options)
    block = fused_block(window.cache, q.shape[1], opts.get("tokens_per_block"),
                        opts.get("blocks"))
    return v4_attention_state(
        q, window, meta.kv_lens, meta.cu_q_lens, meta.distribution,
        sm_scale=HEAD_DIM ** -0.5 if sm_scale is None else float(sm_scale),
        window_size=layout.window_size, compress_ratio=layout.compress_ratio,
        window_pages_per_seq=layout.window_pages_per_seq,
        compressed_pages_per_seq=layout.compressed_pages_per_seq or 0, compressed=compressed,
        compressed_indices=compressed_indices, attn_sink=attn_sink, block=block,
        vmem_limit_bytes=opts.get("vmem_limit_bytes"), interpret=opts.get("interpret", False),
        layer=layer, precision=precision, new_kv=new_kv)


def _nope_fp8(rows):
    """The official QAT of an attention entry: fp8 block 64 on the 448 nope dims."""
    return jnp.concatenate([_qat.act_quant_sim(rows[:, :448]), rows[:, 448:]], axis=-1)


def _index_fp4(rows, rb=lambda x: x):
    """The official QAT of an index entry: Hadamard rotation (its output rounded by ``rb``:
    bf16 in the bf16 regime, as the official ``rotate_activation``), then fp4 block 32."""
    return _qat.fp4_act_quant_sim(rb(_qat.hadamard_rotate(rows)))


def _compress_family(cache, state, kv, score, ape, norm, cos, sin, meta: V4BatchMeta, *,
                     ratio: int, num_slots: int, table, pages_per_seq: int, fmt: str, finish,
                     compress, rope_rows=None):
    """Run the compressor ``compress`` (a ``compress_step``) of every layer of one family
    (stacked inputs ``[Lx, ...]``) and store the completed entries in layer ``s`` of ``cache``;
    the state pool is updated in place (layer ``s`` owns slots ``s * num_slots + i``);
    ``rope_rows``: the tables in the Pallas kernel's row layout (``V4StepParams.rope_rows``).
    Returns ``(cache, state)``."""
    ok = (meta.state_slots >= 0) & (meta.state_slots < num_slots)
    page_indices, cu_lens = table
    for s in range(kv.shape[0]):
        slots = jnp.where(ok, meta.state_slots + s * num_slots, -1).astype(jnp.int32)
        entries, state = compress(kv[s], score[s], ape[s], norm[s], cos, sin, state, slots,
                                  meta.kv_lens, meta.cu_q_lens, meta.distribution, ratio=ratio,
                                  rope_rows=rope_rows)
        entries = entries._replace(rows=finish(entries.rows))
        if fmt == "packed":
            page_id, offset = vc.entry_slots(entries, page_indices, cu_lens,
                                             page_size=int(cache.shape[-2]),
                                             pages_per_seq=pages_per_seq,
                                             num_pages=int(cache.shape[-3]))
            cache = _store(cache, page_id, offset, entries.rows, fmt, s)
        else:
            cache = vc.write_entries(cache, entries, page_indices, cu_lens,
                                     pages_per_seq=pages_per_seq, layer=s)
    return cache, state


def compress_all(caches, states, inputs, params, meta, layout, num_slots, qat, compress,
                 precision: str = "f32"):
    """Every compressor of the step (CSA: attention + indexer; HCA), each by ``compress``;
    ``precision`` rounds the index entries' rotation in the bf16 regime (``_index_fp4``)."""
    ident = lambda x: x  # noqa: E731
    index_fp4 = functools.partial(_index_fp4, rb=rounding(precision))
    fmt = layout.compressed_cache_format
    if layout.count(4):
        table = (meta.csa_page_indices, meta.csa_cu_lens)
        kw = dict(ratio=4, num_slots=num_slots, table=table, compress=compress,
                  pages_per_seq=layout.csa_pages_per_seq, rope_rows=params.rope_rows)
        comp, st = _compress_family(caches.csa_compressed, states.csa, inputs.csa_kv,
                                    inputs.csa_score, params.csa_ape, params.csa_norm,
                                    params.cos, params.sin, meta, fmt=fmt,
                                    finish=_nope_fp8 if qat else ident, **kw)
        idx, ist = _compress_family(caches.csa_index, states.index, inputs.index_kv,
                                    inputs.index_score, params.index_ape, params.index_norm,
                                    params.cos, params.sin, meta,
                                    fmt="fp8" if isinstance(caches.csa_index,
                                                            fp8_cache.Fp8IndexCache) else "plain",
                                    finish=index_fp4 if qat else ident, **kw)
        caches = caches._replace(csa_compressed=comp, csa_index=idx)
        states = states._replace(csa=st, index=ist)
    if layout.count(128):
        comp, st = _compress_family(
            caches.hca_compressed, states.hca, inputs.hca_kv, inputs.hca_score, params.hca_ape,
            params.hca_norm, params.cos, params.sin, meta, ratio=128, num_slots=num_slots,
            table=(meta.hca_page_indices, meta.hca_cu_lens),
            pages_per_seq=layout.hca_pages_per_seq, fmt=fmt,
            finish=_nope_fp8 if qat else ident, compress=compress, rope_rows=params.rope_rows)
        caches = caches._replace(hca_compressed=comp)
        states = states._replace(hca=st)
    return caches, states
