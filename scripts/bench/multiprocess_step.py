"""The context-sharded DSA step under ``jax.distributed``: 2 processes on this machine (CPU
devices, a localhost coordinator on a free port), each process one half of the mesh, and the
result equal to the single-device step.

``python -m scripts.bench.multiprocess_step`` (from the repository root) launches the workers
(``--worker N``, the same module), waits for them (``--timeout`` seconds, then kills both), and
exits 0 only if both report agreement.

Each worker: 4 CPU devices (``--xla_force_host_platform_device_count``), gloo CPU collectives,
``jax.distributed.initialize`` -> 8 global devices; a mesh ``("ctx", "data", "model") = (2, 2,
2)`` whose ``ctx`` axis spans the two processes (so the top-k and LSE merges cross processes);
both processes build the same global batch from the same seed, shard it with
``dsa_jax.context`` and place each process's part with ``jax.make_array_from_callback``; the
single-device step runs locally in each process; the sharded result is gathered with
``multihost_utils.process_allgather`` and compared (top-k index for index, out within f32
round-off, caches after the write identical).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "scripts.bench.multiprocess_step"  # the workers run this module from ROOT
NUM_PROCESSES, LOCAL_DEVICES = 2, 4
MESH_SHAPE, AXES = (2, 2, 2), ("ctx", "data", "model")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(timeout: float) -> int:
    """Start the workers, wait, clean up; 0 if every worker agreed."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"}
    procs = [subprocess.Popen([sys.executable, "-m", MODULE, "--worker", str(i),
                               "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        print(f"workers did not finish within {timeout:.0f} s; killed", file=sys.stderr)
        return 124
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ok = True
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[process {i}]")]
        print("\n".join(lines) if lines else out[-3000:])
        ok &= p.returncode == 0
    print("all processes agree with the single-device step" if ok else "FAILED")
    return 0 if ok else 1


def _batch(layout, seed: int):
    """One data shard's global batch (``tests/test_context.py``'s shapes)."""
    import numpy as np

    from dsa_jax import BatchMeta, StepInputs
    from reference.synthetic import make_ragged_batch

    rng = np.random.default_rng(seed)
    b = make_ragged_batch(rng, q_lens=[1, 5, 1, 2], kv_lens=[3, 50, 64, 17], page_size=8,
                          pages_per_seq=8, num_heads=2, dim=16, pad_rows=2, pad_seqs=1)
    t, p = b.q.shape[0], b.cache.shape[0]
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inputs = StepInputs(f32(2, t, 4, layout.qk_dim), f32(2, t, layout.qk_dim), f32(1, t, 2, 16),
                        f32(1, t, 2), f32(1, t, 16))
    latent = f32(2, p, 8, layout.padded_dim)
    latent[..., layout.qk_dim:] = 0.0
    return inputs, latent, f32(1, p, 8, 16), BatchMeta(*b.meta())


def worker(index: int, port: int) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=NUM_PROCESSES, process_id=index)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import dsa_jax
    from dsa_jax import context

    say = lambda msg: print(f"[process {index}] {msg}", flush=True)  # noqa: E731
    layout = dsa_jax.PagedLayout(page_size=8, pages_per_seq=8, index_dim=16, latent_dim=100,
                                 rope_dim=12)
    kw = dict(layout=layout, indexer_types=("full", "shared"), k=10, sm_scale=0.12, exact=True,
              num_segments=2, backend="reference")
    ctx = MESH_SHAPE[0]
    local = [_batch(layout, seed) for seed in range(MESH_SHAPE[1])]
    cpu0 = jax.local_devices()[0]
    with jax.default_device(cpu0):  # the single-device step, in this process alone
        want = [jax.tree.map(np.asarray, dsa_jax.dsa_step(*x, **kw)) for x in local]
    shards = [context.shard_pages(layout, ctx, m, lat.shape[1]) for _, lat, _, m in local]
    width = max(s.local_pages for s in shards)
    shards = [context.ContextShards(s.tables, np.pad(s.pages, ((0, 0), (0, width - s.local_pages)),
                                                     constant_values=-1)) for s in shards]
    stack = lambda trees: jax.tree.map(lambda *xs: np.stack(xs), *trees)  # noqa: E731
    pairs = list(zip(shards, local, strict=True))
    host = dict(inputs=stack([x[0] for x in local]),
                latent=stack([context.shard_cache(s, x[1], page_axis=1) for s, x in pairs]),
                index=stack([context.shard_cache(s, x[2], page_axis=1) for s, x in pairs]),
                meta=stack([x[3] for x in local])._replace(
                    page_indices=np.stack([s.tables for s in shards])))
    for b, (_, _, _, m) in enumerate(local):  # the rule, on the host tables, before placing
        context.check_local_tables(layout, host["meta"].page_indices[b], m, width)
    mesh = Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), AXES)
    d, dc, heads = P("data"), P("data", "ctx"), P("data", None, None, "model")
    specs = dict(inputs=dsa_jax.StepInputs(heads, d, d, d, d), latent=dc, index=dc,
                 meta=dsa_jax.BatchMeta(d, dc, d, d, d))

    def place(x, spec):  # each process supplies its addressable shards of the global array
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda idx: x[idx])

    args = {k: jax.tree.map(place, host[k], specs[k]) for k in host}
    sharded = dsa_jax.sharded_dsa_step(mesh, args["inputs"], args["latent"],
                                       args["index"], args["meta"], ctx_axis="ctx", **kw)
    got = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                       sharded)
    for b, w in enumerate(want):
        np.testing.assert_array_equal(got.topk[b], w.topk)
        np.testing.assert_allclose(got.out[b], w.out, rtol=2e-6, atol=2e-6)
        back = context.unshard_cache(shards[b], got.latent_caches[b], local[b][1], page_axis=1)
        np.testing.assert_array_equal(back, w.latent_caches)
    say(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh "
        f"{dict(mesh.shape)}: top-k identical, out max |diff| "
        f"{max(float(np.max(np.abs(got.out[b] - w.out))) for b, w in enumerate(want)):.1e}, "
        f"caches identical")
    jax.distributed.shutdown()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", type=int, default=None, help="internal: run worker N")
    ap.add_argument("--port", type=int, default=None, help="internal: coordinator port")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds before the launcher kills the workers (default 300)")
    args = ap.parse_args(argv)
    if args.worker is None:
        return launch(args.timeout)
    return worker(args.worker, args.port)


if __name__ == "__main__":
    sys.exit(main())
