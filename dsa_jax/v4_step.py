"""One DeepSeek-V4 attention step over every layer of a model, on a ragged paged batch.

Layer types (``compress_ratios[l]``): ``0`` window only (SWA), ``4`` CSA (window union the
indexer's top-k compressed entries), ``128`` HCA (window union every visible entry). The
layers of one type share one set of stacked caches (their ``slot`` is their rank among the
layers of that type), because ``v4_attention`` reads a window and a compressed cache at one
``layer=`` index: so the window caches are stacked per type too.

Order of one step (every write before any read, so XLA keeps one buffer per donated stack):

1. each layer's window rows into its type's window stack (the ``V4Layout``'s slot rule);
2. each compressed layer's compressor (``reference.v4_compressor.compress_step``; with
   ``backend="pallas"`` the Pallas ``pallas_kernels.v4_compressor.compress_step``): the entries
   that complete in this step go into the compressed stack (CSA: also the indexer compressor's
   entries into the index-key stack), the state ring advances; the state pools are stacked
   ``[Lx * num_slots, R, W]`` and layer ``slot`` uses slots ``slot * num_slots + i``, so no
   layer's pool is sliced out (no copy);
3. the indexer top-k on every CSA layer (``dsa_jax.indexer_topk``, ``compression_ratio=4``,
   ``k = index_topk``) over the index stack read in place;
4. ``dsa_jax.v4_attention`` per layer, both caches of its type read in place at ``layer=slot``.

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

The output is the attention output ``q.dtype[L, T, H, 512]`` BEFORE the inverse RoPE and the
output projection (``wo_a``/``wo_b``): the caller applies them (the statement
``reference.deepseek_v4.attention_layer`` does both). ``qat=True`` applies the official
simulations to the entries the compressors emit (fp8 block 64 on the nope dims of attention
entries; Hadamard + fp4 block 32 on index entries) before they are stored.

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
import jax.numpy as jnp
import numpy as np

from dsa_jax import backend as _backend
from dsa_jax import cache as _cache
from dsa_jax.indexer import indexer_topk
from dsa_jax.v4_attention import V4Layout, layout_batch, v4_attention
from reference import deepseek_v4 as _dv4
from reference import fp8_cache, packed_cache, v4_cache
from reference import v4_compressor as vc
from reference.v4_attention import COMPRESS_RATIOS, PagedKV

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
    (``reference.v4_compressor.rope_tables``: theta 160000, YaRN)."""

    cos: jax.Array
    sin: jax.Array
    csa_ape: jax.Array | None = None
    csa_norm: jax.Array | None = None
    index_ape: jax.Array | None = None
    index_norm: jax.Array | None = None
    hca_ape: jax.Array | None = None
    hca_norm: jax.Array | None = None


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


# ----------------------------------------------------------------------------- validation


def _shape(name: str, x, want: tuple, why: str) -> None:
    if x is None:
        raise ValueError(f"{name} is missing: the model needs it ({why}), expected shape "
                         f"{want}")
    got = tuple(x.shape)  # arrays and the fp8 cache pytrees alike
    if got != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)} ({why}), got {got}")


def _absent(name: str, x, ratio: int) -> None:
    if x is not None:
        raise ValueError(f"{name} was given but no layer has compress_ratio {ratio}; pass None")


def _family_specs(layout: V4ModelLayout, t: int, hi: int):
    """``{ratio: [(kind, field, want shape, why)]}`` of every per-family argument."""
    lc, lh = layout.count(4), layout.count(128)
    csa, hca = f"Lc={lc} CSA layers, T={t} rows", f"Lh={lh} HCA layers, T={t} rows"
    return {
        4: [("inputs", "csa_kv", (lc, t, 1024), f"{csa}, coff*512"),
            ("inputs", "csa_score", (lc, t, 1024), f"{csa}, coff*512"),
            ("inputs", "index_q", (lc, t, hi, INDEX_DIM), f"{csa}, Hi={hi} heads, 128"),
            ("inputs", "index_weights", (lc, t, hi), f"{csa}, Hi={hi} heads"),
            ("inputs", "index_kv", (lc, t, 2 * INDEX_DIM), f"{csa}, coff*128"),
            ("inputs", "index_score", (lc, t, 2 * INDEX_DIM), f"{csa}, coff*128"),
            ("params", "csa_ape", (lc, 4, 1024), f"Lc={lc}, ratio 4, coff*512"),
            ("params", "csa_norm", (lc, 512), f"Lc={lc}, 512"),
            ("params", "index_ape", (lc, 4, 2 * INDEX_DIM), f"Lc={lc}, ratio 4, coff*128"),
            ("params", "index_norm", (lc, INDEX_DIM), f"Lc={lc}, 128")],
        128: [("inputs", "hca_kv", (lh, t, 512), f"{hca}, 512"),
              ("inputs", "hca_score", (lh, t, 512), f"{hca}, 512"),
              ("params", "hca_ape", (lh, 128, 512), f"Lh={lh}, ratio 128, 512"),
              ("params", "hca_norm", (lh, 512), f"Lh={lh}, 512")],
    }


