"""The static checks of the DeepSeek-V4.1 step's arguments (``check_v41_step_args``): the
layout, the params against the config (``reference.statements.deepseek_v41.check_params``),
``xs``' shape, the metadata's ranks and lengths, every cache against ``init_v41_caches``'
fields, shapes (any page count) and dtypes, one compressor state per ratio-2 KV source. A
``TypeError`` / ``ValueError`` names the argument and the numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax.v41_model import V41Caches, V41Meta, V41StepLayout, init_v41_caches
from reference.core import checks as _checks
from reference.statements.deepseek_v41 import check_params


def _check_caches(caches, layout: V41StepLayout, num_seqs: int) -> None:
    """``caches`` a ``V41Caches`` with ``init_v41_caches(layout, .)``'s fields, shapes (any
    page count) and dtypes."""
    if not isinstance(caches, V41Caches):
        raise TypeError(f"v41_step: caches must be a V41Caches (init_v41_caches), got "
                        f"{type(caches).__name__}")
    want = jax.eval_shape(lambda: init_v41_caches(layout, max(num_seqs, 1)))
    for name, got, ref in zip(V41Caches._fields, caches, want, strict=True):
        if (got is None) != (ref is None):
            raise ValueError(f"v41_step: caches.{name} must be "
                             f"{'None' if ref is None else 'given'} for this config (KV sources "
                             f"of each ratio: {layout.sources}), got "
                             f"{'None' if got is None else 'an array'}")
        if ref is None:
            continue
        shape, rest = tuple(np.shape(got)), ", ".join(str(d) for d in ref.shape[2:])
        what = {"keys": "stack rows, pages, groups, 4, 128: index pages",
                "pool": "stack rows, pages, record + scale rows, words: pool pages",
                "wind": "layers, pages, records + scale rows, words: window pages",
                "cand": "one stack row, pages x rows, 128: index blocks"}[name[:4]]
        if (len(shape) != len(ref.shape) or shape[0] != ref.shape[0]
                or shape[2:] != ref.shape[2:]):
            raise ValueError(f"v41_step: caches.{name} must have shape [{ref.shape[0]}, P, "
                             f"{rest}] ({what}), got {shape}")
        if jnp.result_type(got) != ref.dtype:
            raise ValueError(f"v41_step: caches.{name} must have dtype {ref.dtype} ({what}), "
                             f"got {jnp.result_type(got)}")


def check_v41_step_args(params, xs, caches, states, meta, layout) -> None:
    """``v41_step``'s static checks (module docstring): ``TypeError`` / ``ValueError`` naming
    the argument and the numbers."""
    if not isinstance(layout, V41StepLayout):
        raise TypeError(f"v41_step: layout must be a V41StepLayout, got {type(layout).__name__}")
    c = layout.config
    check_params(params, c)
    _checks.rank("xs", xs, 3)
    _checks.floating("xs", xs)
    _checks.dim("xs", xs, 0, layout.num_layers, "len(config.compress_ratios)")
    _checks.dim("xs", xs, 2, c.dim, "config.dim")
    if not isinstance(meta, V41Meta):
        raise TypeError(f"v41_step: meta must be a V41Meta (v41_meta), got "
                        f"{type(meta).__name__}")
    for name, x in meta._asdict().items():
        _checks.rank(f"meta.{name}", x, 1)
        _checks.integer(f"meta.{name}", x)
    s = int(np.shape(meta.kv_lens)[0])
    _checks.dim("meta.cu_q_lens", meta.cu_q_lens, 0, s + 1, "len(meta.kv_lens) + 1")
    _checks.dim("meta.state_slots", meta.state_slots, 0, s, "len(meta.kv_lens)")
    _check_caches(caches, layout, s)
    n2 = len(layout.sources[2])
    if not isinstance(states, tuple) or len(states) != n2:
        raise ValueError(f"v41_step: states must be a tuple of {n2} compressor states (one per "
                         f"ratio-2 KV source, init_v41_states), got "
                         f"{len(states) if isinstance(states, tuple) else type(states).__name__}")
