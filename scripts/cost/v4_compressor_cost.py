"""Whole-op cost of the V4 compressor at a decode step, its XLA form
(``reference.v4_compressor``, ``impl = reference``) and the Pallas kernels
(``pallas_kernels.v4_compressor``, ``impl = pallas``), by XLA's TPU cost model (AOT through
libtpu; no TPU needed), against the bytes the step must move.

One decode step: 64 sequences, one new token each, a state pool of 64 slots, state (and cache)
donated; contexts of 8192 tokens (2048 entries at ratio 4, 64 at ratio 128), pages of 64
entries. Minimum bytes (f32 rows):

- every step: this step's kv and score rows in (``2 * coff * d * 4`` per sequence), one ring row
  (kv and gate) written per sequence, ``ape`` and the norm weight read once;
- a step where every sequence completes a group (the worst case a static program must serve;
  at ratio 128 one step in 128) adds the other ``R - 1`` slots' relevant halves read from the
  ring (kv and gate, ``d`` wide) and the entry written in the cache format.

Columns: ``XLA MiB`` the glue (the whole program minus the kernels' declared bytes),
``kernel MiB`` the Pallas calls' declared bytes (their static bound: every output slot
completes, ``pallas_kernels.v4_compressor.traffic.worst_counts``), ``total / all-complete`` the
program over the all-complete minimum, ``per-element ops`` gathers / scatters moving under a
128-lane row per index over more than ``E = max_entries(64, 64, r)`` indices (one scalar per
output slot is metadata), ``pool copies`` XLA copies of a pool.

Run: ``python -m scripts.cost.v4_compressor_cost [--chips v6e,tpu7x]``.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import chips as chip_specs
from pallas_kernels import xla_cost
from pallas_kernels.v4_compressor import compress_step as pallas_compress_step
from reference import v4_cache
from reference import v4_compressor as vc

SEQS, CONTEXT, PAGE, TABLE = 64, 8192, 64, 8192
CASES = ((512, 4, ("none", "bf16", "fp8")), (512, 128, ("none", "bf16", "fp8")),
         (128, 4, ("none", "bf16")))
ENTRY_BYTES = {"none": 0, "bf16": None, "fp8": 640}  # bf16: 2 * d; fp8: MODEL1 on TPU


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


IMPLS = {"reference": vc.compress_step,
         "pallas": functools.partial(pallas_compress_step, interpret=False)}


def build(d: int, ratio: int, cache: str, impl: str = "reference"):
    """``(fn, specs, donate_argnums)`` of one decode step by ``IMPLS[impl]``, entries into
    ``cache`` ("none": the entries are returned)."""
    compress = IMPLS[impl]
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
        out, state = compress(kv, score, ape, weight, cos, sin, vc.CompressorState(skv, sscore),
                              slots, kv_lens, cu_q, dist, ratio=ratio)
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


def _pool_copies(compiled, d: int, ratio: int) -> int:
    """XLA copies whose result has a pool's shape (copy-insertion around a pool update)."""
    coff = vc.compressor_coff(ratio)
    shape = f"f32[{SEQS},{vc.state_rows(ratio)},{coff * d}]"
    big = xla_cost.parse_large_results(compiled.as_text(), SEQS * vc.state_rows(ratio) * coff * d)
    return sum(x.opcode.startswith("copy") and x.shape == shape for x in big)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default=chip_specs.DEFAULT,
                    help=f"comma-separated chips (default {chip_specs.DEFAULT})")
    chips = chip_specs.parse(ap.parse_args().chips)
    print("| chip | d | r | cache | impl | XLA MiB | kernel MiB | min MiB (none / all complete) |"
          " total / all-complete | per-element ops | pool copies |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for chip in chips:
        for d, ratio, caches in CASES:
            for cache in caches:
                for impl in IMPLS:
                    fn, specs, donate = build(d, ratio, cache, impl)
                    compiled = xla_cost.compile_program(fn, specs, chip, donate_argnums=donate)
                    cost = xla_cost.analyze(compiled)
                    lo, hi = minimum_bytes(d, ratio, cache)
                    slots = vc.max_entries(SEQS, SEQS, ratio)  # per-slot metadata is fine
                    per_elem = sum(xla_cost.is_per_element(op, row_limit=slots)
                                   for op in cost.indexed_ops)
                    print(f"| {chip} | {d} | {ratio} | {cache} | {impl} | "
                          f"{cost.xla_bytes / 2**20:.1f} | {cost.kernel_bytes / 2**20:.1f} | "
                          f"{lo / 2**20:.2f} / {hi / 2**20:.2f} | "
                          f"{cost.total_bytes / hi:.1f} | {per_elem} | "
                          f"{_pool_copies(compiled, d, ratio)} |", flush=True)


if __name__ == "__main__":
    main()
