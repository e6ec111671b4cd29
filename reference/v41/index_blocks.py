"""V4.1's fp4 index keys (``formats.encode_index_fp4``: e2m1, ue8m0 per 32) laid out so that one
*candidate block* of 8 entries is ONE 512-byte row: what a candidate consumer's kernel reads
(``pallas_kernels.indexer.v41_blocks``) instead of whole pages (``index_pages``, entries along
lanes, where a block is 8 lanes of every row of its page).

Layout ``u32[..., P * R, 128]`` (leading dims: stacked KV sources): ``P`` pages of ``R =
block_rows(ps) + scale_rows(ps)`` consecutive rows, page ``p`` rows ``p R .. p R + R - 1``,
``D = 128`` features (the index head dim, one per lane) and blocks of ``BLOCK = 8`` entries (the
nibbles of a 32-bit word):

- block row ``b < ps / 8``: lane ``f`` holds feature ``f`` of the page's entries ``8 b .. 8 b +
  7``, entry ``8 b + j`` in nibble ``j`` (bits ``4 j .. 4 j + 3``), the format's e2m1 code
  ``sign << 3 | code``. Decoding nibble plane ``j`` of ``n`` gathered block rows gives ``n``
  entries' keys ``[n, D]``, features on lanes: no shuffle.
- scale row ``s`` (rows ``ps / 8 ..``): lane ``l`` holds entry ``128 s + l``'s ``D / 32 = 4``
  ue8m0 scale bytes, byte ``g`` the scale of features ``32 g .. 32 g + 31`` (lanes past ``ps``
  zero). A block's 8 words are lanes ``8 (b % 16) ..`` of scale row ``b // 16``.

Bytes per entry ``512 R / ps``: **68** for page sizes that are multiples of 128 (the format's own
68 B, nothing stored twice); 96 at 16. The pages are one run of rows, not ``[P, R, 128]``: XLA
tiles rows by 8, and ``R = 17`` (pages of 128) would pad each page to 24 rows, or, left to
choose, XLA lays ``[P, R, 128]`` out with ``P`` second-minor and relayouts the whole stack for
the kernel (measured on an AOT compile: a 136 MiB copy at 1M entries). A candidate block moves
512 B of codes and, unless the block before it in the sorted list shares it, the 512 B scale
row it uses (the scales of 16 blocks). Pure bit moves: ``from_blocks(to_blocks(rows))`` is
``rows``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import checks as _checks
from reference.v41.formats import BYTE_BITS, INDEX_BLOCK, NIBBLE_BITS, index_fp4_bytes

LANES = 128  # features a row (the index head dim) and entries a scale row
BLOCK = 8  # entries a block row: the nibbles of a 32-bit word
DIM = LANES
ROW_BYTES = 4 * LANES
BLOCKS_PER_SCALE_ROW = LANES // BLOCK  # 16
_SCALES = DIM // INDEX_BLOCK  # 4 scale bytes an entry: one word


def block_rows(page_size: int) -> int:
    """Block rows a page: ``ps / 8``."""
    return page_size // BLOCK


def scale_rows(page_size: int) -> int:
    """Scale rows a page: ``ceil(ps / 128)``."""
    return -(-page_size // LANES)


def page_rows(page_size: int) -> int:
    """``R``: rows a page."""
    return block_rows(page_size) + scale_rows(page_size)


def bytes_per_entry(page_size: int) -> float:
    """HBM bytes per entry, stored: ``512 R / ps``."""
    return ROW_BYTES * page_rows(page_size) / page_size


def check_geometry(page_size: int, dim: int, block: int, where: str = "index blocks") -> int:
    """Refuse what the layout cannot hold (``ValueError`` naming the numbers): ``dim`` other
    than 128, ``block`` other than 8, a page size not a multiple of 8 that neither divides 128
    nor is a multiple of it. Returns the page size."""
    ps = _checks.positive_int("page_size", page_size, where)
    if dim != DIM:
        raise ValueError(f"{where}: the block layout holds index heads of dim={DIM} (one feature "
                         f"a lane), got dim={dim}")
    if block != BLOCK:
        raise ValueError(f"{where}: the block layout holds candidate blocks of {BLOCK} entries "
                         f"(one nibble of a 32-bit word each), got candidate_block={block}")
    if ps % BLOCK or (LANES % ps and ps % LANES):
        raise ValueError(f"{where}: page_size must be a multiple of {BLOCK} that divides "
                         f"{LANES} or is a multiple of it, got page_size={ps}")
    return ps


def check_pages(pages, page_size: int, name: str = "cache_kv",
                where: str = "index blocks") -> int:
    """``pages`` must be ``u32[L, P * R, 128]`` for ``page_size`` (ValueError / TypeError naming
    ``name`` and the numbers). Returns ``P``."""
    dt = np.dtype(jnp.result_type(pages))
    if dt != np.uint32:
        raise TypeError(f"{where}: {name} must be uint32 (the block layout's words), got {dt}")
    r, shape = page_rows(page_size), tuple(np.shape(pages))
    if len(shape) != 3 or shape[2] != LANES or shape[1] % r:
        raise ValueError(f"{where}: {name} must be u32[L, P * {r}, {LANES}] (pages of {r} rows "
                         f"for page_size={page_size}), got shape {shape}")
    return shape[1] // r


def _nibbles(rows: jax.Array) -> jax.Array:
    """Official rows ``u8[..., 68]`` -> ``u32[..., 128]`` e2m1 codes in feature order."""
    half = rows[..., :DIM // 2].astype(jnp.uint32)
    return jnp.stack([half & 0xF, half >> NIBBLE_BITS], axis=-1).reshape(*rows.shape[:-1], DIM)


def _scale_words(rows: jax.Array) -> jax.Array:
    """Official rows ``u8[..., 68]`` -> ``u32[...]``: scale byte ``g`` at bits ``8 g``."""
    b = rows[..., DIM // 2:].astype(jnp.uint32)
    return sum(b[..., g] << (BYTE_BITS * g) for g in range(_SCALES))


def to_blocks(rows: jax.Array) -> jax.Array:
    """``u8[..., P, ps, 68]`` official rows per page -> ``u32[..., P * R, 128]``."""
    *lead, ps, width = rows.shape
    if width != index_fp4_bytes(DIM):
        raise ValueError(f"to_blocks: rows.shape[-1] must be {index_fp4_bytes(DIM)} (an index "
                         f"row of dim {DIM}), got {width}")
    check_geometry(ps, DIM, BLOCK, "to_blocks")
    nib = _nibbles(rows).reshape(*lead, block_rows(ps), BLOCK, DIM)
    codes = sum(nib[..., j, :] << (NIBBLE_BITS * j) for j in range(BLOCK))
    words = _scale_words(rows)
    pad = scale_rows(ps) * LANES - ps
    words = jnp.pad(words, [(0, 0)] * len(lead) + [(0, pad)]).reshape(*lead, scale_rows(ps),
                                                                          LANES)
    pages = jnp.concatenate([codes, words], axis=-2)
    return pages.reshape(*lead[:-1], lead[-1] * page_rows(ps), LANES)


def from_blocks(pages: jax.Array, page_size: int) -> jax.Array:
    """``to_blocks``' inverse: ``u32[..., P * R, 128] -> u8[..., P, ps, 68]``."""
    nb, r = block_rows(page_size), page_rows(page_size)
    pages = pages.reshape(*pages.shape[:-2], pages.shape[-2] // r, r, LANES)
    codes, words = pages[..., :nb, :], pages[..., nb:, :]
    nib = jnp.stack([(codes >> (NIBBLE_BITS * j)) & 0xF for j in range(BLOCK)], axis=-2)
    nib = nib.reshape(*pages.shape[:-2], page_size, DIM // 2, 2)  # [.., ps, byte, lo/hi]
    packed = nib[..., 0] | (nib[..., 1] << NIBBLE_BITS)
    words = words.reshape(*pages.shape[:-2], -1)[..., :page_size]
    scales = jnp.stack([(words >> (BYTE_BITS * g)) & 0xFF for g in range(_SCALES)], axis=-1)
    return jnp.concatenate([packed, scales], axis=-1).astype(jnp.uint8)


def write_entries(pages: jax.Array, layer, page_id, offset, rows: jax.Array, *,
                  page_size: int) -> jax.Array:
    """``pages u32[L, P * R, 128]`` with the official rows ``rows u8[..., 68]`` stored at ``(layer,
    page_id, offset)`` (``layer`` an int or a scalar; ``page_id`` / ``offset`` ints or arrays
    broadcasting against ``rows``' leading dims); ``page_id`` outside ``[0, P)`` drops the row.

    A block row holds 8 entries' nibbles, so a write is a merge: the entry opening a block
    (``offset % 8 == 0``) sets its block row to its own nibbles (whatever a reused page held
    there is gone), every other entry adds its nibbles into slots its block's opener zeroed.
    The rule this needs: **append-only** (a compressed cache): each entry written once, a
    block's entry 0 in the same call or an earlier one (the V4.1 step's entries complete in
    order from 0). Each scale word is set. All of it is ONE scatter-add of whole rows (u32
    arithmetic wraps): an opener adds ``new - old`` (its old row gathered), a scale word
    ``new - old`` in its lane; XLA's TPU model prices every scatter at its whole operand, so one
    scatter, not three."""
    r = page_rows(page_size)
    n = pages.shape[-2]
    page_id, offset = jnp.asarray(page_id, jnp.int32), jnp.asarray(offset, jnp.int32)
    lead = jnp.broadcast_shapes(page_id.shape, offset.shape, rows.shape[:-1])
    page_id, offset = jnp.broadcast_to(page_id, lead), jnp.broadcast_to(offset, lead)
    ok = (page_id >= 0) & (page_id < n // r)
    base = jnp.where(ok, page_id * r, n)  # n: past the stack, dropped
    nib = _nibbles(jnp.broadcast_to(rows, (*lead, rows.shape[-1])))
    nib = nib << (NIBBLE_BITS * (offset % BLOCK)).astype(jnp.uint32)[..., None]
    brow, srow = base + offset // BLOCK, base + block_rows(page_size) + offset // LANES
    opens = (offset % BLOCK == 0) & ok
    old = pages[layer][jnp.where(opens, brow, 0)]  # [..., 128]: the opener's old row
    bdelta = jnp.where(opens[..., None], nib - old, nib)
    lane = jax.lax.broadcasted_iota(jnp.int32, (*lead, LANES), len(lead))
    sold = pages[layer][jnp.where(ok, srow, 0)]
    word = _scale_words(jnp.broadcast_to(rows, (*lead, rows.shape[-1])))[..., None]
    sdelta = jnp.where(lane == (offset % LANES)[..., None], word - sold, jnp.uint32(0))
    idx = jnp.concatenate([brow.reshape(-1), srow.reshape(-1)])
    delta = jnp.concatenate([bdelta.reshape(-1, LANES), sdelta.reshape(-1, LANES)])
    return pages.at[layer, idx].add(delta, mode="drop")
