"""tokamax 0.0.17's DeepSeek-V4 attention ops (``tokamax.ops.experimental.mla_swa``,
``tokamax.ops.sparse_mla``) with tokamax's names, arguments, results and cache bytes, and the HCA
op tokamax lacks (``hca_mla``, this package's), computed by this package's references (issue 29;
``docs/engines/tokamax.md`` sections 1, 3 and 4).

The split is tokamax's flash-state protocol (``reference.v4_attention.state``): ``mla_swa``
writes this step's window rows and attends the window, returning its unnormalized state ``(acc,
l, m)`` when ``unnormalized_output=True``; ``sparse_mla`` (CSA, ratio 4) or ``hca_mla`` (HCA,
ratio 128) resumes from it over the compressed entries and applies the sink once:

    win, cache, l, m = mla_swa(q, new_kv, cache, kv_lens, ..., unnormalized_output=True)
    out = sparse_mla(q, nope, rope, topk, ..., sinks, win, l, m)

Conventions (tokamax's): ``M = len(cu_q_lens) - 1`` sequence slots; ``distribution i32[3] =
(decode_end, prefill_end, num_seqs)`` (only sequences ``< num_seqs`` are live; rows outside
every live sequence are zeros); ``page_indices i32[N]`` is a fixed-stride table, ``pps = N //
M`` pages per sequence (``N`` must be a positive multiple of ``M``: ``ValueError`` naming both),
sequence ``s`` owning ``page_indices[s * pps:(s + 1) * pps]``; a row's position is ``p = kv_len -
q_len + (t - cu_q_lens[s])``; ``sm_scale`` multiplies ``q . k`` and defaults to 1.0 (V4 passes
``512 ** -0.5``); sinks are ``f32[H]`` logits in the denominator only.

Caches (``reference.formats.tokamax_v4``, read by slot: only the rows a row attends are
gathered and decoded): the window and HCA caches are ``PlaneCache`` bytes, ``i32[P, S, 128]``
or ``u8[P, S, 4, 128]`` (2 rows per token, ``logical_page_size <= S // 2`` tokens used per
page); the CSA cache is ``CsaCache`` bytes, ``nope i32[P, ps, 128]`` (448 e4m3 + 64
lane-periodic ue8m0 scales) and ``rope i32[P, ps // 4, 128]``.

Precision (tokamax's references): bf16 q and rows as given (the cache rows are bf16 values),
f32 logits and f32 accumulation, no rounding of ``e^(s - m)`` before ``P @ V``; the result in
``q.dtype`` (``mla_swa``'s unnormalized ``acc`` too, so a bf16 q rounds it to bf16 between the
two ops, as in tokamax). Sums run in another order than tokamax's, so results agree with its
``"xla"`` implementation to f32 rounding before the final cast (``tests/
test_tokamax_parity_attention.py`` states the bound). ``"pallas"`` with a bf16 q feeds the MXU
bf16 ``e^(s - m)`` (one bf16 rounding of each weight: within ``2**-8`` of ``max|out|`` of
``"xla"``; f32 q: f32 order noise); its window cache bytes equal ``"xla"``'s exactly.

``implementation``: ``None`` or ``"xla"`` (the jnp references, any platform), ``"pallas"``
(``pallas_kernels.v4_attention.state``: ``mla_swa`` by ``v4_attention_state`` writing the rows
in place, ``sparse_mla`` / ``hca_mla`` by ``v4_entries_from_state``; the strict interpreter off
TPU; ``NotImplementedError`` for the u8 slab view and ``non_causal_block``), or an ordered list
of them (``dsa_jax.backend``'s rules: an
unknown name is a ``ValueError``; when every name raises ``NotImplementedError``, an
``ExceptionGroup``).

Where this differs from tokamax's references (inputs tokamax's callers never send): a table
slot past a sequence's ``pps`` pages, a page id outside ``[0, P)``, or a negative entry other
than ``-1`` reads nothing here (tokamax clamps the page number, gathers a clamped id, and reads
``-2`` etc. as an entry); a write to such a place is dropped (tokamax's scatter drops an
out-of-range page id but writes a clamped page slot); ``sparse_mla`` / ``hca_mla`` give zeros on
rows outside every live sequence (tokamax's ``sparse_mla`` computes them from the last
sequence's table); a live row with nothing visible returns ``l = 0``, ``m = -inf`` from
``mla_swa`` under ``"xla"``, ``l = 0``, ``m = 0`` under ``"pallas"`` (the kernel's empty state;
tokamax: ``m`` its mask value); each resumes the same (a state with ``l = 0`` holds nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import backend as _backend
from dsa_jax.dispatch import static_float
from dsa_jax.engines.tokamax.indexer import CAUSAL_RULES  # one declaration of the rule names
from pallas_kernels.v4_attention import state as _kernel_state
from reference.core import batch
from reference.core import checks as _checks
from reference.formats import tokamax_v4
from reference.mla import attend, sinks
from reference.v4_attention import COMPRESS_RATIOS, HEAD_DIM, PagedKV
from reference.v4_attention import state as _state

__all__ = ["CAUSAL_RULES", "hca_lens_to_attend", "hca_mla", "mla_swa", "sparse_mla"]

IMPLEMENTATIONS = ("xla", "pallas")
HCA_RATIO = COMPRESS_RATIOS[-1]  # 128 tokens per HCA entry
TOPK_MULTIPLE = 128  # tokamax's sparse_mla bind: K a positive multiple of 128
PALLAS_KNOBS = ("interpret", "block", "vmem_limit_bytes")  # kernel_options of "pallas"


# ----------------------------------------------------------------------------- checks


def _serve(op: str, implementation, xla_call, pallas_call):
    """``xla_call()`` or ``pallas_call()`` under ``implementation`` (module docstring)."""
    names = _backend.chosen_names(f"tokamax.{op}", IMPLEMENTATIONS, implementation, None)
    names = names or ["xla"]

    def call(name):
        return xla_call() if name == "xla" else pallas_call()

    return _backend.first_serving(f"tokamax.{op}", [(n, n) for n in names], call,
                                  group=len(names) > 1)


def _knobs(op: str, kernel_options) -> tuple:
    """The Pallas kernel's knobs (``PALLAS_KNOBS``) from ``kernel_options``; ``interpret``
    defaults to ``not on_tpu()`` (the strict interpreter off TPU)."""
    opts = dict(kernel_options or {})
    unknown = sorted(set(opts) - set(PALLAS_KNOBS))
    if unknown:
        raise ValueError(f"{op}: kernel_options {unknown} are not knobs of the Pallas kernel; "
                         f"its knobs: {list(PALLAS_KNOBS)}")
    opts.setdefault("interpret", not _backend.on_tpu())
    return tuple(sorted(opts.items()))  # hashable: a static argument


def _no_slab(op: str, cache) -> None:
    """The kernel reads the i32 words; the u8 slab view is a byte transpose of them (a
    cache-sized relayout each call, and no in-place write): not served."""
    if cache.is_slab:
        raise NotImplementedError(
            f"{op}: implementation 'pallas' reads the int32[P, S, 128] plane words; the "
            f"uint8[P, S, 4, 128] slab view is a byte transpose of them (a cache-sized "
            f"relayout per call, no in-place write); pass the int32 words or use 'xla'")


def _ints(op: str, **arrays) -> None:
    for name, x in arrays.items():
        _checks.rank(f"{op}: {name}", x, 1)
        _checks.integer(f"{op}: {name}", x)


def _rows_meta(op: str, cu_q_lens, distribution, lens=None, lens_name: str = "kv_lens") -> int:
    """Check ``cu_q_lens``, ``distribution`` (and ``lens i32[M]``); return ``M``."""
    _ints(op, cu_q_lens=cu_q_lens, distribution=distribution)
    _checks.dim(f"{op}: distribution", distribution, 0, 3, "3 (decode_end, prefill_end, "
                "num_seqs)")
    num_seqs = int(np.shape(cu_q_lens)[0]) - 1
    if num_seqs <= 0:
        raise ValueError(f"{op}: cu_q_lens must have M + 1 >= 2 entries (M sequence slots), got "
                         f"{num_seqs + 1}")
    if lens is not None:
        _ints(op, **{lens_name: lens})
        _checks.dim(f"{op}: {lens_name}", lens, 0, num_seqs, "len(cu_q_lens) - 1 (M)")
    return num_seqs


def _ragged(op: str, page_indices, cu_q_lens, distribution, lens=None) -> int:
    """Check the ragged metadata and the fixed-stride table; return ``pages_per_seq = N //
    M``."""
    num_seqs = _rows_meta(op, cu_q_lens, distribution, lens)
    _ints(op, page_indices=page_indices)
    n = int(np.shape(page_indices)[0])
    if n == 0 or n % num_seqs:
        raise ValueError(f"{op}: len(page_indices) = {n} must be a positive multiple of the "
                         f"M = {num_seqs} sequence slots (a fixed-stride table of N // M pages "
                         f"per sequence)")
    return n // num_seqs


def _query(op: str, q, attention_sinks) -> None:
    _checks.rank(f"{op}: q", q, 3)
    _checks.floating(f"{op}: q", q)
    _checks.dim(f"{op}: q", q, 2, HEAD_DIM, "the V4 head dim (448 nope + 64 rope)")
    sinks.check_sink(attention_sinks, int(np.shape(q)[1]), f"{op}: attention_sinks")


def _swa_state(op: str, q, swa_accumution, swa_l, swa_m) -> None:
    """tokamax's checks of the resumed state: ``acc`` has q's shape and dtype; ``l``, ``m``
    are float ``[T, H]``."""
    if tuple(np.shape(swa_accumution)) != tuple(np.shape(q)):
        raise ValueError(f"{op}: swa_accumution must have q's shape {tuple(np.shape(q))}, got "
                         f"{tuple(np.shape(swa_accumution))}")
    dt, qt = jnp.result_type(swa_accumution), jnp.result_type(q)
    if dt != qt:
        raise ValueError(f"{op}: swa_accumution.dtype ({dt}) must match q.dtype ({qt}), as "
                         f"mla_swa(unnormalized_output=True) returns it")
    for name, x in (("swa_l", swa_l), ("swa_m", swa_m)):
        if tuple(np.shape(x)) != tuple(np.shape(q)[:2]):
            raise ValueError(f"{op}: {name} must have shape (T, H) = {tuple(np.shape(q)[:2])}, "
                             f"got {tuple(np.shape(x))}")
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(f"{op}: {name} must be a float array, got {jnp.result_type(x)}")


def _plane(op: str, cache_kv, logical_page_size) -> tokamax_v4.PlaneCache:
    """tokamax's ``i32[P, S, 128]`` / ``u8[P, S, 4, 128]`` cache as a checked ``PlaneCache``."""
    dt = np.dtype(jnp.result_type(cache_kv))
    if dt == np.uint8:
        ok = np.ndim(cache_kv) == 4
    else:
        ok = dt == np.int32 and np.ndim(cache_kv) == 3
    if not ok:
        raise ValueError(f"{op}: cache_kv must be int32[P, S, 128] or uint8[P, S, 4, 128], got "
                         f"{dt}{list(np.shape(cache_kv))}")
    logical_page_size = _checks.positive_int("logical_page_size", logical_page_size, op)
    cache = tokamax_v4.PlaneCache(cache_kv, logical_page_size)
    tokamax_v4.check_plane_cache(f"{op}: cache_kv", cache)
    return cache


