"""``python -m dsa_jax run --model v4.1-flash``: the DeepSeek-V4.1 step (``dsa_jax.v41_step``) on
a synthetic ragged paged batch, checked against the statement
(``reference.statements.deepseek_v41.attention_stack``).

Dimensions: V4.1-Flash's per layer (``reference.v41.v41_flash``: 64 heads x 512, window 128,
dim 5120, indexer 32 heads x 128, top-512, 2048 candidate blocks of 8) on the tiny config's
9-entry layer map (``PATTERN_FIELDS``), which has every mode of the released map: SWA, FULL
ratio 2 + REUSE, FULL ratio 1 as the candidate source + REUSE, REINDEX as a candidate consumer
+ REUSE x2, an MTP SWA layer; ``--quick`` the tiny config itself (``v41_tiny``: small dims).
Parameters and activations are random (a shape and agreement check, not a model run).

The batch: ``--decode`` one-row sequences, a 3-row sequence and a ``--prefill``-row one, each
with a random history below ``--context`` tokens, written by a first (prefill) step; the run
then times the step that adds the rows and compares each sequence's rows with the statement run
on that sequence alone (its tokens padded to ``--context``: the statement is causal, the padding
changes none of the compared rows)."""

from __future__ import annotations

import dataclasses

from dsa_jax.cli_common import pick_size, row_ulp_error

# the tiny config's layer map (every mode), taken from it
PATTERN_FIELDS = ("n_layers", "n_mtp_layers", "compress_ratios", "kv_source_layer_ids",
                  "index_source_layer_ids", "candidate_source_layer_id")
# The step against the statement, in bf16 ulps of each row's largest output (max, mean): the
# run's check and tests/test_v41_step.py's lock-step (which says why and what it measured).
OUT_ULPS, OUT_MEAN_ULPS = 4.0, 0.5


def config(quick: bool):
    """The run's ``V41Config`` (module docstring)."""
    from reference.v41 import v41_flash, v41_tiny

    tiny = v41_tiny()
    if quick:
        return tiny
    return dataclasses.replace(v41_flash(), **{f: getattr(tiny, f) for f in PATTERN_FIELDS})


def sizes(args) -> dict:
    """The run's sizes: each flag given (not ``None``), else its default (``--quick``:
    small). ``context`` is rounded up to even (ratio-2 pairs)."""
    q = args.quick
    pick = lambda flag, full, small: pick_size(flag, q, full, small)  # noqa: E731
    c = config(q)
    context = pick(args.context, 512, 64)
    return dict(context=context + context % 2, prefill=pick(args.prefill, 64, 16),
                heads=c.n_heads, index_heads=c.index_n_heads, k=c.index_topk,
                layers=len(c.compress_ratios), page_size=pick(args.page_size, 64, 4))


def _batch(rng, s: dict, decode: int):
    """``(q_lens, kv_lens)``: ``decode`` one-row sequences, a 3-row and a prefill one."""
    q_lens = [1] * decode + [3, s["prefill"]]
    kv_lens = [int(rng.integers(max(q, 1), s["context"] + 1)) for q in q_lens]
    return q_lens, kv_lens


def _rows(xs, q_lens, kv_lens, which: str):
    """Each sequence's history (``which="history"``) or this step's rows, concatenated."""
    import numpy as np

    cut = lambda x, q, kv: x[:, :kv - q] if which == "history" else x[:, kv - q:kv]  # noqa: E731
    return np.concatenate([cut(x, q, kv) for x, q, kv in zip(xs, q_lens, kv_lens, strict=True)],
                          axis=1)


def _statement_check(params, xs, res, q_lens, kv_lens, c, layout) -> tuple[str, bool]:
    """Each sequence alone through the statement; the step's rows against it."""
    import numpy as np

    from reference.statements import deepseek_v41 as s41

    worst, worst_mean, differ, off = 0.0, 0.0, 0, 0
    for x, q, kv in zip(xs, q_lens, kv_lens, strict=True):
        state = s41.init_state(c, 1, layout.max_seq_len)
        want, _, sel = s41.attention_stack(params, x[:, None], 0, state, c,
                                           return_selection=True)
        err = row_ulp_error(np.asarray(res.out[:, off:off + q], np.float32),
                            np.asarray(want[:, 0, kv - q:kv], np.float32))
        worst, worst_mean = max(worst, err.max()), max(worst_mean, err.mean())
        for j, layer in enumerate(layout.index_layers):
            a = np.sort(np.asarray(res.topk[j, off:off + q]), -1)
            differ += int(np.any(a != np.sort(np.asarray(sel.topk[layer][0, kv - q:kv]), -1)))
        off += q
    ok = worst <= OUT_ULPS and worst_mean <= OUT_MEAN_ULPS and differ == 0
    return (f"statement check: outputs max {worst:.2f} / mean {worst_mean:.3f} bf16 ulps of each "
            f"row's largest (allowed {OUT_ULPS:g} / {OUT_MEAN_ULPS:g}); top-k sets differ on "
            f"{differ} (sequence, layer) pairs"), ok


