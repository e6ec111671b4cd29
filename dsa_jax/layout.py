"""The paged KV layout, declared once: a value that can only exist if it is valid (seed 004).

Units are kept apart and converted only here:

- tokens: positions in a sequence (``kv_len``, ``capacity_tokens``, ``sliding_window``);
- pages: ``page_size`` tokens each (``pages_per_seq``, ``pages_for(tokens)``);
- features: the head dims (``index_dim``; ``latent_dim + rope_dim = qk_dim``, padded with zeros
  to ``padded_dim``, a multiple of 128, for TPU lanes: 576 -> 640; zeros in both q and the cache
  change no logit).

Every capacity, stride and padded dim the ops need is a property of the layout; nothing
downstream restates them. A page size that does not divide the sliding window is refused, naming
both numbers: a page straddling the window boundary would be either kept too long (the window is
silently wider than the model's) or dropped too early (positions the model must see are missing).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.formats import fp8_cache, packed_cache
from reference.quant import fp8

LANES = 128
INDEX_FORMATS = ("plain", "fp8")
LATENT_FORMATS = ("plain", "packed", "fp8")


class LayoutError(ValueError):
    """A refused paged layout; the message names the offending numbers."""


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LayoutError(f"{name} must be a Python int, got {type(value).__name__} {value!r}")
    return int(value)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class PagedLayout:
    """How sequences are cut into cache pages, and the head dims the caches hold.

    Construct it with keywords; the constructor validates and a ``PagedLayout`` that exists is
    the proof that the rules hold (no second check downstream). Hashable: usable as a static
    argument of ``jax.jit``.

    Fields:
      page_size: tokens per page (>= 1).
      pages_per_seq: page-table stride per sequence (>= 1).
      sliding_window: tokens of the sliding window, or ``None`` for a model without SWA. Must be
        a multiple of ``page_size`` (``0`` is refused: "no window" is ``None``).
      index_dim: the indexer's key/query head dim D (DeepSeek-V3.2: 128).
      latent_dim: the MLA latent (value) dim (512).
      rope_dim: the decoupled rope dim appended to the latent (64).
      packed_latent: store the latent cache as packed bf16 words (``reference.packed_cache``:
        ``u32[num_pages, page_size, packed_words(padded_dim)]``, 640 -> 384 words). This is
        the format the token-sparse Pallas kernel gathers single rows from; with a plain bf16
        cache that kernel must pack the whole cache on every call. ``update_kv_cache`` packs new
        rows; the references and kernels read it directly. The same as
        ``latent_cache_format="packed"`` (either spelling sets both fields).
      index_cache_format: ``"plain"`` (the keys as f32/bf16 arrays ``[P, page_size,
        index_dim]``) or ``"fp8"`` (``reference.fp8_cache.Fp8IndexCache``: e4m3 keys, one f32
        scale per token, DeepSeek-V3.2's indexer rule; needs ``index_dim == 128`` and
        ``page_size`` a multiple of 32).
      latent_cache_format: ``"plain"`` (f32/bf16 ``[P, page_size, padded_dim]``),
        ``"packed"`` (packed bf16 words) or ``"fp8"`` (``reference.fp8_cache.Fp8LatentCache``:
        FlashMLA's V32 values, 512 e4m3 + 4 scales + 64 bf16 rope, in 256 u32 words per token;
        needs ``latent_dim == 512`` and ``rope_dim == 64``).
      index_scale_fmt: the fp8 index cache's scale rounding (``"ue8m0"``, V3.2's setting, or
        ``None``), applied when rows are written.
    """

    page_size: int
    pages_per_seq: int
    sliding_window: int | None = None
    index_dim: int = 128
    latent_dim: int = 512
    rope_dim: int = 64
    packed_latent: bool = False
    index_cache_format: str = "plain"
    latent_cache_format: str = "plain"
    index_scale_fmt: str | None = "ue8m0"

    def __post_init__(self) -> None:
        page_size = _int("page_size", self.page_size)
        if page_size <= 0:
            raise LayoutError(f"page_size must be positive (tokens per page), got "
                              f"page_size={page_size}")
        pages = _int("pages_per_seq", self.pages_per_seq)
        if pages <= 0:
            raise LayoutError(f"pages_per_seq must be positive, got pages_per_seq={pages}")
        if self.sliding_window is not None:
            window = _int("sliding_window", self.sliding_window)
            if window == 0:
                raise LayoutError("sliding_window=0 is not a window: a model without SWA has no "
                                  "window: pass None")
            if window < 0:
                raise LayoutError(f"sliding_window must be positive, got "
                                  f"sliding_window={window}")
            remainder = window % page_size
            if remainder:
                raise LayoutError(
                    f"page_size={page_size} does not divide sliding_window={window} "
                    f"({window} % {page_size} = {remainder}); a page would straddle the window "
                    f"boundary. aligned_page_size({page_size}, {window}) = "
                    f"{aligned_page_size(page_size, window)} is the largest page size that "
                    f"does")
        for name in ("index_dim", "latent_dim"):
            if _int(name, getattr(self, name)) <= 0:
                raise LayoutError(f"{name} must be positive, got {name}={getattr(self, name)}")
        if _int("rope_dim", self.rope_dim) < 0:
            raise LayoutError(f"rope_dim must be >= 0, got rope_dim={self.rope_dim}")
        if not isinstance(self.packed_latent, bool):
            raise LayoutError(f"packed_latent must be a bool, got {self.packed_latent!r}")
        self._check_formats()

    def _check_formats(self) -> None:
        """Validate the cache formats; ``packed_latent`` and ``latent_cache_format="packed"``
        are one fact, so each spelling sets the other."""
        if self.index_cache_format not in INDEX_FORMATS:
            raise LayoutError(f"index_cache_format must be one of {INDEX_FORMATS}, got "
                              f"{self.index_cache_format!r}")
        if self.latent_cache_format not in LATENT_FORMATS:
            raise LayoutError(f"latent_cache_format must be one of {LATENT_FORMATS}, got "
                              f"{self.latent_cache_format!r}")
        if self.packed_latent and self.latent_cache_format not in ("plain", "packed"):
            raise LayoutError(f"packed_latent=True contradicts latent_cache_format="
                              f"{self.latent_cache_format!r}")
        if self.packed_latent or self.latent_cache_format == "packed":
            object.__setattr__(self, "packed_latent", True)
            object.__setattr__(self, "latent_cache_format", "packed")
        if self.index_scale_fmt not in fp8.SCALE_FMTS:
            raise LayoutError(f"index_scale_fmt must be one of {fp8.SCALE_FMTS}, got "
                              f"{self.index_scale_fmt!r}")
        if self.index_cache_format == "fp8":
            if self.index_dim != fp8.INDEX_HEAD_DIM:
                raise LayoutError(f"the fp8 index cache holds index_dim={fp8.INDEX_HEAD_DIM} "
                                  f"(one scale per 128 features), got index_dim={self.index_dim}")
            if self.page_size % fp8_cache.INDEX_PAGE_MULTIPLE:
                raise LayoutError(
                    f"the fp8 index cache needs page_size to be a multiple of "
                    f"{fp8_cache.INDEX_PAGE_MULTIPLE} (an e4m3 tile is "
                    f"{fp8_cache.INDEX_PAGE_MULTIPLE} rows), got page_size={self.page_size} "
                    f"({self.page_size} % {fp8_cache.INDEX_PAGE_MULTIPLE} = "
                    f"{self.page_size % fp8_cache.INDEX_PAGE_MULTIPLE})")
        if self.latent_cache_format == "fp8" and (self.latent_dim, self.rope_dim) != (
                fp8.LATENT_NOPE, fp8.LATENT_ROPE):
            raise LayoutError(f"the fp8 latent cache holds latent_dim={fp8.LATENT_NOPE} and "
                              f"rope_dim={fp8.LATENT_ROPE} (FlashMLA's V32 layout), got "
                              f"latent_dim={self.latent_dim}, rope_dim={self.rope_dim}")

    # -- tokens <-> pages (the one written-out conversion) -----------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Per-sequence capacity in tokens: ``pages_per_seq * page_size``."""
        return batch.capacity_tokens(self.page_size, self.pages_per_seq)

    def batch(self, num_pages: int, kv_lens, page_indices, cu_q_lens, cu_kv_lens,
              distribution) -> batch.RaggedBatch:
        """The ``reference.batch.RaggedBatch`` of this layout's caches (``num_pages`` pages)
        and a step's metadata arrays."""
        return batch.RaggedBatch(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
                                 page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                                 num_pages=int(num_pages))

    @staticmethod
    def context_shard(page: int, num_shards: int) -> int:
        """The context shard holding a sequence's page ``page`` (its sequence-local page
        number) when its KV is spread over ``num_shards`` shards: ``page % num_shards``
        (``dsa_jax.context``; a growing sequence adds its pages to the shards in turn)."""
        return page % num_shards

    def pages_for(self, tokens: int) -> int:
        """Pages holding ``tokens`` tokens: ``ceil(tokens / page_size)``."""
        return -(-int(tokens) // self.page_size)

    @property
    def pages_per_window(self) -> int | None:
        """Whole pages a sliding layer keeps resident (exact by construction); None w/o SWA."""
        if self.sliding_window is None:
            return None
        return self.sliding_window // self.page_size

    # -- feature dims ------------------------------------------------------------------------

    @property
    def qk_dim(self) -> int:
        """Logical MLA query/key dim: ``latent_dim + rope_dim`` (576)."""
        return self.latent_dim + self.rope_dim

    @property
    def padded_dim(self) -> int:
        """``qk_dim`` rounded up to a multiple of 128 (576 -> 640): the latent cache's dim 2."""
        return _round_up(self.qk_dim, LANES)

    @property
    def v_dim(self) -> int:
        """Value dim of the MLA output: the latent dim (the rope part carries no value)."""
        return self.latent_dim

    # -- cache shapes ------------------------------------------------------------------------

    @property
    def latent_cache_width(self) -> int:
        """The latent cache's dim 2: ``padded_dim``, or ``packed_words(padded_dim)`` u32 words
        when ``packed_latent`` (640 -> 384), or 256 words for the fp8 format."""
        if self.latent_cache_format == "fp8":
            return fp8_cache.LATENT_WORDS
        if self.packed_latent:
            return packed_cache.packed_words(self.padded_dim)
        return self.padded_dim

    def latent_cache_shape(self, num_pages: int) -> tuple[int, int, int]:
        """``(num_pages, page_size, latent_cache_width)``."""
        return (int(num_pages), self.page_size, self.latent_cache_width)

    def index_cache_shape(self, num_pages: int) -> tuple[int, int, int]:
        """``(num_pages, page_size, index_dim)``."""
        return (int(num_pages), self.page_size, self.index_dim)

    def cache_format(self, kind: str) -> str:
        """The declared format of the ``"latent"`` or ``"index"`` cache."""
        return self.latent_cache_format if kind == "latent" else self.index_cache_format

    def to_cache(self, values, kind: str):
        """Store ``values`` (float ``[..., P, page_size, D]``; latent D = ``qk_dim`` or
        ``padded_dim``) in this layout's format of the ``kind`` cache: plain keeps the array
        (padded to ``padded_dim``), packed packs it, fp8 quantizes it (rows of this module's
        rules; a latent's zero padding past ``qk_dim`` is dropped: nonzero padding is a
        ``ValueError``, checked where the values are concrete)."""
        fmt = self.cache_format(kind)
        if kind == "index":
            if fmt == "fp8":
                return fp8_cache.quantize_index_cache(values, scale_fmt=self.index_scale_fmt)
            return values
        d = np.shape(values)[-1]
        if d not in (self.qk_dim, self.padded_dim):
            raise ValueError(f"to_cache: latent values.shape[-1] must be qk_dim = {self.qk_dim} "
                             f"or padded_dim = {self.padded_dim}, got {d}")
        if fmt == "fp8":
            pad = values[..., self.qk_dim:]
            if d > self.qk_dim and not isinstance(pad, jax.core.Tracer) and np.any(
                    np.asarray(pad) != 0):
                raise ValueError(f"to_cache: the latent values hold nonzero numbers past "
                                 f"qk_dim = {self.qk_dim} (dims {self.qk_dim}..{d - 1}); the "
                                 f"fp8 cache stores {self.qk_dim} dims, the padding must be 0")
            return fp8_cache.quantize_latent_cache(values[..., :self.qk_dim])
        values = jnp.pad(values, [(0, 0)] * (np.ndim(values) - 1) + [(0, self.padded_dim - d)])
        return packed_cache.pack_cache(values) if fmt == "packed" else values

    def check_cache(self, name: str, cache, kind: str) -> None:
        """Refuse a cache whose page size or feature dim disagrees with the layout.

        kind: ``"latent"`` (dim 2 must be ``padded_dim``) or ``"index"`` (``index_dim``).
        Leading dims beyond ``[num_pages, page_size, D]`` (a layer axis) are allowed. An fp8
        format needs its ``reference.fp8_cache`` object (checked part by part).
        """
        fmt = self.cache_format(kind)
        fp8_cls = fp8_cache.Fp8LatentCache if kind == "latent" else fp8_cache.Fp8IndexCache
        if (fmt == "fp8") != isinstance(cache, fp8_cls):
            raise ValueError(f"{name} is a {type(cache).__name__} but the layout declares "
                             f"{kind}_cache_format={fmt!r} (the fp8 format is a "
                             f"reference.fp8_cache.{fp8_cls.__name__}; layout.to_cache makes one)")
        if fmt == "fp8":
            self._check_fp8_cache(name, cache, kind)
            return
        shape = tuple(np.shape(cache))
        if len(shape) < 3:
            raise ValueError(f"{name} must be [..., num_pages, page_size, D], got shape {shape}")
        want = self.latent_cache_width if kind == "latent" else self.index_dim
        dtype = getattr(cache, "dtype", None)
        if kind == "latent" and dtype is not None and (dtype == jnp.uint32) != self.packed_latent:
            raise ValueError(f"{name} has dtype {dtype} but the layout says "
                             f"packed_latent={self.packed_latent} (a packed latent cache is "
                             f"uint32 words, a plain one is floating)")
        if shape[-2] != self.page_size:
            raise ValueError(f"{name}.shape[-2] (page_size) = {shape[-2]} != layout.page_size "
                             f"= {self.page_size} (shape {shape})")
        if shape[-1] != want:
            what = "latent_cache_width" if kind == "latent" else "index_dim"
            raise ValueError(f"{name}.shape[-1] = {shape[-1]} != layout.{what} = {want} "
                             f"(shape {shape})")


    def _check_fp8_cache(self, name: str, cache, kind: str) -> None:
        """An fp8 cache of this layout: each part's dims and dtype, page size ``page_size``."""
        if kind == "index":
            parts = (("keys", cache.keys, fp8.FP8_DTYPE, (self.page_size, fp8.INDEX_HEAD_DIM)),
                     ("scales", cache.scales, np.dtype(np.float32),
                      (fp8_cache.scale_lanes(self.page_size),)))
        else:
            parts = (("words", cache.words, np.dtype(np.uint32),
                      (self.page_size, fp8_cache.LATENT_WORDS)),)
        for part, x, dtype, tail in parts:
            shape = tuple(np.shape(x))
            if np.dtype(jnp.result_type(x)) != dtype:
                raise ValueError(f"{name}.{part} must have dtype {dtype}, got "
                                 f"{jnp.result_type(x)}")
            if shape[-len(tail):] != tail:
                raise ValueError(f"{name}.{part}.shape must end in {tail} for page_size="
                                 f"{self.page_size}, got {shape}")
        if kind == "index" and np.shape(cache.keys)[:-2] != np.shape(cache.scales)[:-1]:
            raise ValueError(f"{name}.keys {np.shape(cache.keys)} and .scales "
                             f"{np.shape(cache.scales)} disagree on their leading dims")


def aligned_page_size(desired: int, window: int | None) -> int:
    """The largest page size ``<= desired`` that divides ``window``.

    Never rounds up (a bigger page costs more memory per eviction than asked for) and never
    returns 0: ``desired <= 0`` is read as 1. ``window=None`` (no SWA) returns
    ``max(desired, 1)``. The result is always accepted by ``PagedLayout``.
    """
    desired = max(_int("desired", desired), 1)
    if window is None:
        return desired
    window = _int("window", window)
    if window <= 0:
        raise LayoutError(f"window must be positive or None, got window={window}")
    for candidate in range(min(desired, window), 0, -1):
        if window % candidate == 0:
            return candidate
    return 1  # unreachable: 1 divides every positive window