def _num_slots(states: V4States, layout: V4ModelLayout) -> int:
    """The per-layer state pool size, read from the first present pool; every pool checked."""
    num = None
    for field, ratio, dim in (("csa", 4, 512), ("index", 4, INDEX_DIM), ("hca", 128, 512)):
        st, n = getattr(states, field), layout.count(ratio)
        if not n:
            _absent(f"states.{field}", st, ratio)
            continue
        if not isinstance(st, vc.CompressorState):
            raise ValueError(f"states.{field} must be a CompressorState for the {n} layers of "
                             f"ratio {ratio} (init_v4_states), got {type(st).__name__}")
        rows, width = vc.state_rows(ratio), vc.compressor_coff(ratio) * dim
        total = int(st.kv.shape[0])
        if total % n or num is not None and total != n * num:
            raise ValueError(f"states.{field}.kv.shape[0]={total} must be {n} layers x "
                             f"num_slots" + (f" = {n * num}" if num else ""))
        num = total // n
        for part in ("kv", "score"):
            _shape(f"states.{field}.{part}", getattr(st, part), (total, rows, width),
                   f"{n} layers x {num} slots, R={rows}, coff*d={width}")
    return num or 0


def check_v4_step_args(inputs: V4StepInputs, params: V4StepParams, caches: V4Caches,
                       states: V4States, meta: V4BatchMeta, layout: V4ModelLayout) -> int:
    """Static checks of ``v4_step``'s arguments (shapes against the layout, families present
    iff the model has them); returns ``num_slots``. ValueError names the argument and the
    numbers (or the missing field)."""
    if not isinstance(layout, V4ModelLayout):
        raise TypeError(f"layout must be a V4ModelLayout, got {type(layout).__name__}")
    n_layers = layout.num_layers
    q = inputs.q
    if q is None or np.ndim(q) != 4 or q.shape[0] != n_layers or q.shape[3] != 512:
        raise ValueError(f"inputs.q must be [L={n_layers}, T, H, 512], got shape "
                         f"{None if q is None else tuple(q.shape)}")
    t, h = int(q.shape[1]), int(q.shape[2])
    _shape("inputs.window_kv", inputs.window_kv, (n_layers, t, 512), f"L={n_layers}, T={t}")
    if inputs.attn_sink is not None:
        _shape("inputs.attn_sink", inputs.attn_sink, (n_layers, h), f"L={n_layers}, H={h}")
    hi = int(inputs.index_q.shape[2]) if inputs.index_q is not None else 0
    for ratio, specs in _family_specs(layout, t, hi).items():
        for kind, field, want, why in specs:
            x = getattr(inputs if kind == "inputs" else params, field)
            if layout.count(ratio):
                _shape(f"{kind}.{field}", x, want, why)
            else:
                _absent(f"{kind}.{field}", x, ratio)
    for r in TYPES:
        lay, n, name = layout.layout_for(r) if layout.count(r) else None, layout.count(r), \
            TYPE_NAMES[r]
        fields = [f"{name}_window"] + ([f"{name}_compressed"] if r else []) + (
            ["csa_index"] if r == 4 else [])
        for field in fields:
            cache = getattr(caches, field)
            if not n:
                _absent(f"caches.{field}", cache, r)
                continue
            if cache is None or int(cache.shape[0]) != n:
                raise ValueError(f"caches.{field} must stack the {n} layers of ratio {r}, got "
                                 f"{None if cache is None else tuple(cache.shape)}")
            if field == "csa_index":
                ps = layout.csa_page_size
                if tuple(cache.shape[-2:]) != (ps, INDEX_DIM):
                    raise ValueError(f"caches.csa_index must be [Lc, P, csa_page_size={ps}, "
                                     f"128], got {tuple(cache.shape)}")
            else:
                lay.check_cache(f"caches.{field}", cache, field.split("_")[1])
        if r:
            for part in ("page_indices", "cu_lens"):
                if n and getattr(meta, f"{name}_{part}") is None:
                    raise ValueError(f"meta.{name}_{part} is missing ({n} layers of ratio {r})")
    return _num_slots(states, layout)