def _fixed_batch(cache, lens, page_indices, cu_q_lens, distribution, pps: int):
    """The package's ragged batch of a fixed-stride table (sequence ``s``'s pages from slot
    ``s * pps``: ``cu_kv_lens = s * pps * page_size``)."""
    cu = jnp.arange(cu_q_lens.shape[0], dtype=jnp.int32) * (pps * cache.page_size)
    return batch.RaggedBatch.of(cache, lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                                cu_q_lens.astype(jnp.int32), cu, distribution.astype(jnp.int32),
                                pages_per_seq=pps)


def _open_batch(cache, page_indices, cu_q_lens, distribution, pps: int):
    """A batch with no length mask (every entry of the table's pages exists): visibility is
    the caller's (top-k indices, per-row counts)."""
    lens = jnp.full((cu_q_lens.shape[0] - 1,), pps * cache.page_size, jnp.int32)
    return _fixed_batch(cache, lens, page_indices, cu_q_lens, distribution, pps)


# ----------------------------------------------------------------------------- mla_swa


def mla_swa(q, new_kv, cache_kv, kv_lens, page_indices, cu_q_lens, distribution,
            attention_sinks, *, sliding_window: int, logical_page_size: int,
            sm_scale: float = 1.0, chunk_prefill_size: int | None = None,
            unnormalized_output: bool = False, non_causal_block: bool = False,
            implementation=None, kernel_options: dict | None = None):
    """tokamax's ``mla_swa``: write this step's window rows, then attend the sliding window.

    Args:
      q: ``bf16|f32[T, H, 512]`` queries (after RoPE).
      new_kv: ``bf16[T, 512]``: row ``t`` is the window row (K = V) of query row ``t``.
      cache_kv: the window cache, ``i32[P, S, 128]`` or ``u8[P, S, 4, 128]`` (tokamax's plane
        layout, ``reference.formats.tokamax_v4.PlaneCache``).
      kv_lens: ``i32[M]`` tokens per sequence, this step's rows included.
      page_indices: ``i32[M * pps]`` fixed-stride table over window pages.
      cu_q_lens: ``i32[M + 1]``; distribution: ``i32[3]`` (module docstring).
      attention_sinks: ``f32[H]`` sink logits (used when normalizing).
      sliding_window: ``W`` (static, >= 1): row ``p`` sees tokens ``max(0, p - W + 1) .. p``
        (that exist: ``< kv_len``), itself included.
      logical_page_size: tokens used per page (static, ``1 .. S // 2``): token ``pos`` of
        sequence ``s`` lives at page ``page_indices[s * pps + pos // lps]``, slot ``pos % lps``.
      sm_scale: logit scale (static float).
      chunk_prefill_size: tokamax's tuning knob (checked: None or a positive int; no effect).
      unnormalized_output: return ``acc`` (in ``q.dtype``) in place of the output.
      non_causal_block: this step's rows also see each other both ways: row ``p`` sees tokens
        ``max(0, p - W + 1) .. kv_len - 1`` (tokamax's reference rule).
      implementation: ``None`` / ``"xla"`` / ``"pallas"`` / a list (module docstring).
        ``"pallas"`` (``v4_attention_state``, the rows written in place) serves neither
        ``non_causal_block=True`` nor the u8 slab view (``NotImplementedError``).
      kernel_options: ``"pallas"``'s knobs (``PALLAS_KNOBS``: ``interpret``, default ``not
        on_tpu()``; ``block``; ``vmem_limit_bytes``); unused by ``"xla"``.

    Returns:
      ``(out q.dtype[T, H, 512], updated_cache_kv, l f32[T, H], m f32[T, H])``: first, row ``j``
      of each live sequence is written at position ``kv_len - q_len + j`` (as bf16 plane
      words), then each row attends over the updated cache; ``out = acc / (l + e^(sink - m))``,
      or ``acc`` with ``unnormalized_output``; ``m`` the max logit, ``l = sum e^(s - m)``
      (sink-free); rows outside every live sequence: zeros. ``updated_cache_kv`` has
      ``cache_kv``'s dtype and shape.

    Raises:
      ValueError / TypeError: tokamax's bind checks (``new_kv`` not bf16, a cache dtype other
      than int32 / uint8, ``logical_page_size`` outside ``[1, S // 2]``, ``len(kv_lens) !=
      M``, ``N`` not a multiple of ``M``), a head dim other than 512, bad statics.
    """
    op = "tokamax.mla_swa"
    _query(op, q, attention_sinks)
    if jnp.result_type(new_kv) != jnp.bfloat16 or np.shape(new_kv) != (np.shape(q)[0],
                                                                         HEAD_DIM):
        raise ValueError(f"{op}: new_kv must be bfloat16[T, {HEAD_DIM}] with T = "
                         f"{np.shape(q)[0]}, got {jnp.result_type(new_kv)}"
                         f"{list(np.shape(new_kv))}")
    cache = _plane(op, cache_kv, logical_page_size)
    pps = _ragged(op, page_indices, cu_q_lens, distribution, kv_lens)
    sliding_window = _checks.positive_int("sliding_window", sliding_window, op)
    if chunk_prefill_size is not None:
        _checks.positive_int("chunk_prefill_size", chunk_prefill_size, op)
    for name, v in (("unnormalized_output", unnormalized_output),
                    ("non_causal_block", non_causal_block)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{op}: {name} must be a Python bool, got {v!r}")
    statics = dict(sliding_window=sliding_window, pps=pps, sm_scale=static_float(
        op, "sm_scale", sm_scale), unnormalized=bool(unnormalized_output),
        non_causal=bool(non_causal_block))
    args = (q, new_kv, cache, kv_lens, page_indices, cu_q_lens, distribution, attention_sinks)

    def pallas():
        if non_causal_block:
            raise NotImplementedError(f"{op}: implementation 'pallas' has no non_causal_block "
                                      f"(the kernel's window is causal); use 'xla'")
        _no_slab(op, cache)
        return _mla_swa_pallas(*args, **statics, knobs=_knobs(op, kernel_options))

    return _serve("mla_swa", implementation, lambda: _mla_swa_xla(*args, **statics), pallas)


@functools.partial(jax.jit, static_argnames=("sliding_window", "pps", "sm_scale",
                                             "unnormalized", "non_causal"))
def _mla_swa_xla(q, new_kv, cache, kv_lens, page_indices, cu_q_lens, distribution, sink, *,
                 sliding_window, pps, sm_scale, unnormalized, non_causal):
    num_rows = q.shape[0]
    b = _fixed_batch(cache, kv_lens, page_indices, cu_q_lens, distribution, pps)
    rows = b.rows(num_rows)
    # 1. this step's rows into the window cache, at their positions
    ok = rows.in_seq & (rows.abs_pos >= 0) & (rows.abs_pos < b.capacity_tokens)
    pid, off, ok = b.token_slots(rows.seq, rows.abs_pos, ok)
    cache = tokamax_v4.write_plane_rows(cache, new_kv, jnp.where(ok, pid * b.page_size + off,
                                                                 -1))
    # 2. the window: tokens start .. last (token_slots drops those at or past kv_len)
    span = sliding_window + (num_rows - 1 if non_causal else 0)
    start = jnp.maximum(rows.abs_pos - sliding_window + 1, 0)
    last = kv_lens[rows.seq] - 1 if non_causal else rows.abs_pos
    idx = start[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]
    idx = jnp.where(idx <= last[:, None], idx, -1)
    slots, valid = attend.token_slots(idx, rows, b, causal=False)
    st = _state.part_state(q, cache, slots, valid, sm_scale=sm_scale)
    out = st.acc if unnormalized else _state.finish(st, sink)
    live = rows.in_seq[:, None]
    out = jnp.where(live[..., None], out, 0.0).astype(q.dtype)
    return (out, cache.words, jnp.where(live, st.l, 0.0), jnp.where(live, st.m, 0.0))


# ----------------------------------------------------------------------------- sparse_mla


def sparse_mla(q, cache_kv_nope, cache_kv_rope, topk_indices, page_indices, cu_q_lens,
               distribution, attention_sinks, swa_accumution, swa_l, swa_m, *,
               sm_scale: float = 1.0, implementation=None, kernel_options: dict | None = None):
    """tokamax's ``sparse_mla``: resume the window state over the listed CSA entries and apply
    the sink once.

    Args:
      q: ``bf16|f32[T, H, 512]``.
      cache_kv_nope: ``i32[P, ps, 128]``; cache_kv_rope: ``i32[P, ps // 4, 128]`` (tokamax's CSA
        cache, ``reference.formats.tokamax_v4.CsaCache``).
      topk_indices: ``i32[T, K]`` (``K`` a positive multiple of 128) entry numbers within the
        row's sequence, ``-1`` = none: entry ``j`` of sequence ``s`` is page ``page_indices[s *
        pps + j // ps]``, slot ``j % ps``. No other mask (no causal or length rule: the
        caller's top-k decides); a repeated entry counts once per occurrence.
      page_indices: ``i32[M * pps]`` fixed-stride table over CSA pages (``M = len(cu_q_lens) -
        1``).
      cu_q_lens, distribution: as ``mla_swa``.
      attention_sinks: ``f32[H]``, applied here.
      swa_accumution, swa_l, swa_m: the state to resume (``mla_swa(...,
        unnormalized_output=True)``'s ``out``, ``l``, ``m``); ``swa_accumution`` in ``q.dtype``
        (tokamax's spelling).
      sm_scale: logit scale (static float).
      implementation, kernel_options: as ``mla_swa`` (``"pallas"``: ``v4_entries_from_state``
        on the ``CsaCache``).

    Returns:
      ``q.dtype[T, H, 512]``: ``acc' / (l' + e^(sink - m'))`` over the window state and the
      listed entries (``reference.v4_attention.state``); zeros on rows outside every live
      sequence.
    """
    op = "tokamax.sparse_mla"
    _query(op, q, attention_sinks)
    for name, x in (("cache_kv_nope", cache_kv_nope), ("cache_kv_rope", cache_kv_rope)):
        if jnp.result_type(x) != jnp.int32:
            raise ValueError(f"{op}: {name} must be int32 (tokamax's CSA cache), got "
                             f"{jnp.result_type(x)}")
        _checks.rank(f"{op}: {name}", x, 3)
    cache = tokamax_v4.CsaCache(cache_kv_nope, cache_kv_rope)
    tokamax_v4.check_csa_cache(f"{op}: cache", cache)
    _checks.rank(f"{op}: topk_indices", topk_indices, 2)
    _checks.integer(f"{op}: topk_indices", topk_indices)
    _checks.dim(f"{op}: topk_indices", topk_indices, 0, np.shape(q)[0], "q.shape[0] (T)")
    k = int(np.shape(topk_indices)[1])
    if k <= 0 or k % TOPK_MULTIPLE:
        raise ValueError(f"{op}: topk_indices.shape[1] = {k} must be a positive multiple of "
                         f"{TOPK_MULTIPLE} (tokamax's rule)")
    pps = _ragged(op, page_indices, cu_q_lens, distribution)
    _swa_state(op, q, swa_accumution, swa_l, swa_m)
    scale = static_float(op, "sm_scale", sm_scale)
    args = (q, cache, topk_indices.astype(jnp.int32), page_indices, cu_q_lens, distribution,
            attention_sinks, swa_accumution, swa_l, swa_m)
    return _serve("sparse_mla", implementation,
                  lambda: _resume_xla(*args, pps=pps, sm_scale=scale),
                  lambda: _resume_pallas(*args, pps=pps, sm_scale=scale,
                                         knobs=_knobs(op, kernel_options)))


@functools.partial(jax.jit, static_argnames=("pps", "sm_scale"))
def _resume_xla(q, cache, idx, page_indices, cu_q_lens, distribution, sink, acc, l_, m, *,
                pps, sm_scale):
    """Resume ``(acc, l_, m)`` over the entries ``idx i32[T, n]`` (sequence-local, ``< 0`` =
    none) of ``cache`` and finish with the sink; zeros outside every live sequence."""
    b = _open_batch(cache, page_indices, cu_q_lens, distribution, pps)
    rows = b.rows(q.shape[0])
    slots, valid = attend.token_slots(idx, rows, b, causal=False)
    part = _state.part_state(q, cache, slots, valid, sm_scale=sm_scale)
    out = _state.finish(_state.resume(_state.FlashState(acc, l_, m), part), sink)
    return jnp.where(rows.in_seq[:, None, None], out, 0.0).astype(q.dtype)


def _entry_size(cache) -> int:
    """Entries (tokens) per page: a ``PlaneCache``'s logical page size, a ``CsaCache``'s ps."""
    if isinstance(cache, tokamax_v4.PlaneCache):
        return cache.logical_page_size
    return int(np.shape(cache.nope)[1])


def _paged(cache, page_indices, num_seqs: int, pps: int) -> PagedKV:
    """The kernel's ``PagedKV`` of a fixed-stride table: ``cu_lens = s * pps * ps``."""
    cu = jnp.arange(num_seqs + 1, dtype=jnp.int32) * (pps * _entry_size(cache))
    return PagedKV(cache, jnp.asarray(page_indices, jnp.int32), cu)


def _live(q, cu_q_lens, distribution) -> jax.Array:
    """``bool[T]``: rows inside a live sequence."""
    num_seqs = cu_q_lens.shape[0] - 1
    return batch.row_facts(q.shape[0], jnp.zeros((num_seqs,), jnp.int32), cu_q_lens,
                           distribution).in_seq


@functools.partial(jax.jit, static_argnames=("sliding_window", "pps", "sm_scale",
                                             "unnormalized", "non_causal", "knobs"))
def _mla_swa_pallas(q, new_kv, cache, kv_lens, page_indices, cu_q_lens, distribution, sink, *,
                    sliding_window, pps, sm_scale, unnormalized, non_causal, knobs):
    """``mla_swa`` by ``v4_attention_state`` (the window pass writing ``new_kv`` in place,
    returning the state; ``acc`` in f32 when this op normalizes, then ``acc / (l + e^(sink -
    m))`` here). A live row with nothing visible: ``l = 0, m = 0`` (the kernel's empty
    state; ``"xla"``: ``m = -inf``)."""
    del non_causal  # pallas() refuses it
    cu_q_lens, distribution = cu_q_lens.astype(jnp.int32), distribution.astype(jnp.int32)
    window = _paged(cache, page_indices, cu_q_lens.shape[0] - 1, pps)
    st, new_cache = _kernel_state.v4_attention_state(
        q, window, kv_lens.astype(jnp.int32), cu_q_lens, distribution, sm_scale=sm_scale,
        window_size=sliding_window, compress_ratio=0, window_pages_per_seq=pps,
        return_state=True, acc_dtype=None if unnormalized else jnp.float32, new_kv=new_kv,
        **dict(knobs))
    out = st.acc if unnormalized else _state.finish(_state.FlashState(*st), sink)
    live = _live(q, cu_q_lens, distribution)[:, None]
    out = jnp.where(live[..., None], out, 0.0).astype(q.dtype)
    return (out, new_cache.words, jnp.where(live, st.l, 0.0), jnp.where(live, st.m, 0.0))


@functools.partial(jax.jit, static_argnames=("pps", "sm_scale", "knobs"))
def _resume_pallas(q, cache, idx, page_indices, cu_q_lens, distribution, sink, acc, l_, m, *,
                   pps, sm_scale, knobs):
    """``_resume_xla`` by ``v4_entries_from_state`` (``cache`` a ``CsaCache`` or an i32
    ``PlaneCache``)."""
    cu_q_lens, distribution = cu_q_lens.astype(jnp.int32), distribution.astype(jnp.int32)
    state = _kernel_state.FlashState(acc, l_.astype(jnp.float32), m.astype(jnp.float32))
    out = _kernel_state.v4_entries_from_state(
        q, _paged(cache, page_indices, cu_q_lens.shape[0] - 1, pps), cu_q_lens, distribution,
        idx, state, sm_scale=sm_scale, compressed_pages_per_seq=pps, attn_sink=sink,
        **dict(knobs))
    live = _live(q, cu_q_lens, distribution)
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)



