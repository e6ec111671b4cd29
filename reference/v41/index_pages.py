"""V4.1's fp4 index keys (``formats.encode_index_fp4``: e2m1, ue8m0 per 32) laid out for the
TPU: one byte array per page, whole 512-byte rows, the entries along lanes, read by the Pallas
indexer with ONE DMA per page (``pallas_kernels.indexer.v41_pages``) and by the jnp step with
one gathered window per entry.

Layout ``u8[..., P, G, 4, 128]`` (leading dims: stacked KV sources), a *group* ``[4, 128]`` one
32-bit row of 128 lanes, as ``reference.formats.fp8_index_pages`` (XLA tiles it ``T(4,128)(4,1)``):
entry ``e`` of a page lives in lane ``e % 128`` of its *block* ``e // 128`` of ``groups(D)``
groups, ``G = blocks(ps) * groups(D)``:

- groups ``[0, D / 8)`` of a block: the nibble bytes. Byte ``rho = 4 g + i`` (``rho < D / 2``)
  of an entry holds feature ``rho`` in its low nibble and feature ``D / 2 + rho`` in its high
  one: the format's e2m1 codes, paired across the two halves instead of neighbours
  (``pair_halves``; the official row pairs ``2i`` / ``2i + 1``). A kernel then decodes the low
  nibbles to features ``[0, D / 2)`` and the high ones to ``[D / 2, D)``, features on sublanes
  in their natural order: no lane shuffle, no permutation of the query.
- groups ``[D / 8, groups(D))``: the ue8m0 scale bytes, byte ``i`` of group ``D / 8 + i // 4``
  row ``i % 4`` (``D / 32`` of them; the rest of the group is padding).

Bytes per entry ``512 * G / ps``: **68** for ``D = 128`` at page sizes that are multiples of
128 (the format's own 68 B, nothing stored twice), ``8704 / ps`` below (lanes past ``ps`` are
padding: 136 at 64). ``ps`` must divide 128 or be a multiple of it. Pure bit moves: the codes
and scale bytes are ``encode_index_fp4``'s, so ``decode_index_fp4`` of what ``read_entries``
returns is the format's value bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import checks as _checks
from reference.formats import fp8_index_pages as fip
from reference.v41.formats import INDEX_BLOCK, NIBBLE_BITS, index_fp4_bytes

# the group geometry of the fp8 index pages (one 32-bit row of 128 lanes), declared there
LANES = fip.LANES  # entries per block (one lane each)
PACK = fip.PACK  # bytes per 32-bit word: rows of a group
GROUP_BYTES = fip.GROUP_BYTES  # 512
_U8 = np.dtype(np.uint8)


def nibble_groups(dim: int) -> int:
    """Groups of one block holding ``dim`` features' nibbles: ``dim / 8``."""
    return dim // (2 * PACK)


def scale_groups(dim: int) -> int:
    """Groups of one block holding the ``dim / 32`` scale bytes: ``ceil(dim / 128)``."""
    return -(-(dim // INDEX_BLOCK) // PACK)


def groups(dim: int) -> int:
    """Groups per block of 128 entries: ``nibble_groups + scale_groups`` (17 for 128)."""
    return nibble_groups(dim) + scale_groups(dim)


def blocks(page_size: int) -> int:
    """Blocks of 128 lanes per page: ``ceil(ps / 128)``."""
    return -(-page_size // LANES)


def page_groups(page_size: int, dim: int) -> int:
    """Groups per page, ``G = blocks(ps) * groups(dim)``."""
    return blocks(page_size) * groups(dim)


def bytes_per_entry(page_size: int, dim: int) -> float:
    """HBM bytes per entry, stored and moved: ``512 * G / ps``."""
    return GROUP_BYTES * page_groups(page_size, dim) / page_size


def check_geometry(page_size: int, dim: int, name: str = "page_size") -> tuple[int, int]:
    """Refuse a page size that neither divides 128 nor is a multiple of it, or a ``dim`` that is
    not a positive multiple of 32 (``ValueError`` naming the numbers)."""
    ps = _checks.positive_int(name, page_size)
    if LANES % ps and ps % LANES:
        raise ValueError(f"V4.1 index pages need {name} to divide {LANES} or be a multiple of it "
                         f"(entries along lanes), got {name}={ps}")
    d = _checks.positive_int("dim", dim)
    if d % INDEX_BLOCK:
        raise ValueError(f"V4.1 index pages need dim to be a multiple of {INDEX_BLOCK}, got {d}")
    return ps, d


def dim_of(width: int) -> int:
    """The features ``D`` of a ``width = 17 D / 32``-byte official row."""
    return width * INDEX_BLOCK // (INDEX_BLOCK // 2 + 1)


def pair_halves(rows: jax.Array) -> jax.Array:
    """``u8[..., 17 D / 32]`` official rows (``encode_index_fp4``) -> the same length with the
    nibbles paired across halves (byte ``rho``: feature ``rho`` low, ``D / 2 + rho`` high); the
    scale bytes unchanged."""
    half = dim_of(rows.shape[-1]) // 2  # D / 2 nibble bytes
    nib = jnp.stack([rows[..., :half] & 0xF, rows[..., :half] >> NIBBLE_BITS], axis=-1)
    nib = nib.reshape(*rows.shape[:-1], 2 * half)  # feature order
    codes = nib[..., :half] | (nib[..., half:] << NIBBLE_BITS)
    return jnp.concatenate([codes, rows[..., half:]], axis=-1)


def pair_neighbours(rows: jax.Array) -> jax.Array:
    """``pair_halves``' inverse: back to the official row."""
    half = dim_of(rows.shape[-1]) // 2
    nib = jnp.concatenate([rows[..., :half] & 0xF, rows[..., :half] >> NIBBLE_BITS], axis=-1)
    pairs = nib.reshape(*rows.shape[:-1], half, 2)
    codes = pairs[..., 0] | (pairs[..., 1] << NIBBLE_BITS)
    return jnp.concatenate([codes, rows[..., half:]], axis=-1)


def _entry_bytes(dim: int) -> int:
    return groups(dim) * PACK  # one entry's bytes in its lane, padding included


def _blocked(pages: jax.Array, page_size: int, dim: int) -> jax.Array:
    """``u8[L, P, G, 4, 128] -> u8[L, P, blocks, groups * 4, 128]`` (a split of ``G``: the
    same bytes, no relayout)."""
    lead = pages.shape[:2]
    return pages.reshape(*lead, blocks(page_size), _entry_bytes(dim), LANES)


def _padded(rows: jax.Array, dim: int) -> jax.Array:
    """Official rows -> the bytes of one entry's lane (``pair_halves``, scale padding zero)."""
    b = pair_halves(rows)
    pad = _entry_bytes(dim) - b.shape[-1]
    return jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, pad)]) if pad else b


