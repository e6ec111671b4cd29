"""The fp8 MODEL1 cache of DeepSeek-V4 (one KV head of 512 dims, K = V = the whole row): its
quantizer, the TPU storage layout ``Fp8V4Cache``, the row decoder the attend paths use, the row
writer, and bit-exact interop with FlashMLA's MODEL1 page bytes.

Quantization (FlashMLA ``tests/quant.py``, ``FP8KVCacheLayout.MODEL1_FP8Sparse``: ``d = 512,
d_nope = 448, d_rope = 64, tile_size = 64, num_tiles = 7``), ``quantize_v4_fp8``. A row is 448
"nope" features then 64 "rope" features (the rotated dims are the last 64). Per tile ``t`` of 64
nope features, in f32:

- ``s_t = 2**ceil(log2(max(amax_t / 448, 1e-4)))`` (FlashMLA's ``_cast_scale_inv_to_ue8m0``:
  ``pow(2, clamp_min(amax / 448, 1e-4).log2().ceil())``; the floor is on the *scale*, so
  ``s_t >= 2**-13``, and an all-zero tile gets ``2**-13``). The ceiling is exact here, from the f32
  bits (``reference.quant.fp8._pow2_ceil``). FlashMLA takes an f32 ``log2`` first, which can round a
  quotient one ulp above a power of two down to the integer (NumPy's f32 ``log2`` does at
  ``2**-5 (1 + 2**-23)``, not at ``2**-3 (1 + 2**-23)``; torch was not run here): there it
  would pick half our scale, and its top code would round to 448 from ``448 (1 + 2**-23)``.
- ``e4m3_t = float8_e4m3fn(clip(x_t / s_t, -448, 448))``, an f32 division, round-to-nearest-even
  (the clip never binds: ``s_t >= amax_t / 448``).
- The scale is stored as ue8m0 (``float8_e8m0fnu``): its byte is the biased f32 exponent of
  ``s_t`` (``2**(byte - 127)``; 0xFF is NaN). The rope part is cast to bf16 (RNE; exact for bf16
  input) and kept unquantized.
- The official model differs where its QAT simulates this cache (``act_quant`` in the V4
  ``kernel_tilelang.py``, ``shared/SPEC.md``): it floors the *amax* at 1e-4 before dividing
  (``s = 2**ceil(log2(max(amax, 1e-4) / 448))``), so the two disagree only for tiles with
  ``amax < 448e-4 = 0.0448``, where ours keeps ``2**-13`` and the model's goes down to
  ``2**-22``. This module follows FlashMLA, whose bytes it must reproduce.
- Non-finite input: a NaN in a tile makes its scale byte 0xFF (NaN) and its codes NaN; an inf
  gives scale inf, stored as 0xFF (e8m0 has no inf), so the whole tile decodes to NaN.

Values: ``dequantize`` gives ``bf16(e4m3 * s_t)`` and the rope bf16, exactly FlashMLA's
``dequantize_k_cache`` (which multiplies in bf16): an e4m3 value times a power of two is exact in
bf16 (no rounding) for every scale this quantizer writes; it overflows to inf only in a tile with
``amax >= 248 * 2**120`` (about 3.3e38, near f32's largest value), as FlashMLA's would.

TPU storage, ``Fp8V4Cache(nope, rope)`` (pytree; both ``u32``; ``P`` pages of ``ps`` tokens,
optional leading dims such as a layer stack ``L`` on both parts):

- ``nope: u32[..., P, ps, 128]``: one 512-byte record per token, one whole 128-lane row. Record
  byte ``b`` is byte ``b // 128`` (bits ``8 (b // 128)`` up) of word ``b % 128``:
  - bytes ``[0, 448)``: the e4m3 code of nope feature ``b``. So byte plane ``j`` of word ``w``
    is feature ``128 j + w``: planes 0-2 are features 0-383 on all 128 lanes, plane 3 holds
    features 384-447 on words 0-63. Tile ``t`` (features ``64 t .. 64 t + 63``) is plane
    ``t // 2``, lanes ``64 (t % 2) .. + 63``.
  - bytes ``[448, 455)``: the ue8m0 scale byte of tile ``t`` at byte ``448 + t``, i.e. byte 3
    (bits 24-31) of word ``64 + t``. As f32 it is ``bitcast(byte << 23)`` (exact for bytes
    1-254, which includes every byte the quantizer writes: 114-247 for finite input).
  - bytes ``[455, 512)``: zero (bits 24-31 of words 71-127).
- ``rope: u32[..., P, ceil(ps / 4), 128]``: four tokens per 128-lane row. Token ``r`` of a page
  owns words ``32 (r % 4) .. 32 (r % 4) + 31`` of row ``r // 4``; its word ``i`` holds rope
  value ``i`` (feature ``448 + i``) in the low 16 bits and rope value ``32 + i`` (feature
  ``480 + i``) in the high 16 bits, as ``reference.formats.fp8_cache``'s latent rope words do.
  Quarters of a last partial row (``ps % 4 != 0``) are zero.
- A gathered token is the ``u32[160]`` "row" ``quantize_v4_rows`` writes and
  ``dequantize_v4_rows`` reads: its nope record (words 0-127) then its rope quarter (words
  128-159). In VMEM, with the two rows DMA'd: nope ``e4m3 = bitcast((w >> 8 j) & 0xFF)``,
  scale by lane as above; rope low / high halves ``bitcast(w << 16, f32)`` /
  ``bitcast(w & 0xFFFF0000, f32)`` are rope ``i`` / ``32 + i`` exactly.

Why this layout (``scripts/probes/v4_layout_probe.py``, AOT via libtpu on v5e, v6e and tpu7x; the
numbers are XLA's argument bytes and Mosaic's verdicts):

- Mosaic DMAs move whole 128-word lane rows: a 32-of-128-lane piece of a row is refused at a
  dynamic lane offset and at a static one too ("The contiguous inner slice in the DMA transfer
  must be divisible by 512 bytes" / "Source and target leading tiles have different trailing
  dimensions"). A single *row* at a dynamic page and row offset is one DMA for any width.
- A ``u32[P, ps, W]`` with ``W`` not a multiple of 128 (146 = FlashMLA's 584 B, 160, 32) gets a
  *transposed* default layout from XLA (``{0,2,1}`` / ``{0,1,2}``: no lane padding, 584 / 640 /
  128 B per token), and a Pallas kernel reading it row-major makes XLA insert a relayout copy
  of the whole cache on every call. Row-major, such a ``W`` pads to whole 128 lanes (160 words
  -> 256 = 1024 B). So every array here has a last dim of 128.
- One record of 146 words padded to 256 (the V3.2 latent cache's choice) stores and moves 1024 B
  per token. This split stores **640 B per token** in HBM (512 nope + 128 rope; XLA's argument
  bytes, measured at page sizes 4, 8, 16, 32, 64, 256 on all three chips), 0.625x. A
  token-sparse gather moves 512 B nope + the 512 B rope row it shares with three other tokens
  = 1024 B in 2 DMAs (no layout does better: 583 bytes of data per token and 512-byte DMA
  granules); a read of whole pages (e.g. HCA's every visible entry) moves 640 B per token. The
  probe's gather kernel (two whole-row DMAs per token, the quarter picked by lanes, the rope
  halves unpacked) compiles on v5e, v6e and tpu7x with no relayout copy.
- Page sizes for the TPU kernels: a multiple of 32, or 4, 8, 16 (``ceil(ps / 4)`` rope rows a
  multiple of 8 or a power of two). Others work here, but XLA's default layout of the rope array
  is then not row-major (measured: ``u32[256, 6, 128]{2,0,1}`` at ``ps = 24``), so a Pallas
  kernel pays a relayout copy per call; ``ps`` 1 and 2 cost 1024 / 768 B per token.
- tpu-inference (``kernels/experimental/deepseek_v4``, ``csa_gather``) stores the same split:
  a ``(4, 128)`` u8 nope record per token (448 e4m3, 7 e8m0, zero pad, gathered as one 128-lane
  int32 row) and a rope array of 128 B per token, four tokens per 128-lane int32 row (byte
  planes there, gathered by SparseCore; lane quarters here, so a TensorCore kernel selects by
  lanes).

FlashMLA interop (MODEL1, verified against ``tests/quant.py`` ``quantize_k_cache`` and the sm90
decode kernel ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``, which addresses a token's 576
bytes at ``block * block_stride + r * 576`` and its 8 scale bytes at ``block * block_stride + ps *
576 + r * 8``; ``csrc/api/sparse_decode.h`` checks ``448 + 64 * 2 + 7 + 1 = 584`` bytes per
token): a page is ``ps`` x ``[448 e4m3 | 64 bf16 rope (LE)]`` (576 B each), then ``ps`` x ``[7
ue8m0 | 1 pad]``, then zeros up to ``flashmla_page_bytes(ps) = ceil(584 ps / 576) * 576`` bytes
(the test's page stride; the kernel takes any stride). ``v4_cache_to_flashmla`` writes zero pad
bytes; ``v4_cache_from_flashmla`` ignores them. Pure bit moves: round trips are bit-exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.formats import fp8_cache
from reference.quant import fp8

V4_DIM = 512
V4_NOPE = 448
V4_ROPE = 64
V4_TILE = 64
V4_TILES = V4_NOPE // V4_TILE  # 7
LANES = 128
NOPE_WORDS = LANES  # the 512-byte nope record
RECORD_BYTES = 4 * NOPE_WORDS
SCALE_BYTE0 = V4_NOPE  # record byte of tile 0's scale
SCALE_WORD0 = SCALE_BYTE0 % LANES  # 64: tile t's scale is byte 3 of word 64 + t
ROPE_WORDS = V4_ROPE // 2  # 32 words per token
ROPE_TOKENS_PER_ROW = LANES // ROPE_WORDS  # 4
ROW_WORDS = NOPE_WORDS + ROPE_WORDS  # 160: a gathered token
STORED_BYTES_PER_TOKEN = 4 * NOPE_WORDS + 4 * ROPE_WORDS  # 640 (ps % 32 == 0)
FLASHMLA_TOKEN_BYTES = V4_NOPE + 2 * V4_ROPE + V4_TILES + 1  # 584
FLASHMLA_DATA_BYTES = V4_NOPE + 2 * V4_ROPE  # 576
FLASHMLA_SCALE_BYTES = V4_TILES + 1  # 8
E8M0_DTYPE = jnp.dtype(jnp.float8_e8m0fnu)

_U32 = np.dtype(np.uint32)
_U8 = np.dtype(np.uint8)


def rope_rows(page_size: int) -> int:
    """Rows of one page of the rope array: ``ceil(page_size / 4)``."""
    return -(-page_size // ROPE_TOKENS_PER_ROW)


def tpu_page_size_ok(page_size: int) -> bool:
    """Whether XLA's default TPU layout of a page size's rope array is row-major (module
    docstring, "Page sizes for the TPU kernels"): a multiple of 32, or 4, 8, 16. Other page
    sizes are correct everywhere, but a Pallas kernel then pays a relayout copy of the rope
    array per call (measured at 24), and page sizes 1 and 2 store 1024 / 768 B per token."""
    return page_size % 32 == 0 or page_size in (4, 8, 16)


def flashmla_page_bytes(page_size: int) -> int:
    """FlashMLA MODEL1 page bytes: ``584 * page_size`` rounded up to a multiple of 576."""
    return -(-page_size * FLASHMLA_TOKEN_BYTES // FLASHMLA_DATA_BYTES) * FLASHMLA_DATA_BYTES


@dataclass(frozen=True)
class Fp8V4Cache(fp8_cache._Paged):
    """The fp8 MODEL1 cache (module docstring): ``nope u32[..., P, ps, 128]``, ``rope
    u32[..., P, ceil(ps / 4), 128]``. A pytree: it passes through ``jax.jit``."""

    nope: jax.Array
    rope: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, 512)`` of the rows it holds (leading dims
        of a stacked cache included)."""
        return (*np.shape(self.nope)[:-1], V4_DIM)


