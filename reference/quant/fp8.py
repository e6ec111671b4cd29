"""fp8 (``float8_e4m3fn``) quantizers and byte layouts as DeepSeek-V3.2 defines them.

Pure ``jnp``, jittable (every check below is on static shapes, dtypes and Python arguments).

e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinity; ``S.1111.111`` is
NaN, so the largest finite value is 448 = 1.75 * 2**8; subnormals are ``m * 2**-9`` (m = 1..7),
the smallest normal is 2**-6.

Rule 1, indexer (DeepSeek-V3.2-Exp ``inference/kernel.py``, ``act_quant``, used by the lightning
indexer for its query and key with ``scale_fmt="ue8m0"``), ``quantize_fp8``. Per block of
``block_size`` features along the last dim, everything in f32:

- ``amax = max(max|x|, 1e-4)`` (the floor is on the *amax*);
- ``s = amax / 448``; with ``scale_fmt="ue8m0"`` ``s = 2**ceil(log2(s))``, computed exactly from
  the f32 bits (biased exponent, plus one when the mantissa is nonzero), so an exact power of
  two stays unchanged and there is no ``log2`` rounding error; ``scale_fmt=None`` keeps ``s``;
- ``x8 = float8_e4m3fn(clip(x / s, -448, 448))``, ``x / s`` an f32 division, the cast
  round-to-nearest-even.

Both divisions are IEEE f32 divisions, as the rule states. Written plainly in jnp they would not
be: XLA's algebraic simplifier rewrites a division by a broadcast (``amax / 448``, ``x / s``) as
a multiplication by the rounded reciprocal (measured on jax 0.10.2 CPU: one ulp off in about
half resp. a quarter of f32 cases), so ``_divide`` hides the broadcast. The sources' own
``amax / 448`` is such a multiplication (TileLang ``act_quant`` multiplies by ``fp8_max_inv =
1 / 448``; PyTorch on CUDA computes ``tensor / python_scalar`` as ``tensor * (1 / scalar)``):
with ``ue8m0`` the rounded scale is the same either way (checked over 5e5 amaxes near
``448 * 2**k`` and 1e6 random ones); with ``scale_fmt=None`` this module's scale differs from
the TileLang kernel's by one ulp in about half the cases. ``x / s`` is a true division in both
sources.

Rule 2, latent cache (FlashMLA ``tests/quant.py``, layout ``V32_FP8Sparse``),
``quantize_latent_fp8``. A latent row is 576 = 512 "nope" + 64 "rope" features. The nope part
is 4 tiles of 128; per tile ``s = 2**ceil(log2(max(amax / 448, 1e-4)))`` (the floor is on the
*scale* here, so ``s >= 2**-13``; an all-zero tile gets ``s = 2**-13``, where rule 1 gives
``2**-22``), ``nope8 = float8_e4m3fn(clip(nope / s, -448, 448))`` (RNE; the clip never binds
since ``s >= amax / 448``); the rope part is cast to bf16 (RNE).

Dequantizing is ``x8.astype(f32) * s`` (``dequantize_fp8``, ``dequantize_latent_fp8``).

Byte layouts (little-endian), rule 3:

- FlashMLA latent token, 656 bytes (``latent_to_flashmla_bytes``): 512 e4m3 bytes, then the 4
  f32 scales (16 bytes), then the 64 bf16 rope values (128 bytes).
- vLLM / DeepGEMM paged indexer key cache, ``page_size * 132`` bytes per page
  (``index_to_paged_fp8_bytes``): the page's ``page_size * 128`` e4m3 bytes, token-major, then
  its ``page_size`` f32 scales (4 bytes each); the two parts are not interleaved.

``jax.lax.bitcast_convert_type`` from a wide type to ``uint8`` gives the bytes in the host's
order (a trailing dim of ``itemsize``); on the little-endian hosts jax runs on (x86, ARM, TPU
hosts) that is little-endian, as the tests check against NumPy's ``.view('<f4')``. Round trips
are bit-exact: pure bitcasts, so NaN payloads and -0.0 survive.

Cast behaviour (measured on jax 0.10.2 CPU, identical to ``ml_dtypes``): the f32 -> e4m3fn
``astype`` is round-to-nearest-even directly from f32 (no double rounding through f16); it does
not saturate: ``(448, 464]`` rounds to 448 but anything above 464, and +-inf, becomes NaN. The
clip is kept because the rule has it, but it never changes a result: ``|x / s|`` is at most
``448 * (1 + 2**-23)`` (rule 1 with ``scale_fmt=None``, where ``s`` may round down), which the
cast rounds to 448 anyway. XLA on CPU flushes f32 subnormals to zero (sign kept; measured),
which cannot change an e4m3 result (such values are far below 2**-10 and round to +-0 anyway).

Non-finite input (not special-cased; the tests pin it): a NaN anywhere in a block makes that
block's amax, scale and every ``x8`` in it NaN (rule 2: that tile; a NaN rope value stays a
NaN in its own slot). An inf in a block gives ``s = inf``: the infs become NaN (inf / inf),
the finite values +-0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # rule 1: floor on the block amax
SCALE_FLOOR = 1e-4  # rule 2: floor on the tile scale
SCALE_FMTS = ("ue8m0", None)

LATENT_DIM = 576
LATENT_NOPE = 512
LATENT_ROPE = 64
LATENT_TILE = 128
LATENT_TILES = LATENT_NOPE // LATENT_TILE
LATENT_BYTES = LATENT_NOPE + 4 * LATENT_TILES + 2 * LATENT_ROPE  # 656

INDEX_HEAD_DIM = 128
INDEX_TOKEN_BYTES = INDEX_HEAD_DIM + 4  # 132

_F32 = jnp.dtype(jnp.float32)
_BF16 = jnp.dtype(jnp.bfloat16)
_U8 = jnp.dtype(jnp.uint8)


# ---------------------------------------------------------------------------------------------
# Static checks.

def _dtype_of(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.dtype(jnp.asarray(x).dtype)


def _float_input(name: str, x) -> jax.Array:
    """Refuse anything but f32/bf16 (ValueError naming the dtype) and rank 0."""
    dt = _dtype_of(x)
    if dt not in _checks.FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {dt}; supported: "
                         f"{', '.join(str(d) for d in _checks.FLOAT_DTYPES)}")
    _min_rank(name, x, 1)
    return jnp.asarray(x)


def _require_dtype(name: str, x, dtype: np.dtype) -> None:
    dt = _dtype_of(x)
    if dt != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got dtype {dt}")


def _min_rank(name: str, x, rank: int) -> None:
    if np.ndim(x) < rank:
        raise ValueError(f"{name} must have rank >= {rank}, got rank {np.ndim(x)} "
                         f"(shape {tuple(np.shape(x))})")


def _check_scale_fmt(scale_fmt) -> None:
    if not (scale_fmt is None or (isinstance(scale_fmt, str) and scale_fmt in SCALE_FMTS)):
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got scale_fmt={scale_fmt!r}")


def _check_blocks(name: str, d: int, block_size: int) -> int:
    """Return the block count of a last dim ``d``; refuse one that ``block_size`` does not
    divide."""
    if d % block_size:
        raise ValueError(f"{name}.shape[-1] = {d} is not a multiple of block_size = "
                         f"{block_size}")
    return d // block_size


def _check_latent_parts(nope8, scales, rope) -> None:
    """Check ``(nope8 e4m3fn[..., 512], scales f32[..., 4], rope bf16[..., 64])``."""
    for name, x, dtype, width in (("nope8", nope8, FP8_DTYPE, LATENT_NOPE),
                                  ("scales", scales, _F32, LATENT_TILES),
                                  ("rope", rope, _BF16, LATENT_ROPE)):
        _require_dtype(name, x, dtype)
        _min_rank(name, x, 1)
        _checks.dim(name, x, -1, width, "the V32_FP8Sparse latent layout")
    lead = {np.shape(x)[:-1] for x in (nope8, scales, rope)}
    if len(lead) != 1:
        raise ValueError(f"nope8, scales and rope must share their leading dims, got shapes "
                         f"{np.shape(nope8)}, {np.shape(scales)}, {np.shape(rope)}")


# ---------------------------------------------------------------------------------------------
# Quantizers.

def _pow2_ceil(s: jax.Array) -> jax.Array:
    """``2**ceil(log2(s))`` for f32 ``s > 0``, exactly, from the bits: the biased exponent,
    plus one when the mantissa is nonzero. Exact for normal ``s`` (both rules floor ``s`` far
    above the subnormals); inf stays inf, a finite ``s`` above 2**127 rounds up to inf, NaN
    stays NaN."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    exponent = (bits >> 23) & jnp.uint32(0xFF)
    exponent = exponent + ((bits & jnp.uint32(0x7FFFFF)) != 0).astype(jnp.uint32)
    out = lax.bitcast_convert_type(jnp.minimum(exponent, jnp.uint32(0xFF)) << 23, jnp.float32)
    return jnp.where(jnp.isnan(s), s, out)


