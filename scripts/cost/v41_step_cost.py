"""Whole-op cost of the DeepSeek-V4.1 step (``dsa_jax.v41_step``) per chip: XLA's TPU cost and
memory analysis of the AOT-compiled step (libtpu on CPU; no TPU runs), caches and compressor
states donated as serving donates them.

Program: V4.1-Flash's per-layer dims on the CLI's 9-layer pattern with every mode
(``dsa_jax.v41_cli.config``: SWA, FULL ratio 2 + REUSE, FULL ratio 1 as candidate source +
REUSE, REINDEX consumer + REUSE x2, MTP SWA), bf16 weights, a decode batch of ``--rows``
sequences at ``--context`` tokens (``--q-len N``: each sequence's last ``N`` tokens this step's
rows, a prefill chunk), pages of 128, ``--implementation`` xla (every op jnp) or pallas (the
ratio-2 compressor and the index scores on their kernels).

Columns: ``bytes`` (the program's ``bytes accessed``; with a ``while`` loop, the index scores'
blocks, a lower bound: the body counted once), ``weights`` (the bf16 parameters read once),
``cache minimum`` (what a decode row must read of its caches: each layer's window of 128
tokens x 528 B, ``index_topk`` pool entries x 288 B per non-SWA layer, every visible index key
x 68 B per index layer), ``temp`` (XLA's temporary buffers), per-element gathers / scatters
(under 128 elements per index over more than 1024 indices) and the large XLA results (> 1 MiB);
``estimated cycles``: XLA's per-op cycle estimates summed (``hlo.estimated_cycles``), a second
view of the same model (session 29: the two disagreed where ``bytes`` counted a weight's
cross-program prefetch into VMEM).

Usage: ``python -m scripts.cost.v41_step_cost [--quick] [--chips v6e] [--rows 16] [--context
8192] [--q-len 1] [--implementation xla] [--page-reader]``."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsa_jax import v41_cli  # noqa: E402
from dsa_jax.v41_model import V41StepLayout, init_v41_caches, init_v41_states, v41_meta  # noqa: E402
from pallas_kernels import chips as chip_specs  # noqa: E402
from pallas_kernels import xla_cost  # noqa: E402
from reference.statements import deepseek_v41 as s41  # noqa: E402
from reference.v41 import Mode, formats, resolve_layers  # noqa: E402

PAGE = 128  # the index pages at 68 B an entry (reference.v41.index_pages)


def program(rows: int, context: int, quick: bool, implementation: str, q_len: int = 1):
    """``(fn, specs, donate, layout, weight bytes)`` of one step: every sequence at ``context``
    tokens, its last ``q_len`` this step's rows (1: a decode)."""
    import importlib

    step_mod = importlib.import_module("dsa_jax.v41_step")
    c = v41_cli.config(quick)
    layout = V41StepLayout(c, PAGE, context + context % 2)
    params = [{k: jax.ShapeDtypeStruct(v, jnp.bfloat16) for k, v in
               s41.param_shapes(c, layer).items()} for layer in range(len(c.compress_ratios))]
    caches = jax.eval_shape(lambda: init_v41_caches(layout, rows))
    states = jax.eval_shape(lambda: init_v41_states(layout, rows))
    meta = v41_meta(layout, [context] * rows, [q_len] * rows)
    xs = jax.ShapeDtypeStruct((len(c.compress_ratios), rows * q_len, c.dim), jnp.bfloat16)
    args = (params, xs, caches, states, meta)
    leaves, tree = jax.tree.flatten(args)
    specs = [x if isinstance(x, jax.ShapeDtypeStruct) else
             jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in leaves]
    n_in = len(jax.tree.leaves(params)) + 1
    donate = tuple(range(n_in, n_in + len(jax.tree.leaves((caches, states)))))
    opts = (("interpret", False),) if implementation == "pallas" else ()
    body = functools.partial(step_mod.v41_step_body, layout=layout, precision="bf16",
                             implementation=implementation, kernel_options=opts)
    weights = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(params))
    return (lambda *flat: body(*jax.tree.unflatten(tree, flat))), specs, donate, layout, weights


