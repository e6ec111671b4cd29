"""The DeepSeek-V4.1 compressors on TPU (Pallas), with ``reference.v41.compress_step``'s
semantics and results (its module docstring and ``docs/v41.md``: the entry rule, the state, the
chunk invariance, the three ``output`` stages).

Ratio 2 is the V4 pool kernel's geometry with one overlap (``coff = 1``) and a ring of ``R = 2``
rows (``reference.v4_compressor.pool_coff`` / ``pool_rows``; ``POOL_RATIOS`` admits 2 for this
entry only, V4's own entry points keep refusing it): the two kernels of
``pallas_kernels.v4_compressor.kernel`` run unchanged (pool over the completing entries, state
in place; its module docstring), with

- ``ape`` a zero row per ring slot (V4.1 has none; ``score + 0`` is ``score``, so the ring holds
  V4.1's state: row ``k`` the latest token ``t`` with ``t % 2 == k``, its f32 kv and score);
- ``precision="bf16"``: the kernel's finish rounds the pooled row to bf16 before the norm and
  rounds the norm and the RoPE (``finish.finish_row``), which is V4.1's ``_finish``;
- ``output="latent"`` (what the V4.1 step stores from: its pool rows and index keys both start
  from the pre-RoPE latent): the pool kernel without its finish (no table read), the norm over
  the ``E`` output rows in the glue (row-wise, ``E x d``); ``"roped"``: the kernel finishes the
  rows with the tables given; ``"cache"``: ``"roped"`` then ``decode(encode(.))`` of the
  compressed-kv format in the glue (row-wise).
- the one read V4.1 does not need: the zero ape, ``2 x d`` f32 once per call (4 KB at d 512).

Ratio 1 has no pooling and no state: entry ``j`` is token ``j`` normed (and roped). There is
nothing for a kernel to gather or carry, so this entry runs the reference's row-wise XLA
(``reference.v41.compress_step``): one read of each row, one write of each entry, the
minimum (``traffic.step_bytes``).

Not measured on a TPU (none here)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import tpu
from pallas_kernels.v4_compressor import kernel as v4k
from pallas_kernels.v41_compressor import traffic
from reference import v4_compressor as vc
from reference.quant.bf16 import round_bf16
from reference.v41 import compressor as ref
from reference.v41 import formats
from reference.v41.config import v41_flash

RATIO = traffic.RATIO  # the ratio the pool kernel serves here (ratio 1: the reference's XLA)


@functools.partial(jax.jit, static_argnames=("eps", "output", "vmem_limit_bytes", "interpret"))
def _ratio2(kv, score, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
            distribution, *, eps, output, vmem_limit_bytes, interpret):
    ape = jnp.zeros((RATIO, kv.shape[1]), jnp.float32)  # V4.1 has none: score + 0 = score
    knobs = dict(eps=eps, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    entries, state = v4k._compress(kv, score, ape, norm_weight, cos, sin, state, state_slots,
                                   kv_lens, cu_q_lens, distribution, None, ratio=RATIO,
                                   precision="bf16", finished=output != "latent", **knobs)
    if output == "latent":  # the norm over the E output rows (row-wise), V4.1's _finish
        rows = round_bf16(vc.rms_norm(round_bf16(entries.rows), norm_weight, eps))
        entries = entries._replace(rows=jnp.where(entries.seq[:, None] >= 0, rows, 0.0))
    if output == "cache":
        rows = formats.decode_compressed_kv(formats.encode_compressed_kv(entries.rows))
        entries = entries._replace(rows=jnp.where(entries.seq[:, None] >= 0, rows, 0.0))
    return entries, state


def compress_step(kv, score, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
                  distribution, *, ratio: int, eps: float = v41_flash().rms_norm_eps,
                  output: str = "cache", vmem_limit_bytes: int | None = None,
                  interpret=False) -> tuple[vc.CompressedEntries, vc.CompressorState | None]:
    """One step of a V4.1 compressor (ratio 1 or 2) on TPU: ``reference.v41.compress_step``'s
    arguments and results (module docstring for how). ``kv f32|bf16[T, d]``, ``score f32[T, d]``
    (ratio 2; ``None`` at ratio 1), ``state`` a ``CompressorState`` of ``f32[num_slots, 2, d]``
    (ratio 2; ``None`` at ratio 1). ``vmem_limit_bytes`` / ``interpret`` as
    ``pallas_kernels.v4_compressor.compress_step``'s. Bad arguments: the reference's
    ``ValueError`` / ``TypeError``."""
    if isinstance(ratio, bool) or ratio not in ref.COMPRESSED_RATIOS:
        raise ValueError(f"ratio must be one of {ref.COMPRESSED_RATIOS}, got ratio={ratio!r}")
    ref.check_step_args(kv, score, norm_weight, cos, sin, state, state_slots, kv_lens,
                        cu_q_lens, distribution, ratio, output)
    tpu.check_vmem_limit(vmem_limit_bytes)
    if ratio == 1:
        return ref.compress_step(kv, None, norm_weight, cos, sin, None, state_slots, kv_lens,
                                 cu_q_lens, distribution, ratio=1, eps=eps, output=output)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return _ratio2(f32(kv), f32(score), f32(norm_weight), f32(cos), f32(sin), state,
                   i32(state_slots), i32(kv_lens), i32(cu_q_lens), i32(distribution),
                   eps=float(eps), output=output, vmem_limit_bytes=vmem_limit_bytes,
                   interpret=interpret)
