"""Whole-op cost of the DeepSeek-V4 step (``dsa_jax.v4_step``, Pallas backend) per chip: XLA's
TPU cost analysis of the AOT-compiled step (libtpu on CPU; no TPU runs), with the caches and
state pools donated as serving donates them.

Program: V4-Flash dims (64 heads x 512, indexer 64 x 128, top-512, window 128 in pages of 64,
compressed pages of 64 entries), the first ``--layers`` layers of the Flash pattern (default 4:
SWA, SWA, CSA, HCA), a decode batch of ``--rows`` sequences at ``--context`` tokens.

Columns: ``XLA bytes`` (the whole program's ``bytes accessed``), ``kernel bytes`` (the Pallas
calls' declared estimates), per decode row; ``gathers`` / ``scatters`` (XLA ops: the
compressors' slot gathers and the row / entry / state writes); ``large results`` (XLA
results over 1 MiB: a per-layer cache copy would show here); and the gathers / scatters
moving under 128 elements per index over more than 1024 indices (per-element traffic).

Each chip is compiled twice (``--compressors``): with the Pallas compressor
(``pallas_kernels.v4_compressor``, what ``backend="pallas"`` runs) and, for the before/after
comparison, with the reference compressor (``reference.v4_compressor``, XLA) beside the same
Pallas attention and indexer kernels.

Caches (``--window-format``, ``--compressed-format``, ``--index-format``): ``plain`` f32 (the
default) or ``fp8`` (window and compressed: FlashMLA MODEL1, ``reference.v4_cache.Fp8V4Cache``;
index: ``reference.fp8_cache.Fp8IndexCache``).

Usage: ``python -m scripts.cost.v4_step_cost [--quick] [--chips v6e] [--compressors
pallas,reference] [--window-format fp8 --compressed-format fp8 --index-format fp8]``.
"""

from __future__ import annotations

import argparse
import os
from argparse import Namespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import contextlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dsa_jax import backend as _backend  # noqa: E402
from dsa_jax import v4_cli  # noqa: E402
from dsa_jax.v4_step import v4_step_body  # noqa: E402
from pallas_kernels import chips as chip_specs  # noqa: E402
from pallas_kernels import xla_cost  # noqa: E402
from reference import v4_compressor as vc  # noqa: E402


def _reference_compressor(*args, ratio, eps=vc.NORM_EPS, interpret=False, vmem_limit_bytes=None):
    """The reference compressor behind the Pallas entry's knobs (ignored)."""
    del interpret, vmem_limit_bytes
    return vc.compress_step(*args, ratio=ratio, eps=eps)


@contextlib.contextmanager
def compressor(name: str):
    """The step's ``backend="pallas"`` compressor while compiling: ``"pallas"`` (as shipped) or
    ``"reference"`` (the XLA form, for the before column)."""
    saved = _backend.OPS["v4_compressor"]
    if name == "reference":
        _backend.OPS["v4_compressor"] = (saved[0], _reference_compressor)
    elif name != "pallas":
        raise ValueError(f"compressor must be 'pallas' or 'reference', got {name!r}")
    try:
        yield
    finally:
        _backend.OPS["v4_compressor"] = saved


def program(layers: int, rows: int, context: int, formats: dict | None = None):
    """``(fn, specs, donate, num_rows, layout)`` of the step at V4-Flash dims; ``formats``:
    ``v4_cli.build``'s ``window_format`` / ``compressed_format`` / ``index_format``."""
    s = v4_cli.sizes(Namespace(quick=False, context=context, prefill=None, heads=None,
                               topk=None, layers=layers, page_size=None))
    rng = np.random.default_rng(0)
    q_lens, kv_lens = [1] * rows, [context] * rows
    layout, *args = v4_cli.build(rng, s, q_lens, kv_lens, spec=True, **(formats or {}))
    args[4] = args[4]._replace(distribution=np.asarray([rows, rows, rows], np.int32))
    # decode only: no padding rows would be ideal, build adds 2 (kept: the CLI's batch)
    leaves, tree = jax.tree.flatten(args)
    specs = [x if isinstance(x, jax.ShapeDtypeStruct) else
             jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in leaves]
    n_in = len(jax.tree.leaves(args[0])) + len(jax.tree.leaves(args[1]))
    n_state = len(jax.tree.leaves(args[2])) + len(jax.tree.leaves(args[3]))
    donate = tuple(range(n_in, n_in + n_state))

    def fn(*flat):
        a = jax.tree.unflatten(tree, flat)
        return v4_step_body(*a, layout=layout, sm_scale=None, qat=False, exact=True,
                            backend="pallas", kernel_options=(("interpret", False),),
                            precision="f32")  # the programs BENCHMARKS.md reports
    return fn, specs, donate, rows, layout


