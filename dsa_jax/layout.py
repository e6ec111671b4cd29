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

import jax.numpy as jnp
import numpy as np

from reference import batch, packed_cache

LANES = 128


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
        rows; the references and kernels read it directly.
    """

    page_size: int
    pages_per_seq: int
    sliding_window: int | None = None
    index_dim: int = 128
    latent_dim: int = 512
    rope_dim: int = 64
    packed_latent: bool = False

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
        when ``packed_latent`` (640 -> 384)."""
        if self.packed_latent:
            return packed_cache.packed_words(self.padded_dim)
        return self.padded_dim

    def latent_cache_shape(self, num_pages: int) -> tuple[int, int, int]:
        """``(num_pages, page_size, latent_cache_width)``."""
        return (int(num_pages), self.page_size, self.latent_cache_width)

    def index_cache_shape(self, num_pages: int) -> tuple[int, int, int]:
        """``(num_pages, page_size, index_dim)``."""
        return (int(num_pages), self.page_size, self.index_dim)

    def check_cache(self, name: str, cache, kind: str) -> None:
        """Refuse a cache whose page size or feature dim disagrees with the layout.

        kind: ``"latent"`` (dim 2 must be ``padded_dim``) or ``"index"`` (``index_dim``).
        Leading dims beyond ``[num_pages, page_size, D]`` (a layer axis) are allowed.
        """
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
