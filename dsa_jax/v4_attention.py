"""DeepSeek-V4 attention: the layout of its two caches (``V4Layout``) and the op
(``v4_attention``) with the package's backend switch.

``dsa_jax.v4_attention`` is the function (the package exports the op under the family's
name); import the module's names with ``from dsa_jax.v4_attention import ...`` (``V4Layout``,
``V4LayoutWarning``, ``check_v4_batch``, ``layout_batch``...). ``dsa_jax.v4`` is the old path
of this module, kept as a shim.

Units are kept apart and converted only here (``V4Layout``'s properties):

- tokens: positions in a sequence (``kv_lens``, ``window_size``, the window cache's capacity);
- entries: compressed rows, one per ``compress_ratio`` tokens (``entries = tokens // ratio``:
  only complete groups are entries; the compressed cache's capacity, ``cu_lens``);
- pages: ``window_page_size`` tokens or ``compressed_page_size`` entries each.

The window cache's page size must divide the window (seed 004: a page straddling the window
boundary would be kept too long or released too early): refused with ``LayoutError`` naming
both numbers.

Cache formats, per cache: ``"plain"`` (f32/bf16 rows), ``"packed"`` (bf16 rows as u32 words) or
``"fp8"`` (FlashMLA MODEL1, ``reference.v4_cache.Fp8V4Cache``: 640 B per token stored). An fp8
cache whose page size is not a multiple of 32 or one of 4, 8, 16 is served correctly but warns
(``V4LayoutWarning``): XLA's default TPU layout of its rope array is then not row-major, so the
Pallas kernel pays a relayout copy of the whole rope array per call, and page sizes 1 and 2
store 1024 / 768 B per token (``reference.v4_cache``, "Page sizes for the TPU kernels").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from dsa_jax import backend as _backend
from dsa_jax import validate as _validate
from dsa_jax.batch import metadata_from
from dsa_jax.dispatch import empty_batch, static_float
from dsa_jax.layout import LayoutError, _int, aligned_page_size
from reference import v4_attention as v4
from reference.core import batch
from reference.formats import model1 as v4_cache
from reference.formats import packed_cache, stacked
from reference.quant.bf16 import check_precision

V4_CACHE_FORMATS = ("plain", "packed", "fp8")  # fp8: MODEL1, reference.v4_cache.Fp8V4Cache
RESERVED_FORMATS = ()  # kept for callers that tested membership


class V4LayoutWarning(UserWarning):
    """A ``V4Layout`` that is served correctly but costs more than it needs to (an fp8 page
    size whose rope array XLA lays out transposed: module docstring)."""


@dataclass(frozen=True)
class V4Layout:
    """The two paged caches of one DeepSeek-V4 attention layer, declared once (validated in the
    constructor; hashable, usable as a static argument).

    Fields:
      compress_ratio: 0 (window only), 4 (CSA) or 128 (HCA).
      window_page_size: tokens per window-cache page; must divide ``window_size``.
      window_pages_per_seq: the window cache's page-table stride per sequence.
      window_size: tokens a row sees back to itself inclusive (V4: 128).
      compressed_page_size / compressed_pages_per_seq: entries per compressed-cache page and
        its page-table stride; required (positive) iff ``compress_ratio > 0``, else ``None``.
      head_dim / rope_dim: 512 / 64 (the only V4 head; K = V = the whole row).
      window_cache_format / compressed_cache_format: ``"plain"`` (f32/bf16 rows),
        ``"packed"`` (bf16 rows as u32 words, ``reference.packed_cache``) or ``"fp8"``
        (FlashMLA MODEL1, ``reference.v4_cache.Fp8V4Cache``; a page size outside
        ``reference.v4_cache.tpu_page_size_ok`` warns, module docstring).
    """

    compress_ratio: int
    window_page_size: int
    window_pages_per_seq: int
    window_size: int = v4.DEFAULT_WINDOW
    compressed_page_size: int | None = None
    compressed_pages_per_seq: int | None = None
    head_dim: int = v4.HEAD_DIM
    rope_dim: int = v4.ROPE_DIM
    window_cache_format: str = "plain"
    compressed_cache_format: str = "plain"

    def __post_init__(self) -> None:
        ratio = _int("compress_ratio", self.compress_ratio)
        if ratio not in v4.COMPRESS_RATIOS:
            raise LayoutError(f"compress_ratio must be one of {v4.COMPRESS_RATIOS}, got "
                              f"compress_ratio={ratio}")
        for name in ("window_page_size", "window_pages_per_seq", "window_size"):
            if _int(name, getattr(self, name)) <= 0:
                raise LayoutError(f"{name} must be positive, got {name}={getattr(self, name)}")
        ps, window = self.window_page_size, self.window_size
        if window % ps:
            raise LayoutError(
                f"window_page_size={ps} does not divide window_size={window} ({window} % {ps} "
                f"= {window % ps}); a page would straddle the window boundary. "
                f"aligned_page_size({ps}, {window}) = {aligned_page_size(ps, window)} is the "
                f"largest page size that does")
        self._check_compressed(ratio)
        if (self.head_dim, self.rope_dim) != (v4.HEAD_DIM, v4.ROPE_DIM):
            raise LayoutError(f"DeepSeek-V4 has head_dim={v4.HEAD_DIM} (rope_dim="
                              f"{v4.ROPE_DIM} of them), got head_dim={self.head_dim}, "
                              f"rope_dim={self.rope_dim}")
        for which in ("window", "compressed"):
            fmt = getattr(self, f"{which}_cache_format")
            if fmt not in V4_CACHE_FORMATS:
                raise LayoutError(f"{which}_cache_format must be one of {V4_CACHE_FORMATS}, "
                                  f"got {fmt!r}")
            ps = getattr(self, f"{which}_page_size")
            if fmt == "fp8" and ps is not None and not v4_cache.tpu_page_size_ok(ps):
                warnings.warn(
                    f"{which}_cache_format='fp8' with {which}_page_size={ps}: not a multiple "
                    f"of 32 nor one of 4, 8, 16, so XLA lays out the rope array u32[P, "
                    f"{v4_cache.rope_rows(ps)}, 128] transposed and a Pallas kernel pays a "
                    f"relayout copy of it per call (and page sizes 1, 2 store 1024 / 768 B per "
                    f"token); correct, but slower (reference.v4_cache)", V4LayoutWarning,
                    stacklevel=3)

    def _check_compressed(self, ratio: int) -> None:
        fields = ("compressed_page_size", "compressed_pages_per_seq")
        if ratio == 0:
            given = [f for f in fields if getattr(self, f) is not None]
            if given:
                raise LayoutError(f"compress_ratio=0 (window only) has no compressed cache; "
                                  f"got {', '.join(f'{f}={getattr(self, f)}' for f in given)}")
            return
        for name in fields:
            value = getattr(self, name)
            if value is None or _int(name, value) <= 0:
                raise LayoutError(f"compress_ratio={ratio} needs a positive {name}, got "
                                  f"{name}={value}")

    # -- tokens <-> entries <-> pages (the one written-out conversion) -------------------

    @property
    def window_capacity_tokens(self) -> int:
        """Tokens per sequence the window cache's page table can address:
        ``window_pages_per_seq * window_page_size``."""
        return batch.capacity_tokens(self.window_page_size, self.window_pages_per_seq)

    @property
    def pages_per_window(self) -> int:
        """Window-cache pages a row's window spans when aligned (exact by construction)."""
        return self.window_size // self.window_page_size

    @property
    def compressed_capacity_entries(self) -> int:
        """Entries per sequence the compressed cache can hold (0 without one):
        ``compressed_pages_per_seq * compressed_page_size``."""
        if not self.compress_ratio:
            return 0
        return batch.capacity_tokens(self.compressed_page_size, self.compressed_pages_per_seq)

    @property
    def compressed_capacity_tokens(self) -> int:
        """Tokens those entries cover: ``entries * compress_ratio``."""
        return self.compressed_capacity_entries * self.compress_ratio

    def entries_for(self, tokens: int) -> int:
        """Complete compressed entries of ``tokens`` tokens: ``tokens // compress_ratio``."""
        return int(tokens) // self.compress_ratio if self.compress_ratio else 0

    # -- cache shapes ------------------------------------------------------------------------

    def cache_format(self, which: str) -> str:
        """The declared format of the ``"window"`` or ``"compressed"`` cache."""
        return self.window_cache_format if which == "window" else self.compressed_cache_format

    def cache_width(self, which: str) -> int:
        """Dim 2 of the ``"window"`` or ``"compressed"`` cache: ``head_dim`` plain, or
        ``packed_words(head_dim)`` u32 words packed (512 -> 256); fp8: ``head_dim``, the
        logical width of ``Fp8V4Cache.shape`` (its parts are 128 words wide)."""
        if self.cache_format(which) == "packed":
            return packed_cache.packed_words(self.head_dim)
        return self.head_dim

    def cache_shape(self, which: str, num_pages: int) -> tuple[int, int, int]:
        """``(num_pages, page_size, cache_width)`` of the ``"window"`` / ``"compressed"``
        cache (fp8: ``Fp8V4Cache.shape``; its parts are ``nope (num_pages, page_size, 128)``
        and ``rope (num_pages, ceil(page_size / 4), 128)``)."""
        ps = self.window_page_size if which == "window" else self.compressed_page_size
        return (int(num_pages), int(ps), self.cache_width(which))

    def to_cache(self, values, which: str):
        """Store ``values f32|bf16[..., P, page_size, 512]`` in this layout's format of the
        ``which`` cache: plain keeps the array, packed packs it, fp8 quantizes it
        (``reference.v4_cache.quantize_v4_cache``)."""
        fmt = self.cache_format(which)
        if fmt == "fp8":
            return v4_cache.quantize_v4_cache(values)
        return packed_cache.pack_cache(values) if fmt == "packed" else values

    def check_cache(self, name: str, cache, which: str) -> None:
        """Refuse a cache whose page size, width or format disagrees with the layout (leading
        layer dims allowed; an fp8 cache is checked part by part)."""
        fmt = self.cache_format(which)
        if (fmt == "fp8") != isinstance(cache, v4_cache.Fp8V4Cache):
            raise ValueError(f"{name} is a {type(cache).__name__} but the layout declares "
                             f"{which}_cache_format={fmt!r} (the fp8 format is a "
                             f"reference.v4_cache.Fp8V4Cache; layout.to_cache makes one)")
        if fmt == "fp8":
            v4_cache.check_v4_cache(name, cache)
        shape = tuple(np.shape(cache.nope) if fmt == "fp8" else np.shape(cache))
        want = self.cache_shape(which, shape[-3] if len(shape) >= 3 else 0)
        if fmt == "fp8":
            want = (*want[:2], v4_cache.LANES)
        if len(shape) < 3 or shape[-2:] != want[1:]:
            part = f"{name}.nope" if fmt == "fp8" else name
            raise ValueError(f"{part} must be [..., num_pages, {want[1]}, {want[2]}] for this "
                             f"V4Layout ({which}_cache_format={fmt!r}), got shape {shape}")
        if fmt != "fp8" and packed_cache.is_packed(cache) != (fmt == "packed"):
            raise ValueError(f"{name} has dtype {jnp.result_type(cache)} but the layout says "
                             f"{which}_cache_format={fmt!r}")


