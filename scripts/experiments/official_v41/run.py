"""DeepSeek-V4.1's released attention code against this package's V4.1 statement, in the official
bf16 regime (issue 31: the comparison with the release's code run on a tiny config).

The official ``inference/model.py`` is imported UNMODIFIED from ``--official DIR`` (``DIR/model.py``
or ``DIR/inference/model.py``; not vendored here) as the module ``model`` of a synthetic package
whose ``kernel_cpu`` (the vendored copies' import) and ``kernel`` (upstream's) are this package's
CPU stand-ins (``scripts.experiments.official_v41.kernels_cpu``), and whose ``engram``,
``image_processor`` and ``vision`` are the files next to ``model.py`` where present and
importable, else stub modules holding the names it imports (``Transformer`` uses them, the
attention layers never do). Its globals are set as ``Transformer.__init__`` sets them for
``dtype="bf16"`` (``world_size`` 1, ``default_dtype = bf16``: the Linears are ``F.linear`` on
bf16 weights; ``scale_fmt`` and ``scale_dtype`` keep their ue8m0 defaults), the default dtype
bf16 as ``generate.py`` sets it (so the caches and the norm weights are bf16, as built there).
One ``Attention(layer_id, args)`` per layer of the package's tiny V4.1 config
(``reference.v41.v41_tiny``: dim 32, 2 heads of 64, rope 16, window 8, index 2 x 32, top-4,
q_lora 16, 2 x 8 output groups) with every mode:

    layer  0    1       2       3                4       5                6, 7    8
    ratio  0    2       2       1                1       1                1       0 (MTP)
    mode   SWA  FULL    REUSE   FULL, candidate  REUSE   REINDEX,         REUSE   SWA
                                source (2 blocks         candidate
                                of 4 entries)            consumer

``ModelArgs`` from ``V41Config`` (the names that differ): ``kv_source_layers`` <-
``kv_source_layer_ids``, ``index_source_layers`` <- ``index_source_layer_ids``,
``candidate_source_layer`` <- ``candidate_source_layer_id``, ``norm_eps`` <- ``rms_norm_eps``;
the rest by the same names (theta 10000 / 160000 with YaRN factor 16 over 65536, eps 1e-20).
Random weights (``reference.statements.deepseek_v41.init_params``) held in the official dtypes
(bf16 Linears, f32 ratio-2 compressor ``wkv`` / ``wgate`` and ``attn_sink``, bf16 norm weights)
and given to the statement as those values (bf16 -> f32 exact); one bf16 input per layer. Each
call (a prefill at 0 of an odd length, so a ratio-2 token is parked, then one-token decodes past
the window and across candidate blocks) runs every layer's ``forward`` in layer order, as
``Transformer.forward`` does, so the module's ``shared_attn`` carries the published pools, index
keys, top-k and candidate blocks between layers.

This package: ``reference.statements.deepseek_v41.attention_stack(precision="bf16",
return_selection=True)`` over the same calls.

Printed per run and layer: the max abs diff of the outputs (statement vs official, official one
prefill vs official prefill + decodes: the bar) on the prefill rows and on the decode rows, and
the decode rows whose attended compressed entry sets (the official ``sparse_attn`` index list
past the window part, minus its offset, -1 dropped; the statement's ``V41Selection.topk`` of the
layer or, on a REUSE layer, of its index source) are equal; the candidate source's candidate
block sets. Then traces: q, window rows, pool entries and index keys (statement vs official,
element by element) and each decode row whose sets differ, by the statement's scores. Needs torch
and the official code; CPU only (``--quick``: a shorter run).

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m scripts.experiments.official_v41.run \
        --official /tmp/official41 [--quick]
        [--torch-ops cuda]

Measured (torch 2.13.0+cpu, jax 0.10.2, seed 0; the release's ``model.py`` as vendored
byte-identical from DeepSeek-V4.1-Flash revision dba1be0a, header and relative imports aside,
61957 characters; runs ``(13, 200)`` and ``(1, 60)``; about 1.5 min with ``--torch-ops cpu``,
25 s with ``cuda``, on 2 shared cores):

- Prefill rows (both runs, both torch-op settings): the statement equals the official output
  on every layer (max abs diff 0), except, with torch's CPU ``topk``, the ratio-1 layers 3-7 of
  the 13-token prefill (0.09-0.30; 12 / 13 sets equal): ties at the cut-off, see below. Window
  rows, ratio-1 and ratio-2 pools, index keys and q: bit-equal but for a few elements (below).
- Layers 0 and 8 (SWA): 0 on every row but one decode row of layer 8 (0.0020: q, below).
- **The official decode path of a ratio-2 KV source scores another layer's index keys.** Its
  ``Indexer.forward`` publishes ``shared_attn.index_k = self.k_cache`` only when the layer's
  compressor completed a group (``latent is not None``), then scores whatever
  ``shared_attn.index_k`` holds. In decode at an even position (``(p + 1) % 2 != 0``) layer 1
  (ratio 2) publishes nothing, so it scores the index keys last published by the ratio-1 KV
  source layer 3 on the previous step (its per-token cache ``[: (p + 1) // 2]``): measured on
  100 of 201 calls of run 1 (every even position 14-212) and 30 of 61 of run 2 (2-60). Its
  top-k there is unrelated to its own entries, and layer 2 (REUSE) attends it: decode sets
  equal 101 / 200 and 35 / 60 (``cuda``), max abs diff 1.67 / 1.85 on layers 1 / 2. The
  official code disagrees with itself by the same amounts (one prefill, where every KV source
  publishes, vs prefill + decodes: 1.67 / 1.85, sets 101 / 200), and pointing
  ``shared_attn.index_k`` at layer 1's own ``k_cache`` before each of its calls (the harness's
  counterfactual, ``model.py`` unchanged) makes layers 1 and 2 agree with the statement on
  every row (sets 200 / 200 and 60 / 60, outputs 0 and 0.0020). In the released config
  (KV sources 2, 8, 14 at ratio 2, then 20 at ratio 1) the same path makes layers 2-19 score
  layer 20's ratio-1 keys on every other decode step. The statement (every KV source's own
  keys, as the official prefill) is left as is: this is a finding about the release.
- ``--torch-ops cuda`` (CUDA's topk tie rule), stale keys set aside (the own-keys run): every
  set and candidate-block set equal on 259 / 260 decode rows of layers 3-7 and 260 / 260
  elsewhere; outputs 0 on the rows with equal sets, up to 0.0039 on a few (below). The one
  row: entry 109's index key (layer 3) differs in 2 of its 32 elements by one fp4 step: the
  latent ``compressor.norm(wkv(x_109))`` has one element at 1.94140625 in torch (the f32
  result lands exactly on the bf16 midpoint, rounds to even 1.9375) and 1.9414064 in the
  statement (1.9453125), because the RMSNorm mean of squares differs by one f32 ulp (torch's
  summation order vs the statement's pairwise tree; f64: 1.94140629). Selections then differ
  at layer 3 pos 145 (entry 109 vs 8) and layer 5 pos 110 (109 vs 76), outputs on those rows
  0.055-0.36 (layers 3-7). Same class: 1-46 q elements of 27264 differ by an ulp on layers 2,
  7, 8 (f32 summation order in ``wq_b`` / ``q_norm``), giving 0.0020-0.0039 on a decode row.
- With torch's CPU ``topk`` (the code as it runs here): layers 3-7 decode sets 199 / 260
  (3, 4) and 182 / 260 (5-7), candidate blocks 197 / 260; the official code against itself
  213, 211 and 234 / 260. Against the own-keys run every differing row of layers 1 and 3 is
  an exact tie at the cut-off in the statement's bf16 scores (mostly at score 0: both index
  heads negative), which the statement gives to the lower entry (the declared rule, CUDA's)
  and torch's CPU ``topk`` otherwise, but the entry-109 row; layer 5's differing rows are ties
  (19) or rows whose candidate blocks (layer 3's, themselves tie-resolved) differ (58), and
  the entry-109 row.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

import numpy as np

from scripts.experiments.official_v4.run import _differ, _maxdiff, _ulp, cannot_run, harness_args

PACKAGE = "deepseek_v41_official"  # the synthetic package model.py is loaded into
MAX_SEQ = 256
RUNS = ((13, 200), (1, 60))  # (prefill, decodes)
QUICK_RUNS = ((13, 40),)
STUBS = {  # the names model.py imports from its siblings (only Transformer reads them)
    "engram": ("EngramLayout", "NgramHashState"),
    "image_processor": ("IMAGE", "IMAGE_END", "IMAGE_NEW_LINE", "IMAGE_START"),
    "vision": ("Aligner", "ViT"),
}


def _model_path(directory: str) -> str | None:
    for path in (os.path.join(directory, "model.py"),
                 os.path.join(directory, "inference", "model.py")):
        if os.path.isfile(path):
            return path
    return None


def _stub(name: str, names) -> types.ModuleType:
    mod = types.ModuleType(f"{PACKAGE}.{name}")
    mod.__doc__ = "A stub: the attention layers never use these names."
    for n in names:
        setattr(mod, n, None if n.startswith("IMAGE") else type(n, (), {}))
    if name == "engram":
        mod.EngramLayout.from_args = staticmethod(lambda args: None)
    return mod


def load_official(directory: str):
    """The official ``model.py`` under ``directory``, unmodified, as ``<PACKAGE>.model`` on the
    CPU stand-ins, with its globals as ``Transformer.__init__`` sets them for ``dtype="bf16"``
    (module docstring)."""
    import torch

    from scripts.experiments.official_v41 import kernels_cpu

    path = _model_path(directory)
    here = os.path.dirname(path)
    pkg = types.ModuleType(PACKAGE)
    pkg.__path__ = [here]
    sys.modules[PACKAGE] = pkg
    for name in ("kernel_cpu", "kernel"):
        sys.modules[f"{PACKAGE}.{name}"] = kernels_cpu
    for name, names in STUBS.items():
        sibling = os.path.join(here, f"{name}.py")
        sys.modules[f"{PACKAGE}.{name}"] = _stub(name, names)
        if os.path.isfile(sibling):
            spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}", sibling)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            try:
                spec.loader.exec_module(mod)
            except ImportError as e:  # its own dependencies (tokenizers, PIL, ...) missing
                print(f"{sibling}: {e}; a stub stands in for it", file=sys.stderr)
                sys.modules[spec.name] = _stub(name, names)
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}.model", path)
    model = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model
    spec.loader.exec_module(model)
    model.world_size, model.rank = 1, 0
    model.default_dtype = torch.bfloat16  # args.dtype == "bf16"
    torch.set_default_dtype(torch.bfloat16)  # generate.py
    return model


def config():
    from reference.v41.config import v41_tiny
    return v41_tiny()


def model_args(model, c):
    """The official ``ModelArgs`` of ``c`` (``V41Config``; names mapped, module docstring)."""
    same = ("n_layers", "n_mtp_layers", "compress_ratios", "candidate_topk_blocks",
            "candidate_block_size", "n_heads", "head_dim", "rope_head_dim", "window_size",
            "index_n_heads", "index_head_dim", "index_topk", "rope_theta", "compress_rope_theta",
            "rope_factor", "original_seq_len", "beta_fast", "beta_slow", "dim", "q_lora_rank",
            "o_groups", "o_lora_rank")
    cand = c.candidate_source_layer_id
    return model.ModelArgs(**{n: getattr(c, n) for n in same},
                           kv_source_layers=c.kv_source_layer_ids,
                           index_source_layers=c.index_source_layer_ids,
                           candidate_source_layer=-1 if cand is None else cand,
                           norm_eps=c.rms_norm_eps, max_batch_size=1, max_seq_len=MAX_SEQ,
                           dtype="bf16")


def make_weights(model, c, seed):
    """Per layer the official state dict (torch, official dtypes) and the same values as f32
    NumPy by the checkpoint's names (the statement's params)."""
    import torch

    from reference.statements import deepseek_v41 as dv41

    args, weights = model_args(model, c), []
    for i, init in enumerate(dv41.init_params(c, seed=seed)):
        sd = model.Attention(i, args).state_dict()
        if set(sd) != set(init):
            raise SystemExit(f"layer {i}: the official state dict and the package's "
                             f"param_shapes differ on {sorted(set(sd) ^ set(init))}")
        sd = {k: torch.from_numpy(np.array(init[k])).to(v.dtype) for k, v in sd.items()}
        weights.append((sd, {k: v.to(torch.float32).numpy() for k, v in sd.items()}))
    return weights


def _ring_rows(ring, n):
    """The window ring ``[W, D]`` after ``n`` tokens as ``{position: row}``."""
    w = ring.shape[0]
    return {p: ring[p % w] for p in range(max(0, n - w), n)}


def run_official(model, c, weights, xs, schedule, torch_ops="cpu", own_keys=False):
    """Drive one fresh official ``Attention`` per layer (a fresh ``shared_attn``) over
    ``schedule`` (new tokens per call), every layer in order each call. Returns ``(outs, sets,
    cands, held)``: per layer ``f32[N, dim]``; per layer and position the attended compressed
    entry set (a sorted tuple; compressed layers only); per position the candidate source's
    block set; per layer the q ``sparse_attn`` got on every call, the final window rows by
    position, on KV sources the pool and the index keys, and ``stale``: the calls (their start
    positions) after which ``shared_attn.index_k`` (what its indexer scored) was not the layer's
    own ``k_cache``, with the layer whose it was. ``own_keys``: a counterfactual, the harness
    points ``shared_attn.index_k`` at a KV source's own ``k_cache`` before each of its calls
    (``model.py`` unchanged)."""
    import torch

    from reference.v41.config import resolve_layers
    from scripts.experiments.official_v41 import kernels_cpu

    plans, args = resolve_layers(c), model_args(model, c)
    model.shared_attn = model.SharedAttentionRuntime()
    layers = []
    for i in range(len(plans)):
        attn = model.Attention(i, args)
        attn.load_state_dict(weights[i][0], strict=False)
        layers.append(attn)
    attend, calls = model.sparse_attn, []

    def recorded_attn(q, kv, sink, idxs, scale):
        calls.append((q[0].float().numpy(), kv.shape[1], idxs[0].clone()))
        return attend(q, kv, sink, idxs, scale)

    outs = [[] for _ in plans]
    sets = [{} for _ in plans]
    qs = [[] for _ in plans]
    cands, stale, done = {}, [[] for _ in plans], 0
    rule = kernels_cpu.cuda_ops() if torch_ops == "cuda" else contextlib.nullcontext()
    model.sparse_attn = recorded_attn
    try:
        with torch.inference_mode(), rule:
            for n in schedule:
                for plan, attn in zip(plans, layers, strict=True):
                    i = plan.layer
                    if own_keys and attn.is_kv_source:
                        model.shared_attn.index_k = attn.indexer.k_cache
                    outs[i].append(attn(xs[i][None, done:done + n], done)[0].float().numpy())
                    read = model.shared_attn.index_k  # what its indexer scored, if it ran
                    if attn.is_kv_source and (done + n) // plan.ratio and \
                            read is not attn.indexer.k_cache:
                        stale[i].append((done, next((j for j, a in enumerate(layers)
                                                     if a.is_kv_source
                                                     and a.indexer.k_cache is read), None)))
                    q, width, idxs = calls.pop()
                    qs[i].append(q)
                    if plan.ratio:
                        compress_len = (done + n) // plan.ratio
                        offset = width - compress_len
                        for r, row in enumerate(idxs.tolist()):
                            sets[i][done + r] = tuple(sorted(v - offset for v in row
                                                             if v >= offset))
                    if plan.candidates.value == "produces":
                        mask = model.shared_attn.candidates[0]
                        blk = c.candidate_block_size
                        for r, row in enumerate(mask.tolist()):
                            cands[done + r] = tuple(b for b in range(-(-len(row) // blk))
                                                    if row[b * blk])
                done += n
    finally:
        model.sparse_attn = attend
    held = []
    for plan, attn in zip(plans, layers, strict=True):
        h = {"q": np.concatenate(qs[plan.layer]),
             "window": _ring_rows(attn.window_kv_cache[0].float().numpy(), done),
             "stale": stale[plan.layer]}
        if attn.is_kv_source:
            h["pool"] = attn.compress_kv_cache[0].float().numpy()
            h["index_keys"] = attn.indexer.k_cache[0].float().numpy()
        held.append(h)
    return [np.concatenate(o) for o in outs], sets, cands, held


def run_statement(c, weights, xs, schedule):
    """The statement, bf16 regime: ``(outs, sets, cands, scores, state)``: per layer ``f32[N,
    dim]``; per layer and position the attended entry set (a REUSE layer's from its index
    source); per position the candidate block set; per index source and position its scores;
    the final ``V41State``."""
    import jax.numpy as jnp

    from reference.statements import deepseek_v41 as dv41
    from reference.v41.config import resolve_layers

    plans = resolve_layers(c)
    params = [w[1] for w in weights]
    state, done = dv41.init_state(c, 1, MAX_SEQ), 0
    outs = [[] for _ in plans]
    sets = [{} for _ in plans]
    scores = [{} for _ in plans]
    cands = {}
    for n in schedule:
        start = done if done == 0 else jnp.int32(done)
        out, state, sel = dv41.attention_stack(params, xs[:, None, done:done + n], start, state,
                                               c, precision="bf16", return_selection=True)
        out = np.asarray(out, np.float32)
        for plan in plans:
            i = plan.layer
            outs[i].append(out[i, 0])
            if sel.topk[i] is not None:
                for r, (top, sc) in enumerate(zip(np.asarray(sel.topk[i][0]),
                                                  np.asarray(sel.scores[i][0]), strict=True)):
                    scores[i][done + r] = sc
                    sets[i][done + r] = tuple(sorted(int(v) for v in top if v >= 0))
        for plan in plans:
            if plan.ratio:
                sets[plan.layer].update({p: sets[plan.index_source][p]
                                         for p in range(done, done + n)})
        if sel.candidates is not None:
            for r, row in enumerate(np.asarray(sel.candidates[0])):
                cands[done + r] = tuple(sorted(int(v) for v in row if v >= 0))
        done += n
    return [np.concatenate(o) for o in outs], sets, cands, scores, state


def trace_intermediates(c, weights, xs, held, state):
    """Where the two sides part, per layer: the attention's q (the statement's projection of
    every token vs what the official ``sparse_attn`` got), the final window rows, and on a KV
    source the pool entries and index keys (pooled from the statement's final state), element
    by element."""
    import jax.numpy as jnp

    from reference.quant.bf16 import rounding
    from reference.statements import deepseek_v41 as dv41
    from reference.statements import deepseek_v41_layer as L
    from reference.v41.config import resolve_layers

    rb, n, lines = rounding("bf16"), xs.shape[1], []
    sources = tuple(c.kv_source_layer_ids)
    for plan in resolve_layers(c):
        i, r = plan.layer, plan.ratio
        p = L.regime_params({k: jnp.asarray(v) for k, v in weights[i][1].items()}, "bf16")
        cos, sin = L.rope_tables(c, r, MAX_SEQ)
        x = rb(jnp.asarray(xs[i][None]))
        q = L.project(p, x, cos[:n], sin[:n], c, rb)[1][0]
        win = held[i]["window"]
        ours = np.asarray(state.window[i, 0])[sorted(win)]
        parts = [f"q {_differ(q, held[i]['q'])}",
                 f"window rows {_differ(ours, np.stack([win[k] for k in sorted(win)]))}"]
        if i in sources:
            k = sources.index(i)
            latent = dv41._latents(p, state.kv[k], state.score[k], r, c.rms_norm_eps, rb)
            pool, keys = dv41._publish(p, latent, r, c, cos, sin, rb)
            e = n // r
            for name, ours, theirs in (("pool", pool[0, :e], held[i]["pool"][:e]),
                                       ("index keys", keys[0, :e], held[i]["index_keys"][:e])):
                rows = np.nonzero((np.asarray(ours) != theirs).any(-1))[0].tolist()
                parts.append(f"{name} {_differ(ours, theirs)}"
                             + (f" (entries {rows})" if rows else ""))
        lines.append(f"  layer {i} ({plan.mode.value}, ratio {r}), statement vs official: "
                     + "; ".join(parts))
    return lines


def trace_set_differences(c, official, ours, scores, rows, off_cands, st_cands):
    """The decode rows of each index source whose sets differ, classified: an exact tie at the
    cut-off resolved differently (by the statement's scores, the two sides' worst picks score
    the same), a candidate consumer whose row's candidate blocks differ, or other; each "other"
    row listed with the entries only one side picked, their scores, and the gap between the two
    sides' worst picks in bf16 ulps of the cut-off."""
    from reference.v41.config import resolve_layers

    lines = []
    for plan in resolve_layers(c):
        i = plan.layer
        if plan.mode.value not in ("full", "reindex"):
            continue
        kinds, other = {"tie": 0, "candidate blocks": 0, "other": 0}, []
        for p in rows:
            if official[i][p] == ours[i][p]:
                continue
            only_o = sorted(set(official[i][p]) - set(ours[i][p]))
            only_u = sorted(set(ours[i][p]) - set(official[i][p]))
            sc = scores[i][p]
            gap = min(float(sc[j]) for j in only_u) - max(float(sc[j]) for j in only_o) \
                if only_o and only_u else float("nan")
            cut = min(float(sc[j]) for j in ours[i][p]) if ours[i][p] else float("nan")
            if gap == 0:
                kinds["tie"] += 1
            elif plan.candidates.value == "consumes" and off_cands[p] != st_cands[p]:
                kinds["candidate blocks"] += 1
            else:
                kinds["other"] += 1
                other.append(f"    pos {p}: official only {only_o} (scores "
                             f"{[float(sc[j]) for j in only_o]}), statement only {only_u} "
                             f"(scores {[float(sc[j]) for j in only_u]}); gap "
                             f"{gap / _ulp(cut):.1f} ulp")
        lines.append(f"  layer {i} ({plan.mode.value}): decode rows whose sets differ: "
                     + ", ".join(f"{k} {v}" for k, v in kinds.items()))
        lines += other
    return lines


def compare_run(model, c, weights, prefill, decodes, seed, torch_ops):
    """One run: the table's rows, the traces, and per layer ``(sets equal, rows)`` totals."""
    import torch

    from reference.v41.config import resolve_layers

    n, nl = prefill + decodes, len(c.compress_ratios)
    rng = np.random.default_rng(seed + 100)
    xt = torch.from_numpy(rng.standard_normal((nl, n, c.dim), dtype=np.float32)).bfloat16()
    xs = xt.float().numpy()
    split = [prefill] + [1] * decodes
    off, off_sets, off_cands, held = run_official(model, c, weights, xt, split, torch_ops)
    one, one_sets, one_cands, _ = run_official(model, c, weights, xt, [n], torch_ops)
    own, own_sets, own_cands, _ = run_official(model, c, weights, xt, split, torch_ops,
                                               own_keys=True)
    st, st_sets, st_cands, st_scores, state = run_statement(c, weights, xs, split)
    pre, dec = np.arange(prefill), np.arange(prefill, n)
    lines, same = [], {}
    for plan in resolve_layers(c):
        i = plan.layer
        cols = [(_maxdiff(a[i], b[i], pre), _maxdiff(a[i], b[i], dec))
                for a, b in ((st, off), (one, off), (st, own))]
        text = " | ".join(f"{a:.4f} / {b:.4f}" for a, b in cols)
        if plan.ratio:
            same[i] = [sum(a[i][p] == b[i][p] for p in dec)
                       for a, b in ((st_sets, off_sets), (one_sets, off_sets),
                                    (st_sets, own_sets))]
            sets = " | ".join(f"{k} / {len(dec)}" for k in same[i])
            agree = np.array([p for p in dec if st_sets[i][p] == own_sets[i][p]], int)
            sets += f" | {_maxdiff(st[i], own[i], agree):.4f}"
        else:
            sets = "- | - | - | -"
        lines.append(f"| {i} {plan.mode.value} r{plan.ratio} {plan.candidates.value} | {text} "
                     f"| {sets} | {float(np.abs(off[i]).max()):.3f} |")
    cand = [sum(a[p] == b[p] for p in dec)
            for a, b in ((st_cands, off_cands), (one_cands, off_cands), (st_cands, own_cands))]
    cand_pre = sum(st_cands[p] == off_cands[p] for p in pre)
    lines.append(f"| candidate blocks (layer {c.candidate_source_layer_id}), decode rows "
                 f"equal | | | | " + " | ".join(f"{k} / {len(dec)}" for k in cand) + " | | |")
    trace = []
    for plan in resolve_layers(c):
        if plan.mode.value == "full":
            calls = held[plan.layer]["stale"]
            owners = sorted({j for _, j in calls})
            trace.append(f"  layer {plan.layer} (KV source, ratio {plan.ratio}): after "
                         f"{len(calls)} of {len(split)} calls shared_attn.index_k, the keys its "
                         f"indexer scored, was not its own k_cache but layer(s) {owners}'s; "
                         f"calls at {[p for p, _ in calls]}")
    trace += trace_intermediates(c, weights, xs, held, state)
    trace.append("  sets on prefill rows (statement vs official), per compressed layer: "
                 + ", ".join(f"{i}: {sum(st_sets[i][p] == off_sets[i][p] for p in pre)} / "
                             f"{prefill}" for i in same)
                 + f"; candidate blocks {cand_pre} / {prefill}")
    trace.append("  the sets against the official run with own index keys (the stale keys "
                 "set aside):")
    trace += trace_set_differences(c, own_sets, st_sets, st_scores, dec, own_cands, st_cands)
    return lines, trace, same, cand, len(dec)


HEADER = ("| layer (mode, ratio, candidates) | statement vs official (prefill / decodes) | "
          "official vs itself: one prefill vs prefill + decodes | statement vs official with "
          "own index keys | entry sets equal, decode rows: statement vs official | official vs "
          "itself | statement vs official with own index keys | statement vs official with own "
          "index keys, decode rows with equal sets | max abs official output |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    args = harness_args(argv, __doc__, "/tmp/official41",
                        "torch.topk (its indexer's and candidate blocks' tie rule)")
    if cannot_run("official_v41.run", "DeepSeek-V4.1", args.official,
                  _model_path(args.official)):
        return 2
    model = load_official(args.official)
    c = config()
    weights = make_weights(model, c, args.seed)
    totals, cand_tot, rows_tot = {}, np.zeros(3, int), 0
    for prefill, decodes in (QUICK_RUNS if args.quick else RUNS):
        lines, trace, same, cand, rows = compare_run(model, c, weights, prefill, decodes,
                                                     args.seed, args.torch_ops)
        print(f"\nrun: prefill {prefill} then {decodes} decodes (seed {args.seed}; official "
              f"code from {args.official}, torch ops: {args.torch_ops})\n{HEADER}")
        print("\n".join(lines))
        print("Traces (the KV sources' index keys; intermediates; the decode rows whose sets "
              "differ, by the statement's bf16 scores):")
        print("\n".join(trace), flush=True)
        for i, s in same.items():
            totals[i] = totals.get(i, np.zeros(3, int)) + s
        cand_tot, rows_tot = cand_tot + cand, rows_tot + rows
    print(f"\nall runs, decode rows with equal entry sets (statement vs official / official vs "
          f"itself / statement vs official with own index keys), of {rows_tot}: "
          + ", ".join(f"layer {i} {s[0]} / {s[1]} / {s[2]}" for i, s in totals.items())
          + f"; candidate blocks {cand_tot[0]} / {cand_tot[1]} / {cand_tot[2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