def row(chip: str, layers: int, rows: int, context: int, comp: str = "pallas",
        formats: dict | None = None) -> dict:
    fn, specs, donate, n, layout = program(layers, rows, context, formats)
    with compressor(comp):
        compiled = xla_cost.compile_program(fn, specs, chip, donate_argnums=donate,
                                            case="v4_step")
    cost = xla_cost.analyze(compiled)
    big = xla_cost.parse_large_results(compiled.as_text(), 1 << 20)
    return dict(chip=chip, layers=layers, rows=n, context=context, cost=cost, large=big,
                gathers=sum(op.kind == "gather" for op in cost.indexed_ops),
                scatters=sum(op.kind == "scatter" for op in cost.indexed_ops),
                narrow=[op for op in cost.indexed_ops if op.slice_elems < 128
                        and op.num_indices > 1024])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers, 8 rows, context 2048")
    p.add_argument("--chips", default=chip_specs.DEFAULT,
                   help=f"comma-separated chips (default {chip_specs.DEFAULT})")
    p.add_argument("--layers", type=int, default=4, help="first N layers of the Flash pattern")
    p.add_argument("--rows", type=int, default=64, help="decode sequences (default 64)")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--compressors", default="pallas,reference",
                   help="the compressors to compile the step with (default both)")
    for name, what in (("window", "window caches (MODEL1 fp8: reference.v4_cache)"),
                       ("compressed", "CSA / HCA compressed caches (MODEL1 fp8)"),
                       ("index", "CSA index cache (fp8: reference.fp8_cache.Fp8IndexCache)")):
        p.add_argument(f"--{name}-format", choices=("plain", "fp8"), default="plain",
                       help=f"the {what}; default plain (f32)")
    a = p.parse_args(argv)
    rows, context = (8, 2048) if a.quick else (a.rows, a.context)
    formats = dict(window_format=a.window_format, compressed_format=a.compressed_format,
                   index_format=a.index_format)
    caches = ("" if set(formats.values()) == {"plain"} else
              f", caches window {a.window_format} / compressed {a.compressed_format} / index "
              f"{a.index_format}")
    for chip, comp in [(c, m) for c in a.chips.split(",") for m in a.compressors.split(",")]:
        r = row(chip, a.layers, rows, context, comp, formats)
        c, n = r["cost"], rows + 2  # build adds two padding rows
        print(f"{chip} ({comp} compressor{caches}): {a.layers} layers, {rows} decode rows x "
              f"{context} tokens: XLA bytes "
              f"{c.total_bytes / n / 1e6:.3f} MB/row, kernel bytes {c.kernel_bytes / n / 1e6:.3f}"
              f" MB/row, XLA glue {c.xla_bytes / n / 1e6:.3f} MB/row; gathers {r['gathers']}, "
              f"scatters {r['scatters']}, kernels {len(c.kernels)}, loop {c.has_loop}")
        print(f"  narrow gathers/scatters (< 128 elements per index, > 1024 indices): "
              f"{[op.describe() for op in r['narrow']]}")
        print(f"  large XLA results (> 1 MiB): "
              f"{[(x.opcode, x.shape, x.op_name[-60:]) for x in r['large']]}")


if __name__ == "__main__":
    main()
