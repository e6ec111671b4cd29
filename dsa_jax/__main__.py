"""``python -m dsa_jax run``: the multi-layer DSA step on a synthetic ragged paged batch
(``python -m dsa_jax tpu-bench``: ``dsa_jax.measure.tpu_bench``, timings on a TPU).

Builds a ragged batch (decode + MTP + chunked prefill + padding rows and an inactive sequence
slot) at DeepSeek-V3.2 dimensions (64 indexer heads x 128, latent 512 + rope 64 padded to 640,
v_dim 512), sizes scaled by flags, and runs ``dsa_jax.dsa_step`` over ``--layers`` layers with
IndexShare on the jnp reference and, with ``--dsa-use-pallas``, on the Pallas kernels
(interpret mode off TPU: slow, keep sizes small). Prints the agreement between the backends
(top-k overlap, output relative error), the segment-witness coverage of the selection and the
time per backend, and ends with a verdict line and the timings (``dsa_jax.cli_common``; exit
status 0 passed, 1 NaN or Pallas disagrees, 2 bad flags or a combination the layout refuses).
``--devices N`` runs the step sharded over N devices (sequences on a data axis, MLA heads on a
model axis of size ``--tp``); on CPU it asks XLA for N host devices. ``--model v4-flash``:
``dsa_jax.v4_cli``; ``--model v4.1-flash``: ``dsa_jax.v41_cli``. The ``--help`` text is plain
(``DESCRIPTION``, ``EPILOG``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

from dsa_jax.cli_common import (
    SAME_STEP_TOLERANCE,
    backend_line,
    bounded_int,
    compare,
    nonnegative_int,
    pick_size,
    positive_int,
    time_backends,
    verdict,
)

V32 = dict(index_heads=64, index_dim=128, latent_dim=512, rope_dim=64)
SM_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2  # qk head dim 192, YaRN mscale(40)


DESCRIPTION = """\
Run DeepSeek sparse attention on a synthetic ragged paged batch and check the result.

