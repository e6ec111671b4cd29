"""Stacked caches read in place: every layer's cache in one buffer, one layer read per call.

A serving step keeps all layers' caches stacked, ``[L, num_pages, page_size, W]`` (an array) or
an fp8 cache pytree whose every part carries the same leading ``L``
(``reference.formats.fp8_cache``). Every op that reads a cache takes ``layer=`` beside it: the op
then reads only that layer's pages, straight from the stacked buffer (a ``(layer, page)`` row gather
in jnp, a scalar-prefetched layer index in the Pallas kernels), so no layer is ever copied out and
one compiled step serves every layer.

The layer rule (written once, here; the kernels run the same rule on the scalar core):

- ``layer=None``: the cache is one layer, ``[num_pages, page_size, W]`` (the single-layer call
  every op has always taken). It is read as a stack of one layer (``cache[None]``: a reshape,
  no copy).
- ``layer`` a Python int: the cache must be stacked and ``0 <= layer < L``, else ``ValueError``
  naming both numbers.
- ``layer`` traced (an i32 scalar): a layer outside ``[0, L)`` reads **nothing**: every page of
  the call counts as missing (as a page id outside ``[0, num_pages)`` does,
  ``reference.core.batch``), so top-k rows come back all ``-1`` and sparse MLA rows zeros (LSE
  ``-inf``). ``dsa_jax``'s ``validate=True`` reports it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.formats import fp8_cache

CACHE_RANK = 3  # one layer: [num_pages, page_size, W]


class LayerRead(NamedTuple):
    """A cache argument resolved by ``resolve``: the stacked cache (``[L, P, ps, W]`` leaves),
    the layer (i32 scalar, traced or constant), ``L``, and ``one``: shape-only structs of one
    layer (what the single-layer checks read)."""

    stacked: object
    layer: jax.Array
    num_layers: int
    one: object


def _leaves(cache):
    return jax.tree_util.tree_leaves(cache)


def cache_rank(cache) -> int:
    """Rank of a cache's logical shape (``[..., P, ps, D]``; fp8 caches by their ``shape``)."""
    return len(tuple(cache.shape)) if hasattr(cache, "shape") else int(np.ndim(cache))


def _one_layer(stacked):
    """Shape-only structs of layer 0 of a stacked cache (for the single-layer checks)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], jnp.result_type(x)), stacked)


def resolve(name: str, cache, layer) -> LayerRead:
    """Resolve ``(cache, layer)`` by the module's rule (static checks here; runtime masking is
    ``layer_ok``'s)."""
    rank = cache_rank(cache)
    if layer is None:
        if rank != CACHE_RANK:
            raise ValueError(f"{name} has rank {rank} (shape {tuple(cache.shape)}); a stacked "
                             f"cache [L, num_pages, page_size, W] needs layer=, a single layer "
                             f"has rank {CACHE_RANK}")
        stacked = jax.tree_util.tree_map(lambda x: x[None], cache)
        return LayerRead(stacked, jnp.int32(0), 1, cache)
    if rank == CACHE_RANK:  # one layer given with a layer index: a stack of one
        stacked = jax.tree_util.tree_map(lambda x: x[None], cache)
    elif rank == CACHE_RANK + 1:
        stacked = cache
    else:
        raise ValueError(f"{name} with layer= must have rank {CACHE_RANK + 1} ([L, num_pages, "
                         f"page_size, W]), got rank {rank} (shape {tuple(cache.shape)})")
    num_layers = int(np.shape(_leaves(stacked)[0])[0])
    if isinstance(layer, bool):
        raise TypeError(f"layer must be an int or an i32 scalar, got {layer!r}")
    if isinstance(layer, (int, np.integer)):
        if not 0 <= int(layer) < num_layers:
            raise ValueError(f"layer={int(layer)} is outside [0, {num_layers}) (the {num_layers} "
                             f"layers of {name})")
    else:
        if np.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise TypeError(f"layer must be an int or an integer scalar, got shape "
                            f"{tuple(np.shape(layer))} dtype {jnp.result_type(layer)}")
    return LayerRead(stacked, jnp.asarray(layer, jnp.int32), num_layers, _one_layer(stacked))


