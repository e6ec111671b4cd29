"""The entry of the V4.1 attention kernel (``kernel``): argument checks, the per-row meta, the
query into the lane order and the output back; ``window_segments`` (where a row's window
segments start, for the caller's page lookup) and ``traffic`` (the model).

    out = v41_attention(q, sink, window_pages, window_page, window_base, positions,
                        window_size=128, page_size=128, window_layer=l,
                        pool_pages=pool, pool_page=pp, pool_offset=po, pool_layer=k)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import aot, tpu
from pallas_kernels.v41_attention.kernel import AttnConfig, attention_call, vmem_estimate
from reference.core import checks
from reference.v41 import pool_pages, window_pages
from reference.v41.formats import compressed_kv_bytes, window_kv_bytes

_WHERE = "v41_attention"


def window_segments(positions: jax.Array, *, window_size: int, page_size: int,
                    dim: int) -> jax.Array:
    """``i32[T, S]``: the first token position of each window segment a row at ``positions
    i32[T]`` may read (``kernel.AttnConfig.segments`` of ``seg`` tokens, from the segment
    holding ``max(0, p - window_size + 1)``); the caller looks each up in its page table and
    passes the page ids (``-1`` none) as ``window_page``."""
    cfg = AttnConfig(1, dim, window_size, page_size, 0, "bf16")
    first = jnp.maximum(positions.astype(jnp.int32) - window_size + 1, 0) // cfg.seg
    return (first[:, None] + jnp.arange(cfg.segments, dtype=jnp.int32)[None]) * cfg.seg


def sorted_entries(pool_page: jax.Array, pool_offset: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's listed entries ``i32[T, k]`` sorted by page id then offset, the unread ones
    (page ``-1``) last: entries sharing a record or scale row end up side by side, and the
    kernel fetches such a row once (``kernel._entry``). The softmax is over the set, so the
    order changes only the f32 summation order."""
    none = jnp.where(pool_page >= 0, 0, 1).astype(jnp.int32)
    _, page, offset = jax.lax.sort((none, pool_page.astype(jnp.int32),
                                    pool_offset.astype(jnp.int32)), dimension=1, num_keys=3)
    return page, offset


def _check(q, sink, window_pages_, window_page, window_base, positions, pool, cfg) -> None:
    """Static shape and dtype checks, each naming the argument and both numbers."""
    checks.floating("q", q)
    checks.rank("q", q, 3)
    t, h, d = q.shape
    checks.dim("sink", sink, 0, h, "q.shape[1] (heads)")
    rows = window_pages.page_rows(cfg.page_size, d)
    for name, x, r in (("window_pages", window_pages_, rows),
                       ("pool_pages", pool[0], pool_pages.page_rows(cfg.page_size, d))):
        if x is None:
            continue
        if x.dtype != jnp.uint32 or x.ndim != 4 or x.shape[2:] != (r, cfg.width):
            raise ValueError(f"{_WHERE}: {name} must be u32[L, P, {r}, {cfg.width}] (page_size="
                             f"{cfg.page_size}, D={d}), got {x.dtype}{list(x.shape)}")
    for name, x in (("window_page", window_page), ("window_base", window_base)):
        checks.integer(name, x)
        if x.shape != (t, cfg.segments):
            raise ValueError(f"{_WHERE}: {name} must be [T, S] = [{t}, {cfg.segments}] "
                             f"(window_segments), got {list(x.shape)}")
    checks.integer("positions", positions)
    checks.dim("positions", positions, 0, t, "q.shape[0] (rows)")
    for name, x in (("pool_page", pool[1]), ("pool_offset", pool[2])):
        if pool[0] is not None and (x is None or x.shape != (t, cfg.topk)):
            raise ValueError(f"{_WHERE}: {name} must be i32[T, k] = [{t}, {cfg.topk}] with "
                             f"pool_pages, got {None if x is None else list(x.shape)}")


