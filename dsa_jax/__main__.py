"""``python -m dsa_jax run``: the multi-layer DSA step on a synthetic ragged paged batch.

Builds a ragged batch (decode + MTP + chunked prefill + padding rows and an inactive sequence
slot) at DeepSeek-V3.2 dimensions (64 indexer heads x 128, latent 512 + rope 64 padded to 640,
v_dim 512), sizes scaled by flags, and runs ``dsa_jax.dsa_step`` over ``--layers`` layers with
IndexShare on the jnp reference and, with ``--dsa-use-pallas``, on the Pallas kernels
(interpret mode off TPU: slow, keep sizes small). Prints the agreement between the backends
(top-k overlap, output relative error), the segment-witness coverage of the selection and the
time per backend. ``--devices N`` runs the step sharded over N devices (sequences on a data
axis, MLA heads on a model axis of size ``--tp``); on CPU it asks XLA for N host devices.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

V32 = dict(index_heads=64, index_dim=128, latent_dim=512, rope_dim=64)
SM_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2  # qk head dim 192, YaRN mscale(40)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsa_jax", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", description=__doc__, help="run the DSA step on a synthetic batch",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--model", choices=("v3.2", "v4-flash"), default="v3.2",
                   help="v3.2: the DSA step (default); v4-flash: the DeepSeek-V4 attention "
                        "step at V4-Flash dims (dsa_jax.v4_cli: 43-layer SWA/CSA/HCA pattern, "
                        "scaled by --layers, --heads, --context, --prefill, --topk, --page-size)")
    r.add_argument("--quick", action="store_true",
                   help="small sizes (context 512, prefill 32, 4 heads, k 128, 2 layers, "
                        "page 16): well under a minute on a laptop CPU")
    r.add_argument("--context", type=int, default=None,
                   help="KV length bound of the longest sequence in tokens (default 8192; "
                        "quick 512)")
    r.add_argument("--decode", type=int, default=4, help="number of decode sequences (1 row "
                   "each; default 4)")
    r.add_argument("--prefill", type=int, default=None,
                   help="rows of the chunked-prefill sequence (default 256; quick 32); an MTP "
                        "sequence of 3 rows is always added")
    r.add_argument("--heads", type=int, default=None,
                   help="MLA query heads per device group (default 16, i.e. 128 over TP 8; "
                        "quick 4)")
    r.add_argument("--topk", type=int, default=None, help="token budget k per row (default "
                   "2048; quick 128)")
    r.add_argument("--layers", type=int, default=None,
                   help="layers of the step (default 4; quick 2); IndexShare pattern: one full "
                        "layer, then repeating shared x3 + full (GLM-5.2 style)")
    r.add_argument("--page-size", type=int, default=None,
                   help="tokens per cache page (default 64; quick 16)")
    r.add_argument("--num-segments", type=int, default=8,
                   help="segment witnesses merged into each top-k row (0 = off; default 8)")
    r.add_argument("--witness-fill", choices=("tail", "lowest"), default="tail",
                   help="where witnesses go: tail = the upstream reserved last S slots "
                        "(default), lowest = over a row's last w slots (padding, then the "
                        "lowest-scored); see EXPERIMENTS.md")
    r.add_argument("--packed-latent", action="store_true",
                   help="store the latent cache as packed bf16 u32 words (the format the "
                        "token-sparse Pallas kernel gathers rows from; values rounded to bf16)")
    r.add_argument("--cache-format", choices=("plain", "fp8"), default="plain",
                   help="fp8: both caches in DeepSeek-V3.2's fp8 formats (e4m3 indexer keys "
                        "with per-token scales, FlashMLA's fp8 latent), quantized on write; "
                        "pages default to 64 (quick 32: the fp8 index cache needs multiples "
                        "of 32)")
    r.add_argument("--exact", action="store_true",
                   help="exact top_k selection (deterministic ties) instead of approx_max_k")
    r.add_argument("--dsa-use-pallas", action="store_true",
                   help="also run the Pallas kernels (interpret mode off TPU) and compare "
                        "them with the reference")
    r.add_argument("--devices", type=int, default=1,
                   help="run sharded over N devices: N/tp data shards (each its own batch) x "
                        "tp model shards (default 1 = single device)")
    r.add_argument("--tp", type=int, default=1,
                   help="model-axis size for --devices (MLA heads split over it; default 1)")
    r.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress indicator on stderr")
    return p


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
    q = args.quick
    quick_page = 32 if args.cache_format == "fp8" else 16
    return dict(context=args.context or (512 if q else 8192),
                prefill=args.prefill or (32 if q else 256), heads=args.heads or (4 if q else 16),
                k=args.topk or (128 if q else 2048), layers=args.layers or (2 if q else 4),
                page_size=args.page_size or (quick_page if q else 64))


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


def run(args: argparse.Namespace) -> int:
    if args.devices > 1 and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    import dsa_jax

    s = _sizes(args)
    if args.devices % args.tp:
        print(f"--devices {args.devices} must be a multiple of --tp {args.tp}", file=sys.stderr)
        return 2
    layout = dsa_jax.PagedLayout(page_size=s["page_size"],
                                 pages_per_seq=-(-s["context"] // s["page_size"]),
                                 index_dim=V32["index_dim"], latent_dim=V32["latent_dim"],
                                 rope_dim=V32["rope_dim"], packed_latent=args.packed_latent,
                                 index_cache_format=args.cache_format,
                                 latent_cache_format=("packed" if args.packed_latent
                                                      else args.cache_format))
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
    if args.devices > 1:
        from jax.sharding import Mesh

        if len(jax.devices()) < args.devices:
            print(f"--devices {args.devices}: only {len(jax.devices())} devices",
                  file=sys.stderr)
            return 2
        mesh = Mesh(np.array(jax.devices()[:args.devices]).reshape(data, args.tp),
                    ("data", "model"))
        stacked = [jax.tree.map(lambda *xs: np.stack(xs), *[x[j] for x in local])
                   for j in range(4)]
        step = lambda backend: dsa_jax.sharded_dsa_step(mesh, *stacked, backend=backend, **kw)
        print(f"mesh: data={data} x model={args.tp} ({args.devices} devices)")
    else:
        step = lambda backend: dsa_jax.dsa_step(inputs, latent, index, meta, backend=backend,
                                                **kw)
    results = {}
    backends = ["reference"] + (["pallas"] if args.dsa_use_pallas else [])
    for backend in backends:
        with Progress(f"{backend}: compile + first step", not args.no_progress):
            t0 = time.perf_counter()
            res = jax.block_until_ready(step(backend))
            t1 = time.perf_counter()
        results[backend] = jax.tree.map(np.asarray, res)
        out = results[backend].out
        what = f"out {out.shape}, NaN in out: {bool(np.isnan(out).any())}"
        if backend == "pallas" and jax.default_backend() != "tpu":
            # interpret mode simulates every DMA on the CPU: a second timing says nothing
            print(f"{backend}: one step {t1 - t0:.2f} s (interpret mode, not a TPU timing); "
                  f"{what}")
            continue
        with Progress(f"{backend}: second step", not args.no_progress):
            jax.block_until_ready(step(backend))
            t2 = time.perf_counter()
        print(f"{backend}: first step {t1 - t0:.2f} s (compile), then {1e3 * (t2 - t1):.1f} ms; "
              f"{what}")
    ref = results["reference"]
    ctx = _context_lens(meta, inputs.q_mla.shape[1])
    ref0 = jax.tree.map(lambda x: x[0], ref) if args.devices > 1 else ref
    print(_report_selection(ref0.topk, ctx, args.num_segments, args.witness_fill))
    if args.devices > 1:
        single = dsa_jax.dsa_step(inputs, latent, index, meta, backend="reference", **kw)
        diff = float(np.max(np.abs(np.asarray(single.out) - ref0.out)))
        print(f"sharded vs single-device (data shard 0): max |diff| {diff:.2e}")
    if "pallas" in results:
        pal0 = results["pallas"]
        pal0 = jax.tree.map(lambda x: x[0], pal0) if args.devices > 1 else pal0
        print(_agreement(ref0, pal0, ctx))
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from pallas_kernels import tpu

    tpu.skip_tpu_probe_without_tpu()  # no libtpu error block on a machine without a TPU
    if args.cmd == "run" and args.model == "v4-flash":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from dsa_jax import v4_cli

        return v4_cli.run_v4(args, lambda label: Progress(label, not args.no_progress))
    if args.cmd == "run":
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
