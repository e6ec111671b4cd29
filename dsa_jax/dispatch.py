"""The call path of the DSA ops (``dsa_jax.indexer``, ``dsa_jax.mla``): one signature each, with
a ``backend=`` switch.

Every op takes the reference's arguments (``reference.*_ref``) plus:

- ``backend``: ``"reference"``, ``"pallas"`` or ``None`` (``dsa_jax.backend``);
- ``validate``: run the batch checks of ``dsa_jax.validate`` first (checkify; raises
  ``checkify.JaxRuntimeError`` naming the offending sequence and numbers; eager only);
- ``kernel_options``: knobs for the Pallas entry (block sizes, ``chip``, ``interpret``...);
  ignored by the reference;
- ``layer``: with a stacked cache (``[L, num_pages, page_size, W]``, or an fp8 cache with a
  leading ``L``), the layer to read, in place (``reference.stacked``: a Python int outside
  ``[0, L)`` is a ``ValueError``; a traced one reads nothing, and ``validate`` reports it).

Empty batches are valid (an idle engine step): ``T = 0`` rows give empty results of the right
shapes and dtypes; ``S = 0`` sequences make every row one outside every sequence (top-k rows
``-1``, attention rows zeros); both implementations, by ``empty_batch``'s padding.

Both backends have the same semantics; compare top-k results by score (``reference.selection``).
``call`` runs the implementation ``dsa_jax.backend.implementation`` picked, under those checks
when ``validate``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from dsa_jax import validate as _validate
from reference.formats import stacked


def call(fn, extra, arrays, statics, validate: bool, *, num_rows: int, cache_index: int,
         seq_lens_index: int, pages_per_seq: int, layer=None, keyword_arrays=None,
         row_axes=None):
    """Run ``fn(*arrays, **statics, **extra, **keyword_arrays, layer=layer)``, under the
    checkify rules when ``validate`` (the batch rules, and the layer rule for a stacked cache).
    ``keyword_arrays``: traced keyword operands (e.g. ``attn_sink``); a ``None`` value is not
    passed (the op's default), so a call without them is exactly the call before them.
    ``row_axes``: ``{index into arrays: (axis of its T rows, fill value)}``, the arrays an
    empty batch is padded in (``empty_batch``)."""
    arrays, empty_rows = empty_batch(arrays, seq_lens_index, row_axes or {})
    if empty_rows:
        res = call(fn, extra, arrays, statics, validate, num_rows=1, cache_index=cache_index,
                   seq_lens_index=seq_lens_index, pages_per_seq=pages_per_seq, layer=layer,
                   keyword_arrays=keyword_arrays)
        return jax.tree.map(lambda x: x[:0], res)
    kw_arrays = {k: v for k, v in (keyword_arrays or {}).items() if v is not None}
    if not validate:
        return fn(*arrays, **statics, **extra, **kw_arrays, layer=layer)
    cache = arrays[cache_index]  # an array, or an fp8 cache object (both have ``.shape``)
    read = stacked.resolve("cache_kv", cache, layer)  # static refusals before tracing
    shape = tuple(getattr(cache, "shape", np.shape(cache)))
    num_pages, page_size = (int(d) for d in shape[-3:-1])
    key = (fn, tuple(statics.items()), tuple(sorted(extra.items())), num_rows, seq_lens_index,
           page_size, pages_per_seq, num_pages, None if layer is None else read.num_layers)
    err, res = _checked(key)(arrays, read.layer, kw_arrays)  # kw_arrays: traced, by name
    err.throw()
    return res


@functools.lru_cache(maxsize=64)
def _checked(key):
    """``jit(checkify(fn + the batch rules))``, built once per op and statics."""
    (fn, statics, extra, num_rows, seq_lens_index, page_size, pages_per_seq, num_pages,
     num_layers) = key

    def checked(xs, layer, kw_arrays):
        kv, rest = xs[seq_lens_index], xs[-4:]  # page_indices, cu_q_lens, cu_kv_lens, dist
        _validate.check_batch(num_rows, kv, *rest, page_size=page_size,
                              pages_per_seq=pages_per_seq, num_pages=num_pages,
                              compression_ratio=dict(statics).get("compression_ratio", 1))
        if num_layers is not None:
            _validate.check_layer(layer, num_layers)
        return fn(*xs, **dict(statics), **dict(extra), **kw_arrays,
                  layer=None if num_layers is None else layer)

    return jax.jit(checkify.checkify(checked))


def empty_batch(arrays: tuple, seq_lens_index: int, row_axes: dict) -> tuple[tuple, bool]:
    """An empty batch made servable, and whether its rows were empty.

    The documented rule: ``S = 0`` sequences is a batch whose every row lies outside every
    sequence (top-k rows ``-1``, attention rows as the op gives a row outside every sequence);
    ``T = 0`` rows is an empty result of the right shape and dtype. Both are served by padding:
    ``S = 0`` gets one inactive sequence slot (``kv_len = 0``, no rows, ``distribution = 0``;
    an empty ``page_indices`` one entry ``0``, never read); ``T = 0`` gets one row outside every
    sequence (``cu_q_lens`` ends at 0), computed and dropped. Nothing is padded otherwise."""
    arrays = list(arrays)
    where = (seq_lens_index, *range(len(arrays) - 4, len(arrays)))  # as ``_checked`` reads them
    kv, pages, cu_q, cu_kv, dist = (arrays[i] for i in where)
    if np.shape(kv)[0] == 0:
        kv = jnp.zeros((1,), jnp.int32)
        cu_q = jnp.concatenate([jnp.asarray(cu_q, jnp.int32)[:1]] * 2)
        cu_kv = jnp.concatenate([jnp.asarray(cu_kv, jnp.int32)[:1]] * 2)
        dist = jnp.zeros((3,), jnp.int32)
    if np.shape(pages)[0] == 0:
        pages = jnp.zeros((1,), jnp.int32)
    for i, x in zip(where, (kv, pages, cu_q, cu_kv, dist), strict=True):
        arrays[i] = x
    empty_rows = any(np.ndim(arrays[i]) >= (-axis if axis < 0 else axis + 1)
                     and np.shape(arrays[i])[axis] == 0 for i, (axis, _) in row_axes.items())
    if empty_rows:
        for i, (axis, fill) in row_axes.items():  # the op's own checks refuse a bad rank
            x = jnp.asarray(arrays[i])
            if x.ndim < (-axis if axis < 0 else axis + 1):
                continue
            width = [(0, 0)] * x.ndim
            width[axis] = (0, 1)
            arrays[i] = jnp.pad(x, width, constant_values=fill)
    return tuple(arrays), empty_rows


def static_float(op: str, name: str, value) -> float:
    """``value`` as a Python float (a static of the compiled program): a Python / NumPy number
    or a concrete JAX scalar; a traced value is a ``TypeError`` naming ``name``."""
    try:
        out = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(f"{op}: {name} must be a Python float (static: one compiled program "
                        f"per value), got {type(value).__name__}") from e
    if not np.isfinite(out):
        raise ValueError(f"{op}: {name} must be finite, got {name}={out}")
    return out