# ----------------------------------------------------------------------------- validation


def check_v4_batch(num_rows: int, kv_lens, cu_q_lens, distribution, window, compressed, *,
                   layout: V4Layout, window_pages: int, compressed_pages: int) -> None:
    """The batch rules of ``dsa_jax.validate`` for V4 (inside ``checkify``): the window cache's
    token batch (distribution, monotone, capacity; page ids only of the pages some row's window
    reaches, since older ones may be released) and the compressed cache's entry batch
    (``kv_len // ratio`` entries: monotone, capacity, page ids)."""
    wb = layout_batch(layout, "window", window_pages, kv_lens, window, cu_q_lens, distribution)
    _validate.check_monotone(wb.cu_q_lens, wb.cu_kv_lens, page_size=wb.page_size)
    _validate.check_distribution(num_rows, wb.kv_lens, wb.cu_q_lens, wb.distribution)
    _validate.check_capacity(wb)
    _check_window_pages(wb, layout.window_size)
    if compressed is not None:
        entries = v4.compressed_lens(jnp.asarray(kv_lens), layout.compress_ratio)
        cb = layout_batch(layout, "compressed", compressed_pages, entries, compressed,
                          cu_q_lens, distribution)
        _validate.check_monotone(cb.cu_q_lens, cb.cu_kv_lens, page_size=cb.page_size)
        _validate.check_capacity(cb)
        _validate.check_page_ids(cb)


