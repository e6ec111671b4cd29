"""DeepSeek-V4 attention in two passes of the token-sparse MLA kernel (``fused=False`` of
``pallas_kernels.v4_attention.v4_attention``, once called "milestone 1"): two calls of the
token-mode sparse MLA gather kernel (``pallas_kernels.mla``), one per source, merged in XLA
(1.43x the minimum bytes at V4-Flash decode). It reads packed / plain caches only: an fp8
``Fp8V4Cache`` is refused by name (NotImplementedError) and served by the fused kernel
(``pallas_kernels.v4_attention.kernel``, the default).

Math: ``reference.v4_attention`` is the definition (one softmax over a row's window tokens
``max(0, p - W + 1) .. p`` and its visible compressed entries, K = V = the 512-dim row, the
sink applied once after the merge, the returned LSE sink-free).

How: each part is a token top-k the kernel already serves, built elementwise in XLA (no
per-element gather or scatter):

- window: ``i32[T, W]`` from an iota, ``p - W + 1 .. p`` (``-1`` below 0); read from the window
  cache with ``kv_lens`` in tokens. A released page is skipped by the kernel's page-id check
  (``reference.batch.lookup_page``) and is never in any row's window anyway.
- compressed: ratio 4 the given ``compressed_indices`` with entries ``j >= (p + 1) // 4`` set to
  ``-1``; ratio 128 an iota over the entry capacity masked the same way (the kernel's walk stops
  at a row's last valid entry, so the masked tail costs only its 4 B per entry of SMEM meta);
  read from the compressed cache with ``kv_lens // r`` entries.

Each call returns its sink-free state (``return_lse=True``); ``reference.sinks.merge_states``
then ``apply_sink`` finish in XLA: two f32 ``[T, H, 512]`` reads, one write, elementwise.
With a bf16 ``q`` each part's output is rounded to bf16 before the merge (two roundings: within
two bf16 steps of the f32 result). That extra rounding of each part is not a rounding point of
the official ``sparse_attn`` (one softmax, one bf16 output), so ``precision="bf16"`` is refused
here (NotImplementedError naming it; the fused kernel serves it); ``"f32"`` is the default.

Shapes: ``q f32|bf16[T, H, 512]``; caches ``f32[P, ps, 512]`` or packed ``u32[P, ps, 256]``
(``reference.packed_cache``; a plain bf16 cache is packed per call by the MLA entry, a full copy:
the documented slow path), stacked ``[L, ...]`` read in place at ``layer=``. Out
``q.dtype[T, H, 512]``, LSE ``f32[T, H]``.

Traffic per decode row: the window's ``W`` rows plus the selected entries, each one packed row
(1024 B for 512 bf16 features: the minimum, no padding at D = 512), q read twice (once per
call), two partial outputs written and read back by the merge (``compile_cases.v4_traffic``:
1.43x the minimum at V4-Flash decode). The fused kernel moves 1.00x by its model.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import sparse_mla
from pallas_kernels.v4_attention import formats
from reference import v4_attention as v4
from reference.core import batch
from reference.formats import model1 as v4_cache
from reference.formats import stacked
from reference.quant.bf16 import check_precision

STATIC_ARGNAMES = ("sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
                   "compressed_pages_per_seq", "return_lse", "tokens_per_block", "blocks",
                   "vmem_limit_bytes", "interpret", "precision")


def _part(q, kv: v4.PagedKV, idx, kv_lens, cu_q_lens, distribution, *, pages_per_seq,
          sm_scale, knobs, layer):
    """One source's sink-free state ``(q.dtype[T, H, 512], f32[T, H])`` from the MLA kernel."""
    return sparse_mla(q, kv.cache, kv_lens, idx, kv.page_indices, cu_q_lens, kv.cu_lens,
                      distribution, sm_scale=sm_scale, pages_per_seq=pages_per_seq,
                      v_dim=v4.HEAD_DIM, return_lse=True, layer=layer, **knobs)