jax.tree_util.register_dataclass(Fp8V4Cache, data_fields=["nope", "rope"], meta_fields=[])


# ---------------------------------------------------------------------------------------------
# Static checks.

def _dtype(x) -> np.dtype:
    return np.dtype(jnp.result_type(x))


def check_v4_cache(name: str, cache) -> None:
    """Refuse anything but a well-formed ``Fp8V4Cache`` (TypeError for another type, ValueError
    naming the part, the numbers and the rule otherwise). Static: shapes and dtypes only."""
    if not isinstance(cache, Fp8V4Cache):
        raise TypeError(f"{name} must be an Fp8V4Cache, got {type(cache).__name__}")
    for part in ("nope", "rope"):
        x = getattr(cache, part)
        if _dtype(x) != _U32:
            raise ValueError(f"{name}.{part} must have dtype uint32, got {_dtype(x)}")
        if np.ndim(x) < 3:
            raise ValueError(f"{name}.{part} must have rank >= 3 ([..., num_pages, rows, 128]), "
                             f"got shape {tuple(np.shape(x))}")
        if np.shape(x)[-1] != LANES:
            raise ValueError(f"{name}.{part}.shape[-1] must be {LANES} (one 128-lane row), got "
                             f"{np.shape(x)[-1]} (shape {tuple(np.shape(x))})")
    nope, rope = np.shape(cache.nope), np.shape(cache.rope)
    want = (*nope[:-2], rope_rows(nope[-2]), LANES)
    if tuple(rope) != want:
        raise ValueError(f"{name}.rope must have shape {want} (leading dims and pages of "
                         f"{name}.nope {tuple(nope)}, ceil(page_size / 4) = "
                         f"{rope_rows(nope[-2])} rows for page_size {nope[-2]}), got "
                         f"{tuple(rope)}")