def write_entries(pages: jax.Array, layer, page_id, offset, rows: jax.Array, *, page_size: int,
                  dim: int) -> jax.Array:
    """``pages u8[L, P, G, 4, 128]`` with the official rows ``rows u8[..., 17 D / 32]`` stored
    at ``(layer, page_id, offset)`` (ints or arrays broadcasting against ``rows``' leading
    dims); ``page_id`` outside ``[0, P)`` (or ``layer`` outside ``[0, L)``) drops the row. Each
    slot at most once a call (the step's writes: an entry's slot is its own).

    Two forms, the same bytes (tests), picked by the call's static shapes: an entry's bytes are
    one lane of its block (``groups(D) * 4`` bytes down a column), and a scatter of lane
    columns makes XLA's TPU layout put that column minor, i.e. copy the whole stack out of
    and back into its tiling around the scatter (4 copies; 1.4 GB modelled a decode write at
    1M entries, ``_write_lanes``). ``_write_blocks`` instead adds each entry's ``new - old``
    into its whole block (``groups(D)`` rows of 512 B: full-lane windows, no relayout; 8.7 KB
    an entry at ``D = 128``). Blocks when the call writes at most as many entries as the stack
    has pages (a decode, a chunk into a long cache), lanes otherwise (a long chunk into a short
    cache, where the stack costs less than the windows)."""
    b = _padded(rows, dim)
    lead = jnp.broadcast_shapes(jnp.shape(layer), jnp.shape(page_id), jnp.shape(offset),
                                b.shape[:-1])
    layer, page_id, offset = (jnp.broadcast_to(jnp.asarray(a, jnp.int32), lead).reshape(-1)
                              for a in (layer, page_id, offset))
    b = jnp.broadcast_to(b, (*lead, b.shape[-1])).reshape(-1, b.shape[-1])
    num_layers, num_pages = pages.shape[:2]
    ok = (page_id >= 0) & (page_id < num_pages) & (layer >= 0) & (layer < num_layers)
    page_id = jnp.where(ok, page_id, num_pages)  # past the stack: dropped (never wrapped)
    write = _write_blocks if b.shape[0] <= num_pages else _write_lanes
    return write(pages, jnp.where(ok, layer, 0), page_id, offset, b, page_size, dim)


