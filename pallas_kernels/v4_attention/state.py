"""The flash-state protocol of the fused V4 attention kernel (``kernel``): tokamax's
``mla_swa(unnormalized_output=True)`` -> ``sparse_mla`` split (``docs/engines/tokamax.md``
sections 3.4 and 4), so a V4 layer may run as two calls over caches in two formats (tokamax's
window ``PlaneCache`` and CSA ``CsaCache``).

The state of a query row and head, tokamax's convention (natural exp):

    m   = max_x s_x                      (the running max of the scaled logits, f32)
    l   = sum_x e^(s_x - m)              (the sink-free denominator relative to m, f32)
    acc = sum_x e^(s_x - m) v_x          (the unnormalized numerator, f32 or bf16)

over the keys ``x`` walked so far, ``s_x = sm_scale * q . k_x``. ``FlashState(acc f32|bf16[T, H,
512], l f32[T, H], m f32[T, H])``. A state with ``l <= 0`` holds nothing (its ``m`` and ``acc``
are not read; a returned empty state is ``acc = 0, l = 0, m = 0``, as tokamax's invalid rows).
Normalizing gives ``out = acc / (l + e^(sink - m))`` and the sink-free ``lse = m + log l``: the
sink is applied exactly once, by the call that normalizes (a call that returns the state takes
no sink).

Two entries, both one ``kernel.fused_call`` (the kernel starts each row from ``state`` instead
of empty, and with ``return_state`` writes the state instead of normalizing):

- ``v4_attention_state``: ``v4_attention_fused``'s op (window + compressed by the ratio, every
  mask of ``reference.v4_attention``) from and / or to a state. The window pass of the split is
  ``compress_ratio=0, return_state=True`` (tokamax's ``mla_swa`` with ``unnormalized_output``),
  with ``new_kv`` writing this step's rows into its window cache first, in place (``writes``).
- ``v4_entries_from_state``: the compressed source alone, tokamax's ``sparse_mla``: each row
  walks its listed entries with NO position mask (no ``kv_lens``): entry ``e`` of the row's
  sequence is read iff ``0 <= e < `` the sequence's entry capacity (``min(pages_per_seq * ps,
  cu_lens[s + 1] - cu_lens[s])``) and its page exists; ``-1`` (any negative) is none. Rows
  outside every sequence walk nothing and normalize their state as given.

Traffic per row: the state's ``acc`` (itemsize of its dtype) and f32 ``l``, ``m`` read and / or
written in place of the output and LSE (``kernel.fused_traffic``'s ``acc_in_itemsize`` /
``acc_out_itemsize``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.v4_attention import formats, kernel
from pallas_kernels.v4_attention.blocks import DEFAULT_BLOCK
from reference import v4_attention as v4
from reference.core import batch, checks
from reference.formats import stacked
from reference.mla import sinks
from reference.quant.bf16 import check_precision


class FlashState(NamedTuple):
    """One flash state per query row and head (module docstring): ``acc f32|bf16[T, H, 512]``,
    ``l f32[T, H]``, ``m f32[T, H]``. A pytree."""

    acc: jax.Array
    l: jax.Array  # noqa: E741 (tokamax's name)
    m: jax.Array


def check_state(state, q, *, return_state: bool, attn_sink, acc_dtype) -> FlashState | None:
    """Static checks of the state arguments (ValueError / TypeError naming the argument and
    the numbers); returns ``state`` as a ``FlashState`` or None."""
    if return_state and attn_sink is not None:
        raise ValueError("attn_sink is applied once, by the call that normalizes; "
                         "return_state=True returns the unnormalized state: pass the sink to "
                         "the call that finishes the row")
    if acc_dtype is not None and jnp.dtype(acc_dtype) not in checks.FLOAT_DTYPES:
        raise ValueError(f"acc_dtype must be one of {[str(d) for d in checks.FLOAT_DTYPES]} "
                         f"or None (q's dtype), got {acc_dtype!r}")
    if state is None:
        return None
    if not isinstance(state, tuple) or len(state) != 3:
        raise TypeError(f"state must be a FlashState (acc, l, m) or None, got "
                        f"{type(state).__name__}")
    acc, l_in, m_in = state
    checks.floating("state.acc", acc)
    rows, heads, _ = np.shape(q)
    if tuple(np.shape(acc)) != tuple(np.shape(q)):
        raise ValueError(f"state.acc must have q's shape {tuple(np.shape(q))} (T, H, 512), got "
                         f"{tuple(np.shape(acc))}")
    for name, x in (("state.l", l_in), ("state.m", m_in)):
        if tuple(np.shape(x)) != (rows, heads):
            raise ValueError(f"{name} must have shape (T, H) = ({rows}, {heads}), got "
                             f"{tuple(np.shape(x))}")
        if jnp.result_type(x) != jnp.float32:
            raise TypeError(f"{name} must be float32, got dtype {jnp.result_type(x)}")
    return FlashState(acc, l_in, m_in)


def _result(res, *, return_state: bool, return_lse: bool):
    if return_state:
        acc, l_out, m_out = res
        return FlashState(acc, l_out[..., 0], m_out[..., 0])
    out, lse = res
    return (out, lse[..., 0]) if return_lse else out


@v4.checks_layers
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
    "compressed_pages_per_seq", "return_lse", "return_state", "block", "vmem_limit_bytes",
    "interpret", "precision", "acc_dtype"))
def v4_attention_state(q: jax.Array, window: v4.PagedKV, kv_lens: jax.Array,
                       cu_q_lens: jax.Array, distribution: jax.Array, *, sm_scale: float,
                       window_size: int, compress_ratio: int, window_pages_per_seq: int,
                       compressed_pages_per_seq: int = 0,
                       compressed: v4.PagedKV | None = None,
                       compressed_indices: jax.Array | None = None,
                       attn_sink: jax.Array | None = None, state: FlashState | None = None,
                       return_state: bool = False, return_lse: bool = False,
                       block: int = DEFAULT_BLOCK, vmem_limit_bytes: int | None = None,
                       interpret=False, layer=None, precision: str = "f32", acc_dtype=None,
                       new_kv: jax.Array | None = None):
    """``v4_attention_fused``'s op from and / or to a flash state (module docstring).

    Args: as ``kernel.v4_attention_fused`` (q f32|bf16[T, H, 512]; both caches in one format,
    tokamax's ``PlaneCache`` / ``CsaCache`` included), plus
      state: ``FlashState`` (``acc f32|bf16[T, H, 512]``, ``l, m f32[T, H]``) each row starts
        from, or None (empty).
      return_state: return the row's ``FlashState`` (``acc`` in ``acc_dtype``, default q's
        dtype) instead of the normalized output; takes no ``attn_sink`` (ValueError).
      acc_dtype: f32 | bf16 | None (q's dtype), static.
      new_kv: f32|bf16[T, 512] or None: this step's window rows, written in the window
        cache's format (a ``PlaneCache``, packed u32, f32 or fp8 ``Fp8V4Cache``) at each row's
        own position before the call attends (tokamax's ``mla_swa``; ``writes``); the cache is
        updated in place when donated.

    Returns:
      ``FlashState`` (``return_state``), else ``q.dtype[T, H, 512]`` (normalized, the sink
      applied once) and with ``return_lse`` the sink-free ``f32[T, H]`` (``m + log l``); with
      ``new_kv``: ``(that, the updated window cache)``, in its format.
    """
    state = check_state(state, q, return_state=return_state, attn_sink=attn_sink,
                        acc_dtype=acc_dtype)
    res, written = kernel.fused_rows(
        q, window, kv_lens, cu_q_lens, distribution, sm_scale=sm_scale,
        window_size=window_size, compress_ratio=compress_ratio,
        window_pages_per_seq=window_pages_per_seq,
        compressed_pages_per_seq=compressed_pages_per_seq, compressed=compressed,
        compressed_indices=compressed_indices, attn_sink=attn_sink, block=block,
        vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, layer=layer,
        precision=precision, state=state, return_state=return_state, acc_dtype=acc_dtype,
        new_kv=new_kv)
    result = _result(res, return_state=return_state, return_lse=return_lse)
    return result if new_kv is None else (result, written)


def check_entries_args(q, compressed: v4.PagedKV, cu_q_lens, distribution, compressed_indices,
                       attn_sink, *, sm_scale, pages_per_seq: int, block: int, layer):
    """Static checks of ``v4_entries_from_state`` (ValueError / TypeError naming the argument
    and the numbers); returns the compressed cache's ``stacked.LayerRead``."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"block must be a positive multiple of 8, got block={block!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a static Python float, got {sm_scale!r}")
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and positive, got sm_scale={sm_scale}")
    checks.rank("q", q, 3)
    checks.floating("q", q)
    rows, heads, dim = np.shape(q)
    if dim != v4.HEAD_DIM:
        raise ValueError(f"q.shape[2] must be the V4 head dim {v4.HEAD_DIM}, got {dim}")
    read = stacked.resolve("compressed.cache", compressed.cache, layer)
    v4.cache_format("compressed.cache",
                    formats.check_tokamax_cache("compressed.cache", read.one))
    checks.positive_int("compressed_pages_per_seq", pages_per_seq)
    for name, x in (("compressed.page_indices", compressed.page_indices),
                    ("compressed.cu_lens", compressed.cu_lens), ("cu_q_lens", cu_q_lens),
                    ("distribution", distribution)):
        checks.rank(name, x, 1)
        checks.integer(name, x)
    checks.dim("compressed.cu_lens", compressed.cu_lens, 0, np.shape(cu_q_lens)[0],
               "len(cu_q_lens) (S + 1)")
    checks.dim("distribution", distribution, 0, 3, "3 (decode_end, prefill_end, num_seqs)")
    checks.rank("compressed_indices", compressed_indices, 2)
    checks.integer("compressed_indices", compressed_indices)
    checks.dim("compressed_indices", compressed_indices, 0, rows, "q.shape[0] (T)")
    sinks.check_sink(attn_sink, heads)
    return read


def entries_info(rows: batch.RowFacts, cb: batch.RaggedBatch, entries) -> jax.Array:
    """``kernel.row_info``'s fields for the compressed source alone: no window; the entry
    limit is the sequence's entry capacity (``min(pages_per_seq * ps, cu_lens[s + 1] -
    cu_lens[s])``) on rows inside a sequence, 0 elsewhere."""
    own = cb.cu_kv_lens[rows.seq + 1] - cb.cu_kv_lens[rows.seq]
    c_limit = jnp.where(rows.in_seq, jnp.clip(own, 0, cb.capacity_tokens), 0)
    zeros = jnp.zeros_like(c_limit)
    return kernel.pack_info((zeros, zeros, zeros, kernel.list_walk_end(entries, c_limit),
                             cb.first_slot(rows.seq), c_limit))


def _checks_layer(fn):
    """Check a Python-int ``layer=`` against the stacked compressed cache before ``fn`` (jitted)
    traces it (``reference.v4_attention.checks_layers``' rule)."""

    @functools.wraps(fn)
    def wrapped(q, compressed, *args, layer=None, **kwargs):
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            stacked.resolve("compressed.cache", compressed.cache, int(layer))
        return fn(q, compressed, *args, layer=layer, **kwargs)

    return wrapped


@_checks_layer
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "compressed_pages_per_seq", "return_lse", "return_state", "block",
    "vmem_limit_bytes", "interpret", "precision", "acc_dtype"))
