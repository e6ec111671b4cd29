"""The entry finish inside the pool kernel (``kernel``): the weighted RMSNorm and the RoPE at the
group's first position ``r j`` of one pooled row, bit for bit as
``reference.v4_compressor.finish_entries`` (the same ops in the same order), so that the XLA
glue neither gathers table rows nor touches the ``E x d`` pooled rows.

The RoPE tables ``cos`` / ``sin f32[P, h]`` (``h = rope_dim / 2``, narrower than a lane row)
are stored by XLA's TPU layout column-major (``{0,1}``: no lane padding), so a row gather
``cos[r j]`` made XLA copy each table row-major (4x lane-padded) first: ~20 MiB per call at
8192 positions. Here the kernel reads the tables through their free transposed view
``cos.T f32[h, P]`` (row-major, lane-dense; padded to whole 128-lane tiles when ``P`` is not a
multiple of 128): one ``[h, 128]`` DMA per table and completing entry, the 128-position tile
that holds ``r j``. Column ``r j % 128`` of the tile is spread onto the rope lanes of the row by
exact selects and sums of zeros (no arithmetic on the values).

The caller may instead pass the tables once in the kernel's row layout (``rope_rows``:
``f32[P, 128]``, position ``p``'s ``cos`` and ``sin`` each repeated onto the lane pairs they
rotate, a model constant built once): then the kernel reads one 512-B row per completing entry
(``row_copies``), not 2 x 16 KB, and places it by one lane rotation (``_row_lanes``). Building
that layout per call in the glue would cost more than it saves (XLA's TPU model: ~5-9 MB at
8192 positions, ratio 4, from the column-major tables), so the glue never builds it.

The norm's mean uses ``reference.v4_compressor._tree``'s pairwise order by lane rotations
(``y + roll(y, d - h)`` at ``h = d / 2, ..., 1``: lane ``i < h`` adds lane ``i + h``, the
reference's ``x[:h] + x[h:]``), so ``d`` must be a power of two; ``fusable`` says when the
kernel finishes the rows (V4's ``d`` 512 and 128, ``h`` 32), else the glue does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from pallas_kernels.v4_compressor.traffic import TABLE_TILE as TILE  # positions per table DMA


def fusable(d: int, half: int) -> bool:
    """Whether the pool kernel finishes the rows (static): ``d`` a power of two of whole lane
    rows and the tables' ``half`` a whole number of sublane rows."""
    return d % tpu.LANES == 0 and d & (d - 1) == 0 and half % tpu.SUBLANES == 0


def table_view(table: jax.Array) -> jax.Array:
    """``f32[P, h] -> f32[h, ceil(P / 128) * 128]``: the lane-dense transposed view the kernel
    DMAs (a bitcast of XLA's column-major table; padded by the glue only when ``P % 128``)."""
    t = table.T
    pad = -t.shape[1] % TILE
    return jnp.pad(t, ((0, 0), (0, pad))) if pad else t


