"""Whole-op cost of the V4 compressor's XLA form (``reference.v4_compressor``) at a decode step,
by XLA's TPU cost model (AOT through libtpu; no TPU needed), against the bytes the step must
move.

One decode step: 64 sequences, one new token each, a state pool of 64 slots, state (and cache)
donated; contexts of 8192 tokens (2048 entries at ratio 4, 64 at ratio 128), pages of 64
entries. Minimum bytes (f32 rows):

- every step: this step's kv and score rows in (``2 * coff * d * 4`` per sequence), one ring row
  (kv and gate) written per sequence, ``ape`` and the norm weight read once;
- a step where every sequence completes a group (the worst case a static program must serve;
  at ratio 128 one step in 128) adds the other ``R - 1`` slots' relevant halves read from the
  ring (kv and gate, ``d`` wide) and the entry written in the cache format.

Run: ``python scripts/v4_compressor_cost.py [--chip v6e]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels import xla_cost
from reference import v4_cache
from reference import v4_compressor as vc

SEQS, CONTEXT, PAGE, TABLE = 64, 8192, 64, 8192
CASES = ((512, 4, ("none", "bf16", "fp8")), (512, 128, ("none", "bf16", "fp8")),
         (128, 4, ("none", "bf16")))
ENTRY_BYTES = {"none": 0, "bf16": None, "fp8": 640}  # bf16: 2 * d; fp8: MODEL1 on TPU


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def build(d: int, ratio: int, cache: str):
    """``(fn, specs, donate_argnums)`` of one decode step, entries into ``cache`` ("none": the
    entries are returned)."""
    coff = vc.compressor_coff(ratio)
    width, rows = coff * d, vc.state_rows(ratio)
    entries = CONTEXT // ratio
    ps = min(PAGE, entries)
    pps = entries // ps
    specs = [_s((SEQS, width), jnp.float32)] * 2 + [
        _s((ratio, width), jnp.float32), _s((d,), jnp.float32),
        _s((TABLE, 32), jnp.float32), _s((TABLE, 32), jnp.float32),
        _s((SEQS, rows, width), jnp.float32), _s((SEQS, rows, width), jnp.float32),
        _s((SEQS,), jnp.int32), _s((SEQS,), jnp.int32), _s((SEQS + 1,), jnp.int32),
        _s((3,), jnp.int32)]
    if cache == "bf16":
        specs.append(_s((SEQS * pps, ps, d), jnp.bfloat16))
    elif cache == "fp8":
        specs += [_s((SEQS * pps, ps, 128), jnp.uint32),
                  _s((SEQS * pps, -(-ps // 4), 128), jnp.uint32)]
    if cache != "none":
        specs += [_s((SEQS * pps,), jnp.int32), _s((SEQS + 1,), jnp.int32)]

    def fn(kv, score, ape, weight, cos, sin, skv, sscore, slots, kv_lens, cu_q, dist, *rest):
        out, state = vc.compress_step(kv, score, ape, weight, cos, sin,
                                      vc.CompressorState(skv, sscore), slots, kv_lens, cu_q,
                                      dist, ratio=ratio)
        if cache == "none":
            return out, state
        c = rest[0] if cache == "bf16" else v4_cache.Fp8V4Cache(rest[0], rest[1])
        return vc.write_entries(c, out, rest[-2], rest[-1], pages_per_seq=pps), state

    donate = {"none": (6, 7), "bf16": (6, 7, 12), "fp8": (6, 7, 12, 13)}[cache]
    return fn, specs, donate


def minimum_bytes(d: int, ratio: int, cache: str) -> tuple[int, int]:
    """``(no sequence completes, every sequence completes)`` bytes (module docstring)."""
    coff = vc.compressor_coff(ratio)
    width, rows = coff * d, vc.state_rows(ratio)
    entry = 2 * d if cache == "bf16" else ENTRY_BYTES[cache]
    every = SEQS * 2 * width * 4 * 2 + ratio * width * 4 + d * 4
    return every, every + SEQS * (2 * (rows - 1) * d * 4 + entry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="v6e")
    chip = ap.parse_args().chip
    print("| chip | d | r | cache | XLA MiB | min MiB (none / all complete) | x all-complete |"
          " per-element ops |\n|---|---|---|---|---|---|---|---|")
    for d, ratio, caches in CASES:
        for cache in caches:
            fn, specs, donate = build(d, ratio, cache)
            cost = xla_cost.analyze(xla_cost.compile_program(fn, specs, chip,
                                                             donate_argnums=donate))
            lo, hi = minimum_bytes(d, ratio, cache)
            per_elem = sum(xla_cost.is_per_element(op, row_limit=SEQS)
                           for op in cost.indexed_ops)
            print(f"| {chip} | {d} | {ratio} | {cache} | {cost.xla_bytes / 2**20:.1f} | "
                  f"{lo / 2**20:.2f} / {hi / 2**20:.2f} | {cost.xla_bytes / hi:.0f} | "
                  f"{per_elem} |", flush=True)


if __name__ == "__main__":
    main()
