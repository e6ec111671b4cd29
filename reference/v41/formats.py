"""DeepSeek-V4.1's cache quantizers as stored formats: encode rows to bytes, decode bytes to f32.

The rules are the official ``inference/kernel.py`` of the DeepSeek-V4.1-Flash release (TileLang
``act_quant_kernel`` and ``fp4_quant_kernel``; read through public restatements that cite its
lines, restated here), called from ``inference/model.py`` with ``inplace=True`` (quantize,
dequantize, write the bf16 value back). Everything is f32; ``/`` is an IEEE f32 division
(``reference.quant.fp8._divide`` keeps XLA from turning it into a multiply by the reciprocal).

- **Window KV**, fp8 e4m3 with ue8m0 scales per 32 over all ``D = 512`` dims (the RoPE tail
  included): per block ``amax = max(max |x|, 1e-4)``, ``s = 2**ceil(log2(amax * f32(1/448)))``
  (the ceiling from the f32 bits: an exact power of two stays, anything above goes up),
  ``code = e4m3(clip(x / s, -448, 448))`` round-to-nearest-even. This is
  ``reference.quant.fp8.quantize_fp8(x, block_size=32, scale_fmt="ue8m0")``, reused as is.
- **Compressed KV**, fp4 e2m1 with e4m3 scales per 16 over all ``D = 512`` dims, after RoPE:
  ``amax = max(max |x|, 6 * 2**-9)`` (an all-zero block gets the smallest e4m3 subnormal,
  ``2**-9``), ``s = e4m3(amax / 6)`` round-to-nearest-even, saturating to 448 (CUDA's
  ``satfinite`` conversion; reached only for ``amax > 2784``), then ``code = e2m1(clip(x / s, -6,
  6))`` RNE onto ``{0, .5, 1, 1.5, 2, 3, 4, 6}``: midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go
  to the even code (0, 1, 1, 2, 2, 4, 4). Since ``s`` may round *down*, ``x / s`` can exceed 6 and
  saturates there.
- **Index q and k**, fp4 e2m1 with ue8m0 scales per 32 (``D = 128`` per head), **no Hadamard
  rotation**: ``amax = max(max |x|, 6 * 2**-126)``, ``s = 2**ceil(log2(amax * f32(1/6)))``, ``code =
  e2m1(clip(x / s, -6, 6))`` RNE.

Decoded values are ``value(code) * s`` in f32, exact, and exactly representable in bf16: they are
the official in-place bf16 results bit for bit. The official e4m3 scale is ``amax / 6`` where
V4-style code multiplies by ``f32(1/6)``; for bf16 input (the kernels' input dtype) both give the
same e4m3 scale for every positive bf16 amax (``tests/test_v41_formats.py`` sweeps them all), and
an f32 quotient never lands across an e2m1 or e4m3 midpoint that the exact quotient does not.

Byte layouts (one token row; little-endian; ``D`` the row width):

- window: ``D`` e4m3 bytes (feature ``i`` at byte ``i``), then ``D / 32`` ue8m0 bytes (block
  ``j`` at ``D + j``; value ``2**(byte - 127)``, 0xFF NaN): **528 B** for ``D = 512``.
- compressed: ``D / 2`` nibble bytes (byte ``i``: feature ``2i`` in the low nibble, ``2i + 1`` in
  the high one, as ``torch.float4_e2m1fn_x2`` and the official ``fp4_gemm`` pack), then ``D / 16``
  e4m3 scale bytes: **288 B** for ``D = 512``.
- index: ``D / 2`` nibble bytes as above, then ``D / 32`` ue8m0 bytes: **68 B** for ``D = 128``.

An e2m1 nibble is ``sign << 3 | code``, code 0-7 the grid above; ``-x`` rounding to zero keeps
its sign (0x8, decoding to -0.0), as the hardware conversion does. Non-finite input: a NaN in a
block makes its scale NaN (e4m3 0x7F, ue8m0 0xFF; its nibbles are 0) so the block decodes to NaN;
an inf gives an inf (ue8m0: 0xFF) or saturated (e4m3: 448) scale; neither is in the formats'
domain.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.formats import model1
from reference.quant import fp8, qat
from reference.v41.config import HEAD_DIM, INDEX_HEAD_DIM

__all__ = [
    "BYTE_BITS", "COMPRESSED_BLOCK", "E2M1_GRID", "INDEX_BLOCK", "NIBBLE_BITS", "WINDOW_BLOCK",
    "compressed_kv_bytes",
    "decode_compressed_kv", "decode_index_fp4", "decode_window_kv", "e2m1_values",
    "encode_compressed_kv", "encode_index_fp4", "encode_window_kv", "index_fp4_bytes",
    "ue8m0_values", "window_kv_bytes",
]

WINDOW_BLOCK = 32  # features per ue8m0 scale of the window kv (fp8)
COMPRESSED_BLOCK = 16  # features per e4m3 scale of the compressed kv (fp4)
INDEX_BLOCK = 32  # features per ue8m0 scale of index q and k (fp4)
COMPRESSED_AMAX_FLOOR = 6.0 * 2.0 ** -9  # keeps an all-zero block's e4m3 scale nonzero
NIBBLE_BITS = 4  # bits of an e2m1 code: two a byte, eight a 32-bit word
BYTE_BITS = 8  # bits of an e4m3 / ue8m0 byte: four a 32-bit word
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; bit 3 is the sign

_U8 = jnp.dtype(jnp.uint8)


def window_kv_bytes(dim: int = HEAD_DIM) -> int:
    """Bytes per token of the window kv: ``dim`` e4m3 codes + ``dim / 32`` ue8m0 scales."""
    return dim + dim // WINDOW_BLOCK


def compressed_kv_bytes(dim: int = HEAD_DIM) -> int:
    """Bytes per token of the compressed kv: ``dim / 2`` nibble bytes + ``dim / 16`` e4m3 scales."""
    return dim // 2 + dim // COMPRESSED_BLOCK


def index_fp4_bytes(dim: int = INDEX_HEAD_DIM) -> int:
    """Bytes per index head row: ``dim / 2`` nibble bytes + ``dim / 32`` ue8m0 scales."""
    return dim // 2 + dim // INDEX_BLOCK


# ---------------------------------------------------------------------------------------------
# Pieces.

def _rows(name: str, x, block: int) -> jax.Array:
    """Refuse non-f32/bf16 input, rank 0, or a last dim ``block`` does not divide (or odd)."""
    _checks.floating(name, x)
    if np.ndim(x) < 1:
        raise ValueError(f"{name} must have rank >= 1, got shape {tuple(np.shape(x))}")
    d = np.shape(x)[-1]
    if d % block:
        raise ValueError(f"{name}.shape[-1] = {d} is not a multiple of the block size {block}")
    return jnp.asarray(x)


def _bytes_in(name: str, b, per_unit: int, unit: int) -> int:
    """Check ``u8[..., W]`` with ``W`` a multiple of ``per_unit`` bytes (one per ``unit``
    features); return the row width in features."""
    dt = np.dtype(b.dtype) if hasattr(b, "dtype") else np.asarray(b).dtype
    if dt != _U8:
        raise ValueError(f"{name} must have dtype uint8, got dtype {dt}")
    if np.ndim(b) < 1:
        raise ValueError(f"{name} must have rank >= 1, got shape {tuple(np.shape(b))}")
    w = np.shape(b)[-1]
    if w == 0 or w % per_unit:
        raise ValueError(f"{name}.shape[-1] = {w} is not a positive multiple of {per_unit} bytes "
                         f"(one per {unit} features)")
    return w // per_unit * unit


def ue8m0_values(b: jax.Array) -> jax.Array:
    """ue8m0 bytes (``u8`` or ``i32`` holding 0-255) -> f32 ``2**(byte - 127)`` (bytes 1-254
    exact; 0xFF NaN; 0 is never written and reads as 0 here). Integer shifts, a same-width
    bitcast and a select: the form a Pallas TPU kernel lowers (``pallas_kernels.indexer.
    v41_pages`` decodes its pages with it)."""
    b = b.astype(jnp.int32)
    v = lax.bitcast_convert_type(b << 23, jnp.float32)
    return jnp.where(b == 0xFF, jnp.float32(jnp.nan), v)



def _e2m1_nibbles(y: jax.Array) -> jax.Array:
    """f32 ``y`` with ``|y| <= 6`` (or NaN) -> u8 nibbles ``sign << 3 | code``, RNE onto the grid
    (``qat._round_e2m1``: a half-to-even rounding of ``|y| / step``, step 0.5 / 1 / 2 below 2 / 4 /
    6). NaN -> 0."""
    m = jnp.abs(qat._round_e2m1(y))
    code = jnp.where(m < 2, m * 2, jnp.where(m < 4, m + 2, m / 2 + 4))
    code = jnp.where(jnp.isnan(y), 0.0, code).astype(jnp.uint8)
    sign = (lax.bitcast_convert_type(y, jnp.uint32) >> 31).astype(jnp.uint8)
    return jnp.where(jnp.isnan(y), jnp.uint8(0), code | (sign << 3))


def _pack(nibbles: jax.Array) -> jax.Array:
    """``u8[..., D]`` nibbles -> ``u8[..., D / 2]``: feature ``2i`` low, ``2i + 1`` high."""
    pairs = nibbles.reshape(*nibbles.shape[:-1], nibbles.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << NIBBLE_BITS)


def _unpack_values(packed: jax.Array) -> jax.Array:
    """``u8[..., D / 2]`` -> f32 e2m1 values ``[..., D]`` (signed; 0x8 is -0.0)."""
    nib = jnp.stack([packed & 0xF, packed >> NIBBLE_BITS], axis=-1).reshape(*packed.shape[:-1], -1)
    return e2m1_values(nib)


def e2m1_values(nib: jax.Array) -> jax.Array:
    """e2m1 nibbles ``sign << 3 | code`` (``u8`` or ``i32`` holding 0-15) -> their f32 values
    (signed; 0x8 is -0.0). The ``E2M1_GRID`` value of code ``c = e << 1 | m`` by selects (a
    table lookup is a gather per element on TPU): ``e = 0`` the subnormals ``m / 2``, else ``(1
    + m / 2) 2^(e - 1)``; exact in f32. The form a Pallas TPU kernel lowers too."""
    code = (nib & 0x7).astype(jnp.int32)
    e, m = (code >> 1).astype(jnp.float32), (code & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.where(e == 1, 1.0,
                                                                    jnp.where(e == 2, 2.0, 4.0)))
    return jnp.where((nib & 0x8) != 0, -mag, mag)


def _fp4_blocks(x: jax.Array, block: int, scale_of) -> tuple[jax.Array, jax.Array]:
    """Quantize ``x: f32[..., D]`` per ``block``: ``scale_of(amax) -> (s f32, s bytes u8)``;
    return ``(packed u8[..., D / 2], scale bytes u8[..., D / block])``."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s, s_bytes = scale_of(fp8._amax(blocks))
    y = jnp.clip(fp8._divide(blocks, s[..., None]), -qat.FP4_MAX, qat.FP4_MAX)
    return _pack(_e2m1_nibbles(y).reshape(x.shape)), s_bytes