def run_v41(args, progress) -> int:
    """The ``--model v4.1-flash`` run (module docstring); ``progress(label)`` a context
    manager. Returns the exit status (0 passed, 1 NaN or disagreement with the statement)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsa_jax.cli_common import backend_line, compare, time_backends, verdict
    from dsa_jax.v41_step import (
        V41StepLayout,
        init_v41_caches,
        init_v41_states,
        v41_meta,
        v41_step,
    )
    from reference.statements import deepseek_v41 as s41
    from reference.v41 import resolve_layers

    s, c = sizes(args), config(args.quick)
    layout = V41StepLayout(c, s["page_size"], s["context"])
    rng = np.random.default_rng(args.seed)
    q_lens, kv_lens = _batch(rng, s, args.decode)
    print(f"model: DeepSeek-V4.1{'' if args.quick else '-Flash dims'}, {s['layers']} layers "
          f"{[f'{p.mode.value}/{p.ratio}' for p in resolve_layers(c)]}, precision bf16")
    print(f"layout: page {layout.page_size}, {s['context']} tokens/seq; heads {c.n_heads} x "
          f"{c.head_dim}, dim {c.dim}, indexer {c.index_n_heads} x {c.index_head_dim}, top-k "
          f"{c.index_topk}, candidates {c.candidate_topk_blocks} x {c.candidate_block_size}")
    print(f"batch: q_lens={q_lens}, kv_lens={kv_lens} (a history step first)")
    params = s41.init_params(c, seed=args.seed)
    xs = [rng.standard_normal((len(c.compress_ratios), s["context"], c.dim), dtype=np.float32)
          for _ in q_lens]
    n = len(q_lens)
    with progress("history: one prefill step"):
        hist = v41_step(params, _rows(xs, q_lens, kv_lens, "history"),
                        init_v41_caches(layout, n), init_v41_states(layout, n),
                        v41_meta(layout, [kv - q for q, kv in zip(q_lens, kv_lens, strict=True)],
                                 [kv - q for q, kv in zip(q_lens, kv_lens, strict=True)]),
                        layout=layout)
        caches, states = jax.tree.map(np.asarray, (hist.caches, hist.states))
    rows, meta = _rows(xs, q_lens, kv_lens, "step"), v41_meta(layout, kv_lens, q_lens)

    def step(backend):
        pallas = dict(implementation="pallas", kernel_options={"interpret": interpret})
        return v41_step(params, rows, jax.tree.map(jnp.asarray, caches),
                        jax.tree.map(jnp.asarray, states), meta, layout=layout,
                        **(pallas if backend == "pallas" else {}))

    interpret = jax.default_backend() != "tpu"
    backends = ["xla"] + (["pallas"] if args.dsa_use_pallas else [])
    results, timings = time_backends(step, backends, progress)
    res = results["xla"]
    nan = {b: bool(np.isnan(np.asarray(results[b].out, np.float32)).any()) for b in backends}
    for b in backends:
        print(backend_line(b, timings[b], results[b].out))
    cmp = None
    if args.dsa_use_pallas:
        pal = results["pallas"]
        blocks = ("; the candidate consumer's over its candidate blocks alone"
                  if layout.block_keys else "")
        print(f"pallas: the ratio-2 compressor, the index scores over the index pages{blocks} "
              "and the attention over the window and pool pages on their Pallas kernels; the "
              "selection jnp")
        cmp = compare(res.out, pal.out, res.topk, pal.topk, "bf16")
    with progress("statement"):
        line, ok = _statement_check(params, xs, res, q_lens, kv_lens, c, layout)
    print(line)
    lines, status = verdict("the V4.1 step", nan, timings, cmp,
                            None if ok else "the step disagrees with the statement",
                            hint="and agrees with the statement; --dsa-use-pallas adds the "
                                 "Pallas kernels")
    print("\n".join(lines))
    return status
