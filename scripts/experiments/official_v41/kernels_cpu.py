"""CPU stand-ins, in torch, for the GPU kernels DeepSeek-V4.1's released ``inference/model.py``
imports (``from .kernel_cpu import ...`` in the vendored copy, ``kernel`` upstream; the tilelang
kernels), written from their semantics (``docs/v41.md``, "The cache formats", and
``reference/v41/formats.py``), reproducing their rounding points. No DeepSeek code is copied:
this module only computes what those kernels compute. Where V4.1 calls a kernel as V4 does, the
V4 stand-in (``scripts.experiments.official_v4.kernels_cpu``) is reused as is.

What the attention layers need in the ``args.dtype = "bf16"`` path is real here:

- ``act_quant(x bf16[..., N], block, scale_fmt, scale_dtype, inplace)``: V4's stand-in. V4.1
  calls it for the window key only, as ``act_quant(kv, 32, "ue8m0", e8m0, True)``: per 32
  columns ``amax = max(|x|_max, 1e-4)``, ``s = pow2ceil(amax * f32(1/448))``, written back
  ``bf16(f32(e4m3(clamp(x / s, +-448))) * s)``: ``formats``' window rule.
- ``fp4_act_quant(x bf16[..., N], block, inplace, scale_dtype=e8m0)``, two branches by
  ``scale_dtype`` (``inplace=True`` only, as the attention layers call it):
  ``torch.float8_e4m3fn`` (the compressed kv: ``fp4_act_quant(latent, 16, True,
  scale_dtype=torch.float8_e4m3fn)``): per 16 columns ``amax = max(|x|_max, 6 * 2**-9)``,
  ``s = e4m3(amax / 6)`` (an f32 division, round to nearest even, saturating at 448), then
  ``bf16(e2m1(clamp(x / s, +-6)) * s)``; any other (the index q and keys:
  ``fp4_act_quant(k, 32, True)``): V4's rule, per 32 ``amax = max(|x|_max, 6 * 2**-126)``,
  ``s = pow2ceil(amax * f32(1/6))``, the same e2m1 rounding (no Hadamard rotation in V4.1).
- ``sparse_attn(q, kv, attn_sink, topk_idxs, scale)``: V4's stand-in (the online softmax in
  blocks of 64 index slots with its bf16 / f32 rounding points; ``-1`` slots empty).

``cuda_ops()`` (V4's context manager) makes ``Tensor.topk`` keep the lowest indices among ties at
the k-th value (CUDA's rule; torch's CPU ``topk`` does not) and bf16 ``torch.rsqrt`` round once;
V4.1 calls ``topk`` in its indexer and in ``select_candidate_blocks``, and has no bf16 rsqrt.

``fp8_gemm``, ``fp4_gemm`` and ``hc_split_sinkhorn`` (V4's: unused by ``Attention`` in the bf16
path) raise ``NotImplementedError``."""

from __future__ import annotations

import torch

from scripts.experiments.official_v4.kernels_cpu import (
    FP4_MAX,
    _blocks,
    act_quant,
    cuda_ops,
    fp4_gemm,
    fp4_round,
    fp8_gemm,
    hc_split_sinkhorn,
    sparse_attn,
)

__all__ = ["COMPRESSED_AMAX_FLOOR", "E4M3_MAX", "act_quant", "cuda_ops", "e4m3_round",
           "fp4_act_quant", "fp4_gemm", "fp8_gemm", "hc_split_sinkhorn", "sparse_attn"]

E4M3_MAX = 448.0
COMPRESSED_AMAX_FLOOR = 6.0 * 2.0 ** -9  # a zero block's e4m3 scale: the smallest subnormal


def e4m3_round(s: torch.Tensor) -> torch.Tensor:
    """f32 ``s >= 0`` to the nearest e4m3 value (ties to even, subnormals included), saturating
    at 448 (CUDA's ``satfinite`` conversion; torch's own cast would give NaN above it)."""
    return s.clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False,
                  scale_dtype: torch.dtype = torch.float8_e8m0fnu):
    """Block-wise fp4 e2m1 quantize-dequantize of ``x bf16[..., N]`` written back into ``x``
    (returned): e4m3 scales (``scale_dtype=torch.float8_e4m3fn``) or power-of-two ones (module
    docstring)."""
    if not inplace:
        raise NotImplementedError("fp4_act_quant(inplace=False): the packed fp4 output (fp4 "
                                  "Linears) is not needed by the attention layers")
    if scale_dtype == torch.float8_e4m3fn:
        n = x.shape[-1]
        if n % block_size:
            raise ValueError(f"the quantized width {n} must be a multiple of the block "
                             f"{block_size}")
        blocks = x.to(torch.float32).reshape(*x.shape[:-1], n // block_size, block_size)
        amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(COMPRESSED_AMAX_FLOOR)
        s = e4m3_round(amax / torch.tensor(FP4_MAX, dtype=torch.float32))
    else:
        blocks, s = _blocks(x, block_size, 6.0 * 2.0 ** -126, FP4_MAX, True)
    y = fp4_round((blocks / s).clamp(-FP4_MAX, FP4_MAX)) * s
    x.copy_(y.reshape(x.shape).to(x.dtype))
    return x