def v4_entries_from_state(q: jax.Array, compressed: v4.PagedKV, cu_q_lens: jax.Array,
                          distribution: jax.Array, compressed_indices: jax.Array,
                          state: FlashState | None = None, *, sm_scale: float,
                          compressed_pages_per_seq: int, attn_sink: jax.Array | None = None,
                          return_lse: bool = False, return_state: bool = False,
                          block: int = DEFAULT_BLOCK, vmem_limit_bytes: int | None = None,
                          interpret=False, layer=None, precision: str = "f32",
                          acc_dtype=None):
    """The compressed source alone from a flash state: tokamax's ``sparse_mla`` (module
    docstring: no position mask, the list alone says what is read).

    Args:
      q: f32|bf16[T, H, 512].
      compressed: ``PagedKV`` of compressed entries in any kernel format (tokamax's
        ``CsaCache`` the intended one); ``cu_lens`` in entries (a fixed-stride table: ``s *
        pages_per_seq * ps``).
      cu_q_lens: i32[S+1]; distribution: i32[3] (``reference.core.batch``).
      compressed_indices: i32[T, k] sequence-local entry numbers, ``-1`` none.
      state: ``FlashState`` each row starts from (tokamax: ``mla_swa``'s unnormalized output
        and its ``l``, ``m``), or None (empty).
      sm_scale, attn_sink (f32[H], applied once when normalizing), return_lse, return_state,
        block, vmem_limit_bytes, interpret, layer, precision, acc_dtype: as
        ``v4_attention_state``; ``compressed_pages_per_seq``: the table stride.

    Returns:
      as ``v4_attention_state``.
    """
    check_precision(precision)
    read = check_entries_args(q, compressed, cu_q_lens, distribution, compressed_indices,
                              attn_sink, sm_scale=sm_scale,
                              pages_per_seq=compressed_pages_per_seq, block=block,
                              layer=layer)
    state = check_state(state, q, return_state=return_state, attn_sink=attn_sink,
                        acc_dtype=acc_dtype)
    num_seqs = np.shape(cu_q_lens)[0] - 1
    rows = batch.row_facts(q.shape[0], jnp.zeros((num_seqs,), jnp.int32), cu_q_lens,
                           distribution)
    cb = batch.RaggedBatch.of(read.one, jnp.zeros((num_seqs,), jnp.int32),
                              compressed.page_indices, cu_q_lens, compressed.cu_lens,
                              distribution, pages_per_seq=compressed_pages_per_seq)
    cache = formats.kernel_cache(read.stacked)
    if formats.kernel_format(cache) in formats.FP8_FORMATS:  # shared rope rows, record runs
        compressed_indices = kernel.walk_order(compressed_indices)
    info = entries_info(rows, cb, compressed_indices)
    q_in = q.astype(jnp.bfloat16) if precision == "bf16" else q
    res = kernel.fused_call(q_in, cache, cache, read.layer, compressed_indices, info,
                            jnp.full((1,), -1, jnp.int32), compressed.page_indices, attn_sink,
                            gathered_rows=compressed_indices.shape[1], block=block,
                            sm_scale=sm_scale, vmem_limit_bytes=vmem_limit_bytes,
                            interpret=interpret, state=state, return_state=return_state,
                            acc_dtype=q.dtype if acc_dtype is None else acc_dtype)
    if not return_state and precision == "bf16":
        res = (res[0].astype(q.dtype), res[1])
    return _result(res, return_state=return_state, return_lse=return_lse)
