"""CPU stand-ins, in torch, for the GPU kernels DeepSeek-V4's released ``inference/model.py``
imports (``from kernel import ...``; the tilelang kernels) and for ``fast_hadamard_transform``,
written from their semantics (``docs/V4_OFFICIAL_REGIME.md``), reproducing their rounding points.
No DeepSeek code is copied: this module only computes what those kernels compute.

What the attention layer needs in the ``args.dtype = "bf16"`` path is real here:

- ``act_quant(x bf16[..., N], block, scale_fmt, scale_dtype, inplace)``: per block of ``block``
  columns ``amax = max(|x|_max, 1e-4)`` (f32), the scale ``s = amax * f32(1/448)`` or, with
  ``scale_fmt`` set (``"ue8m0"``), its power-of-two ceiling from the f32 bits; ``inplace=True``
  writes ``bf16(f32(e4m3(clamp(x / s, +-448))) * s)`` back into ``x`` (the REAL e4m3 cast: copy
  "O" of the release, ``kernel_tilelang.py:88``; copy "F" casts ``x / s`` to bf16 instead, an
  identity on bf16 input: the notes' D3). ``inplace=False`` returns ``(e4m3[..., N], s)``.
- ``fp4_act_quant(x bf16[..., N], block=32, inplace)``: ``amax = max(|x|_max, 6 * 2**-126)``,
  ``s = pow2ceil(amax * f32(1/6))``, e2m1 round-to-nearest-even of ``clamp(x / s, +-6)``;
  ``inplace=True`` writes ``bf16(e2m1 * s)`` back.
- ``sparse_attn(q bf16[B, M, H, D], kv bf16[B, N, D], attn_sink f32[H], topk_idxs i32[B, M, K],
  scale) -> bf16[B, M, H, D]``: the kernel's online softmax over the index list in blocks of 64
  (``-1`` slots: key 0, logit ``-inf``): f32 logits of the bf16 q and keys times ``scale`` after
  the dot, the running max per block, ``P = exp(s - m_run)`` in f32 summed unrounded into the
  denominator and rounded to bf16 for ``P @ V`` (f32 accumulation), the sink ``exp(sink - m)``
  added to the denominator only, the output rounded once to bf16.
- ``hadamard_transform(x bf16[..., n], scale)`` (the ``fast_hadamard_transform`` package's
  function): the Sylvester (natural order) Walsh-Hadamard butterflies in f32, times ``scale``,
  rounded once to the input dtype.

``cuda_ops()`` (a context manager) swaps two torch ops the layer calls for what torch's CUDA
kernels compute, so the official code run on CPU computes what it computes on a GPU:
``Tensor.topk`` with the CUDA selection rule (``TensorTopK.cu::gatherTopK``: among values tied
at the k-th, the lowest indices win; then sorted by value; torch's CPU ``topk`` breaks ties by
libstdc++'s partial sort, not by index: the notes' D4), and ``torch.rsqrt`` of a bf16 tensor
computed in f32 and rounded once (CUDA's f32 opmath; torch 2.14's CPU bf16 ``rsqrt`` does so
on its vectorized body but computes ``bf16(1 / bf16(sqrt(x)))`` on the elements outside it,
the last ``n % 32`` and every tensor under 32 elements: the per-head q norm of a decode row
with few heads; measured: 28% of the positive bf16 inputs then differ by an ulp).

``fp8_gemm``, ``fp4_gemm`` and ``hc_split_sinkhorn`` (the fp8 / fp4 Linears and the
hyper-connections, unused by ``Attention`` in the bf16 path) raise ``NotImplementedError``."""

from __future__ import annotations

import contextlib
import sys
import types

import torch

__all__ = ["FP4_GRID", "SPARSE_ATTN_BLOCK", "act_quant", "cuda_ops", "fp4_act_quant", "fp4_round",
           "fp8_gemm", "fp4_gemm", "hadamard_transform", "hc_split_sinkhorn", "install",
           "pow2_ceil", "sparse_attn"]

