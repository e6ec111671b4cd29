"""The declarations of a DeepSeek-V4 model's attention step (``dsa_jax.v4_step``): its caches'
layout (``V4ModelLayout``), the step's arguments and result as NamedTuples (``V4StepInputs``,
``V4StepParams``, ``V4Caches``, ``V4States``, ``V4BatchMeta``, ``V4StepResult``) and the fresh
compressor state pools (``init_v4_states``).

Layer types (``compress_ratios[l]``): ``0`` window only (SWA), ``4`` CSA (window union the
indexer's top-k compressed entries), ``128`` HCA (window union every visible entry). The
layers of one type share one set of stacked caches (their ``slot`` is their rank among the
layers of that type), because ``v4_attention`` reads a window and a compressed cache at one
``layer=`` index: so the window caches are stacked per type too. The compressor state pools
are stacked ``[Lx * num_slots, R, W]``: layer ``slot`` uses slots ``slot * num_slots + i``.

Inputs are this step's **projected** activations (the caller applies ``wq_a``/``wq_b``/``wkv``,
the norms and the RoPE at each row's position; the layer's RoPE tables are the caller's):

- ``q f[L, T, H, 512]`` normed and roped; ``window_kv f[L, T, 512]`` normed and roped (with
  QAT: already fp8-simulated, as the statement stores it);
- CSA (``Lc`` layers, in layer order): ``csa_kv``/``csa_score f32[Lc, T, 1024]`` (``wkv``/
  ``wgate`` of the compressor, coff 2), ``index_q f[Lc, T, Hi, 128]`` roped (with QAT:
  rotated + fp4-simulated), ``index_weights f32[Lc, T, Hi]`` (``weights_proj(x) * Di**-0.5 *
  Hi**-0.5``: the scale is the caller's), ``index_kv``/``index_score f32[Lc, T, 256]``;
- HCA (``Lh`` layers): ``hca_kv``/``hca_score f32[Lh, T, 512]``;
- ``attn_sink f32[L, H]`` or ``None``.

Batch (``V4BatchMeta``): ``kv_lens i32[S]`` tokens incl. this step's, ``cu_q_lens i32[S+1]``,
``distribution i32[3]``, ``state_slots i32[S]`` (each sequence's compressor state slot, in
``[0, num_slots)``), and one page table per cache family in its own unit: the window table
(``cu`` in tokens, shared by every layer's window cache), the CSA table (``cu`` in ratio-4
entries, shared by the CSA compressed and index stacks), the HCA table (``cu`` in ratio-128
entries). A family the model does not have takes ``None``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax

from dsa_jax.v4_attention import V4Layout
from reference import v4_compressor as vc
from reference.v4_attention import COMPRESS_RATIOS

TYPES = COMPRESS_RATIOS  # 0 window only, 4 CSA, 128 HCA
TYPE_NAMES = {0: "swa", 4: "csa", 128: "hca"}
INDEX_DIM = 128  # the V4 indexer head dim


@dataclass(frozen=True)
class V4ModelLayout:
    """The caches of a V4 model, declared once (hashable; a jit static). One ``V4Layout`` per
    layer type present (``layout_for``); every number below is read from here.

    Fields: ``compress_ratios`` per layer (0 / 4 / 128); the window cache's ``window_page_size``
    (tokens; divides ``window_size``) and ``window_pages_per_seq``; the CSA cache's
    ``csa_page_size`` / ``csa_pages_per_seq`` (ratio-4 entries) and the HCA cache's
    ``hca_page_size`` / ``hca_pages_per_seq`` (ratio-128 entries), ``None`` when the model has
    no such layer; ``index_topk`` (CSA top-k, V4-Flash 512); the cache formats of
    ``V4Layout``."""

    compress_ratios: tuple[int, ...]
    window_page_size: int
    window_pages_per_seq: int
    window_size: int = 128
    csa_page_size: int | None = None
    csa_pages_per_seq: int | None = None
    hca_page_size: int | None = None
    hca_pages_per_seq: int | None = None
    index_topk: int = 512
    window_cache_format: str = "plain"
    compressed_cache_format: str = "plain"

    def __post_init__(self) -> None:
        ratios = tuple(self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        if not ratios:
            raise ValueError("compress_ratios must name at least one layer, got ()")
        bad = [(i, r) for i, r in enumerate(ratios) if isinstance(r, bool) or r not in TYPES]
        if bad:
            raise ValueError(f"compress_ratios[{bad[0][0]}]={bad[0][1]!r} must be one of "
                             f"{TYPES} (0 window only, 4 CSA, 128 HCA)")
        if int(self.index_topk) < 1:
            raise ValueError(f"index_topk must be positive, got index_topk={self.index_topk}")
        for r in TYPES:
            name = TYPE_NAMES[r]
            given = (getattr(self, f"{name}_page_size", None),
                     getattr(self, f"{name}_pages_per_seq", None))
            if r and self.count(r) == 0 and given != (None, None):
                raise ValueError(f"no layer has ratio {r} but {name}_page_size / "
                                 f"{name}_pages_per_seq = {given} were given")
            if self.count(r):
                self.layout_for(r)  # V4Layout validates (LayoutError names the numbers)

    def count(self, ratio: int) -> int:
        """Layers of type ``ratio``."""
        return sum(1 for r in self.compress_ratios if r == ratio)

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    def slot(self, layer: int) -> int:
        """``layer``'s index in its type's stacks (its rank among layers of that type)."""
        r = self.compress_ratios[layer]
        return sum(1 for x in self.compress_ratios[:layer] if x == r)

    def layers_of(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    @functools.cache  # noqa: B019  (frozen, hashable instance; a handful of layouts per run)
    def layout_for(self, ratio: int) -> V4Layout:
        """The ``V4Layout`` of layer type ``ratio`` (built once)."""
        name = TYPE_NAMES[ratio]
        return V4Layout(
            compress_ratio=ratio, window_page_size=self.window_page_size,
            window_pages_per_seq=self.window_pages_per_seq, window_size=self.window_size,
            compressed_page_size=getattr(self, f"{name}_page_size") if ratio else None,
            compressed_pages_per_seq=getattr(self, f"{name}_pages_per_seq") if ratio else None,
            window_cache_format=self.window_cache_format,
            compressed_cache_format=self.compressed_cache_format)


class V4StepInputs(NamedTuple):
    """This step's projected activations (module docstring); a family absent from the model
    takes ``None``."""

    q: jax.Array
    window_kv: jax.Array
    csa_kv: jax.Array | None = None
    csa_score: jax.Array | None = None
    index_q: jax.Array | None = None
    index_weights: jax.Array | None = None
    index_kv: jax.Array | None = None
    index_score: jax.Array | None = None
    hca_kv: jax.Array | None = None
    hca_score: jax.Array | None = None
    attn_sink: jax.Array | None = None


class V4StepParams(NamedTuple):
    """The compressor parameters the step applies (per layer of the type, in layer order):
    ``csa_ape f32[Lc, 4, 1024]``, ``csa_norm f32[Lc, 512]``, ``index_ape f32[Lc, 4, 256]``,
    ``index_norm f32[Lc, 128]``, ``hca_ape f32[Lh, 128, 512]``, ``hca_norm f32[Lh, 512]``, and
    the compressed entries' RoPE tables ``cos, sin f32[positions, 32]``
    (``reference.v4_compressor.rope_tables``: theta 160000, YaRN); ``rope_rows f32[positions,
    128]``: optional, the same tables in the Pallas compressor's row layout
    (``pallas_kernels.v4_compressor.rope_rows(cos, sin)``, built once with the tables: the
    kernel then reads one 512-B row per completing entry instead of two 16-KB table tiles; the
    reference ignores it)."""

    cos: jax.Array
    sin: jax.Array
    csa_ape: jax.Array | None = None
    csa_norm: jax.Array | None = None
    index_ape: jax.Array | None = None
    index_norm: jax.Array | None = None
    hca_ape: jax.Array | None = None
    hca_norm: jax.Array | None = None
    rope_rows: jax.Array | None = None


class V4Caches(NamedTuple):
    """Stacked caches per layer type (donated): ``*_window [Lx, Pw, window_page_size, 512]``
    (all types share the window page table), ``csa_compressed [Lc, Pc, csa_page_size, 512]``,
    ``csa_index f32|bf16[Lc, Pc, csa_page_size, 128]`` (or an ``Fp8IndexCache``),
    ``hca_compressed [Lh, Ph, hca_page_size, 512]``; formats per the layout (fp8: an
    ``Fp8V4Cache`` with a leading ``Lx``)."""

    swa_window: object = None
    csa_window: object = None
    csa_compressed: object = None
    csa_index: object = None
    hca_window: object = None
    hca_compressed: object = None


class V4States(NamedTuple):
    """Compressor state pools (``reference.v4_compressor.CompressorState``), stacked per layer
    of the type along the slot axis: ``csa f32[Lc * num_slots, 8, 1024]`` x 2, ``index
    f32[Lc * num_slots, 8, 256]`` x 2, ``hca f32[Lh * num_slots, 128, 512]`` x 2 (layer ``s``
    owns slots ``[s * num_slots, (s + 1) * num_slots)``; ``init_v4_states`` makes them)."""

    csa: vc.CompressorState | None = None
    index: vc.CompressorState | None = None
    hca: vc.CompressorState | None = None


class V4BatchMeta(NamedTuple):
    """Batch metadata (module docstring): tokens, rows, and one ``(page_indices i32[N],
    cu_lens i32[S+1])`` per cache family in its unit (``None`` when absent)."""

    kv_lens: jax.Array
    cu_q_lens: jax.Array
    distribution: jax.Array
    state_slots: jax.Array
    window_page_indices: jax.Array
    window_cu_lens: jax.Array
    csa_page_indices: jax.Array | None = None
    csa_cu_lens: jax.Array | None = None
    hca_page_indices: jax.Array | None = None
    hca_cu_lens: jax.Array | None = None

    @classmethod
    def from_batch(cls, batch, state_slots, *, csa=None, hca=None) -> V4BatchMeta:
        """The step's metadata from ``dsa_jax.Batch``es: ``batch`` the window cache's (tokens:
        ``kv_lens``, ``cu_q_lens``, ``distribution`` and the window page table), ``csa`` /
        ``hca`` each compressed family's page table as a ``Batch`` in entries (only its table
        is read: ``Batch.from_fixed_stride(kv_lens, table, cu_q_lens, distribution,
        page_size=entries_per_page)``) or ``None`` for a family the model lacks;
        ``state_slots i32[S]`` each sequence's compressor state slot."""
        tables = []
        for name, b in (("batch", batch), ("csa", csa), ("hca", hca)):
            if b is not None and not hasattr(b, "cu_kv_lens"):
                raise TypeError(f"V4BatchMeta.from_batch: {name} must be a dsa_jax.Batch, got "
                                f"{type(b).__name__}")
            tables += [None, None] if b is None else [b.page_indices, b.cu_kv_lens]
        return cls(batch.kv_lens, batch.cu_q_lens, batch.distribution, state_slots, *tables)


class V4StepResult(NamedTuple):
    """``out q.dtype[L, T, H, 512]`` (before inverse RoPE / output projection), ``topk
    i32[Lc, T, index_topk]`` (CSA entry numbers, ``-1`` tail; ``[0, T, k]`` without CSA), and
    the updated caches and states."""

    out: jax.Array
    topk: jax.Array
    caches: V4Caches
    states: V4States


def init_v4_states(layout: V4ModelLayout, num_slots: int) -> V4States:
    """Fresh state pools for ``num_slots`` sequences per layer (``V4States``)."""
    def pool(ratio, dim, layers):
        return vc.init_compressor_state(layers * num_slots, ratio, dim) if layers else None
    lc, lh = layout.count(4), layout.count(128)
    return V4States(pool(4, 512, lc), pool(4, INDEX_DIM, lc), pool(128, 512, lh))
