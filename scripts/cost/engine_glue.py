"""sglang-jax adapter glue: XLA-side bytes against the Pallas kernels' on each chip (issue 29).

XLA's TPU cost model of AOT compiles through libtpu on CPU (no TPU runs), split into the Pallas
calls' declared bytes and the XLA ops (``pallas_kernels.xla_cost.analyze``). The Pallas path is
compiled for TPU through the ops' own route, ``kernel_options={"interpret": False}``.

Programs, at 8 decode rows x 8K context (``DECODE``; ``--small``: ``SMALL``, the gate test's):

- ``mla_decode``: ``dsa_jax.engines.sglang_jax.sparse_mla_page_level`` as sglang-jax calls it
  (bf16 pool ``[P, ps / 2, 2, 640]`` donated, token top-k of 2048, ``k_pages_max = 32``, H = 16):
  the pool read in place (``pallas_kernels.mla.pool.TokenPackedCache``).
- ``mla_read_view`` / ``mla_read_pool``: ``dsa_jax.page_sparse_mla`` alone on the pool's
  ``[P, ps, 640]`` reshape (the adapter's route before the token-packed format) and on the pool
  in place: what the view itself costs; ``mla_read_pool_f32``: an f32 pool ``[P, ps, 1, 640]``
  in place.
- ``indexer_view`` / ``indexer_plain``: the calls ``streamindex_topk`` makes
  (``index_cache_view`` of the bf16 index cache ``[P, ps / 2, 2, 128]``, then
  ``dsa_jax.indexer_topk``, recall 1.0, k = 2048) and the same on a native ``[P, ps, 128]``
  cache: the view's cost before the Pallas indexer.

Columns: XLA bytes, kernel bytes, the pool's bytes, and ``pool_copies``: entry ops that make a
pool-sized buffer other than the in-place row scatter (copies, reshapes, transposes, fusions):
a relayout of the whole pool.

Usage: ``python -m scripts.cost.engine_glue [--chips v5e,v6e,tpu7x] [--small]``
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dsa_jax  # noqa: E402
from dsa_jax.engines import sglang_jax as sj  # noqa: E402
from pallas_kernels import chips, xla_cost  # noqa: E402
from pallas_kernels.measure import hlo  # noqa: E402
from pallas_kernels.mla.pool import TokenPackedCache  # noqa: E402

BF16, I32 = jnp.bfloat16, jnp.int32
LKV, ROPE, D, INDEX_D = 512, 64, 640, 128
COMPILE = {"interpret": False}  # the Pallas path compiled (for the AOT chip), not interpreted
# Ops that only name or move a buffer in place (never a relayout of it).
_IN_PLACE = ("scatter",)


@dataclass(frozen=True)
class Shape:
    """A decode batch: ``rows`` sequences of one query row, ``heads`` heads, pages of
    ``page_size`` tokens, ``pages_per_seq`` pages each (the context), ``topk`` tokens and
    ``k_pages`` page slots per row."""

    rows: int
    heads: int
    page_size: int
    pages_per_seq: int
    topk: int
    k_pages: int

    @property
    def num_pages(self) -> int:
        return self.rows * self.pages_per_seq + 1  # plus sglang-jax's sentinel page


DECODE = Shape(rows=8, heads=16, page_size=64, pages_per_seq=128, topk=2048, k_pages=32)
SMALL = Shape(rows=4, heads=16, page_size=32, pages_per_seq=8, topk=64, k_pages=4)


@dataclass(frozen=True)
class Row:
    """One program on one chip (module docstring's columns)."""

    chip: str
    program: str
    xla_bytes: float
    kernel_bytes: float
    pool_bytes: int
    pool_copies: tuple


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _batch_specs(sh: Shape):
    return [_s((sh.rows,), I32), _s((sh.rows * sh.pages_per_seq,), I32),
            _s((sh.rows + 1,), I32), _s((sh.rows + 1,), I32), _s((3,), I32)]


def _pool(sh: Shape, dim: int, dtype=BF16):
    """sglang-jax's pool ``[P, ps / k, k, dim]``, ``k = 32 // bits``."""
    k = 32 // (jnp.dtype(dtype).itemsize * 8)
    return _s((sh.num_pages, sh.page_size // k, k, dim), dtype)


def mla_decode(sh: Shape):
    """``(fn, specs, donate, pool spec)`` of ``sparse_mla_page_level`` (module docstring)."""
    pool = _pool(sh, D)
    kv, table, cu_q, cu_kv, dist = _batch_specs(sh)
    specs = [_s((sh.rows, sh.heads, LKV), BF16), _s((sh.rows, sh.heads, ROPE), BF16),
             _s((sh.rows, LKV), BF16), _s((sh.rows, ROPE), BF16), pool, kv,
             _s((sh.rows, sh.topk), I32), table, cu_q, cu_kv, dist]

    def fn(*args):
        return sj.sparse_mla_page_level(
            *args, sm_scale=0.07, page_size=sh.page_size, pages_per_seq=sh.pages_per_seq,
            kv_lora_rank=LKV, k_pages_max=sh.k_pages, implementation="pallas",
            kernel_options=COMPILE)
    return fn, specs, (4,), pool


def mla_read(sh: Shape, in_place: bool, dtype=BF16):
    """``dsa_jax.page_sparse_mla`` on the pool in place, or on its ``[P, ps, D]`` reshape."""
    pool = _pool(sh, D, dtype)
    specs = [_s((sh.rows, sh.heads, D), BF16), pool, _s((sh.rows, sh.k_pages), I32),
             *_batch_specs(sh)]

    def fn(q, cache, pages, kv, table, cu_q, cu_kv, dist):
        cache = TokenPackedCache(cache) if in_place else TokenPackedCache(cache).view()
        return dsa_jax.page_sparse_mla(q, cache, kv, pages, table, cu_q, cu_kv, dist,
                                       sm_scale=0.07, pages_per_seq=sh.pages_per_seq,
                                       v_dim=LKV, implementation="pallas",
                                       kernel_options=COMPILE)
    return fn, specs, (), pool


def indexer(sh: Shape, view: bool):
    """The calls of ``sj.streamindex_topk`` (``index_cache_view``, a fixed-stride batch,
    ``indexer_topk`` at recall 1.0) on the 4-D index cache, or on a native 3-D one."""
    pool = _pool(sh, INDEX_D)
    cache = pool if view else _s((sh.num_pages, sh.page_size, INDEX_D), BF16)
    kv, table, cu_q, _, dist = _batch_specs(sh)
    specs = [_s((sh.rows, sh.heads, INDEX_D), BF16), _s((sh.rows, sh.heads), BF16), cache, kv,
             table, cu_q, dist]

    def fn(q, w, cache, kv, table, cu_q, dist):
        keys = sj.index_cache_view(cache) if view else cache
        batch = dsa_jax.Batch.from_fixed_stride(kv, table.reshape(sh.rows, -1), cu_q, dist,
                                                page_size=sh.page_size)
        return dsa_jax.indexer_topk(q, w.astype(jnp.float32), keys, batch=batch, k=sh.topk,
                                    recall_target=1.0, implementation="pallas",
                                    kernel_options=COMPILE)
    return fn, specs, (), pool


PROGRAMS = {"mla_decode": mla_decode,
            "mla_read_view": lambda sh: mla_read(sh, in_place=False),
            "mla_read_pool": lambda sh: mla_read(sh, in_place=True),
            "mla_read_pool_f32": lambda sh: mla_read(sh, in_place=True, dtype=jnp.float32),
            "indexer_view": lambda sh: indexer(sh, view=True),
            "indexer_plain": lambda sh: indexer(sh, view=False)}


def pool_copies(hlo_text: str, pool_bytes: int) -> tuple[hlo.LargeResult, ...]:
    """The entry ops of a compiled program (its ``as_text()``) that make a buffer of at least
    ``pool_bytes`` other than the in-place row scatter: each one a relayout (or a copy) of the
    whole pool."""
    return tuple(r for r in hlo.parse_large_results(hlo_text, pool_bytes)
                 if not (r.opcode == "fusion" and r.op_name.endswith(_IN_PLACE)))


def measure(chip: str, program: str, sh: Shape = DECODE) -> tuple[Row, str]:
    """Compile ``PROGRAMS[program]`` at ``sh`` for ``chip``: its ``Row`` and optimized HLO."""
    fn, specs, donate, pool = PROGRAMS[program](sh)
    compiled = xla_cost.compile_program(fn, specs, chip, donate_argnums=donate, case=program)
    cost, text = xla_cost.analyze(compiled), compiled.as_text()
    pool_bytes = jnp.dtype(pool.dtype).itemsize * math.prod(pool.shape)
    return Row(chip, program, cost.xla_bytes, cost.kernel_bytes, pool_bytes,
               pool_copies(text, pool_bytes)), text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default=",".join(chips.NAMES))
    ap.add_argument("--small", action="store_true", help="the gate test's shape")
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    args = ap.parse_args(argv)
    sh = SMALL if args.small else DECODE
    print(f"shape: {sh}")
    print(f"{'chip':6} {'program':17} {'XLA MB':>9} {'kernel MB':>9} {'XLA/kern':>8} "
          f"{'pool MB':>8}  pool-sized copies")
    for chip in args.chips.split(","):
        for name in args.programs.split(","):
            row, _ = measure(chip, name, sh)
            copies = "; ".join(f"{r.opcode} {r.shape} ({r.op_name})" for r in row.pool_copies)
            print(f"{chip:6} {name:17} {row.xla_bytes / 1e6:9.2f} {row.kernel_bytes / 1e6:9.2f} "
                  f"{row.xla_bytes / max(row.kernel_bytes, 1):8.2f} {row.pool_bytes / 1e6:8.2f}  "
                  f"{copies or '-'}")


if __name__ == "__main__":
    main()