def cache_minimum(layout: V41StepLayout, context: int) -> int:
    """Bytes a decode row must read of its caches (module docstring)."""
    c, total = layout.config, 0
    for plan in resolve_layers(c):
        total += min(c.window_size, context) * formats.window_kv_bytes(c.head_dim)
        if plan.mode is not Mode.SWA:
            total += min(c.index_topk, context // plan.ratio) * formats.compressed_kv_bytes(
                c.head_dim)
        if plan.mode in (Mode.FULL, Mode.REINDEX):
            total += context // plan.ratio * formats.index_fp4_bytes(c.index_head_dim)
    return total


def row(chip: str, rows: int, context: int, quick: bool, implementation: str,
        q_len: int = 1) -> dict:
    fn, specs, donate, layout, weights = program(rows, context, quick, implementation, q_len)
    compiled = xla_cost.compile_program(fn, specs, chip, donate_argnums=donate,
                                        case="v41_step")
    cost = xla_cost.analyze(compiled)
    mem = compiled.memory_analysis()
    return dict(cost=cost, temp=getattr(mem, "temp_size_in_bytes", 0), weights=weights,
                minimum=cache_minimum(layout, context),
                large=xla_cost.parse_large_results(compiled.as_text(), 1 << 20),
                narrow=[op for op in cost.indexed_ops
                        if op.slice_elems < 128 and op.num_indices > 1024])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny config, 8 rows, context 256")
    p.add_argument("--chips", default=chip_specs.DEFAULT,
                   help=f"comma-separated chips (default {chip_specs.DEFAULT})")
    p.add_argument("--rows", type=int, default=16, help="decode sequences (default 16)")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--q-len", type=int, default=1,
                   help="rows per sequence this step (default 1: a decode; more: a prefill "
                        "chunk ending at --context)")
    p.add_argument("--implementation", default="xla,pallas",
                   help="comma-separated: xla, pallas (default both)")
    p.add_argument("--page-reader", action="store_true",
                   help="for comparison: the layout without the block keys (V41StepLayout."
                        "block_keys off), so the Pallas consumer reads whole pages holding "
                        "candidates, as before session 28")
    a = p.parse_args(argv)
    if a.page_reader:  # this process only: the comparison's program
        V41StepLayout.block_keys = property(lambda self: False)
    rows, context = (8, 256) if a.quick else (a.rows, a.context)
    for chip in a.chips.split(","):
        for impl in a.implementation.split(","):
            r = row(chip, rows, context, a.quick, impl, a.q_len)
            c, mb = r["cost"], 1e6
            rest = (c.total_bytes - r["weights"]) / (rows * a.q_len) / mb
            loop = " (lower bound: loop)" if c.has_loop else ""
            what = "decode rows" if a.q_len == 1 else f"sequences x {a.q_len} rows"
            print(f"{chip} {impl}: {rows} {what} x {context} tokens: bytes "
                  f"{c.total_bytes / mb:.1f} MB{loop} = weights {r['weights'] / mb:.1f} MB + "
                  f"{rest:.3f} MB/row (cache minimum {r['minimum'] / mb:.3f} MB/row); kernels "
                  f"{c.kernel_bytes / mb:.3f} MB; temp {r['temp'] / 2**20:.1f} MiB; "
                  f"XLA's estimated cycles {c.estimated_cycles / 1e6:.2f} M (its ops, summed)")
            print(f"  per-element gathers/scatters: {[op.describe() for op in r['narrow']]}")
            print(f"  large XLA results (> 1 MiB): "
                  f"{[(x.opcode, x.shape) for x in r['large']][:8]}")


if __name__ == "__main__":
    main()