def layout_batch(layout: V4Layout, which: str, num_pages: int, lens, kv: v4.PagedKV,
                 cu_q_lens, distribution) -> batch.RaggedBatch:
    """The ``RaggedBatch`` of one V4 cache (``lens`` in its unit)."""
    window = which == "window"
    return batch.RaggedBatch(
        jnp.asarray(lens), jnp.asarray(kv.page_indices), jnp.asarray(cu_q_lens),
        jnp.asarray(kv.cu_lens), jnp.asarray(distribution),
        page_size=layout.window_page_size if window else layout.compressed_page_size,
        pages_per_seq=layout.window_pages_per_seq if window else layout.compressed_pages_per_seq,
        num_pages=int(num_pages))


def _check_window_pages(b: batch.RaggedBatch, window_size: int) -> None:
    """Every window-cache page some row's window reaches (tokens ``kv_len - q_len - W + 1 ..
    kv_len - 1`` of an active sequence) has a slot in the table and an id in range."""
    seqs = jnp.arange(b.num_seqs)
    q_len = b.cu_q_lens[1:] - b.cu_q_lens[:-1]
    kv = b.kv_eff(seqs)
    first = jnp.maximum(kv - q_len - window_size + 1, 0) // b.page_size
    used = (kv + b.page_size - 1) // b.page_size
    j = jnp.arange(b.pages_per_seq, dtype=jnp.int32)
    live = b.active()[:, None] & (j[None, :] >= first[:, None]) & (j[None, :] < used[:, None])
    _, ok = b.page_ids(seqs[:, None], j[None, :], live)
    bad = (live & ~ok).reshape(-1)
    f = jnp.argmax(bad).astype(jnp.int32)
    checkify.check(~jnp.any(bad),
                   "window cache: sequence {seq} page {page} is inside a row's window but its "
                   "page-table slot or page id is out of range (released too early?)",
                   seq=f // b.pages_per_seq, page=f % b.pages_per_seq)


# ----------------------------------------------------------------------------- the op


def v4_attention(q, window: v4.PagedKV, kv_lens=None, cu_q_lens=None, distribution=None, *,
                 layout: V4Layout, compressed: v4.PagedKV | None = None,
                 compressed_indices=None, attn_sink=None, sm_scale: float | None = None,
                 return_lse: bool = False, backend: str | None = None, validate: bool = False,
                 kernel_options: dict | None = None, layer=None, precision: str = "f32",
                 batch=None, implementation=None, config=None):
    """DeepSeek-V4 attention: ``q.dtype[T, H, 512]`` (and the sink-free LSE ``f32[T, H]``).

    Args:
      q: ``f32|bf16[T, H, 512]`` queries (after RoPE).
      window: ``PagedKV(cache, page_indices i32[N], cu_lens i32[S+1])``, the window cache in
        tokens (``layout.window_page_size`` tokens per page); with ``batch=`` a bare cache,
        the batch's page table then being the window cache's (``batch.page_size`` must equal
        ``layout.window_page_size``).
      kv_lens: ``i32[S]`` tokens per sequence, this step's rows included.
      cu_q_lens: ``i32[S+1]`` query-row offsets. distribution: ``i32[3]``
        ``(decode_end, prefill_end, num_seqs)``. All three may come from ``batch=`` instead.
      layout: the ``V4Layout`` (window size, ratio, page sizes; the caches are checked
        against it).
      compressed: the compressed cache as ``PagedKV`` in entries (ratio > 0 only).
      compressed_indices: ``i32[T, k]`` CSA entry numbers (ratio 4; ``-1`` = none).
      attn_sink: optional ``f32[H]`` sink logits (denominator only).
      sm_scale: softmax scale (default ``512 ** -0.5``; a Python float or a concrete scalar).
      return_lse: also return the sink-free LSE ``f32[T, H]``.
      backend / implementation: ``implementation=`` ``"xla"`` (the jnp reference),
        ``"pallas"`` (the fused kernel), ``"pallas_two_pass"`` (the token-sparse MLA kernel
        once per source, merged in XLA; packed / plain caches, f32 only), an ordered list, or
        ``None`` (platform default); ``backend=`` the older spelling (``dsa_jax.backend``).
      validate: the batch rules first (checkify, eager).
      kernel_options / config: Pallas knobs; ``config`` a ``MlaBlocks``
        (``tokens_per_block``).
      layer: both caches stacked ``[L, ...]``, read in place at ``layer``.
      precision: ``"f32"`` (default) or ``"bf16"``, the official ``sparse_attn`` rounding (bf16
        q and rows, f32 logits, P rounded to bf16 for ``P @ V``, bf16 output in ``q.dtype``;
        ``reference.v4_attention``'s module docstring). Anything else: ValueError.
      batch: a ``dsa_jax.Batch`` giving ``kv_lens``, ``cu_q_lens``, ``distribution`` (and the
        window's page table when ``window`` is a bare cache).

    An empty batch (``T = 0`` rows or ``S = 0`` sequences) is served: ``dsa_jax.dispatch``'s
    rule (empty rows; rows outside every sequence).
    """
    if not isinstance(layout, V4Layout):
        raise TypeError(f"layout must be a V4Layout, got {type(layout).__name__}")
    window, (kv_lens, cu_q_lens, distribution) = _v4_batch(
        batch, window, (kv_lens, cu_q_lens, distribution), layout)
    for name, kv, which in (("window.cache", window, "window"),
                            ("compressed.cache", compressed, "compressed")):
        if kv is not None:
            layout.check_cache(name, kv.cache, which)
    check_precision(precision)
    scale = v4.HEAD_DIM ** -0.5 if sm_scale is None else static_float(
        "v4_attention", "sm_scale", sm_scale)
    statics = dict(sm_scale=float(scale), window_size=layout.window_size,
                   compress_ratio=layout.compress_ratio,
                   window_pages_per_seq=layout.window_pages_per_seq,
                   compressed_pages_per_seq=layout.compressed_pages_per_seq or 0,
                   return_lse=return_lse, precision=precision)
    args = _v4_nonempty(q, window, kv_lens, cu_q_lens, distribution, compressed,
                        compressed_indices)
    kernel_options = _backend.with_config("v4_attention", kernel_options, config)

    def call(fn, extra):
        return _v4_call(fn, {**statics, **extra}, *args, attn_sink, layout, validate, layer)

    res = _backend.run("v4_attention", implementation, backend, kernel_options, call)
    if np.shape(q)[0] == 0:
        res = jax.tree.map(lambda x: x[:0], res)
    return res


def _v4_batch(batch, window, positional, layout: V4Layout):
    """``(window, (kv_lens, cu_q_lens, distribution))`` from ``batch=`` or the arguments."""
    if metadata_from("v4_attention", batch, positional,
                     ("kv_lens", "cu_q_lens", "distribution")) is not None:
        return window, positional
    if not isinstance(window, v4.PagedKV):
        for field, want in (("page_size", layout.window_page_size),
                            ("pages_per_seq", layout.window_pages_per_seq)):
            if getattr(batch, field) != want:
                raise ValueError(f"v4_attention: batch.{field} = {getattr(batch, field)} but "
                                 f"layout.window_{field} = {want} (the batch's page table is "
                                 f"the window cache's when window is a bare cache)")
        window = v4.PagedKV(window, batch.page_indices, batch.cu_kv_lens)
    return window, (batch.kv_lens, batch.cu_q_lens, batch.distribution)


def _v4_nonempty(q, window, kv_lens, cu_q_lens, distribution, compressed, compressed_indices):
    """The arguments with an empty batch padded (``dsa_jax.dispatch.empty_batch``'s rule):
    ``S = 0`` gets an inactive sequence (each cache's table too), ``T = 0`` one row outside
    every sequence (dropped by the caller)."""
    def padded(kv):
        if kv is None:
            return None
        (_, pages, _, cu, _), _ = empty_batch(
            (kv_lens, kv.page_indices, cu_q_lens, kv.cu_lens, distribution), 0, {})
        return kv._replace(page_indices=pages, cu_lens=cu)

    window, compressed = padded(window), padded(compressed)  # before the batch is padded
    rows = {0: (-3, 0)} if compressed_indices is None else {0: (-3, 0), 1: (0, -1)}
    xs = (q,) if compressed_indices is None else (q, compressed_indices)
    (*xs, kv_lens, _, cu_q_lens, _, distribution), _ = empty_batch(
        (*xs, kv_lens, window.page_indices, cu_q_lens, window.cu_lens, distribution),
        len(xs), rows)
    q, compressed_indices = (xs[0], xs[1] if len(xs) > 1 else None)
    return q, window, kv_lens, cu_q_lens, distribution, compressed, compressed_indices


def _v4_call(fn, statics, q, window, kv_lens, cu_q_lens, distribution, compressed,
             compressed_indices, attn_sink, layout, validate, layer):
    """One implementation's call, under the V4 batch checks when ``validate``."""
    call = dict(compressed=compressed, compressed_indices=compressed_indices,
                attn_sink=attn_sink)
    if not validate:
        return fn(q, window, kv_lens, cu_q_lens, distribution, **statics, **call, layer=layer)
    num_pages = [int(np.shape(kv.cache)[-3]) if kv is not None else 0
                 for kv in (window, compressed)]
    num_layers = None
    if layer is not None:  # static refusals first (an int is a tracer inside jit)
        reads = [stacked.resolve(name, kv.cache, layer) for name, kv in
                 (("window.cache", window), ("compressed.cache", compressed)) if kv is not None]
        num_layers = reads[0].num_layers

    def checked(q, window, kv_lens, cu_q_lens, distribution, call, layer):
        check_v4_batch(q.shape[0], kv_lens, cu_q_lens, distribution, window,
                       call["compressed"], layout=layout, window_pages=num_pages[0],
                       compressed_pages=num_pages[1])
        if num_layers is not None:
            _validate.check_layer(layer, num_layers)
        return fn(q, window, kv_lens, cu_q_lens, distribution, **statics, **call, layer=layer)

    err, res = jax.jit(checkify.checkify(checked))(q, window, kv_lens, cu_q_lens, distribution,
                                                   call, layer)
    err.throw()
    return res