def layer_ok(layer, num_layers: int):
    """Whether ``layer`` is a layer of the stack (the masking rule)."""
    return (layer >= 0) & (layer < num_layers)


def safe_layer(layer, num_layers: int):
    """``layer`` where valid, else ``num_layers`` (one past the end: a fill-mode gather then
    reads nothing; a negative index would wrap)."""
    return jnp.where(layer_ok(layer, num_layers), layer, num_layers).astype(jnp.int32)


def mask_table(page_indices, read: LayerRead):
    """The page table as this layer sees it: every slot ``-1`` (no page) when the layer lies
    outside the stack, so every op's own page rule reads nothing (elementwise over the table,
    no gather)."""
    return jnp.where(layer_ok(read.layer, read.num_layers), page_indices, -1)


def take(x, layer, ids):
    """``x[layer, ids]`` of a stacked leaf ``x [L, n, ...]``, zeros (no read) where ``ids`` is out
    of ``[0, n)`` or the layer outside ``[0, L)``: one row gather over the stacked buffer."""
    lay = safe_layer(layer, x.shape[0])
    return x.at[lay, ids].get(mode="fill", fill_value=0)


def is_fp8_index(read: LayerRead) -> bool:
    return isinstance(read.stacked, fp8_cache.Fp8IndexCache)


def is_fp8_latent(read: LayerRead) -> bool:
    return isinstance(read.stacked, fp8_cache.Fp8LatentCache)


def layer_query(q, read: LayerRead, *, layer):
    """Static checks of sparse MLA's per-layer query (``reference.formats.stacked``'s rule extended
    to it): ``q`` is ``[T, H, D]``, or with ``layer=`` the stacked ``[L, T, H, D]`` read in place
    at that layer. Returns ``q``, or shape-only structs of the one-layer query (what the
    single-layer checks read)."""
    if np.ndim(q) != 4:
        return q
    if layer is None:
        raise ValueError(f"q has rank 4 (shape {tuple(np.shape(q))}), a stacked query "
                         f"[L, T, H, D]: pass layer=")
    if np.shape(q)[0] != read.num_layers:
        raise ValueError(f"q.shape[0] = {np.shape(q)[0]} must equal the stacked cache's "
                         f"layers L = {read.num_layers}")
    return jax.ShapeDtypeStruct(tuple(np.shape(q))[1:], jnp.result_type(q))


def query_at(q, read: LayerRead):
    """The layer's query: ``q`` itself, or ``q[layer]`` of a stacked ``[L, T, H, D]`` (a
    dynamic slice; clipped: a layer outside the stack reads no cache, whatever its query)."""
    if np.ndim(q) != 4:
        return q
    return jax.lax.dynamic_index_in_dim(q, jnp.clip(read.layer, 0, read.num_layers - 1), 0,
                                        keepdims=False)


class _LayerChecked:
    """A jitted op behind ``checks_layer``: calls check a Python-int ``layer=`` first; every
    other attribute (``clear_cache``, ``lower``, ``trace``...) is the jitted function's."""

    def __init__(self, fn, cache_pos: int):
        functools.update_wrapper(self, fn)
        self._fn, self._cache_pos = fn, cache_pos

    def __call__(self, *args, layer=None, **kwargs):
        if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
            pos = self._cache_pos
            cache = args[pos] if len(args) > pos else kwargs.get("cache_kv")
            resolve("cache_kv", cache, int(layer))
        return self._fn(*args, layer=layer, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


def checks_layer(cache_pos: int):
    """Decorate a jitted op whose cache is positional argument ``cache_pos`` (or ``cache_kv=``)
    so that a Python-int ``layer=`` is checked against the stack before tracing (inside ``jit``
    an int is a tracer, and a traced layer is masked, not refused)."""
    return lambda fn: _LayerChecked(fn, cache_pos)