def rope_rows(cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The RoPE tables in the kernel's row layout: ``cos`` / ``sin f32[P, h]`` (``4 h <=
    128``) -> ``f32[P, 128]`` whose row ``p`` holds ``cos[p, i]`` at lanes ``128 - 4 h + 2 i +
    b`` and ``sin[p, i]`` at lanes ``128 - 2 h + 2 i + b`` (``b`` 0, 1: each value on both lanes
    of the pair it rotates), lanes below ``128 - 4 h`` zero. Exact (copies only); build it once
    per model (``pallas_kernels.v4_compressor.compress_step``'s ``rope_rows``)."""
    num, half = cos.shape
    if sin.shape != cos.shape:
        raise ValueError(f"sin shape {sin.shape} != cos shape {cos.shape}")
    if 4 * half > tpu.LANES:
        raise ValueError(f"rope_rows needs 4 * h <= {tpu.LANES}: cos width h {half}")
    pad = jnp.zeros((num, tpu.LANES - 4 * half), jnp.float32)
    return jnp.concatenate([pad, jnp.repeat(jnp.asarray(cos, jnp.float32), 2, axis=1),
                            jnp.repeat(jnp.asarray(sin, jnp.float32), 2, axis=1)], axis=1)


def row_copies(rows_hbm, tbuf, tsem, pos):
    """The DMA of position ``pos``'s row of the ``rope_rows`` table (HBM f32[P, 128]) into
    ``tbuf[0]`` (VMEM f32[1, 1, 128]): one 512-B row DMA."""
    return [pltpu.make_async_copy(rows_hbm.at[pl.ds(pos, 1)], tbuf.at[0], tsem.at[0])]


def table_copies(cos_t, sin_t, tbuf, tsem, pos):
    """The DMAs of the 128-position tiles holding position ``pos``: ``cos_t`` / ``sin_t``
    (HBM f32[h, P']) into ``tbuf[0]`` / ``tbuf[1]`` (VMEM f32[2, h, 128])."""
    start = pl.multiple_of(pos // TILE * TILE, TILE)
    return [pltpu.make_async_copy(src.at[:, pl.ds(start, TILE)], tbuf.at[a], tsem.at[a])
            for a, src in enumerate((cos_t, sin_t))]


def _lanes(tile, pos, d: int):
    """``f32[1, d]``: rope lane ``d - 2 h + 2 i + b`` holds ``tile[i, pos % 128]``, other lanes
    0 (selects and sums of zeros: exact)."""
    half = tile.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 1)
    col = jnp.sum(jnp.where(lane == pos % TILE, tile, 0.0), axis=1, keepdims=True)  # [h, 1]
    sub = jax.lax.broadcasted_iota(jnp.int32, (half, d), 0)
    out = jax.lax.broadcasted_iota(jnp.int32, (half, d), 1) - (d - 2 * half)
    hit = (out >= 0) & (out // 2 == sub)
    return jnp.sum(jnp.where(hit, col, 0.0), axis=0, keepdims=True)


def _row_lanes(row, d: int, half: int):
    """``(cos, sin) f32[1, d]`` from a ``rope_rows`` row ``f32[1, 128]``: the rope lanes ``d -
    2 h + 2 i + b`` of each hold ``cos[i]`` / ``sin[i]`` (one static lane rotation for cos;
    the other lanes hold whatever: ``finish_row`` selects the rope lanes)."""
    cos = pltpu.roll(row, 2 * half, 1)
    reps = d // tpu.LANES
    if reps == 1:
        return cos, row
    return jnp.concatenate([cos] * reps, axis=1), jnp.concatenate([row] * reps, axis=1)


def _lane_tree_sum(y):
    """``f32[1, d] -> f32[1, 1]``: ``_tree(y, -1, add)`` (module docstring)."""
    d = y.shape[1]
    h = d // 2
    while h >= 1:
        y = y + pltpu.roll(y, d - h, 1)
        h //= 2
    return y[:, :1]


def finish_row(pooled, weight, tbuf, pos, *, eps: float, precision: str, half: int = 0):
    """``f32[1, d]``: ``finish_entries``' row of one valid entry from its pooled row
    ``pooled f32[1, d]``, the norm weight ``weight f32[1, d]``, the table tiles ``tbuf f32[2,
    h, 128]`` (``table_copies``) and the RoPE position ``pos = r j``; or (``half``, the tables'
    ``h``, nonzero) the position's ``rope_rows`` row in ``tbuf f32[1, 1, 128]``
    (``row_copies``)."""
    rb = tpu.rounding(precision)  # the convert pair: Mosaic has no reduce_precision
    d = pooled.shape[1]
    x = rb(pooled)
    var = _lane_tree_sum(jnp.square(x)) / jnp.float32(d)
    x = rb(weight * (x * jax.lax.rsqrt(var + jnp.float32(eps))))
    if half:
        cos, sin = _row_lanes(tbuf[0], d, half)
    else:
        half = tbuf.shape[1]
        cos, sin = _lanes(tbuf[0], pos, d), _lanes(tbuf[1], pos, d)
    nxt = pltpu.roll(x, d - 1, 1)  # lane l holds x[l + 1]: at an even lane, (a, b) = (x, nxt)
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
    rope = lane >= d - 2 * half
    even = x * cos - nxt * sin  # a cos - b sin
    odd = pltpu.roll(x * sin + nxt * cos, 1, 1)  # a sin + b cos, moved to the pair's odd lane
    return rb(jnp.where(rope, jnp.where(lane % 2 == 0, even, odd), x))