def _divide(num: jax.Array, den) -> jax.Array:
    """Correctly rounded f32 ``num / den``, ``den`` broadcast to ``num``'s shape.

    XLA's algebraic simplifier rewrites a division by a broadcast (a constant, a scalar, a
    per-block scale) as a multiplication by the broadcast reciprocal: two roundings, so one ulp
    off in about a quarter (per-block scales) to half (``/ 448``) of f32 cases (measured on
    jax 0.10.2 CPU). A divisor that selects on the dividend is no broadcast, so the divide
    stays a divide; the select never changes the quotient (NaN / anything is NaN)."""
    den = jnp.broadcast_to(den, num.shape)
    return num / jnp.where(jnp.isnan(num), jnp.ones_like(den), den)


def _amax(blocks: jax.Array) -> jax.Array:
    """``max |x|`` over the last axis, NaN if any element is NaN. XLA CPU's reduce-max drops a
    NaN once the array is large enough (measured on jax 0.10.2: ``f32[32, 128]`` rows lose it,
    ``f32[24, 128]`` rows keep it), so the NaN is carried explicitly."""
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    return jnp.where(jnp.any(jnp.isnan(blocks), axis=-1), jnp.float32(jnp.nan), amax)


def _cast_blocks(blocks: jax.Array, s: jax.Array) -> jax.Array:
    """``f32[..., n, b] / f32[..., n]`` -> e4m3fn, clipped to +-448 before the RNE cast."""
    return jnp.clip(_divide(blocks, s[..., None]), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


@functools.partial(jax.jit, static_argnames=("block_size", "ue8m0"))
def _quantize(x: jax.Array, block_size: int, ue8m0: bool) -> tuple[jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    blocks = x32.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = jnp.maximum(_amax(blocks), jnp.float32(AMAX_FLOOR))
    s = _divide(amax, jnp.float32(FP8_MAX))
    if ue8m0:
        s = _pow2_ceil(s)
    return _cast_blocks(blocks, s).reshape(x.shape), s


def quantize_fp8(x, *, block_size: int = 128,
                 scale_fmt: str | None = "ue8m0") -> tuple[jax.Array, jax.Array]:
    """Rule 1 (indexer): ``x: f32|bf16[..., D]`` -> ``(x8: float8_e4m3fn[..., D],
    scale: f32[..., D // block_size])`` with ``x ~= x8 * scale`` per block.

    ``block_size`` (static int >= 1) must divide ``D``; ``scale_fmt`` is ``"ue8m0"`` (scales
    rounded up to powers of two) or ``None``. Other dtypes (f16, f64, fp8, integers) are refused
    with a ValueError naming the dtype; bf16 is upcast to f32 exactly.
    """
    block_size = _checks.positive_int("block_size", block_size)
    _check_scale_fmt(scale_fmt)
    x = _float_input("x", x)
    _check_blocks("x", x.shape[-1], block_size)
    return _quantize(x, block_size, scale_fmt == "ue8m0")


@functools.partial(jax.jit, static_argnames=("block_size",))
def _dequantize(x8: jax.Array, scale: jax.Array, block_size: int) -> jax.Array:
    blocks = x8.astype(jnp.float32).reshape(*scale.shape, block_size)
    return (blocks * scale[..., None]).reshape(x8.shape)


def dequantize_fp8(x8, scale, *, block_size: int = 128) -> jax.Array:
    """``x8: float8_e4m3fn[..., D]``, ``scale: f32[..., D // block_size]`` -> ``f32[..., D]``,
    ``x8.astype(f32) * scale`` repeated over each block (f32 product)."""
    block_size = _checks.positive_int("block_size", block_size)
    _require_dtype("x8", x8, FP8_DTYPE)
    _require_dtype("scale", scale, _F32)
    _min_rank("x8", x8, 1)
    shape = tuple(np.shape(x8))
    n = _check_blocks("x8", shape[-1], block_size)
    if tuple(np.shape(scale)) != shape[:-1] + (n,):
        raise ValueError(f"scale must have shape x8.shape[:-1] + (D // block_size,) = "
                         f"{shape[:-1] + (n,)} (D = {shape[-1]}, block_size = {block_size}), "
                         f"got {tuple(np.shape(scale))}")
    return _dequantize(jnp.asarray(x8), jnp.asarray(scale), block_size)


@jax.jit
def _quantize_latent(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    x32 = x.astype(jnp.float32)
    lead = x.shape[:-1]
    tiles = x32[..., :LATENT_NOPE].reshape(*lead, LATENT_TILES, LATENT_TILE)
    amax = _amax(tiles)
    s = _pow2_ceil(jnp.maximum(_divide(amax, jnp.float32(FP8_MAX)), jnp.float32(SCALE_FLOOR)))
    nope8 = _cast_blocks(tiles, s).reshape(*lead, LATENT_NOPE)
    return nope8, s, x32[..., LATENT_NOPE:].astype(jnp.bfloat16)


def quantize_latent_fp8(x) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rule 2 (FlashMLA V32_FP8Sparse): ``x: f32|bf16[..., 576]`` -> ``(nope8:
    float8_e4m3fn[..., 512], scales: f32[..., 4], rope: bf16[..., 64])``.

    Scales are powers of two ``>= 2**-13``, one per 128-feature tile of the nope part; the rope
    part is rounded to bf16 (RNE; exact for bf16 input).
    """
    x = _float_input("x", x)
    _checks.dim("x", x, -1, LATENT_DIM, "the latent dim (512 nope + 64 rope)")
    return _quantize_latent(x)


def dequantize_latent_fp8(nope8, scales, rope) -> jax.Array:
    """``(nope8: float8_e4m3fn[..., 512], scales: f32[..., 4], rope: bf16[..., 64])`` ->
    ``f32[..., 576]``: ``concat(nope8 * repeat(scales, 128), rope)``."""
    _check_latent_parts(nope8, scales, rope)
    return _dequantize_latent(*(jnp.asarray(a) for a in (nope8, scales, rope)))


@jax.jit
def _dequantize_latent(nope8: jax.Array, scales: jax.Array, rope: jax.Array) -> jax.Array:
    nope = _dequantize(nope8, scales, LATENT_TILE)
    return jnp.concatenate([nope, rope.astype(jnp.float32)], axis=-1)


# ---------------------------------------------------------------------------------------------
# Byte layouts.

def _to_bytes(x: jax.Array) -> jax.Array:
    """``T[..., n]`` -> ``u8[..., n * itemsize]``, each element's bytes in host (little-endian)
    order."""
    b = lax.bitcast_convert_type(x, jnp.uint8)
    return b.reshape(*x.shape[:-1], x.shape[-1] * jnp.dtype(x.dtype).itemsize)


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
    """``u8[..., n * itemsize]`` -> ``dtype[..., n]`` (inverse of ``_to_bytes``)."""
    size = jnp.dtype(dtype).itemsize
    if size > 1:
        b = b.reshape(*b.shape[:-1], b.shape[-1] // size, size)
    return lax.bitcast_convert_type(b, dtype)


@jax.jit
def _latent_to_bytes(nope8: jax.Array, scales: jax.Array, rope: jax.Array) -> jax.Array:
    return jnp.concatenate([_to_bytes(a) for a in (nope8, scales, rope)], axis=-1)


def latent_to_flashmla_bytes(nope8, scales, rope) -> jax.Array:
    """``(nope8: float8_e4m3fn[..., 512], scales: f32[..., 4], rope: bf16[..., 64])`` ->
    ``u8[..., 656]``: 512 e4m3 bytes, 16 bytes of f32 scales, 128 bytes of bf16 rope (LE)."""
    _check_latent_parts(nope8, scales, rope)
    return _latent_to_bytes(*(jnp.asarray(a) for a in (nope8, scales, rope)))


@jax.jit
def _latent_from_bytes(b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    cut = LATENT_NOPE + 4 * LATENT_TILES
    return (_from_bytes(b[..., :LATENT_NOPE], FP8_DTYPE),
            _from_bytes(b[..., LATENT_NOPE:cut], jnp.float32),
            _from_bytes(b[..., cut:], jnp.bfloat16))


def latent_from_flashmla_bytes(b) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``u8[..., 656]`` -> ``(nope8: float8_e4m3fn[..., 512], scales: f32[..., 4], rope:
    bf16[..., 64])``, the exact inverse of ``latent_to_flashmla_bytes``."""
    _require_dtype("b", b, _U8)
    _min_rank("b", b, 1)
    _checks.dim("b", b, -1, LATENT_BYTES, "the FlashMLA V32_FP8Sparse token size (512+16+128)")
    return _latent_from_bytes(jnp.asarray(b))


@jax.jit
def _paged_to_bytes(k8: jax.Array, scale: jax.Array) -> jax.Array:
    pages, page_size, _ = k8.shape
    keys = _to_bytes(k8).reshape(pages, page_size * INDEX_HEAD_DIM)
    scales = _to_bytes(scale).reshape(pages, page_size * 4)
    return jnp.concatenate([keys, scales], axis=-1)


def index_to_paged_fp8_bytes(k8, scale) -> jax.Array:
    """``k8: float8_e4m3fn[P, page_size, 128]``, ``scale: f32[P, page_size, 1]`` ->
    ``u8[P, page_size * 132]``: per page the ``page_size * 128`` key bytes (token-major), then
    the ``page_size`` f32 scales (little-endian), not interleaved."""
    _require_dtype("k8", k8, FP8_DTYPE)
    _require_dtype("scale", scale, _F32)
    _checks.rank("k8", k8, 3)
    _checks.rank("scale", scale, 3)
    _checks.dim("k8", k8, 2, INDEX_HEAD_DIM, "the indexer head dim")
    pages, page_size, _ = np.shape(k8)
    if tuple(np.shape(scale)) != (pages, page_size, 1):
        raise ValueError(f"scale must have shape (P, page_size, 1) = {(pages, page_size, 1)} "
                         f"to match k8 {tuple(np.shape(k8))}, got {tuple(np.shape(scale))}")
    return _paged_to_bytes(jnp.asarray(k8), jnp.asarray(scale))


@functools.partial(jax.jit, static_argnames=("page_size",))
def _paged_from_bytes(b: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    pages = b.shape[0]
    cut = page_size * INDEX_HEAD_DIM
    k8 = _from_bytes(b[:, :cut], FP8_DTYPE).reshape(pages, page_size, INDEX_HEAD_DIM)
    scale = _from_bytes(b[:, cut:], jnp.float32).reshape(pages, page_size, 1)
    return k8, scale


def index_from_paged_fp8_bytes(b, *, page_size: int) -> tuple[jax.Array, jax.Array]:
    """``u8[P, page_size * 132]`` -> ``(k8: float8_e4m3fn[P, page_size, 128], scale:
    f32[P, page_size, 1])``, the exact inverse of ``index_to_paged_fp8_bytes``."""
    page_size = _checks.positive_int("page_size", page_size)
    _require_dtype("b", b, _U8)
    _checks.rank("b", b, 2)
    width = np.shape(b)[1]
    if width % INDEX_TOKEN_BYTES:
        raise ValueError(f"b.shape[1] = {width} is not a multiple of {INDEX_TOKEN_BYTES} bytes "
                         f"per token ({INDEX_HEAD_DIM} fp8 + 4 scale)")
    if width != page_size * INDEX_TOKEN_BYTES:
        raise ValueError(f"b.shape[1] = {width} must equal page_size * {INDEX_TOKEN_BYTES} = "
                         f"{page_size * INDEX_TOKEN_BYTES} (page_size = {page_size}; the bytes "
                         f"hold {width // INDEX_TOKEN_BYTES} tokens per page)")
    return _paged_from_bytes(jnp.asarray(b), page_size)
