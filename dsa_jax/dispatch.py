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

Both backends have the same semantics; compare top-k results by score (``reference.selection``).
``call`` runs the implementation ``dsa_jax.backend.implementation`` picked, under those checks
when ``validate``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import checkify

from dsa_jax import validate as _validate
from reference.formats import stacked


def call(fn, extra, arrays, statics, validate: bool, *, num_rows: int, cache_index: int,
         seq_lens_index: int, pages_per_seq: int, layer=None, keyword_arrays=None):
    """Run ``fn(*arrays, **statics, **extra, **keyword_arrays, layer=layer)``, under the
    checkify rules when ``validate`` (the batch rules, and the layer rule for a stacked cache).
    ``keyword_arrays``: traced keyword operands (e.g. ``attn_sink``); a ``None`` value is not
    passed (the op's default), so a call without them is exactly the call before them."""
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
