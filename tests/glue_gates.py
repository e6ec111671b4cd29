"""The XLA glue gates of issue 30 deliverable 4 ("glue at the peers' floor"), asserted inside the
compile gates that already compile these programs (``tests/test_compile_indexer.py``'s V4-Flash
decode case, ``tests/test_compile_v4.py``'s ``csa_d512_decode64`` compressor case, pool donated),
so the gate costs no compile of its own. XLA's TPU cost model of AOT compiles through libtpu on
CPU (no TPU runs): the program's bytes accessed minus the Pallas kernels' declared estimates
(``pallas_kernels.measure.xla_cost.analyze``), at V4-Flash decode (64 rows x 8192 tokens) on v5e,
v6e and tpu7x:

- the compressed-key indexer (``streamindex_topk``, ``compression_ratio=4``, index heads 64 x
  128, top-512) <= 5 MB per call: what is left is the selection (``approx_max_k``'s sort of
  ``f32[64, 2048]``, the masks);
- the Pallas V4 compressor (d 512, ratio 4) <= 7.5 MB per call.

Before (main 2027a0e, v6e): indexer 11.2 MB (the work list's scalar gathers, priced by XLA at
kilobytes per index, and the ``[T, H, 1]`` weights relaid with 128x lane padding), compressor
22.3 MB (the RoPE tables copied row-major to gather rows, the norm and RoPE on the ``E`` rows,
the per-slot facts' gathers). The per-chip table: ``python -m scripts.cost.glue_cost``."""

from __future__ import annotations

import math

from pallas_kernels import xla_cost

MB = 1e6
INDEXER_FLASH = "V4-Flash decode 64x8192 (2048 entries) k=512"
COMPRESSOR = "csa_d512_decode64"
GLUE_BOUND = {"indexer": 5.0 * MB, "compressor": 7.5 * MB}


def assert_glue(name: str, chip: str, cost) -> None:
    """``cost`` (``xla_cost.analyze`` of the compiled program) keeps its XLA glue within
    ``GLUE_BOUND[name]``, with every kernel's estimate declared and no loop hiding bytes."""
    assert cost.loops_negligible, cost.loops  # a loop body counted once would hide bytes
    assert cost.kernels and cost.kernels_without_estimate == 0
    assert cost.xla_bytes <= GLUE_BOUND[name], (
        f"{name} on {chip}: XLA glue {cost.xla_bytes / MB:.2f} MB > "
        f"{GLUE_BOUND[name] / MB} MB (kernels {cost.kernel_bytes / MB:.2f} MB); largest XLA "
        f"results: {[(r.opcode, r.shape, r.op_name) for r in cost.large_results[:8]]}")


def assert_pool_in_place(compiled, cost, pool, row_limit: int) -> None:
    """A compressor program (``compiled``, its ``cost``) updates its state ``pool`` (the
    donated ``ShapeDtypeStruct``) in place: no loop, no per-element gather or scatter in the
    glue (``row_limit`` the rows or slots one index may address as metadata), no copy of the
    pool."""
    assert not cost.has_loop
    assert not [op.describe() for op in cost.indexed_ops
                if xla_cost.is_per_element(op, row_limit=row_limit)]
    pool_shape = f"f32[{','.join(map(str, pool.shape))}]"
    copies = [x for x in xla_cost.parse_large_results(compiled.as_text(),
                                                      math.prod(pool.shape) * 4)
              if x.opcode.startswith("copy") and x.shape == pool_shape]
    assert not copies, copies
