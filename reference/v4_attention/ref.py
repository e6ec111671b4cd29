"""DeepSeek-V4 attention (reference): one softmax over a row's sliding window of raw tokens and
its compressed entries, with an optional attention sink.

Math, per query row ``t`` of sequence ``i`` at absolute position ``p`` (the package's row rule,
``reference.core.batch``), ``r = compress_ratio``, ``W = window_size``:

    window set      Wn(t) = { s : max(0, p - W + 1) <= s <= p, s < kv_len }     (tokens)
    compressed set  C(t)  = ratio 4:   { j in compressed_indices[t] : 0 <= j < (p + 1) // 4 }
                            ratio 128: { j : 0 <= j < (p + 1) // 128 }
                            ratio 0:   {}                                         (entries)
    logits          s_x   = sm_scale * q[t, h, :] . row_x        x in Wn(t) u C(t) (no dedup)
    out[t, h, :]          = sum_x e^(s_x - m) row_x / sum_x e^(s_x - m)      K = V = the row
    lse[t, h]             = log sum_x e^(s_x)                     (natural log, sink-free)

and with ``attn_sink`` the FlashMLA rule ``out *= 1 / (1 + exp(sink - lse))``, applied once,
after the two parts are merged (``reference.mla.sinks``); the returned LSE stays sink-free.

Precision (``precision=``, ``reference.quant.bf16``): ``"f32"`` (the default) computes the above
in f32 on the values given. ``"bf16"`` is the official ``sparse_attn`` regime (docs/
V4_OFFICIAL_REGIME.md step 27): q and every cache row are used as bf16 values (f32 inputs are
rounded to bf16 first; packed, bf16 and fp8 rows already are), the logits are f32 (f32 sums of
exact bf16 products, times ``sm_scale``), each part's probabilities ``P = e^(s - m)`` are rounded
to bf16 before ``P @ V`` while its denominator sums the unrounded f32 ``P``, and the output is
rounded to bf16 (returned in ``q.dtype``: for an f32 q, bf16 values held in f32). The sink is
the denominator term ``e^(sink - m)`` of the official kernel, applied by the rule above (the same
value). Where it rounds: the reference rounds ``P`` relative to each part's max (window, then
compressed) and merges the two f32 parts by their LSE; the official kernel walks one list
(window then compressed) in blocks of 64 and rounds relative to its running max at each block,
so a rounded ``P`` may differ by 1 bf16 ulp between the two (and the merge of two parts
likewise), a difference well inside 2 bf16 ulps of each output row's largest value.

Two paged caches, each a ``PagedKV`` (cache, packed page table, cu_lens) with the package's slot
rule (``reference.core.batch``) in its own unit:

- the window cache holds raw tokens; ``cu_lens`` counts tokens; token ``s`` of a sequence lives
  in its page ``s // page_size``. Pages that fell out of every row's window may be released: a
  released page's table slot holds an id outside ``[0, num_pages)``, and it is never read (the
  window never reaches it; were it reached, the id check would skip it).
- the compressed cache holds one entry per ``r`` tokens; ``cu_lens`` counts entries; a sequence
  holds ``kv_len // r`` complete entries (also bounded by its entry capacity).

Entries are valid only inside those bounds; invalid ones are never gathered (the row-level
page lookup of ``reference.mla.attend.token_slots``), so NaN in any slot that must not be read
cannot reach the output. A row with nothing valid returns zeros and LSE ``-inf``; rows outside
every sequence likewise.

Cache formats (``cache_format``), per cache, mixed freely here: ``f32|bf16[P, ps, 512]``, the packed
bf16 words ``u32[P, ps, 256]`` (``reference.formats.packed_cache``), or the MODEL1 fp8 cache
``reference.formats.model1.Fp8V4Cache`` (``nope u32[P, ps, 128]``, ``rope u32[P, ceil(ps / 4),
128]``: 448 e4m3 in 7 ue8m0-scaled tiles + 64 bf16 rope), whose rows are gathered and decoded by
``attend.attend_selected`` (exact: the values are ``dequantize_v4_cache``'s). Stacked ``[L, P, ps,
W]`` caches (an fp8 cache: both parts with a leading ``L``) are read in place at ``layer=``
(``reference.formats.stacked``; both caches at the same layer). Any other cache object is refused by
name.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.core import checks as _checks
from reference.formats import model1, packed_cache, stacked
from reference.mla import attend, sinks
from reference.quant.bf16 import check_precision, rounding

HEAD_DIM = model1.V4_DIM  # one KV head of 448 nope + 64 rope features; K = V = the whole row
ROPE_DIM = model1.V4_ROPE
COMPRESS_RATIOS = (0, 4, 128)  # window only, CSA (indexer top-k), HCA (every visible entry)
DEFAULT_WINDOW = 128


class PagedKV(NamedTuple):
    """One paged cache and its page table (a pytree).

    cache: ``f32|bf16[P, ps, 512]``, packed ``u32[P, ps, 256]`` or an ``Fp8V4Cache``
      (``reference.formats.model1``); stacked: a leading ``L`` (on both parts of an fp8 cache).
    page_indices: ``i32[N]`` packed page table (sequence ``i``'s pages start at slot
      ``cu_lens[i] // ps``).
    cu_lens: ``i32[S+1]`` cumsum of page-aligned capacities in THIS cache's unit (window cache:
      tokens; compressed cache: entries).
    """

    cache: Any
    page_indices: jax.Array
    cu_lens: jax.Array


# ----------------------------------------------------------------------------- static checks


def cache_format(name: str, cache) -> str:
    """``"plain"`` (f32/bf16 rows), ``"packed"`` (u32 words) or ``"fp8"`` (an ``Fp8V4Cache``,
    checked part by part by ``reference.formats.model1.check_v4_cache``) for one layer's cache
    struct; refuses anything else by name."""
    if isinstance(cache, model1.Fp8V4Cache):
        model1.check_v4_cache(name, cache)
        _checks.rank(f"{name}.nope", cache.nope, 3)
        return "fp8"
    if not hasattr(cache, "dtype") or not hasattr(cache, "shape"):
        raise TypeError(f"{name} must be an array [P, ps, {HEAD_DIM}] (f32/bf16), packed "
                        f"u32[P, ps, {packed_cache.packed_words(HEAD_DIM)}] or a "
                        f"reference.v4_cache.Fp8V4Cache, got {type(cache).__name__}")
    _checks.rank(name, cache, 3)
    if packed_cache.is_packed(cache):
        _checks.dim(name, cache, 2, packed_cache.packed_words(HEAD_DIM),
                    f"packed_words({HEAD_DIM}) for a packed u32 cache")
        return "packed"
    _checks.floating(name, cache)
    _checks.dim(name, cache, 2, HEAD_DIM, "the V4 head dim")
    return "plain"


def _check_statics(*, sm_scale, window_size, compress_ratio, window_pages_per_seq,
                   compressed_pages_per_seq, window_page_size: int) -> None:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a static Python float, got {sm_scale!r}")
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and positive, got sm_scale={sm_scale}")
    _checks.positive_int("window_size", window_size)
    _checks.positive_int("window_pages_per_seq", window_pages_per_seq)
    if isinstance(compress_ratio, bool) or compress_ratio not in COMPRESS_RATIOS:
        raise ValueError(f"compress_ratio must be one of {COMPRESS_RATIOS}, got "
                         f"compress_ratio={compress_ratio!r}")
    if window_size % window_page_size:
        raise ValueError(f"the window cache's page_size={window_page_size} does not divide "
                         f"window_size={window_size} ({window_size} % {window_page_size} = "
                         f"{window_size % window_page_size}); a page would straddle the window "
                         f"boundary")
    if compress_ratio:
        _checks.positive_int("compressed_pages_per_seq", compressed_pages_per_seq)


def _check_compressed(compressed, compressed_indices, *, compress_ratio, num_rows, one) -> None:
    """The ratio decides which of ``compressed`` / ``compressed_indices`` must be given."""
    if compress_ratio == 0 and compressed is not None:
        raise ValueError("compress_ratio=0 (window only) takes no compressed cache; got one")
    if compress_ratio and compressed is None:
        raise ValueError(f"compress_ratio={compress_ratio} needs the compressed cache "
                         f"(compressed=PagedKV(...)), got None")
    if compress_ratio != 4 and compressed_indices is not None:
        raise ValueError(f"compressed_indices are the ratio-4 indexer's top-k; compress_ratio="
                         f"{compress_ratio} takes none (ratio 128 attends every visible entry)")
    if compress_ratio == 4:
        if compressed_indices is None:
            raise ValueError("compress_ratio=4 needs compressed_indices i32[T, k] (sequence-"
                             "local entry numbers, -1 pad), got None")
        _checks.rank("compressed_indices", compressed_indices, 2)
        _checks.integer("compressed_indices", compressed_indices)
        _checks.dim("compressed_indices", compressed_indices, 0, num_rows, "q.shape[0] (T)")
    if compressed is not None:
        cache_format("compressed.cache", one)
        for name, x in (("compressed.page_indices", compressed.page_indices),
                        ("compressed.cu_lens", compressed.cu_lens)):
            _checks.rank(name, x, 1)
            _checks.integer(name, x)


def check_v4_args(q, window_one, kv_lens, cu_q_lens, distribution, window, compressed,
                  compressed_one, compressed_indices, attn_sink, **statics) -> None:
    """Every static check of ``v4_attention_ref`` (also the Pallas entry's). ``*_one``: one
    layer's cache structs (``stacked.resolve``); ``statics`` the op's static arguments,
    ``precision`` among them (default ``"f32"``). Raises ValueError/TypeError naming the
    argument and the numbers."""
    statics = dict(statics)
    check_precision(statics.pop("precision", "f32"))
    _checks.rank("q", q, 3)
    _checks.floating("q", q)
    num_rows, heads, dim = np.shape(q)
    if dim != HEAD_DIM:
        raise ValueError(f"q.shape[2] must be the V4 head dim {HEAD_DIM} (448 nope + 64 rope; "
                         f"K = V = the whole row), got {dim}")
    cache_format("window.cache", window_one)
    _checks.ragged_metadata(kv_lens, window.page_indices, cu_q_lens, window.cu_lens,
                            distribution, seq_lens_name="kv_lens",
                            page_indices_name="window.page_indices",
                            cu_kv_lens_name="window.cu_lens")
    if compressed is not None:
        for name in ("page_indices", "cu_lens"):
            _checks.rank(f"compressed.{name}", getattr(compressed, name), 1)
            _checks.integer(f"compressed.{name}", getattr(compressed, name))
        _checks.dim("compressed.cu_lens", compressed.cu_lens, 0, np.shape(kv_lens)[0] + 1,
                    "len(kv_lens) + 1")
    _check_statics(window_page_size=int(np.shape(window_one)[1]), **statics)
    _check_compressed(compressed, compressed_indices, compress_ratio=statics["compress_ratio"],
                      num_rows=num_rows, one=compressed_one)
    sinks.check_sink(attn_sink, heads)


# ----------------------------------------------------------------------------- index lists


def window_indices(abs_pos, window_size: int):
    """``i32[T, W]``: each row's window tokens ``p - W + 1 .. p`` (``-1`` below 0), from an iota
    (elementwise, no gather). Rows outside every sequence are masked by the batch rules."""
    offs = jnp.arange(1 - window_size, 1, dtype=jnp.int32)
    idx = abs_pos[:, None].astype(jnp.int32) + offs[None, :]
    return jnp.where(idx >= 0, idx, -1)


def visible_entries(abs_pos, compress_ratio: int):
    """``i32[T]``: compressed entries a row at ``abs_pos`` may see, ``(p + 1) // r`` (an entry
    is emitted when its group's last token arrives), at least 0."""
    return jnp.maximum(batch.entries_of_tokens(abs_pos.astype(jnp.int32) + 1, compress_ratio),
                       0)


def compressed_selection(abs_pos, compressed_indices, *, compress_ratio: int,
                         capacity_entries: int):
    """``i32[T, k]`` compressed entries of each row with the invisible ones set to ``-1``:
    ratio 4 masks the given indices by ``j < (p + 1) // 4``; ratio 128 lists every entry
    ``0 .. capacity_entries - 1`` (an iota) masked the same way. Elementwise."""
    vis = visible_entries(abs_pos, compress_ratio)[:, None]
    if compress_ratio == 4:
        idx = compressed_indices.astype(jnp.int32)
    else:
        idx = jnp.broadcast_to(jnp.arange(capacity_entries, dtype=jnp.int32)[None, :],
                               (abs_pos.shape[0], capacity_entries))
    return jnp.where((idx >= 0) & (idx < vis), idx, -1)


def compressed_lens(kv_lens, compress_ratio: int):
    """``i32[S]``: complete compressed entries per sequence, ``kv_len // r`` (tokens ->
    entries; at least 0)."""
    return batch.entries_of_tokens(jnp.maximum(kv_lens.astype(jnp.int32), 0), compress_ratio)


def finish(outs, lses, attn_sink, dtype, return_lse: bool, precision: str = "f32"):
    """Merge the parts' sink-free states, apply the sink once, round the output to bf16 under
    ``precision="bf16"``, cast to ``dtype``."""
    out, lse = sinks.merge_states(outs, lses)
    out = rounding(precision)(sinks.apply_sink(out, lse, attn_sink)).astype(dtype)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- the op


def checks_layers(fn):
    """Check a Python-int ``layer=`` against both stacked caches before ``fn`` (jitted) traces
    it (inside jit an int is a tracer, and a traced layer is masked, not refused)."""

    @functools.wraps(fn)
    def wrapped(q, window, *args, layer=None, compressed=None, **kwargs):
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            stacked.resolve("window.cache", window.cache, int(layer))
            if compressed is not None:
                stacked.resolve("compressed.cache", compressed.cache, int(layer))
        return fn(q, window, *args, layer=layer, compressed=compressed, **kwargs)

    return wrapped


def _part(q, kv: PagedKV, idx, kv_lens, rows, cu_q_lens, distribution, *, pages_per_seq,
          sm_scale, layer, precision):
    """One part's sink-free state over ``idx i32[T, n]`` (sequence-local, this cache's unit)."""
    read = stacked.resolve("cache", kv.cache, layer)
    b = batch.RaggedBatch.of(read.one, kv_lens, stacked.mask_table(kv.page_indices, read),
                             cu_q_lens, kv.cu_lens, distribution, pages_per_seq=pages_per_seq)
    slots, valid = attend.token_slots(idx, rows, b, causal=False)
    return attend.attend_selected(q, kv.cache, slots, valid, sm_scale=sm_scale, v_dim=HEAD_DIM,
                                  layer=layer, precision=precision)


@checks_layers
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "window_size", "compress_ratio", "window_pages_per_seq",
    "compressed_pages_per_seq", "return_lse", "precision"))