def _check_rows_in(name: str, x) -> jax.Array:
    x = fp8._float_input(name, x)
    _checks.dim(name, x, -1, V4_DIM, "the V4 row (448 nope + 64 rope)")
    return x


def _check_words(name: str, words) -> jax.Array:
    if _dtype(words) != _U32:
        raise ValueError(f"{name} must have dtype uint32, got {_dtype(words)}")
    fp8._min_rank(name, words, 1)
    _checks.dim(name, words, -1, ROW_WORDS, "a gathered V4 token (128 nope + 32 rope words)")
    return jnp.asarray(words)


# ---------------------------------------------------------------------------------------------
# The quantizer and the row words.

@jax.jit
def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    lead = x.shape[:-1]
    tiles = x32[..., :V4_NOPE].reshape(*lead, V4_TILES, V4_TILE)
    s = fp8._divide(fp8._amax(tiles), jnp.float32(fp8.FP8_MAX))
    s = fp8._pow2_ceil(jnp.maximum(s, jnp.float32(fp8.SCALE_FLOOR)))
    nope8 = fp8._cast_blocks(tiles, s).reshape(*lead, V4_NOPE)
    return nope8, s, x32[..., V4_NOPE:].astype(jnp.bfloat16)


def quantize_v4_fp8(x) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FlashMLA's MODEL1 rule (module docstring): ``x: f32|bf16[..., 512]`` -> ``(nope8:
    float8_e4m3fn[..., 448], scales: f32[..., 7], rope: bf16[..., 64])``; the scales are powers
    of two ``>= 2**-13`` (NaN / inf for non-finite tiles)."""
    return _quantize(_check_rows_in("x", x))


def _scale_bytes(s: jax.Array) -> jax.Array:
    """f32 powers of two -> their ue8m0 bytes (the biased exponent; NaN and inf -> 0xFF)."""
    e = (lax.bitcast_convert_type(s, jnp.uint32) >> 23) & jnp.uint32(0xFF)
    return e.astype(jnp.uint8)


def _bytes_to_words(b: jax.Array) -> jax.Array:
    """``u8[..., 512]`` record -> ``u32[..., 128]``: byte ``b`` in byte ``b // 128`` of word
    ``b % 128``."""
    planes = b.astype(jnp.uint32).reshape(*b.shape[:-1], 4, NOPE_WORDS)
    return sum(planes[..., j, :] << (8 * j) for j in range(4))


def _words_to_bytes(w: jax.Array) -> jax.Array:
    """Inverse of ``_bytes_to_words``."""
    planes = jnp.stack([(w >> (8 * j)) & 0xFF for j in range(4)], axis=-2)
    return planes.astype(jnp.uint8).reshape(*w.shape[:-1], RECORD_BYTES)


@jax.jit
def _parts_to_words(nope8, scale_bytes, rope) -> jax.Array:
    lead = nope8.shape[:-1]
    codes = lax.bitcast_convert_type(nope8, jnp.uint8)
    pad = jnp.zeros((*lead, RECORD_BYTES - V4_NOPE - V4_TILES), jnp.uint8)
    record = _bytes_to_words(jnp.concatenate([codes, scale_bytes, pad], axis=-1))
    bits = lax.bitcast_convert_type(rope, jnp.uint16).astype(jnp.uint32)
    rope_words = bits[..., :ROPE_WORDS] | (bits[..., ROPE_WORDS:] << 16)
    return jnp.concatenate([record, rope_words], axis=-1)


@jax.jit
def _words_to_parts(words) -> tuple[jax.Array, jax.Array, jax.Array]:
    record = _words_to_bytes(words[..., :NOPE_WORDS])
    nope8 = lax.bitcast_convert_type(record[..., :V4_NOPE], fp8.FP8_DTYPE)
    scale_bytes = record[..., SCALE_BYTE0:SCALE_BYTE0 + V4_TILES]
    rw = words[..., NOPE_WORDS:]
    halves = jnp.concatenate([rw & 0xFFFF, rw >> 16], axis=-1).astype(jnp.uint16)
    return nope8, scale_bytes, lax.bitcast_convert_type(halves, jnp.bfloat16)


def quantize_v4_rows(x) -> jax.Array:
    """``x: f32|bf16[..., 512]`` -> ``u32[..., 160]``: each row quantized and stored as a
    gathered token's words (module docstring: the nope record, then the rope quarter)."""
    nope8, s, rope = quantize_v4_fp8(x)
    return _parts_to_words(nope8, _scale_bytes(s), rope)