# ----------------------------------------------------------------------------- the step


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


def _write_windows(caches: V4Caches, inputs: V4StepInputs, meta: V4BatchMeta,
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


def _nope_fp8(rows):
    """The official QAT of an attention entry: fp8 block 64 on the 448 nope dims."""
    return jnp.concatenate([_dv4.act_quant_sim(rows[:, :448]), rows[:, 448:]], axis=-1)


def _index_fp4(rows):
    """The official QAT of an index entry: Hadamard rotation, then fp4 block 32."""
    return _dv4.fp4_act_quant_sim(_dv4.hadamard_rotate(rows))


def _compress_family(cache, state, kv, score, ape, norm, cos, sin, meta: V4BatchMeta, *,
                     ratio: int, num_slots: int, table, pages_per_seq: int, fmt: str, finish,
                     compress):
    """Run the compressor ``compress`` (a ``compress_step``) of every layer of one family
    (stacked inputs ``[Lx, ...]``) and store the completed entries in layer ``s`` of ``cache``;
    the state pool is updated in place (layer ``s`` owns slots ``s * num_slots + i``). Returns
    ``(cache, state)``."""
    ok = (meta.state_slots >= 0) & (meta.state_slots < num_slots)
    page_indices, cu_lens = table
    for s in range(kv.shape[0]):
        slots = jnp.where(ok, meta.state_slots + s * num_slots, -1).astype(jnp.int32)
        entries, state = compress(kv[s], score[s], ape[s], norm[s], cos, sin, state, slots,
                                  meta.kv_lens, meta.cu_q_lens, meta.distribution, ratio=ratio)
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


def _compress_all(caches, states, inputs, params, meta, layout, num_slots, qat, compress):
    """Every compressor of the step (CSA: attention + indexer; HCA), each by ``compress``."""
    ident = lambda x: x  # noqa: E731
    fmt = layout.compressed_cache_format
    if layout.count(4):
        table = (meta.csa_page_indices, meta.csa_cu_lens)
        kw = dict(ratio=4, num_slots=num_slots, table=table, compress=compress,
                  pages_per_seq=layout.csa_pages_per_seq)
        comp, st = _compress_family(caches.csa_compressed, states.csa, inputs.csa_kv,
                                    inputs.csa_score, params.csa_ape, params.csa_norm,
                                    params.cos, params.sin, meta, fmt=fmt,
                                    finish=_nope_fp8 if qat else ident, **kw)
        idx, ist = _compress_family(caches.csa_index, states.index, inputs.index_kv,
                                    inputs.index_score, params.index_ape, params.index_norm,
                                    params.cos, params.sin, meta,
                                    fmt="fp8" if isinstance(caches.csa_index,
                                                            fp8_cache.Fp8IndexCache) else "plain",
                                    finish=_index_fp4 if qat else ident, **kw)
        caches = caches._replace(csa_compressed=comp, csa_index=idx)
        states = states._replace(csa=st, index=ist)
    if layout.count(128):
        comp, st = _compress_family(
            caches.hca_compressed, states.hca, inputs.hca_kv, inputs.hca_score, params.hca_ape,
            params.hca_norm, params.cos, params.sin, meta, ratio=128, num_slots=num_slots,
            table=(meta.hca_page_indices, meta.hca_cu_lens),
            pages_per_seq=layout.hca_pages_per_seq, fmt=fmt,
            finish=_nope_fp8 if qat else ident, compress=compress)
        caches = caches._replace(hca_compressed=comp)
        states = states._replace(hca=st)
    return caches, states


def _after(x, dep):
    """``x`` ordered after ``dep`` (``dsa_jax.step``'s chain of kernel calls; no data moves)."""
    return x if dep is None else jax.lax.optimization_barrier((x, dep))[0]


def v4_step_body(inputs: V4StepInputs, params: V4StepParams, caches: V4Caches,
                 states: V4States, meta: V4BatchMeta, *, layout: V4ModelLayout,
                 sm_scale: float | None, qat: bool, exact: bool, backend: str,
                 kernel_options: tuple) -> V4StepResult:
    """The step, unjitted (``v4_step`` jits it; ``sharded_v4_step`` runs it per shard);
    ``backend`` resolved, ``kernel_options`` a sorted tuple of items."""
    num_slots = check_v4_step_args(inputs, params, caches, states, meta, layout)
    topk_opts, attn_opts, comp_opts = _backend.split_kernel_options(
        ("indexer_topk", "v4_attention", "v4_compressor"), dict(kernel_options)).values()
    comp_fn, comp_extra = _backend.implementation("v4_compressor", backend, comp_opts)
    caches = _write_windows(caches, inputs, meta, layout)
    caches, states = _compress_all(caches, states, inputs, params, meta, layout, num_slots, qat,
                                   functools.partial(comp_fn, **comp_extra))
    # Every write above, every read below.
    topks, dep = [], None
    for s in range(layout.count(4)):
        topks.append(indexer_topk(
            _after(inputs.index_q[s], dep), inputs.index_weights[s], caches.csa_index,
            meta.kv_lens, meta.csa_page_indices, meta.cu_q_lens, meta.csa_cu_lens,
            meta.distribution, k=layout.index_topk, pages_per_seq=layout.csa_pages_per_seq,
            compression_ratio=4, exact=exact, backend=backend, kernel_options=topk_opts,
            layer=s))
        dep = topks[-1]
    outs = []
    for layer, r in enumerate(layout.compress_ratios):
        name, s = TYPE_NAMES[r], layout.slot(layer)
        window = PagedKV(getattr(caches, f"{name}_window"), meta.window_page_indices,
                         meta.window_cu_lens)
        compressed = None if not r else PagedKV(
            getattr(caches, f"{name}_compressed"), getattr(meta, f"{name}_page_indices"),
            getattr(meta, f"{name}_cu_lens"))
        outs.append(v4_attention(
            _after(inputs.q[layer], outs[-1] if outs else dep), window, meta.kv_lens,
            meta.cu_q_lens, meta.distribution, layout=layout.layout_for(r),
            compressed=compressed, compressed_indices=topks[s] if r == 4 else None,
            attn_sink=None if inputs.attn_sink is None else inputs.attn_sink[layer],
            sm_scale=sm_scale, backend=backend, kernel_options=attn_opts, layer=s))
    t = inputs.q.shape[1]
    topk = (jnp.stack(topks) if topks
            else jnp.zeros((0, t, layout.index_topk), jnp.int32))
    return V4StepResult(jnp.stack(outs), topk, caches, states)


_STATICS = ("layout", "sm_scale", "qat", "exact", "backend", "kernel_options")
_v4_step = jax.jit(v4_step_body, static_argnames=_STATICS, donate_argnames=("caches", "states"))


def v4_step(inputs: V4StepInputs, params: V4StepParams, caches: V4Caches, states: V4States,
            meta: V4BatchMeta, *, layout: V4ModelLayout, sm_scale: float | None = None,
            qat: bool = False, exact: bool = True, backend: str | None = None,
            kernel_options: dict | None = None) -> V4StepResult:
    """One DeepSeek-V4 attention step over all layers (module docstring); jitted, caches and
    states donated.

    Args:
      inputs: ``V4StepInputs`` (projected activations; families absent from the model None).
      params: ``V4StepParams`` (compressor ape / norm weights per layer, entry RoPE tables).
      caches: ``V4Caches`` (stacked per layer type), states: ``V4States`` (``init_v4_states``).
      meta: ``V4BatchMeta`` (tokens, rows, page tables per family in their units).
      layout: the ``V4ModelLayout`` (every static number).
      sm_scale: attention scale (default ``512 ** -0.5``).
      qat: apply the official QAT simulations to the compressed and index entries stored.
      exact: exact indexer top-k (the official ``topk``); False allows the approximate one.
      backend: ``"reference"`` / ``"pallas"`` / ``None`` (``dsa_jax.backend``) for every op.
      kernel_options: Pallas knobs, routed to the indexer, the V4 attention and the
        compressor entries by name (``dsa_jax.backend.split_kernel_options``; ``interpret`` to
        all).

    Returns ``V4StepResult(out [L, T, H, 512], topk [Lc, T, index_topk], caches, states)``.
    Bad shapes, a missing family argument or one given for a type the model lacks raise
    ``ValueError`` naming the argument and the numbers."""
    statics = dict(layout=layout, sm_scale=None if sm_scale is None else float(sm_scale),
                   qat=bool(qat), exact=bool(exact), backend=_backend.resolve_backend(backend),
                   kernel_options=tuple(sorted((kernel_options or {}).items())))
    return _v4_step(V4StepInputs(*inputs), V4StepParams(*params), V4Caches(*caches),
                    V4States(*states), V4BatchMeta(*meta), **statics)