def v4_attention_ref(q: jax.Array, window: PagedKV, kv_lens: jax.Array, cu_q_lens: jax.Array,
                     distribution: jax.Array, *, sm_scale: float, window_size: int,
                     compress_ratio: int, window_pages_per_seq: int,
                     compressed_pages_per_seq: int = 0, compressed: PagedKV | None = None,
                     compressed_indices: jax.Array | None = None,
                     attn_sink: jax.Array | None = None, return_lse: bool = False, layer=None,
                     precision: str = "f32") -> jax.Array | tuple[jax.Array, jax.Array]:
    """DeepSeek-V4 attention over the window and compressed caches (module docstring).

    Args:
      q: f32|bf16[T, H, 512] (RMS-normed, rope on the last 64 dims).
      window: ``PagedKV`` of raw tokens (``cu_lens`` in tokens).
      kv_lens: i32[S] tokens per sequence, this step's included (the rows' positions).
      cu_q_lens: i32[S+1]; distribution: i32[3] (``reference.core.batch``).
      sm_scale: logit scale (V4: ``512 ** -0.5``).
      window_size: W, tokens a row sees back to itself inclusive (V4: 128); the window cache's
        page size must divide it.
      compress_ratio: 0 (window only), 4 (CSA, ``compressed_indices``) or 128 (HCA, every
        visible entry).
      window_pages_per_seq / compressed_pages_per_seq: page-table strides (capacities: times
        each cache's page size, in its unit).
      compressed: ``PagedKV`` of compressed entries (``cu_lens`` in entries); None for ratio 0.
      compressed_indices: i32[T, k] sequence-local entry numbers, -1 pad (ratio 4 only).
      attn_sink: f32[H] or None.
      return_lse: also return the sink-free LSE f32[T, H].
      layer: read both (stacked) caches at this layer, in place.
      precision: ``"f32"`` (default) or ``"bf16"``, the official ``sparse_attn`` rounding
        (module docstring: bf16 q and rows, f32 logits, P rounded to bf16 for ``P @ V`` with
        the denominator from the unrounded P, bf16 output); static. Anything else: ValueError.

    Returns:
      ``q.dtype[T, H, 512]``; with ``return_lse`` also ``f32[T, H]`` (``-inf`` for an empty row).
    """
    statics = dict(sm_scale=sm_scale, window_size=window_size, compress_ratio=compress_ratio,
                   window_pages_per_seq=window_pages_per_seq,
                   compressed_pages_per_seq=compressed_pages_per_seq)
    w_read = stacked.resolve("window.cache", window.cache, layer)
    c_one = None
    if compressed is not None:
        c_one = stacked.resolve("compressed.cache", compressed.cache, layer).one
    check_v4_args(q, w_read.one, kv_lens, cu_q_lens, distribution, window, compressed, c_one,
                  compressed_indices, attn_sink, precision=precision, **statics)
    rows = batch.row_facts(q.shape[0], kv_lens, cu_q_lens, distribution)
    outs, lses = [], []
    o, lse = _part(q, window, window_indices(rows.abs_pos, window_size), kv_lens, rows,
                   cu_q_lens, distribution, pages_per_seq=window_pages_per_seq,
                   sm_scale=sm_scale, layer=layer, precision=precision)
    outs.append(o)
    lses.append(lse)
    if compress_ratio:
        capacity = compressed_pages_per_seq * int(np.shape(c_one)[1])  # entries
        idx = compressed_selection(rows.abs_pos, compressed_indices,
                                   compress_ratio=compress_ratio, capacity_entries=capacity)
        o, lse = _part(q, compressed, idx, compressed_lens(kv_lens, compress_ratio), rows,
                       cu_q_lens, distribution, pages_per_seq=compressed_pages_per_seq,
                       sm_scale=sm_scale, layer=layer, precision=precision)
        outs.append(o)
        lses.append(lse)
    return finish(outs, lses, attn_sink, q.dtype, return_lse, precision)