@jax.jit
def _dequantize_rows(words: jax.Array) -> jax.Array:
    nope8, scale_bytes, rope = _words_to_parts(words)
    s = lax.bitcast_convert_type(scale_bytes, E8M0_DTYPE).astype(jnp.float32)
    tiles = nope8.astype(jnp.float32).reshape(*nope8.shape[:-1], V4_TILES, V4_TILE)
    nope = (tiles * s[..., None]).reshape(nope8.shape).astype(jnp.bfloat16)
    return jnp.concatenate([nope, rope], axis=-1)


def dequantize_v4_rows(words) -> jax.Array:
    """Gathered stored rows ``u32[..., 160]`` -> their values ``bf16[..., 512]``: ``e4m3 * s_t``
    per tile (exact in bf16), then the rope. All-zero words decode to zeros."""
    return _dequantize_rows(_check_words("words", words))


# ---------------------------------------------------------------------------------------------
# Whole caches.

def _rows_to_cache(words: jax.Array) -> Fp8V4Cache:
    """``u32[..., P, ps, 160]`` token words -> ``Fp8V4Cache`` (rope quarters into rows)."""
    *lead, ps, _ = words.shape
    rope = words[..., NOPE_WORDS:]
    extra = rope_rows(ps) * ROPE_TOKENS_PER_ROW - ps
    rope = jnp.pad(rope, [(0, 0)] * len(lead) + [(0, extra), (0, 0)])
    return Fp8V4Cache(words[..., :NOPE_WORDS], rope.reshape(*lead, rope_rows(ps), LANES))