# ----------------------------------------------------------------------------- HCA


def hca_mla(q, cache_kv, kv_lens_to_attend, page_indices, cu_q_lens, distribution,
            attention_sinks, swa_accumution, swa_l, swa_m, *, logical_page_size: int,
            sm_scale: float = 1.0, implementation=None, kernel_options: dict | None = None):
    """The V4 HCA part (ratio 128), tokamax-style: resume the window state over every visible
    compressed entry of a plane cache and apply the sink once. **This package's op**: tokamax
    0.0.17 has no HCA attention; the arguments follow ``sparse_mla`` and vLLM's TPU path
    (tpu-inference ``deepseek_v4`` ``mla_ragged_paged_attention``, whose HCA mode takes the
    same per-row ``kv_lens_to_attend``).

    Args:
      q: ``bf16|f32[T, H, 512]``.
      cache_kv: the HCA cache, ``i32[P, S, 128]`` or ``u8[P, S, 4, 128]``: the bf16 plane
        records tokamax's ``dsv4_compressor`` writes in HCA mode (2 rows per entry).
      kv_lens_to_attend: ``i32[T]``, per query row, the entries it sees: ``0 ..
        kv_lens_to_attend[t] - 1`` (those past the sequence's ``pps * logical_page_size``
        capacity do not exist). vLLM passes ``(position + 1) // 128``, the official rule;
        ``hca_lens_to_attend`` computes it (or the indexer's rule) from ``kv_lens``.
      page_indices: ``i32[M * pps]`` fixed-stride table over HCA pages: entry ``j`` of sequence
        ``s`` is page ``page_indices[s * pps + j // lps]``, slot ``j % lps``.
      cu_q_lens, distribution, attention_sinks, swa_accumution, swa_l, swa_m: as
        ``sparse_mla``.
      logical_page_size: entries used per page (static, ``1 .. S // 2``).
      sm_scale, implementation, kernel_options: as ``sparse_mla``. ``"pallas"`` is
        ``v4_entries_from_state`` on the plane cache with the list ``j`` (``-1`` at ``j >=
        kv_lens_to_attend[t]``), ``k = pps * logical_page_size``: the list (4 B per entry per
        row) is written by XLA and read by the kernel, whose walk stops after the row's last
        listed entry (entries read: the row's count); the u8 slab view is not served.

    Returns:
      ``q.dtype[T, H, 512]`` (zeros outside every live sequence).
    """
    op = "hca_mla"
    _query(op, q, attention_sinks)
    cache = _plane(op, cache_kv, logical_page_size)
    _ints(op, kv_lens_to_attend=kv_lens_to_attend)
    _checks.dim(f"{op}: kv_lens_to_attend", kv_lens_to_attend, 0, np.shape(q)[0],
                "q.shape[0] (T: one count per query row)")
    pps = _ragged(op, page_indices, cu_q_lens, distribution)
    _swa_state(op, q, swa_accumution, swa_l, swa_m)
    scale = static_float(op, "sm_scale", sm_scale)
    capacity = pps * cache.logical_page_size
    idx = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    idx = jnp.where(idx < jnp.asarray(kv_lens_to_attend, jnp.int32)[:, None], idx, -1)
    args = (q, cache, idx, page_indices, cu_q_lens, distribution, attention_sinks,
            swa_accumution, swa_l, swa_m)

    def pallas():
        _no_slab(op, cache)
        return _resume_pallas(*args, pps=pps, sm_scale=scale, knobs=_knobs(op, kernel_options))

    return _serve("hca_mla", implementation, lambda: _resume_xla(*args, pps=pps,
                                                                 sm_scale=scale), pallas)