def _decode_fp4(b: jax.Array, dim: int, block: int, scale_value) -> jax.Array:
    values = _unpack_values(b[..., :dim // 2])
    s = scale_value(b[..., dim // 2:])
    blocks = values.reshape(*values.shape[:-1], dim // block, block) * s[..., None]
    return blocks.reshape(values.shape)


# ---------------------------------------------------------------------------------------------
# Window kv: fp8 e4m3, ue8m0 per 32.

@jax.jit
def _encode_window(x: jax.Array) -> jax.Array:
    x8, s = fp8.quantize_fp8(x, block_size=WINDOW_BLOCK, scale_fmt="ue8m0")
    return jnp.concatenate([lax.bitcast_convert_type(x8, jnp.uint8), model1._scale_bytes(s)],
                           axis=-1)


def encode_window_kv(x) -> jax.Array:
    """``x: f32|bf16[..., D]`` (``D % 32 == 0``; 512 in V4.1) -> ``u8[..., D + D / 32]`` (528 B
    for 512): e4m3 codes then ue8m0 scale bytes (module docstring)."""
    return _encode_window(_rows("x", x, WINDOW_BLOCK))


@functools.partial(jax.jit, static_argnames=("dim",))
def _decode_window(b: jax.Array, dim: int) -> jax.Array:
    x8 = lax.bitcast_convert_type(b[..., :dim], fp8.FP8_DTYPE)
    return fp8.dequantize_fp8(x8, ue8m0_values(b[..., dim:]), block_size=WINDOW_BLOCK)


def decode_window_kv(b) -> jax.Array:
    """``u8[..., 33 D / 32]`` -> ``f32[..., D]``: ``e4m3(code) * 2**(scale byte - 127)``."""
    dim = _bytes_in("b", b, window_kv_bytes(WINDOW_BLOCK), WINDOW_BLOCK)
    return _decode_window(jnp.asarray(b), dim)


# ---------------------------------------------------------------------------------------------
# Compressed kv: fp4 e2m1, e4m3 per 16.

def _e4m3_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    q = fp8._divide(jnp.maximum(amax, jnp.float32(COMPRESSED_AMAX_FLOOR)), jnp.float32(qat.FP4_MAX))
    s8 = jnp.minimum(q, jnp.float32(fp8.FP8_MAX)).astype(fp8.FP8_DTYPE)  # satfinite; NaN stays
    return s8.astype(jnp.float32), lax.bitcast_convert_type(s8, jnp.uint8)


@jax.jit
def _encode_compressed(x: jax.Array) -> jax.Array:
    packed, s_bytes = _fp4_blocks(x.astype(jnp.float32), COMPRESSED_BLOCK, _e4m3_scale)
    return jnp.concatenate([packed, s_bytes], axis=-1)


def encode_compressed_kv(x) -> jax.Array:
    """``x: f32|bf16[..., D]`` (``D % 16 == 0``; 512 in V4.1, after RoPE) -> ``u8[..., D / 2 + D /
    16]`` (288 B for 512): e2m1 nibbles then e4m3 scale bytes (module docstring)."""
    return _encode_compressed(_rows("x", x, COMPRESSED_BLOCK))


def _e4m3_value(b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(b, fp8.FP8_DTYPE).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("dim",))
def _decode_compressed(b: jax.Array, dim: int) -> jax.Array:
    return _decode_fp4(b, dim, COMPRESSED_BLOCK, _e4m3_value)


def decode_compressed_kv(b) -> jax.Array:
    """``u8[..., 9 D / 16]`` -> ``f32[..., D]``: ``e2m1(nibble) * e4m3(scale byte)``."""
    dim = _bytes_in("b", b, compressed_kv_bytes(COMPRESSED_BLOCK), COMPRESSED_BLOCK)
    return _decode_compressed(jnp.asarray(b), dim)


# ---------------------------------------------------------------------------------------------
# Index q and k: fp4 e2m1, ue8m0 per 32, no Hadamard.

def _ue8m0_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    a = jnp.maximum(amax, jnp.float32(qat.FP4_AMAX_FLOOR))
    s = fp8._pow2_ceil(a * jnp.float32(1.0 / qat.FP4_MAX))
    return s, model1._scale_bytes(s)


@jax.jit
def _encode_index(x: jax.Array) -> jax.Array:
    packed, s_bytes = _fp4_blocks(x.astype(jnp.float32), INDEX_BLOCK, _ue8m0_scale)
    return jnp.concatenate([packed, s_bytes], axis=-1)


def encode_index_fp4(x) -> jax.Array:
    """``x: f32|bf16[..., D]`` (``D % 32 == 0``; one index head, 128 in V4.1: a query head or a
    key) -> ``u8[..., D / 2 + D / 32]`` (68 B for 128): e2m1 nibbles then ue8m0 scale bytes."""
    return _encode_index(_rows("x", x, INDEX_BLOCK))


@functools.partial(jax.jit, static_argnames=("dim",))
def _decode_index(b: jax.Array, dim: int) -> jax.Array:
    return _decode_fp4(b, dim, INDEX_BLOCK, ue8m0_values)


def decode_index_fp4(b) -> jax.Array:
    """``u8[..., 17 D / 32]`` -> ``f32[..., D]``: ``e2m1(nibble) * 2**(scale byte - 127)``."""
    dim = _bytes_in("b", b, index_fp4_bytes(INDEX_BLOCK), INDEX_BLOCK)
    return _decode_index(jnp.asarray(b), dim)