def _cache_to_rows(cache: Fp8V4Cache) -> jax.Array:
    """Inverse of ``_rows_to_cache``: ``u32[..., P, ps, 160]``."""
    ps = cache.page_size
    lead = np.shape(cache.rope)[:-2]
    rope = cache.rope.reshape(*lead, -1, ROPE_WORDS)[..., :ps, :]
    return jnp.concatenate([cache.nope, rope], axis=-1)


def _check_paged(name: str, x) -> None:
    if np.ndim(x) < 3:
        raise ValueError(f"{name} must be [..., num_pages, page_size, 512] (rank >= 3), got "
                         f"rank {np.ndim(x)} (shape {tuple(np.shape(x))})")


def quantize_v4_cache(x) -> Fp8V4Cache:
    """``x: f32|bf16[..., P, page_size, 512]`` -> the ``Fp8V4Cache`` holding each token's
    MODEL1 quantization (leading dims, e.g. stacked layers, kept)."""
    _check_paged("x", x)
    return _rows_to_cache(quantize_v4_rows(x))


def dequantize_v4_cache(cache: Fp8V4Cache) -> jax.Array:
    """The values an ``Fp8V4Cache`` holds: ``bf16[..., P, page_size, 512]``."""
    check_v4_cache("cache", cache)
    return _dequantize_rows(_cache_to_rows(cache))


@functools.partial(jax.jit, static_argnames=("num_pages", "page_size"))
def empty_v4_cache(num_pages: int, page_size: int) -> Fp8V4Cache:
    """An all-zero ``Fp8V4Cache`` (every value 0)."""
    return Fp8V4Cache(jnp.zeros((num_pages, page_size, NOPE_WORDS), jnp.uint32),
                      jnp.zeros((num_pages, rope_rows(page_size), LANES), jnp.uint32))


