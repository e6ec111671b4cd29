"""AOT compile-gate cases of the Pallas V4 compressor (``pallas_kernels.v4_compressor``) at the
V4 dims: the attention compressors (d 512, ratio 4 CSA and ratio 128 HCA) and the indexer's
(d 128, ratio 4); a decode step (64 sequences, one token each) and a prefill chunk (one
sequence, 8192 tokens); a pool of 64 slots, RoPE tables of 8192 positions, also given in the
kernel's row layout (``finish.rope_rows``, the last argument: a model constant, so the kernel
reads one 512-B row per entry and the glue builds nothing), the pool donated.

Traffic (``traffic.compressor_traffic``): decode where every sequence completes an entry (the
worst decode step), prefill of a whole 8192-token chunk from position 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import aot, tpu
from pallas_kernels.v4_compressor import traffic
from pallas_kernels.v4_compressor.kernel import compress_step
from reference import v4_compressor as vc

SLOTS, TABLE = 64, 8192
# (name, d, ratio, rows T, sequences S)
SHAPES = (("csa_d512_decode64", 512, 4, 64, 64), ("hca_d512_decode64", 512, 128, 64, 64),
          ("index_d128_decode64", 128, 4, 64, 64), ("csa_d512_prefill8192", 512, 4, 8192, 1),
          ("hca_d512_prefill8192", 512, 128, 8192, 1),
          ("index_d128_prefill8192", 128, 4, 8192, 1))


def specs(*, d: int, ratio: int, rows: int, seqs: int) -> list:
    """ShapeDtypeStructs of ``compress_step``'s array arguments, the pool as two arrays, then
    ``rope_rows`` (``f32[P, 128]``)."""
    sd = jax.ShapeDtypeStruct
    coff = vc.compressor_coff(ratio)
    width = coff * d
    pool = sd((SLOTS, vc.state_rows(ratio), width), jnp.float32)
    return [sd((rows, width), jnp.float32), sd((rows, width), jnp.float32),
            sd((ratio, width), jnp.float32), sd((d,), jnp.float32),
            sd((TABLE, vc.ROPE_DIM // 2), jnp.float32), sd((TABLE, vc.ROPE_DIM // 2), jnp.float32),
            pool, pool, sd((seqs,), jnp.int32), sd((seqs,), jnp.int32),
            sd((seqs + 1,), jnp.int32), sd((3,), jnp.int32), sd((TABLE, tpu.LANES), jnp.float32)]


def step_fn(ratio: int):
    """``compress_step`` over flat arrays (pool kv / score as arguments 6 / 7, ``rope_rows``
    last)."""
    def fn(kv, score, ape, weight, cos, sin, skv, sscore, slots, kv_lens, cu, dist, rope_rows):
        return compress_step(kv, score, ape, weight, cos, sin, vc.CompressorState(skv, sscore),
                             slots, kv_lens, cu, dist, ratio=ratio, rope_rows=rope_rows)
    return fn


def case_traffic(chip: str, *, d: int, ratio: int, rows: int, seqs: int) -> aot.Traffic:
    """The model at the case's shape (module docstring); one block size on every chip."""
    del chip
    counts = (traffic.decode_counts(seqs, ratio) if rows == seqs
              else traffic.prefill_counts(rows, ratio))
    return traffic.compressor_traffic(counts, ratio=ratio, d=d, row_table=True)


def compile_cases() -> list[aot.CompileCase]:
    """One case per ``SHAPES`` entry."""
    cases = []
    for name, d, ratio, rows, seqs in SHAPES:
        dims = dict(d=d, ratio=ratio, rows=rows, seqs=seqs)
        cases.append(aot.CompileCase(
            "v4_compressor", name, lambda chip, ratio=ratio: step_fn(ratio), specs(**dims),
            functools.partial(case_traffic, **dims),
            tags=("decode",) if rows == seqs else ("prefill",)))
    return cases
