"""The static checks of the DeepSeek-V4 step's arguments (``check_v4_step_args``): every shape
against the ``V4ModelLayout``, each family's arguments present iff the model has layers of its
type, the caches against their ``V4Layout``, the state pools against the layer counts. A
``ValueError`` names the argument and the numbers (or the missing field)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsa_jax.v4_model import (
    INDEX_DIM,
    TYPE_NAMES,
    TYPES,
    V4BatchMeta,
    V4Caches,
    V4ModelLayout,
    V4States,
    V4StepInputs,
    V4StepParams,
)
from reference import v4_compressor as vc


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
    _check_meta(meta)
    _check_rope(params, layout)
    num_slots = _num_slots(states, layout)
    seqs = int(np.shape(meta.kv_lens)[0])
    if (layout.count(4) or layout.count(128)) and num_slots < seqs:
        raise ValueError(f"the compressor state pools hold {num_slots} slots per layer, fewer "
                         f"than the batch's S = {seqs} sequences (len(meta.kv_lens)); each "
                         f"sequence needs its own slot (init_v4_states(layout, num_slots))")
    return num_slots


def _check_meta(meta: V4BatchMeta) -> None:
    """Every array of ``meta`` a rank-1 integer array; the ``cu`` arrays ``S + 1`` long and
    ``state_slots`` ``S`` long; named as ``meta.<field>``."""
    seqs = int(np.shape(meta.kv_lens)[0])
    for field, x in meta._asdict().items():
        if x is None:
            continue
        if np.ndim(x) != 1 or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"meta.{field} must be a rank-1 integer array, got shape "
                             f"{tuple(np.shape(x))} dtype {jnp.result_type(x)}")
        want = {"cu_q_lens": seqs + 1, "state_slots": seqs, "distribution": 3}.get(
            field, seqs + 1 if field.endswith("cu_lens") else None)
        if want is not None and int(np.shape(x)[0]) != want:
            raise ValueError(f"meta.{field} must have {want} entries (S = {seqs} sequences, "
                             f"len(meta.kv_lens)), got {int(np.shape(x)[0])}")


def _check_rope(params: V4StepParams, layout: V4ModelLayout) -> None:
    """The entries' RoPE tables cover every position the layout's caches can hold (the window
    cache's capacity in tokens): a shorter table would leave positions without a rotation."""
    if not (layout.count(4) or layout.count(128)):
        return
    capacity = layout.window_pages_per_seq * layout.window_page_size
    for name in ("cos", "sin"):
        x = getattr(params, name)
        if x is None:
            raise ValueError(f"params.{name} is missing: the compressed layers rotate their "
                             f"entries (reference.v4_compressor.rope_tables)")
        if int(np.shape(x)[0]) < capacity:
            raise ValueError(f"params.{name} has {int(np.shape(x)[0])} positions, fewer than "
                             f"the {capacity} tokens a sequence can hold (window_pages_per_seq"
                             f" {layout.window_pages_per_seq} x window_page_size "
                             f"{layout.window_page_size}); build the tables for "
                             f"{capacity} positions")