def gather_v4_rows(cache: Fp8V4Cache, slots) -> jax.Array:
    """The stored words of tokens ``slots i32[...]`` -> ``u32[..., 160]``; zeros (nothing read)
    for a slot outside ``[0, num_slots)``.

    A slot is flat over every leading dim: ``((l * P) + page_id) * page_size + offset`` for
    layer ``l`` of a stacked cache (``page_id * page_size + offset`` unstacked). The nope row is
    row ``slot`` of ``nope`` flattened; the rope words are quarter ``offset % 4`` of row
    ``(slot // page_size) * ceil(page_size / 4) + offset // 4`` of ``rope`` flattened."""
    ps = cache.page_size
    nope = cache.nope.reshape(-1, NOPE_WORDS)
    rope = cache.rope.reshape(-1, LANES)
    slots = jnp.asarray(slots, jnp.int32)
    ok = (slots >= 0) & (slots < nope.shape[0])
    s = jnp.where(ok, slots, 0)
    rec = jnp.take(nope, jnp.where(ok, s, nope.shape[0]), axis=0, mode="fill", fill_value=0)
    row = jnp.where(ok, (s // ps) * rope_rows(ps) + (s % ps) // ROPE_TOKENS_PER_ROW,
                    rope.shape[0])
    rows = jnp.take(rope, row, axis=0, mode="fill", fill_value=0)
    rows = rows.reshape(*rows.shape[:-1], ROPE_TOKENS_PER_ROW, ROPE_WORDS)
    quarter = (s % ps) % ROPE_TOKENS_PER_ROW
    rope_words = jnp.take_along_axis(rows, quarter[..., None, None], axis=-2)[..., 0, :]
    return jnp.concatenate([rec, rope_words], axis=-1)


def write_v4_rows(cache: Fp8V4Cache, slots, rows, *, layer=None) -> Fp8V4Cache:
    """Quantize ``rows f32|bf16[T, 512]`` and store row ``t`` at flat slot ``slots[t]`` (``page_id
    * page_size + offset``; of ``layer`` of a stacked ``[L, P, ...]`` cache when given, else flat
    over every leading dim as ``gather_v4_rows``). A slot outside ``[0, num_slots)`` drops its
    row; nothing else changes. Two rows with one slot: which lands is unspecified (the nope and
    rope parts may even come from different rows)."""
    check_v4_cache("cache", cache)
    rows = _check_rows_in("rows", rows)
    slots = jnp.asarray(slots)
    if np.ndim(rows) != 2 or np.shape(slots) != np.shape(rows)[:1]:
        raise ValueError(f"rows must be [T, 512] and slots [T], got rows {tuple(np.shape(rows))}"
                         f" and slots {tuple(np.shape(slots))}")
    lead = np.shape(cache.nope)[:-3]
    per_layer = cache.num_pages * cache.page_size
    if layer is None:
        limit, base = per_layer * int(np.prod(lead, dtype=np.int64)), 0
    else:
        if len(lead) != 1:
            raise ValueError(f"layer= needs a stacked cache [L, P, ps, ...], got cache.shape "
                             f"{cache.shape}")
        limit, base = per_layer, jnp.asarray(layer, jnp.int32) * per_layer
    return _write(cache, slots.astype(jnp.int32), rows, limit, base)


@functools.partial(jax.jit, static_argnames=("limit",))
def _write(cache, slots, rows, limit, base):
    ps = cache.page_size
    words = quantize_v4_rows(rows)
    nope = cache.nope.reshape(-1, ps, NOPE_WORDS)
    rope = cache.rope.reshape(-1, rope_rows(ps), LANES)
    ok = (slots >= 0) & (slots < limit)
    s = jnp.where(ok, slots, 0) + base
    ok &= (s >= 0) & (s < nope.shape[0] * ps)  # a layer outside [0, L) too
    page = jnp.where(ok, s // ps, nope.shape[0])  # one past the end: dropped
    offset = s % ps
    nope = nope.at[page, offset].set(words[:, :NOPE_WORDS], mode="drop")
    # The rope quarters, as whole 128-lane rows (a row gather and a row scatter per index; a
    # scatter of 32 single words per token is per element in XLA's TPU model, and one of a
    # 32-lane window at a dynamic lane offset becomes a loop over the tokens): one read-modify-
    # write pass per quarter q = offset % 4, so tokens sharing a rope row (consecutive offsets)
    # are in different passes and each pass sees the earlier ones' words. Within a pass, two
    # tokens on one row have one slot (the unspecified case above); the other lanes agree.
    rope_row = offset // ROPE_TOKENS_PER_ROW
    quarter = offset % ROPE_TOKENS_PER_ROW
    mine = jnp.tile(words[:, NOPE_WORDS:], (1, ROPE_TOKENS_PER_ROW))  # [T, 128]
    lane_quarter = jnp.arange(LANES) // ROPE_WORDS
    for q in range(ROPE_TOKENS_PER_ROW):
        pg = jnp.where(quarter == q, page, rope.shape[0])
        old = rope.at[pg, rope_row].get(mode="fill", fill_value=0)
        rope = rope.at[pg, rope_row].set(jnp.where(lane_quarter == q, mine, old), mode="drop")
    return Fp8V4Cache(nope.reshape(cache.nope.shape), rope.reshape(cache.rope.shape))


# ---------------------------------------------------------------------------------------------
# FlashMLA MODEL1 page bytes.

@jax.jit
def _to_flashmla(cache: Fp8V4Cache) -> jax.Array:
    words = _cache_to_rows(cache)
    *lead, ps, _ = words.shape
    nope8, scale_bytes, rope = _words_to_parts(words)
    data = jnp.concatenate([lax.bitcast_convert_type(nope8, jnp.uint8),
                            fp8._to_bytes(rope)], axis=-1)  # [..., ps, 576]
    scales = jnp.pad(scale_bytes, [(0, 0)] * (len(lead) + 1) + [(0, 1)])  # [..., ps, 8]
    used = ps * FLASHMLA_TOKEN_BYTES
    page = jnp.concatenate([data.reshape(*lead, ps * FLASHMLA_DATA_BYTES),
                            scales.reshape(*lead, ps * FLASHMLA_SCALE_BYTES),
                            jnp.zeros((*lead, flashmla_page_bytes(ps) - used), jnp.uint8)],
                           axis=-1)
    return page


def v4_cache_to_flashmla(cache: Fp8V4Cache) -> jax.Array:
    """``u8[..., P, flashmla_page_bytes(page_size)]``: FlashMLA's MODEL1 pages (module
    docstring), pad bytes zero. View one as FlashMLA's ``(P, page_size, 1, 584)`` k cache with
    page stride ``flashmla_page_bytes(page_size)``."""
    check_v4_cache("cache", cache)
    return _to_flashmla(cache)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _from_flashmla(pages: jax.Array, page_size: int) -> Fp8V4Cache:
    *lead, _ = pages.shape
    cut = page_size * FLASHMLA_DATA_BYTES
    data = pages[..., :cut].reshape(*lead, page_size, FLASHMLA_DATA_BYTES)
    scales = pages[..., cut:cut + page_size * FLASHMLA_SCALE_BYTES].reshape(
        *lead, page_size, FLASHMLA_SCALE_BYTES)
    nope8 = lax.bitcast_convert_type(data[..., :V4_NOPE], fp8.FP8_DTYPE)
    rope = fp8._from_bytes(data[..., V4_NOPE:], jnp.bfloat16)
    return _rows_to_cache(_parts_to_words(nope8, scales[..., :V4_TILES], rope))


def v4_cache_from_flashmla(pages, page_size: int) -> Fp8V4Cache:
    """The inverse of ``v4_cache_to_flashmla``: ``pages u8[..., P, W]`` with ``W`` either
    ``flashmla_page_bytes(page_size)`` (padded, as FlashMLA's test allocates) or ``584 *
    page_size`` (unpadded) -> ``Fp8V4Cache``. Pad bytes (each token's 8th scale byte, the page
    tail) are ignored; everything else round-trips bit-exactly."""
    page_size = _checks.positive_int("page_size", page_size)
    if _dtype(pages) != _U8:
        raise ValueError(f"pages must have dtype uint8, got {_dtype(pages)}")
    fp8._min_rank("pages", pages, 2)
    width = np.shape(pages)[-1]
    allowed = (flashmla_page_bytes(page_size), page_size * FLASHMLA_TOKEN_BYTES)
    if width not in allowed:
        raise ValueError(f"pages.shape[-1] = {width} does not fit page_size = {page_size}: a "
                         f"MODEL1 page of {page_size} tokens x {FLASHMLA_TOKEN_BYTES} B is "
                         f"{allowed[1]} bytes, {allowed[0]} padded to a multiple of "
                         f"{FLASHMLA_DATA_BYTES}")
    return _from_flashmla(jnp.asarray(pages), page_size)