def _valid(page, num_pages: int, layer, num_layers: int, offset=None, page_size: int = 0):
    """``page`` where it can be read (``[0, num_pages)``, the stack row ``layer`` inside
    ``[0, num_layers)``, ``offset`` inside ``[0, page_size)``), else ``-1`` (never read)."""
    layer = jnp.asarray(layer, jnp.int32)
    ok = (page >= 0) & (page < num_pages) & (layer >= 0) & (layer < num_layers)
    if offset is not None:
        ok = ok & (offset >= 0) & (offset < page_size)
    return jnp.where(ok, page, -1).astype(jnp.int32)


def v41_attention(q: jax.Array, sink: jax.Array, window_pages_: jax.Array,
                  window_page: jax.Array, window_base: jax.Array, positions: jax.Array, *,
                  window_size: int, page_size: int, window_layer=0,
                  pool_pages_: jax.Array | None = None, pool_page: jax.Array | None = None,
                  pool_offset: jax.Array | None = None, pool_layer=0, precision: str = "bf16",
                  chip: str | None = None, vmem_limit_bytes: int | None = None,
                  interpret=False) -> jax.Array:
    """V4.1 attention of ``q f32|bf16[T, H, D]`` (feature order) over each row's window in
    ``window_pages_ u32[L, P, Rw, W]`` at stack row ``window_layer`` and its listed entries of
    ``pool_pages_ u32[K, P, Rp, W]`` at ``pool_layer``, read in place (``kernel``).

    ``window_page i32[T, S]``: the page id of each segment ``window_base i32[T, S]``
    (``window_segments``) starts in, ``-1`` none (a released page, a row outside every
    sequence); ``positions i32[T]``: each row's token position (its window ``max(0, p -
    window_size + 1) .. p``; tokens outside it are never attended). ``pool_page / pool_offset
    i32[T, k]``: each listed entry's page id (``-1``: not attended) and offset in it.
    ``sink f32[H]``. Returns ``f32[T, H, D]`` (rounded to bf16 values under ``"bf16"``).

    Bad values: a Python-int layer outside its stack is a ``ValueError``; a traced one, a page
    id outside ``[0, P)`` or an offset outside the page reads nothing (the segment or entry is
    not attended; a row left with no key gives zeros)."""
    for name, layer, stack in (("window_layer", window_layer, window_pages_),
                               ("pool_layer", pool_layer, pool_pages_)):
        if stack is not None and isinstance(layer, (int, np.integer)) \
                and not isinstance(layer, bool) and not 0 <= int(layer) < stack.shape[0]:
            raise ValueError(f"{_WHERE}: {name}={int(layer)} is outside [0, {stack.shape[0]}) "
                             f"(the stack's rows)")
    return _attention(q, sink, window_pages_, window_page, window_base, positions,
                      window_size=window_size, page_size=page_size, window_layer=window_layer,
                      pool_pages_=pool_pages_, pool_page=pool_page, pool_offset=pool_offset,
                      pool_layer=pool_layer, precision=precision, chip=chip,
                      vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("window_size", "page_size", "precision", "chip",
                                             "vmem_limit_bytes", "interpret"))
def _attention(q, sink, window_pages_, window_page, window_base, positions, *, window_size,
               page_size, window_layer, pool_pages_, pool_page, pool_offset, pool_layer,
               precision, chip, vmem_limit_bytes, interpret) -> jax.Array:
    """``v41_attention`` after its static layer checks (jitted)."""
    checks.positive_int("window_size", window_size, _WHERE)
    checks.positive_int("page_size", page_size, _WHERE)
    if precision not in ("bf16", "f32"):
        raise ValueError(f"{_WHERE}: precision must be 'bf16' or 'f32', got {precision!r}")
    topk = 0 if pool_pages_ is None else int(pool_page.shape[-1])
    cfg = AttnConfig(int(q.shape[1]), int(q.shape[2]), window_size, page_size, topk, precision)
    _check(q, sink, window_pages_, window_page, window_base, positions,
           (pool_pages_, pool_page, pool_offset), cfg)
    t = q.shape[0]
    pos = positions.astype(jnp.int32)
    first = jnp.maximum(pos - window_size + 1, 0)
    wpage = _valid(window_page, window_pages_.shape[1], window_layer, window_pages_.shape[0])
    parts = [pos[:, None], first[:, None], wpage, window_base.astype(jnp.int32)]
    if topk:
        ppage = _valid(pool_page, pool_pages_.shape[1], pool_layer, pool_pages_.shape[0],
                       pool_offset, page_size)
        parts += list(sorted_entries(ppage, pool_offset))
    meta = jnp.concatenate(parts, axis=1)
    if t == 0:
        return jnp.zeros(q.shape, jnp.float32)
    layers = jnp.stack([jnp.asarray(window_layer, jnp.int32), jnp.asarray(pool_layer, jnp.int32)])
    limit = tpu.vmem_limit(vmem_estimate(cfg), tpu.resolve_chip(chip), vmem_limit_bytes)
    out = attention_call(pool_pages.to_lane_order(q), sink.astype(jnp.float32)[:, None], meta,
                         tpu.in_hbm(window_pages_),
                         None if pool_pages_ is None else tpu.in_hbm(pool_pages_), layers,
                         cfg=cfg, vmem_limit_bytes=limit, interpret=interpret)
    return pool_pages.from_lane_order(out)


