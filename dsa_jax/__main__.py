"""``python -m dsa_jax run``: a DSA step on a synthetic ragged paged batch.

Builds a ragged batch (decode + MTP + chunked prefill + padding rows) at DeepSeek-V3.2 dimensions
scaled by flags, runs indexer top-k -> sparse MLA on the jnp reference path, and prints what it
did with timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsa_jax", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a DSA step on a synthetic ragged paged batch")
    r.add_argument("--quick", action="store_true", help="small sizes (well under a minute)")
    r.add_argument("--context", type=int, default=None,
                   help="KV length of the longest sequence in tokens (default 8192; quick 1024)")
    r.add_argument("--decode", type=int, default=4, help="number of decode sequences")
    r.add_argument("--prefill", type=int, default=None,
                   help="tokens of the chunked-prefill sequence (default 256; quick 64)")
    r.add_argument("--heads", type=int, default=None,
                   help="MLA query heads (default 16, i.e. 128 over TP 8; quick 4)")
    r.add_argument("--topk", type=int, default=None, help="token budget k (default 2048)")
    r.add_argument("--seed", type=int, default=0, help="random seed")
    return p


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from reference import sparse_mla_ref, streamindex_topk_ref
    from reference.synthetic import make_ragged_batch

    quick = args.quick
    context = args.context or (1024 if quick else 8192)
    prefill = args.prefill or (64 if quick else 256)
    heads = args.heads or (4 if quick else 16)
    k = args.topk or (256 if quick else 2048)
    page_size, d_index, index_heads, d_latent, v_dim = 64, 128, 64, 640, 512
    pages_per_seq = -(-context // page_size)
    q_lens = [1] * args.decode + [3, prefill]
    rng = np.random.default_rng(args.seed)
    kv_lens = [
        int(rng.integers(max(q, 1), context + 1)) for q in q_lens]
    idx_b = make_ragged_batch(rng, q_lens=q_lens, kv_lens=kv_lens, page_size=page_size,
                              pages_per_seq=pages_per_seq, num_heads=index_heads, dim=d_index,
                              pad_rows=2, pad_seqs=1)
    mla_b = make_ragged_batch(np.random.default_rng(args.seed + 1), q_lens=q_lens,
                              kv_lens=kv_lens, page_size=page_size, pages_per_seq=pages_per_seq,
                              num_heads=heads, dim=d_latent, pad_rows=2, pad_seqs=1)
    T = idx_b.q.shape[0]
    print(f"batch: {len(q_lens)} sequences (+1 padding slot), T={T} rows (2 padding), "
          f"q_lens={q_lens}, kv_lens={kv_lens}, page_size={page_size}, "
          f"pages_per_seq={pages_per_seq}, k={k}, MLA heads={heads}, latent={d_latent}")
    sm_scale = 192**-0.5 * (0.1 * np.log(40) + 1.0) ** 2

    def step():
        idx = streamindex_topk_ref(*idx_b.args(), k=k, pages_per_seq=pages_per_seq)
        out = sparse_mla_ref(mla_b.q, mla_b.cache, mla_b.seq_lens, idx, *mla_b.meta()[1:],
                             sm_scale=float(sm_scale), pages_per_seq=pages_per_seq, v_dim=v_dim)
        return idx, out

    t0 = time.perf_counter()
    idx, out = jax.block_until_ready(step())
    t1 = time.perf_counter()
    jax.block_until_ready(step())
    t2 = time.perf_counter()
    idx, out = np.asarray(idx), np.asarray(out, np.float32)
    print(f"reference: first call {1e3 * (t1 - t0):.0f} ms (compile), then {1e3 * (t2 - t1):.1f}"
          f" ms; selected {int((idx >= 0).sum())} entries, out {out.shape}, "
          f"NaN in out: {bool(np.isnan(out).any())}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "run":
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