The batch mixes decode sequences (1 row each), an MTP sequence (3 rows), a chunked-prefill
sequence, 2 padding rows and an inactive sequence slot. Caches, activations and weights are
random numbers: this checks shapes, the reference and the kernels' agreement; it is not a
model run.

  --model v3.2 (default): the DeepSeek-V3.2 DSA step (dsa_jax.dsa_step) at V3.2 dimensions
      (64 indexer heads x 128, latent 512 + rope 64), over --layers layers with IndexShare.
  --model v4-flash: the DeepSeek-V4 attention step (dsa_jax.v4_step) at V4-Flash dimensions
      (64 heads x 512, window 128, the 43-layer SWA/CSA/HCA pattern; --layers N runs the
      first N layers).
  --model v4.1-flash: the DeepSeek-V4.1 step (dsa_jax.v41_step) at V4.1-Flash dimensions
      (64 heads x 512, dim 5120, indexer 32 x 128, top-512, 2048 candidate blocks of 8) on a
      9-layer pattern with every mode (SWA, FULL ratio 2 / 1, REUSE, REINDEX, the candidate
      source and consumer), its caches in V4.1's fp8 / fp4 formats; each sequence checked
      against the statement (--quick: the tiny config). --dsa-use-pallas: the ratio-2
      compressor on its Pallas kernel, the other ops jnp (no kernel reads V4.1's formats yet).

Every run runs the jnp reference. --dsa-use-pallas also runs the Pallas kernels (off TPU in
interpret mode: slow, keep the sizes small) and compares them with the reference. The run
ends with a verdict line and the measured times."""

EPILOG = """\
examples:
  python -m dsa_jax run --quick
      V3.2 step at small sizes, reference only
  python -m dsa_jax run --quick --dsa-use-pallas
      the same, plus the Pallas kernels, compared with the reference
  python -m dsa_jax run --quick --cache-format fp8
      V3.2 with DeepSeek-V3.2's fp8 caches
  python -m dsa_jax run --quick --devices 8 --tp 2
      V3.2 sharded over 8 (host) devices: 4 data shards x 2 model shards
  python -m dsa_jax run --model v4-flash --quick
      the DeepSeek-V4-Flash step, 4 layers (SWA, SWA, CSA, HCA)
  python -m dsa_jax run --model v4-flash --quick --dsa-use-pallas \\
      --context 256 --prefill 8 --decode 1 --topk 16
      V4-Flash on both backends, shrunk further (about 1.5 min on 2 CPU cores)
  python -m dsa_jax run --model v4.1-flash --quick
      the DeepSeek-V4.1 step, tiny config, against its statement (about 20 s)

exit status:
  0  the run passed: the reference ran without NaN and, with --dsa-use-pallas, Pallas
     agrees with it (same top-k sets, outputs within the tolerance the tests use)
  1  the run failed: NaN in an output, or Pallas disagrees with the reference (v4.1-flash:
     or the step disagrees with the statement)
  2  bad flags, or a combination of sizes the step refuses"""

SIZE_FLAGS = {"context": "context", "prefill": "prefill", "heads": "heads", "topk": "k",
              "layers": "layers", "page_size": "page_size"}
V32_ONLY = ("num_segments", "witness_fill", "packed_latent", "cache_format", "exact", "devices",
            "tp")


def _size_table() -> dict:
    """``{model: (default sizes, --quick sizes)}`` from the functions the runs use."""
    from dsa_jax import v4_cli

    ns = lambda quick: argparse.Namespace(quick=quick, cache_format="plain",  # noqa: E731
                                          **dict.fromkeys(SIZE_FLAGS))
    return {"v3.2": (_sizes(ns(False)), _sizes(ns(True))),
            "v4-flash": (v4_cli.sizes(ns(False)), v4_cli.sizes(ns(True)))}


def _default_text(table: dict, key: str) -> str:
    (v3, v3q), (v4, v4q) = table["v3.2"], table["v4-flash"]
    if (v3[key], v3q[key]) == (v4[key], v4q[key]):
        return f"default {v3[key]}; --quick {v3q[key]}"
    return (f"default {v3[key]}, v4-flash {v4[key]}; --quick {v3q[key]}, "
            f"v4-flash {v4q[key]}")


def _quick_text(table: dict) -> str:
    from dsa_jax import v4_cli
    from reference.statements import deepseek_v4 as dv4

    v3, v4 = table["v3.2"][1], table["v4-flash"][1]
    types = ", ".join({0: "SWA", 4: "CSA", 128: "HCA"}[r]
                      for r in dv4.FLASH_COMPRESS_RATIOS[:v4_cli.V4_FLASH["layers"]][:v4["layers"]])
    return (f"small sizes (a flag given sets its own). v3.2: context {v3['context']}, "
            f"prefill {v3['prefill']}, {v3['heads']} MLA heads, top-k {v3['k']}, "
            f"{v3['layers']} layers, page {v3['page_size']} (32 with --cache-format fp8). "
            f"v4-flash: context {v4['context']}, prefill {v4['prefill']}, {v4['heads']} "
            f"heads, {v4['index_heads']} indexer heads, top-k {v4['k']}, {v4['layers']} layers "
            f"({types}), page {v4['page_size']}")


def _parser() -> argparse.ArgumentParser:
    from reference.witnesses import MAX_TOPOLOGY_SEGMENTS

    p = argparse.ArgumentParser(
        prog="python -m dsa_jax", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="DeepSeek sparse attention in JAX: the DeepSeek-V3.2 DSA step and the\n"
                    "DeepSeek-V4-Flash attention step on a synthetic batch, on the jnp\n"
                    "reference and the Pallas kernels.",
        epilog="run 'python -m dsa_jax run --help' for the flags and examples")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", description=DESCRIPTION, epilog=EPILOG,
                       help="run the V3.2 or V4-Flash step on a synthetic batch and check it",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    table = _size_table()
    g = r.add_argument_group("what to run")
    g.add_argument("--model", choices=("v3.2", "v4-flash", "v4.1-flash"), default="v3.2",
                   help="v3.2: the DeepSeek-V3.2 DSA step (default); v4-flash: the "
                        "DeepSeek-V4 attention step at V4-Flash dimensions; v4.1-flash: the "
                        "DeepSeek-V4.1 step (every layer mode) at V4.1-Flash dimensions "
                        "(--quick: a tiny config), checked against its statement")
    g.add_argument("--quick", action="store_true", help=_quick_text(table))
    g.add_argument("--dsa-use-pallas", action="store_true",
                   help="also run the Pallas kernels (interpret mode off TPU) and compare "
                        "them with the reference")
    g.add_argument("--seed", type=nonnegative_int, default=0, metavar="N",
                   help="random seed of the batch (default 0)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress indicator on stderr")
    g = r.add_argument_group("sizes (every model; each at least 1 unless said)")
    g.add_argument("--context", type=positive_int, default=None, metavar="TOKENS",
                   help=f"KV length bound of the longest sequence, in tokens "
                        f"({_default_text(table, 'context')})")
    g.add_argument("--decode", type=nonnegative_int, default=4, metavar="N",
                   help="number of decode sequences, 1 row each (default 4; 0 = none)")
    g.add_argument("--prefill", type=positive_int, default=None, metavar="ROWS",
                   help=f"rows of the chunked-prefill sequence, at most --context "
                        f"({_default_text(table, 'prefill')}); an MTP sequence of 3 rows "
                        f"is always added")
    g.add_argument("--heads", type=positive_int, default=None, metavar="N",
                   help=f"attention (MLA) query heads ({_default_text(table, 'heads')}; "
                        f"v3.2's 16 are 128 heads over tensor parallelism 8)")
    g.add_argument("--topk", type=positive_int, default=None, metavar="K",
                   help=f"token budget k per row ({_default_text(table, 'k')})")
    g.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help=f"layers of the step ({_default_text(table, 'layers')}). v3.2: one "
                        f"full layer, then shared x3 + full repeating (IndexShare); "
                        f"v4-flash: the first N of the 43-layer pattern")
    g.add_argument("--page-size", type=positive_int, default=None, metavar="TOKENS",
                   help=f"tokens per cache page ({_default_text(table, 'page_size')}; v3.2 "
                        f"with --cache-format fp8: a multiple of 32; v4-flash: a divisor of "
                        f"the 128-token window)")
    g = r.add_argument_group("v3.2 only")
    g.add_argument("--num-segments", type=bounded_int(0, MAX_TOPOLOGY_SEGMENTS),
                   default=8, metavar="S",
                   help=f"segment witnesses merged into each top-k row, 0 to "
                        f"{MAX_TOPOLOGY_SEGMENTS} (0 = witnesses off; default 8)")
    g.add_argument("--witness-fill", choices=("tail", "lowest"), default="tail",
                   help="where witnesses go: tail = the last S slots of a row, as upstream "
                        "(default); lowest = over a row's last w slots (padding, then the "
                        "lowest-scored); see EXPERIMENTS.md")
    g.add_argument("--packed-latent", action="store_true",
                   help="store the latent cache as packed bf16 u32 words (the format the "
                        "token-sparse Pallas kernel gathers rows from; values rounded to bf16)")
    g.add_argument("--cache-format", choices=("plain", "fp8"), default="plain",
                   help="fp8: both caches in DeepSeek-V3.2's fp8 formats (e4m3 indexer keys "
                        "with per-token scales, FlashMLA's fp8 latent), quantized on write "
                        "(default plain: f32)")
    g.add_argument("--exact", action="store_true",
                   help="exact top_k selection (deterministic ties) instead of approx_max_k")
    g.add_argument("--devices", type=positive_int, default=1, metavar="N",
                   help="run sharded over N devices: N/tp data shards (each its own batch) x "
                        "tp model shards (default 1 = one device; on CPU, N host devices)")
    g.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="model-axis size for --devices: MLA heads are split over it, so it "
                        "divides --devices and --heads (default 1)")
    sub.add_parser("tpu-bench", add_help=False,  # main() hands its arguments to tpu_bench
                   help="time every kernel, the selection and the steps on a TPU "
                        "(dsa_jax.measure.tpu_bench; 'tpu-bench --help' for its flags)")
    return p


def _run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if a.dest == "cmd").choices["run"]


def _check_flags(rp: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of flags the run refuses, decided before anything runs (``rp.error``:
    the usage line and one message, exit 2)."""
    from dsa_jax import v4_cli

    given = lambda dest: "" if getattr(args, dest) is not None else (  # noqa: E731
        " (the --quick default)" if args.quick else " (the default)")
    if args.model == "v4.1-flash":
        from dsa_jax import v41_cli

        for dest in (*V32_ONLY, "heads", "topk", "layers"):
            if getattr(args, dest) not in (rp.get_default(dest), None):
                flag = "--" + dest.replace("_", "-")
                rp.error(f"{flag} does not apply to --model v4.1-flash (one device, V4.1's own "
                         f"cache formats, the config's heads, top-k and layer pattern)")
        s = v41_cli.sizes(args)
    elif args.model == "v4-flash":
        for dest in V32_ONLY:
            if getattr(args, dest) != rp.get_default(dest):
                flag = "--" + dest.replace("_", "-")
                rp.error(f"{flag} applies to --model v3.2 only (v4-flash runs on one device, "
                         f"plain caches, no witnesses)")
        s = v4_cli.sizes(args)
        if s["layers"] > v4_cli.V4_FLASH["layers"]:
            rp.error(f"--layers {s['layers']}: V4-Flash has {v4_cli.V4_FLASH['layers']} "
                     f"attention layers")
    else:
        s = _sizes(args)
        if args.devices % args.tp:
            rp.error(f"--devices {args.devices} must be a multiple of --tp {args.tp}")
        if args.devices > 1 and s["heads"] % args.tp:
            rp.error(f"--heads {s['heads']}{given('heads')} must be divisible by --tp "
                     f"{args.tp} (the MLA heads are split over the model axis)")
    if s["prefill"] > s["context"]:
        rp.error(f"--prefill {s['prefill']}{given('prefill')} is longer than --context "
                 f"{s['context']}{given('context')}: a sequence's rows are part of its KV "
                 f"length")
    if s["context"] < 3:
        rp.error(f"--context {s['context']} is shorter than the MTP sequence's 3 rows")


class Progress:
    """Elapsed-time indicator on stderr while a long phase runs (a line per 10 s off a tty)."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled = label, enabled
        self._stop = threading.Event()
        self._tty = sys.stderr.isatty()

    def _run(self):
        t0, spin = time.perf_counter(), "|/-\\"
        i = 0
        while not self._stop.wait(0.5 if self._tty else 10.0):
            dt = time.perf_counter() - t0
            if self._tty:
                sys.stderr.write(f"\r  {spin[i % 4]} {self.label} {dt:5.0f} s")
            else:
                sys.stderr.write(f"  ... {self.label}: {dt:.0f} s\n")
            sys.stderr.flush()
            i += 1

    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._stop.set()
            self._thread.join()
            if self._tty:
                sys.stderr.write("\r" + " " * 60 + "\r")
        return False


def _sizes(args):
    """The V3.2 run's sizes: each flag given, else its default (``--quick``: small)."""
    pick = lambda flag, full, small: pick_size(flag, args.quick, full, small)  # noqa: E731
    return dict(context=pick(args.context, 8192, 512), prefill=pick(args.prefill, 256, 32),
                heads=pick(args.heads, 16, 4), k=pick(args.topk, 2048, 128),
                layers=pick(args.layers, 4, 2),
                page_size=pick(args.page_size, 64, 32 if args.cache_format == "fp8" else 16))


def _local_batch(rng, s, layout, indexer_types, q_lens, kv_lens):
    """One local batch (its own pages, page table and data): metadata, caches, activations."""
    import jax
    import numpy as np

    from dsa_jax import BatchMeta, StepInputs
    from reference.core.synthetic import make_ragged_batch

    b = make_ragged_batch(rng, q_lens=q_lens, kv_lens=kv_lens, page_size=layout.page_size,
                          pages_per_seq=layout.pages_per_seq, num_heads=1, dim=8, pad_rows=2,
                          pad_seqs=1, fill=0.0)
    t, p = b.q.shape[0], b.cache.shape[0]
    nl, nf = len(indexer_types), indexer_types.count("full")
    f32 = lambda *shape: rng.standard_normal(shape, np.float32)
    latent = f32(nl, p, layout.page_size, layout.padded_dim)
    latent[..., layout.qk_dim:] = 0.0
    # packed words or fp8 as the layout declares; host (NumPy) arrays, so that the step's
    # donation never consumes them and the CLI can run several steps on the same caches
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    latent = host(layout.to_cache(latent, "latent"))
    index = host(layout.to_cache(f32(nf, *layout.index_cache_shape(p)), "index"))
    inputs = StepInputs(q_mla=f32(nl, t, s["heads"], layout.qk_dim),
                        new_latent=f32(nl, t, layout.qk_dim),
                        q_index=f32(nf, t, V32["index_heads"], layout.index_dim),
                        index_weights=f32(nf, t, V32["index_heads"]) / 8.0,
                        new_index=f32(nf, t, layout.index_dim))
    return inputs, latent, index, BatchMeta(*b.meta())


def _context_lens(meta, num_rows):
    """Per row: causal context length ``min(abs_pos + 1, kv_len)`` (0 outside sequences)."""
    import jax.numpy as jnp
    import numpy as np

    from reference.core import batch
    from reference.indexer import selection

    kv, _, cu_q, _, dist = (jnp.asarray(x) for x in meta)
    rows = batch.row_facts(num_rows, kv, cu_q, dist)
    ctx = selection.causal_token_count(rows.abs_pos, kv[rows.seq])
    return np.asarray(jnp.where(rows.in_seq, ctx, 0), np.int64)


def _report_selection(topk, ctx, num_segments, fill):
    import numpy as np

    from dsa_jax import segment_coverage

    rows = [r for r in range(topk.shape[-2]) if ctx[r] > 0]
    if not num_segments:
        return "witnesses off (--num-segments 0)"
    cov = [segment_coverage(topk[f, r], int(ctx[r]), num_segments)
           for f in range(topk.shape[0]) for r in rows]
    return (f"witness coverage ({num_segments} segments, fill {fill}): mean "
            f"{np.mean(cov):.3f}, min {np.min(cov):.3f} over {len(cov)} (full layer, row) pairs")


def _agreement(ref, pal, ctx):
    import numpy as np

    overlaps = []
    for f in range(ref.topk.shape[-3]):
        for r in np.nonzero(ctx > 0)[0]:
            a = set(ref.topk[..., f, r, :].reshape(-1).tolist()) - {-1}
            b = set(pal.topk[..., f, r, :].reshape(-1).tolist()) - {-1}
            overlaps.append(len(a & b) / max(len(a), 1))
    o_ref, o_pal = np.asarray(ref.out, np.float64), np.asarray(pal.out, np.float64)
    rel = np.linalg.norm(o_pal - o_ref) / max(np.linalg.norm(o_ref), 1e-30)
    return (f"agreement pallas vs reference: top-k overlap mean {np.mean(overlaps):.4f} (min "
            f"{np.min(overlaps):.4f}), output rel. error {rel:.2e}")


def _layout(args, s):
    import dsa_jax

    return dsa_jax.PagedLayout(page_size=s["page_size"],
                               pages_per_seq=-(-s["context"] // s["page_size"]),
                               index_dim=V32["index_dim"], latent_dim=V32["latent_dim"],
                               rope_dim=V32["rope_dim"], packed_latent=args.packed_latent,
                               index_cache_format=args.cache_format,
                               latent_cache_format=("packed" if args.packed_latent
                                                    else args.cache_format))


def _step(args, kw, local):
    """``(step(backend), mesh line or None)``: one device, or sharded over ``--devices``."""
    import jax
    import numpy as np

    import dsa_jax

    inputs, latent, index, meta = local[0]
    if args.devices == 1:
        return (lambda backend: dsa_jax.dsa_step(inputs, latent, index, meta, backend=backend,
                                                 **kw)), None
    from jax.sharding import Mesh

    if len(jax.devices()) < args.devices:
        raise ValueError(f"--devices {args.devices}: only {len(jax.devices())} devices here")
    data = args.devices // args.tp
    mesh = Mesh(np.array(jax.devices()[:args.devices]).reshape(data, args.tp),
                ("data", "model"))
    stacked = [jax.tree.map(lambda *xs: np.stack(xs), *[x[j] for x in local]) for j in range(4)]
    return (lambda backend: dsa_jax.sharded_dsa_step(mesh, *stacked, backend=backend, **kw),
            f"mesh: data={data} x model={args.tp} ({args.devices} devices)")


def _rows_of_all_shards(x, sharded: bool):
    """``[D, L, T, ...]`` -> ``[L, D * T, ...]`` (the shards' rows side by side)."""
    import numpy as np

    if not sharded:
        return x
    x = np.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _check(args, results, local, kw):
    """Prints the selection, the sharded and the Pallas checks; returns ``(comparison,
    another failed check or None)`` for the verdict."""
    import jax
    import numpy as np

    import dsa_jax

    inputs, latent, index, meta = local[0]
    sharded = args.devices > 1
    ctx = _context_lens(meta, inputs.q_mla.shape[1])
    shard0 = lambda res: jax.tree.map(lambda x: x[0], res) if sharded else res  # noqa: E731
    ref0 = shard0(results["reference"])
    print(_report_selection(ref0.topk, ctx, args.num_segments, args.witness_fill))
    fail = None
    if sharded:
        single = np.asarray(dsa_jax.dsa_step(inputs, latent, index, meta, backend="reference",
                                             **kw).out)
        diff = float(np.max(np.abs(single - ref0.out)))
        print(f"sharded vs single-device (data shard 0): max |diff| {diff:.2e}")
        tol = SAME_STEP_TOLERANCE["v3.2"][1]
        if not np.all(np.abs(single - ref0.out) <= tol + tol * np.abs(single)):
            fail = f"the sharded step differs from one device (max |diff| {diff:.2e})"
    if "pallas" not in results:
        return None, fail
    print(_agreement(ref0, shard0(results["pallas"]), ctx))
    ref, pal = results["reference"], results["pallas"]
    return compare(*(_rows_of_all_shards(x, sharded) for x in (ref.out, pal.out, ref.topk,
                                                               pal.topk)), "v3.2"), fail


def run(args: argparse.Namespace) -> int:
    """The ``--model v3.2`` run (module docstring); returns the exit status (``main``)."""
    if args.devices > 1 and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    import dsa_jax

    if args.devices % args.tp:  # main checks it first; run(args) may be called directly
        raise ValueError(f"--devices {args.devices} must be a multiple of --tp {args.tp}")
    s = _sizes(args)
    layout = _layout(args, s)
    types = tuple(dsa_jax.glm_index_share_pattern(s["layers"], leading_full=1))
    data = args.devices // args.tp
    rng = np.random.default_rng(args.seed)
    q_lens = [1] * args.decode + [3, s["prefill"]]
    kv_lens = [int(rng.integers(max(q, 1), layout.capacity_tokens + 1)) for q in q_lens]
    # every data shard has the same shapes (lengths), its own pages and data
    local = [_local_batch(rng, s, layout, types, q_lens, kv_lens) for _ in range(data)]
    inputs, latent, index, meta = local[0]
    print(f"layout: page_size={layout.page_size} pages_per_seq={layout.pages_per_seq} "
          f"capacity={layout.capacity_tokens} tokens, latent {layout.qk_dim} -> padded "
          f"{layout.padded_dim}, index dim {layout.index_dim}; caches: index "
          f"{layout.index_cache_format}, latent {layout.latent_cache_format}")
    print(f"batch (per data shard, {data} shard(s)): q_lens={q_lens} (+2 padding rows, +1 "
          f"inactive slot), kv_lens={kv_lens}; T={inputs.q_mla.shape[1]} rows, "
          f"{latent.shape[1]} pages; MLA heads={s['heads']}, k={s['k']}")
    print(f"layers: {list(types)}")
    kw = dict(layout=layout, indexer_types=types, k=s["k"], sm_scale=float(SM_SCALE),
              num_segments=args.num_segments, fill=args.witness_fill, exact=args.exact)
    step, mesh_line = _step(args, kw, local)
    if mesh_line:
        print(mesh_line)
    backends = ["reference"] + (["pallas"] if args.dsa_use_pallas else [])
    results, timings = time_backends(step, backends,
                                     lambda label: Progress(label, not args.no_progress))
    nan = {b: bool(np.isnan(np.asarray(results[b].out, np.float32)).any()) for b in backends}
    for b in backends:
        print(backend_line(b, timings[b], results[b].out))
    cmp, fail = _check(args, results, local, kw)
    ran = "the V3.2 DSA step" + (f" (sharded over {args.devices} devices; data shard 0 within "
                                 f"tolerance of one device)" if args.devices > 1 else "")
    lines, status = verdict(ran, nan, timings, cmp, fail)
    print("\n".join(lines))
    return status


def main(argv=None) -> int:
    """``python -m dsa_jax``: 0 the run passed, 1 it failed (NaN, Pallas disagrees), 2 bad
    flags (argparse exits) or a combination the step refuses (its ``ValueError``, one line).
    ``tpu-bench ...``: ``dsa_jax.measure.tpu_bench.main`` (2 off a TPU without --allow-cpu)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tpu-bench"]:
        from pallas_kernels import tpu
        tpu.skip_tpu_probe_without_tpu()
        from dsa_jax.measure import tpu_bench

        return tpu_bench.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    _check_flags(_run_parser(parser), args)
    from pallas_kernels import tpu

    tpu.skip_tpu_probe_without_tpu()  # no libtpu error block on a machine without a TPU
    try:
        if args.model == "v4.1-flash":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            from dsa_jax import v41_cli

            return v41_cli.run_v41(args, lambda label: Progress(label, not args.no_progress))
        if args.model == "v4-flash":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            from dsa_jax import v4_cli

            return v4_cli.run_v4(args, lambda label: Progress(label, not args.no_progress))
        return run(args)
    except ValueError as e:  # LayoutError, WitnessError, ...: a refused combination of sizes
        print(f"dsa_jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