def _pool_rows(pool_page: np.ndarray, pool_offset: np.ndarray | None, dim: int) -> int:
    """Record and scale rows the kernel fetches for the listed entries with a page: per row of
    the call, its entries sorted (``sorted_entries``), a row counted for an entry unless its
    predecessor is on the same page in the same row; ``pool_offset`` None: two an entry (no
    entry shares, an upper bound)."""
    if pool_offset is None:
        return 2 * int((pool_page >= 0).sum())
    lay, n = pool_pages.layout(dim), 0
    for page, off in zip(pool_page, np.asarray(pool_offset), strict=True):
        got = sorted(zip(page[page >= 0].tolist(), off[page >= 0].tolist(), strict=True))
        for per in (lay.per_row, lay.per_scale_row):
            n += len({(p, o // per) for p, o in got})
    return n


def traffic(window_page, window_base, positions, pool_page, *, heads: int, dim: int,
            window_size: int, page_size: int, q_itemsize: int = 4,
            pool_offset=None) -> aot.Traffic:
    """HBM bytes and DMA descriptors of one call, from its arrays (NumPy): per row its meta row
    (one DMA), per window segment with a page ``seg`` record rows and a scale row (two DMAs),
    per distinct record row and scale row its listed entries with a page fall in, one DMA of
    ``4 W`` bytes (``_pool_rows``; without ``pool_offset`` two an entry, an upper bound), q and
    the output (``f32``) once a row (two block copies). Minimum: the window tokens attended at
    ``window_kv_bytes`` each, the listed entries at ``compressed_kv_bytes``, q and the output
    once."""
    pool_page = None if pool_page is None else np.asarray(pool_page)
    topk = 0 if pool_page is None else pool_page.shape[1]
    cfg = AttnConfig(heads, dim, window_size, page_size, topk, "bf16")
    wp_, base, pos = np.asarray(window_page), np.asarray(window_base), np.asarray(positions)
    row = 4 * cfg.width
    segs = int((wp_ >= 0).sum())
    entries = 0 if pool_page is None else int((pool_page >= 0).sum())
    fetched = 0 if pool_page is None else _pool_rows(pool_page, pool_offset, dim)
    t = pos.shape[0]
    moved = (t * 4 * cfg.meta_words + segs * (cfg.seg + 1) * row + fetched * row
             + t * heads * dim * (q_itemsize + 4) + heads * tpu.LANES * 4)
    tokens = 0
    for r in range(t):
        lo, hi = max(pos[r] - window_size + 1, 0), pos[r]
        for s in range(cfg.segments):
            if wp_[r, s] >= 0:
                tokens += max(0, min(hi, base[r, s] + cfg.seg - 1) - max(lo, base[r, s]) + 1)
    bytes_min = (tokens * window_kv_bytes(dim) + entries * compressed_kv_bytes(dim)
                 + t * heads * dim * (q_itemsize + 4))
    return aot.Traffic(bytes_moved=moved, bytes_min=bytes_min,
                       flops=4 * t * heads * dim * (cfg.window_rows + topk),
                       vmem_bytes=vmem_estimate(cfg), dmas=t + 2 * segs + fetched + 2 * t + 1)