def hca_lens_to_attend(kv_lens, cu_q_lens, distribution, *, num_rows: int,
                       causal_rule: str = "official",
                       compress_ratio: int = HCA_RATIO) -> jax.Array:
    """``i32[num_rows]``: the compressed entries each query row sees, for ``hca_mla``.

    Args:
      kv_lens: ``i32[M]`` tokens per sequence, this step's rows included (``mla_swa``'s).
      cu_q_lens, distribution: as ``mla_swa``.
      num_rows: ``T`` (static).
      causal_rule: ``"official"``: entry ``j`` is visible at position ``p`` iff ``j < (p + 1) //
        r`` (an entry exists once its group's last token has arrived; the official model,
        ``dsa_jax.v4_attention`` and vLLM's TPU HCA path); ``"tpu_inference"``: iff ``j <= p // r``
        and ``j < kv_len // r`` (tokamax's / tpu-inference's indexer rule, which shows a row
        the entry of its own unfinished group; the two agree on the last row of a sequence).
      compress_ratio: ``r`` (static, default 128).

    Returns:
      ``i32[num_rows]``, 0 on rows outside every live sequence.
    """
    if causal_rule not in CAUSAL_RULES:
        raise ValueError(f"hca_lens_to_attend: causal_rule must be one of {CAUSAL_RULES}, got "
                         f"{causal_rule!r}")
    num_rows = _checks.nonneg_int("num_rows", num_rows)
    r = _checks.positive_int("compress_ratio", compress_ratio, "hca_lens_to_attend")
    _rows_meta("hca_lens_to_attend", cu_q_lens, distribution, kv_lens)
    rows = batch.row_facts(num_rows, jnp.asarray(kv_lens, jnp.int32),
                           jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(distribution,
                                                                           jnp.int32))
    pos = rows.abs_pos
    if causal_rule == "official":
        n = batch.entries_of_tokens(pos + 1, r)
    else:
        n = jnp.minimum(pos // r + 1, batch.entries_of_tokens(
            jnp.asarray(kv_lens, jnp.int32)[rows.seq], r))
    return jnp.where(rows.in_seq, jnp.maximum(n, 0), 0).astype(jnp.int32)