FP8_MAX = 448.0
FP4_MAX = 6.0
SPARSE_ATTN_BLOCK = 64  # the tilelang sparse_attn's block of index slots
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes, code order


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(s))`` of f32 ``s > 0`` from its bits: the biased exponent, plus one when
    any mantissa bit is set (the kernels' ``fast_log2_ceil`` / ``fast_pow2``)."""
    bits = s.to(torch.float32).view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int, floor: float, qmax: float, round_scale: bool):
    """``(blocks f32[..., n, block], s f32[..., n, 1])`` of ``x [..., N]``."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"the quantized width {n} must be a multiple of the block {block}")
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], n // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
    s = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
    return blocks, (pow2_ceil(s) if round_scale else s)


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    """Block-wise fp8 e4m3 quantization of ``x bf16[..., N]`` (module docstring); ``inplace``:
    the fused quantize-dequantize written back into ``x`` (returned)."""
    blocks, s = _blocks(x, block_size, 1e-4, FP8_MAX, scale_fmt is not None)
    codes = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        y = (codes.to(torch.float32) * s).reshape(x.shape)
        x.copy_(y.to(x.dtype))
        return x
    return codes.reshape(x.shape), s.squeeze(-1).to(scale_dtype)


def fp4_round(y: torch.Tensor) -> torch.Tensor:
    """Round f32 ``|y| <= 6`` to the nearest e2m1 value, a tie to the even code (``FP4_GRID``
    index): the midpoints between neighbours decide, an exact midpoint goes to the even index."""
    grid = torch.tensor(FP4_GRID, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    a = y.abs()
    idx = torch.bucketize(a, mids, right=True)  # grid index when a is strictly off a midpoint
    tie = (idx > 0) & (a == mids[(idx - 1).clamp_min(0)])
    idx = torch.where(tie & (idx % 2 == 1), idx - 1, idx)  # midpoint k|k+1: the even of the two
    return torch.copysign(grid[idx], y)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False):
    """Block-wise fp4 e2m1 quantization of ``x bf16[..., N]`` with power-of-two scales
    (module docstring); only the fused ``inplace=True`` form (the V4 indexer's) is provided."""
    if not inplace:
        raise NotImplementedError("fp4_act_quant(inplace=False): the packed fp4 output (fp4 "
                                  "Linears) is not needed by the attention layer")
    blocks, s = _blocks(x, block_size, 6.0 * 2.0 ** -126, FP4_MAX, True)
    y = fp4_round((blocks / s).clamp(-FP4_MAX, FP4_MAX)) * s
    x.copy_(y.reshape(x.shape).to(x.dtype))
    return x


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``bf16(f32(x) @ H * scale)`` over the last dim (a power of two), ``H`` the Sylvester
    Hadamard matrix, by f32 butterflies (``fast_hadamard_transform.hadamard_transform``)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard_transform needs a power-of-two width, got {n}")
    y = x.to(torch.float32).reshape(-1, n)
    h = 1
    while h < n:  # pair (i, i + h) inside each block of 2h: (a + b, a - b)
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).reshape(-1, n)
        h *= 2
    y = y * torch.tensor(scale, dtype=torch.float32)
    return y.reshape(x.shape).to(x.dtype)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor,
                topk_idxs: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """The official sparse attention with its rounding (module docstring).
    ``q bf16[B, M, H, D]``, ``kv bf16[B, N, D]``, ``attn_sink f32[H]``, ``topk_idxs
    i32[B, M, K]`` (``-1``: an empty slot) -> ``bf16[B, M, H, D]``."""
    b, m, h, d = q.shape
    k = topk_idxs.shape[-1]
    width = -(-k // SPARSE_ATTN_BLOCK) * SPARSE_ATTN_BLOCK
    idxs = torch.full((b, m, width), -1, dtype=torch.int64)
    idxs[..., :k] = topk_idxs.to(torch.int64)
    qf = q.to(torch.float32)
    scale = torch.tensor(softmax_scale, dtype=torch.float32)
    acc_o = torch.zeros(b, m, h, d, dtype=torch.float32)
    sum_exp = torch.zeros(b, m, h, dtype=torch.float32)
    m_run = torch.full((b, m, h), -torch.inf, dtype=torch.float32)
    rows = torch.arange(b)[:, None, None]
    for t in range(0, width, SPARSE_ATTN_BLOCK):
        idx = idxs[..., t:t + SPARSE_ATTN_BLOCK]  # [B, M, 64]
        ok = idx != -1
        keys = torch.where(ok[..., None], kv[rows, idx.clamp_min(0)],
                           torch.zeros((), dtype=kv.dtype)).to(torch.float32)  # [B, M, 64, D]
        s = torch.einsum("bmhd,bmjd->bmhj", qf, keys)
        s = torch.where(ok[:, :, None, :], s, -torch.inf) * scale
        m_new = torch.maximum(m_run, s.amax(dim=-1))
        rescale = torch.exp(m_run - m_new)
        p = torch.exp(s - m_new[..., None])
        sum_exp = sum_exp * rescale + p.sum(dim=-1)
        p_bf16 = p.to(torch.bfloat16).to(torch.float32)
        acc_o = acc_o * rescale[..., None] + torch.einsum("bmhj,bmjd->bmhd", p_bf16, keys)
        m_run = m_new
    sum_exp = sum_exp + torch.exp(attn_sink.to(torch.float32) - m_run)
    return (acc_o / sum_exp[..., None]).to(torch.bfloat16)


def _topk_lowest_index_first(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    """``torch.topk`` with the CUDA tie rule: a stable sort (equal values keep index order),
    the first ``k``."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


_TORCH_RSQRT = torch.rsqrt


def _rsqrt_rounded_once(x, *args, **kwargs):
    """``torch.rsqrt``; a bf16 input computed in f32, rounded once."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and not args and not kwargs:
        return _TORCH_RSQRT(x.to(torch.float32)).to(torch.bfloat16)
    return _TORCH_RSQRT(x, *args, **kwargs)


@contextlib.contextmanager
def cuda_ops():
    """Within the block, ``Tensor.topk`` and ``torch.rsqrt`` compute as torch's CUDA kernels
    (module docstring)."""
    saved = torch.Tensor.topk, torch.rsqrt
    torch.Tensor.topk, torch.rsqrt = _topk_lowest_index_first, _rsqrt_rounded_once
    try:
        yield
    finally:
        torch.Tensor.topk, torch.rsqrt = saved


def fp8_gemm(*args, **kwargs):
    """The fp8 Linear's GEMM: not needed in the bf16 path (``args.dtype = "bf16"``)."""
    raise NotImplementedError("fp8_gemm: the official model's fp8 Linears are not simulated "
                              "here (build it with dtype='bf16')")


def fp4_gemm(*args, **kwargs):
    """The fp4 expert GEMM: not used by the attention layer."""
    raise NotImplementedError("fp4_gemm: not used by the attention layer")


def hc_split_sinkhorn(*args, **kwargs):
    """The hyper-connections' Sinkhorn: not used by the attention layer."""
    raise NotImplementedError("hc_split_sinkhorn: not used by the attention layer")


def install() -> None:
    """Register this module as ``kernel`` and a ``fast_hadamard_transform`` module holding
    ``hadamard_transform`` in ``sys.modules``, so the official ``model.py`` imports them."""
    sys.modules["kernel"] = sys.modules[__name__]
    fht = types.ModuleType("fast_hadamard_transform")
    fht.hadamard_transform = hadamard_transform
    sys.modules["fast_hadamard_transform"] = fht