def _write_lanes(pages, layer, page_id, offset, b, page_size: int, dim: int):
    """``b u8[N, groups * 4]`` (``_padded``) into its lane: one window per entry."""
    blk = _blocked(pages, page_size, dim)
    out = blk.at[layer, page_id, offset // LANES, :, offset % LANES].set(b, mode="drop")
    return out.reshape(pages.shape)


def _write_blocks(pages, layer, page_id, offset, b, page_size: int, dim: int):
    """``b u8[N, groups * 4]`` added as ``new - old`` into the entry's lane of its whole block
    (u8 arithmetic wraps; the other lanes add 0, so entries sharing a block all land). The
    pages seen as ``[.., blocks, groups, 4, 128]``, their own tiling, not ``_blocked``'s
    ``[.., groups * 4, 128]``: through that view XLA relayouts the stack again (measured; the
    copy test fails)."""
    n, g = b.shape[0], groups(dim)
    win = pages.reshape(*pages.shape[:2], blocks(page_size), g, PACK, LANES)
    blk = offset // LANES
    old = win[layer, jnp.minimum(page_id, pages.shape[1] - 1), blk]  # [N, g, 4, 128]
    lane = jax.lax.broadcasted_iota(jnp.int32, (n, 1, 1, LANES), 3) == (offset % LANES)[
        :, None, None, None]
    delta = jnp.where(lane, b.reshape(n, g, PACK, 1) - old, jnp.uint8(0))
    return win.at[layer, page_id, blk].add(delta, mode="drop").reshape(pages.shape)


def read_entries(pages: jax.Array, layer, page_id, offset, *, page_size: int,
                 dim: int) -> jax.Array:
    """The official rows ``u8[..., 17 D / 32]`` at ``(layer, page_id, offset)`` (arrays of one
    shape ``[...]``); ``page_id`` outside ``[0, P)`` reads zeros (never gathered)."""
    blk = _blocked(pages, page_size, dim)
    got = blk.at[layer, page_id, offset // LANES, :, offset % LANES].get(mode="fill",
                                                                          fill_value=0)
    return pair_neighbours(got[..., :index_fp4_bytes(dim)])


def to_pages(rows: jax.Array) -> jax.Array:
    """``u8[..., P, ps, 17 D / 32]`` official rows per page -> ``u8[..., P, G, 4, 128]`` (lanes
    past ``ps`` zero)."""
    *lead, ps, width = rows.shape
    dim = dim_of(width)
    check_geometry(ps, dim)
    b = _padded(rows, dim)  # [..., P, ps, E]
    nb = blocks(ps)
    b = jnp.pad(b, [(0, 0)] * len(lead) + [(0, nb * LANES - ps), (0, 0)])
    b = b.reshape(*lead, nb, LANES, -1)
    b = jnp.swapaxes(b, -1, -2)  # [..., P, blocks, E, 128]
    return b.reshape(*lead, page_groups(ps, dim), PACK, LANES)


def from_pages(pages: jax.Array, page_size: int, dim: int) -> jax.Array:
    """``to_pages``' inverse: ``u8[..., P, G, 4, 128] -> u8[..., P, ps, 17 D / 32]``."""
    *lead, _, _, _ = pages.shape
    b = pages.reshape(*lead, blocks(page_size), _entry_bytes(dim), LANES)
    b = jnp.swapaxes(b, -1, -2).reshape(*lead, blocks(page_size) * LANES, -1)
    return pair_neighbours(b[..., :page_size, :index_fp4_bytes(dim)])


@dataclass(frozen=True)
class IndexFp4Pages:
    """V4.1 fp4 index pages ``u8[..., P, G, 4, 128]`` (module docstring) seen by the indexer ops
    as keys of logical shape ``(..., P, ps, D)`` (what their shape checks, batch and layer rules
    read). A pytree (``page_size`` and ``dim`` static)."""

    pages: jax.Array
    page_size: int
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, dim)`` of the keys it holds."""
        return (*np.shape(self.pages)[:-3], self.page_size, self.dim)


jax.tree_util.register_dataclass(IndexFp4Pages, data_fields=["pages"],
                                 meta_fields=["page_size", "dim"])


def as_index_fp4_pages(pages, page_size: int, dim: int, name: str = "cache_kv") -> IndexFp4Pages:
    """``pages`` (``u8[..., P, G, 4, 128]`` or an ``IndexFp4Pages``) checked against ``page_size``
    and ``dim`` (ValueError / TypeError naming ``name`` and the numbers)."""
    if isinstance(pages, IndexFp4Pages):
        pages = pages.pages
    ps, d = check_geometry(page_size, dim)
    if np.ndim(pages) < 4:
        raise ValueError(f"{name} must be u8[..., P, G, 4, 128] (rank >= 4), got shape "
                         f"{tuple(np.shape(pages))}")
    dtype = np.dtype(jnp.result_type(pages))
    if dtype != _U8:
        raise TypeError(f"{name} must be uint8 (the V4.1 index pages' bytes), got dtype {dtype}")
    want = (page_groups(ps, d), PACK, LANES)
    if tuple(np.shape(pages)[-3:]) != want:
        raise ValueError(f"{name}.shape[-3:] must be (G, 4, 128) = {want} for page_size={ps}, "
                         f"dim={d}, got {tuple(np.shape(pages)[-3:])}")
    return IndexFp4Pages(jnp.asarray(pages), ps, d)
