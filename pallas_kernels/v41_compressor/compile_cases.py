"""AOT compile-gate cases of the V4.1 ratio-2 compressor (``pallas_kernels.v41_compressor``)
at V4.1-Flash's dims (``d = 512``, the RoPE tables of 8192 positions, a pool of 64 slots,
donated): a decode step (64 sequences, every one completing an entry: the worst decode) and a
prefill chunk (one sequence, 8192 tokens from position 0), each for the output the V4.1 step
uses (``"latent"``) and the finished one (``"roped"``).

Traffic: ``traffic.step_traffic`` of ``decode_counts`` / ``prefill_counts``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import aot
from pallas_kernels.v4_compressor import compile_cases as v4cc
from pallas_kernels.v41_compressor import traffic
from pallas_kernels.v41_compressor.kernel import compress_step
from reference import v4_compressor as vc
from reference.v41 import v41_flash

SLOTS, TABLE = v4cc.SLOTS, v4cc.TABLE  # the V4 compressor cases' pool and tables
D = v41_flash().head_dim
# (name, rows T, sequences S, output)
SHAPES = tuple((f"r2_d{D}_{kind}_{out}", rows, seqs, out)
               for kind, rows, seqs in (("decode64", 64, 64), ("prefill8192", 8192, 1))
               for out in ("latent", "roped"))


def specs(*, rows: int, seqs: int) -> list:
    """ShapeDtypeStructs of ``compress_step``'s array arguments, the state as two arrays."""
    sd = jax.ShapeDtypeStruct
    pool = sd((SLOTS, traffic.RATIO, D), jnp.float32)
    table = sd((TABLE, v41_flash().rope_head_dim // 2), jnp.float32)
    return [sd((rows, D), jnp.float32), sd((rows, D), jnp.float32), sd((D,), jnp.float32),
            table, table, pool, pool, sd((seqs,), jnp.int32), sd((seqs,), jnp.int32),
            sd((seqs + 1,), jnp.int32), sd((3,), jnp.int32)]


def step_fn(output: str):
    """``compress_step`` at ratio 2 over flat arrays (the state kv / score arguments 5 / 6)."""
    def fn(kv, score, weight, cos, sin, skv, sscore, slots, kv_lens, cu, dist):
        return compress_step(kv, score, weight, cos, sin, vc.CompressorState(skv, sscore),
                             slots, kv_lens, cu, dist, ratio=traffic.RATIO, output=output)
    return fn


def counts(rows: int, seqs: int):
    """The step's counts: every sequence completing an entry (decode), or the whole chunk."""
    return (traffic.decode_counts(seqs, traffic.RATIO) if rows == seqs
            else traffic.prefill_counts(rows, traffic.RATIO))


def case_traffic(chip: str, *, rows: int, seqs: int, output: str) -> aot.Traffic:
    """The model at the case's shape; one block size on every chip."""
    del chip
    return traffic.step_traffic(counts(rows, seqs), d=D, output=output)


def compile_cases() -> list[aot.CompileCase]:
    """One case per ``SHAPES`` entry."""
    return [aot.CompileCase(
        "v41_compressor", name, lambda chip, output=output: step_fn(output),
        specs(rows=rows, seqs=seqs),
        functools.partial(case_traffic, rows=rows, seqs=seqs, output=output),
        tags=("decode",) if rows == seqs else ("prefill",))
        for name, rows, seqs, output in SHAPES]