def two_pass(q: jax.Array, window: v4.PagedKV, kv_lens: jax.Array, cu_q_lens: jax.Array,
             distribution: jax.Array, *, sm_scale: float, window_size: int, compress_ratio: int,
             window_pages_per_seq: int, compressed_pages_per_seq: int = 0,
             compressed: v4.PagedKV | None = None, compressed_indices: jax.Array | None = None,
             attn_sink: jax.Array | None = None, return_lse: bool = False,
             tokens_per_block: int | None = None, blocks: mla_blocks.MlaBlocks | None = None,
             vmem_limit_bytes: int | None = None, interpret=False, layer=None,
             precision: str = "f32"):
    """The two-pass computation (module docstring), unjitted: what ``v4_attention(...,
    fused=False)`` traces inside its own jit, and ``v4_attention_two_pass`` jits.
    ``precision``: ``"f32"`` only (``"bf16"``: NotImplementedError; other values: ValueError)."""
    if check_precision(precision) != "f32":
        raise NotImplementedError(
            f"precision={precision!r}: the two-pass form (fused=False) rounds each part's "
            f"output to bf16 before the merge, which the official regime does not; the fused "
            f"kernel (fused=True, the default) serves precision='bf16'")
    statics = dict(sm_scale=sm_scale, window_size=window_size, compress_ratio=compress_ratio,
                   window_pages_per_seq=window_pages_per_seq,
                   compressed_pages_per_seq=compressed_pages_per_seq)
    for name, kv in (("window.cache", window), ("compressed.cache", compressed)):
        if kv is not None and isinstance(kv.cache, v4_cache.Fp8V4Cache):
            raise NotImplementedError(
                f"{name} is an fp8 Fp8V4Cache: the two-pass form (fused=False, the MLA kernel) "
                f"reads packed bf16 or f32 caches only; the fused kernel (fused=True, the "
                f"default) reads fp8 caches")
        if kv is not None and not formats.is_array(kv.cache):
            raise NotImplementedError(
                f"{name} is {formats.describe(kv.cache)}: the two-pass form (fused=False) "
                f"reads packed bf16 or f32 caches only; the fused kernel (fused=True, the "
                f"default) reads tokamax's cache formats")
    w_one = stacked.resolve("window.cache", window.cache, layer).one
    c_one = None
    if compressed is not None:
        c_one = stacked.resolve("compressed.cache", compressed.cache, layer).one
    v4.check_v4_args(q, w_one, kv_lens, cu_q_lens, distribution, window, compressed, c_one,
                     compressed_indices, attn_sink, **statics)
    knobs = dict(tokens_per_block=tokens_per_block, blocks=blocks,
                 vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    rows = batch.row_facts(q.shape[0], kv_lens, cu_q_lens, distribution)
    states = [_part(q, window, v4.window_indices(rows.abs_pos, window_size), kv_lens, cu_q_lens,
                    distribution, pages_per_seq=window_pages_per_seq, sm_scale=sm_scale,
                    knobs=knobs, layer=layer)]
    if compress_ratio:
        capacity = compressed_pages_per_seq * int(np.shape(c_one)[1])  # entries
        idx = v4.compressed_selection(rows.abs_pos, compressed_indices,
                                      compress_ratio=compress_ratio, capacity_entries=capacity)
        states.append(_part(q, compressed, idx, v4.compressed_lens(kv_lens, compress_ratio),
                            cu_q_lens, distribution, pages_per_seq=compressed_pages_per_seq,
                            sm_scale=sm_scale, knobs=knobs, layer=layer))
    outs, lses = zip(*states, strict=True)
    return v4.finish(outs, lses, attn_sink, q.dtype, return_lse)


v4_attention_two_pass = v4.checks_layers(
    functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)(two_pass))
v4_attention_two_pass.__doc__ = """DeepSeek-V4 attention by two MLA kernel passes merged in XLA
(module docstring); same arguments as ``pallas_kernels.v4_attention.v4_attention`` without
``fused`` (``tokens_per_block`` / ``blocks`` / ``vmem_limit_bytes``: the MLA kernel's knobs,
``pallas_kernels.mla.sparse_mla``, used by both calls; no fp8 caches)."""
