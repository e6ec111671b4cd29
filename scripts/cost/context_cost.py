"""Context-parallel decode: the report of ``pallas_kernels.measure.context_cost``'s COST MODEL
(arithmetic only; nothing is run or measured; what is modelled: that module's docstring): bytes
each device reads vs bytes the context shards exchange, when context sharding pays, and the
longest context whose cache fits (issue 11 item 7).

Usage: ``python -m scripts.cost.context_cost [--quick] [--out DIR]`` (prints the tables;
``--out`` writes ``context_cost.md`` and ``context_cost.json``; ``main(argv)`` returns the
data).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pallas_kernels.measure.context_cost import (  # noqa: E402
    ALPHA_US,
    BATCH_ROWS,
    F32,
    MAX_CONTEXT,
    WEIGHT_CHIPS,
    build,
    tokens,
)

# ----------------------------------------------------------------------------- report


def mib(b: float) -> str:
    return f"{b / 2**20:.3f}"


def kib(b: float) -> str:
    return f"{b / 2**10:.1f}"


def markdown(d: dict) -> str:
    cfg = d["config"]
    shards = cfg["shards"]
    multi = [(c["name"], c["devices_per_chip"]) for c in d["chips"] if c["devices_per_chip"] > 1]
    per_chip = "".join(f"; {name}: a chip is {n} devices" for name, n in multi)
    groups = "".join(f" ({name}: chips, {n} devices each)" for name, n in multi)
    lines = [f"Every number: {d['label']}. Per decode row, per layer, per device (busiest "
             "context shard); MiB = 2^20 B, K tokens = 1024. Settings: LSE merge out "
             f"{cfg['lse_out_bytes']} B per element (merge_lse: 4, f32), score row "
             f"{cfg['score_row']} ('full' = as implemented), ICI fraction "
             f"{cfg['ici_fraction']:g}, alpha {cfg['alpha_us']:g} us per ring step.", "",
             f"Chips (per device{per_chip}):", "",
             "| chip | HBM BW / device (chip_info) | HBM / device (chip_info) | bf16 peak / device "
             "| cited per chip: HBM, HBM BW, bidir. ICI | ICI egress / device used | source |",
             "|---|---:|---:|---:|---|---:|---|"]
    for c in d["chips"]:
        doc = c["doc"]
        lines.append(f"| {c['name']} | {c['hbm_bw'] / 1e9:.0f} GB/s | "
                     f"{c['hbm_bytes'] / 1e9:.1f} GB | {c['peak'] / 1e12:.0f} TFLOP/s | "
                     f"{doc['hbm']}, {doc['hbm_bw_gbps']:.0f} "
                     f"GB/s, {doc['ici_bidir_gbps']:.0f} GB/s | {c['ici_egress'] / 1e9:.0f} GB/s "
                     f"| {doc['url']} |")
    lines += ["", "(1a) Exchanged per device (KiB), chip- and context-independent: candidates = "
              "two ring all-gathers of k i32 + k f32 (own 16 KiB; received = sent); LSE = three "
              "ring all-reduces, 2(N-1)/N x (H x v_dim x 4 + 2 x H x 4) B; 'bf16 out' = the "
              "same with out sent in bf16 (not what merge_lse does).", "",
              "| N | candidates received | LSE H=128 | LSE H=128, bf16 out | LSE H=16 | "
              "total H=128 | total H=16 | collectives | ring steps |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["exchange"]:
        a, b = r["H128"], r["H16"]
        lines.append(f"| {r['N']} | {kib(a['candidates_received'])} | {kib(a['lse_ring'])} | "
                     f"{kib(r['H128_lse_bf16_out'])} | {kib(b['lse_ring'])} | "
                     f"{kib(r['H128_total'])} | {kib(r['H16_total'])} | {a['collectives']} | "
                     f"{a['ring_steps']} |")
    lines += ["", "(1b) KV bytes read per device (MiB): indexer keys + MLA gathered (selected "
              "share k/N); not divided by N and not in these columns: q/weights/out (H=128) and "
              "the f32 score row (8 B per token of L, on every shard, as implemented). "
              "'x/read' = exchanged (H=128) / (KV read + fixed + score row) at that N.", "",
              "| format | L | keys N=1 | MLA N=1 | fixed H=128 | score row | "
              + " | ".join(f"KV N={n} (x/read)" for n in shards) + " |",
              "|---|---:|---:|---:|---:|---:|" + "---:|" * len(shards)]
    rows = {}
    for r in d["read"]:
        rows.setdefault((r["format"], r["L"]), {})[r["N"]] = r
    for (fmt, L), by_n in rows.items():
        one = by_n[1]
        cells = []
        for n in shards:
            r = by_n[n]
            ratio = r["exchanged_H128"] / (r["kv_read"] + r["fixed_H128"] + r["score_row"])
            cells.append(f"{mib(r['kv_read'])} ({ratio:.3f})")
        lines.append(f"| {fmt} | {tokens(L)} | {mib(one['index_keys'])} | "
                     f"{mib(one['mla_gathered'])} | {mib(one['fixed_H128'])} | "
                     f"{mib(one['score_row'])} | " + " | ".join(cells) + " |")
    lines += ["", f"(2a) Break-even context: smallest L (multiple of 64, up to "
              f"{tokens(cfg['max_context'])}) with t(N) < t(1) in the roofline time model. "
              f"Scenarios: bandwidth = exchange bytes / ICI only; latency = plus "
              f"alpha = {cfg['alpha_us']:g} us per ring step (an assumption), 8(N-1) steps "
              f"per layer, shared by 1 or {cfg['batch_rows']} rows. ICI fraction "
              f"{cfg['ici_fraction']:g} of the chip's total egress. In brackets: the context "
              "each device holds at the break-even, L / N. '*' = stops paying at some larger L "
              "(not seen in this model).", "",
              "| chip | format | MLA H | scenario | " + " | ".join(f"N={n}" for n in shards[1:])
              + " |", "|---|---|---:|---|" + "---:|" * (len(shards) - 1)]
    for r in d["pays"]:
        cells = [be["label"] + ("" if be["context"] is None else
                                f" ({tokens(be['context'] / n)})")
                 + ("" if be["stays_paying"] else "*") for n, be in r["break_even"].items()]
        lines.append(f"| {r['chip']} | {r['format']} | {r['heads']} | {r['scenario']} | "
                     + " | ".join(cells) + " |")
    at = " / ".join(tokens(L) for L in cfg["speedup_at"])
    lines += ["", f"(2b) Modelled speed-up t(1) / t(N) at L = {at}, and t(1) per row per layer "
              "(us, roofline model):", "",
              f"| chip | format | MLA H | scenario | t(1) us at {at} | "
              + " | ".join(f"N={n}" for n in shards[1:]) + " |",
              "|---|---|---:|---|---:|" + "---:|" * (len(shards) - 1)]
    for r in d["pays"]:
        t1 = " / ".join(f"{v:.1f}" for v in r["t1_us"].values())
        cells = [" / ".join(f"{v:.2f}" for v in sp.values()) for sp in r["speedup"].values()]
        lines.append(f"| {r['chip']} | {r['format']} | {r['heads']} | {r['scenario']} | {t1} | "
                     + " | ".join(cells) + " |")
    w = d["fits"][0]["weights_per_chip"]
    for tag, title in (("cache_only", "cache only, before any weights"),
                       ("with_weights", f"after a weight share of {w / 1e9:.1f} GB per chip "
                        f"({cfg['weight_params'] / 1e9:.0f}B params at 1 B over "
                        f"{cfg['weight_chips']} chips)")):
        lines += ["", f"(3) Longest context per sequence whose cache fits, {title}: "
                  f"{cfg['layers']} layers x (latent + keys) per token; N chips in the context "
                  f"group{groups}; a model.", "",
                  "| chip | format | B / token (61 layers) | HBM / chip | "
                  + " | ".join(f"N={n}" for n in shards) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(shards)]
        for r in d["fits"]:
            seq = r[f"sequence_context_{tag}"]
            lines.append(f"| {r['chip']} | {r['format']} | {r['bytes_per_token_61_layers']:,.0f} "
                         f"| {r['hbm_per_chip'] / 1e9:.1f} GB | "
                         + " | ".join(tokens(seq[n]) for n in shards) + " |")
    lines += ["", f"Weights: {cfg['model_doc']}. Latency: {cfg['latency_note']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="N in {1, 2, 4}, two contexts, a 4M search bound (CI smoke run)")
    p.add_argument("--out", default=None, help="folder for context_cost.md and .json")
    p.add_argument("--alpha-us", type=float, default=ALPHA_US,
                   help="assumed latency per ring step, us (default %(default)s)")
    p.add_argument("--batch-rows", type=int, default=BATCH_ROWS,
                   help="decode rows sharing one collective in the batched scenario")
    p.add_argument("--ici-fraction", type=float, default=1.0,
                   help="share of the chip's total ICI egress the exchange gets (default 1)")
    p.add_argument("--weight-chips", type=int, default=WEIGHT_CHIPS,
                   help="chips the weights are spread over in the fits table's weight share")
    p.add_argument("--max-context", type=int, default=MAX_CONTEXT,
                   help="break-even search bound in tokens")
    p.add_argument("--lse-out-bytes", type=int, choices=(2, 4), default=F32,
                   help="what-if: bytes per out element in the LSE merge (merge_lse: 4, f32)")
    p.add_argument("--score-row", choices=("full", "local"), default="full",
                   help="what-if: the indexer score row over the full width (as implemented) "
                        "or over the shard's own pages")
    a = p.parse_args(argv)
    data = build(a.quick, a.alpha_us, a.batch_rows, a.ici_fraction, a.weight_chips,
                 a.max_context, a.lse_out_bytes, a.score_row == "local")
    md = markdown(data)
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "context_cost.md").write_text(md)
        (out / "context_cost.json").write_text(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    main()
    sys.exit(0)
