"""Context-parallel decode: a COST MODEL (arithmetic only; nothing is run or measured) of the
bytes each device reads vs the bytes the context shards exchange, a roofline time model of
when context sharding pays, and the longest context whose cache fits (issue 11 item 7).

What is modelled (``dsa_jax.context``): one sequence's KV pages spread over ``N`` context
shards (page ``j`` on shard ``j % N``). Per decode row and per layer each shard scores its own
keys, keeps its local top-k (``k`` i32 indices + ``k`` f32 scores), the shards all-gather the
candidates (``merge_topk``: two ``all_gather``), each shard attends to the selected tokens it
owns, and the shards combine ``(out f32[H, v_dim], lse f32[H])`` by ``merge_lse``:
``pmax(lse)``, ``psum(w)``, ``psum(w * out)`` (three all-reduces). N = 1: no exchange.

Dims (DeepSeek-V3.2; the repo's compile-gate dims): 61 layers; indexer H_i = 64 heads,
D = 128, page 64, k = 2048 tokens; MLA H = 128 heads, and H = 16 (128 heads over TP 8, what a
device holds when serving splits heads; the indexer is not split, as ``dsa_jax.sharding``
runs it on every model shard), latent 576 (512 + 64 rope), v_dim 512.

Cache formats, bytes per token per layer (the repo's constants):

- ``bf16``: keys bf16 256 B (D x 2); latent bf16 padded to 640 = 1280 B
  (``CacheFormat.BF16.row_bytes(640)``), read by the page kernel (the token kernel needs the
  packed form);
- ``packed``: keys bf16 256 B; latent ``packed_cache.packed_words(640) * 4`` = 1536 B;
- ``fp8``: keys ``fp8_cache.index_bytes_per_token(64)`` = 136 B (128 e4m3 + the page's padded
  f32 scale row / 64); latent ``fp8_cache.LATENT_TOKEN_BYTES`` = 1024 B.

Fits table only (reference rows): bf16 unpadded 576 (1152 B) and the GPU fp8 layout
(FlashMLA 656 B latent, ``fp8.LATENT_BYTES``; 132 B keys, ``fp8.INDEX_TOKEN_BYTES``).

Bytes per decode row per layer on the busiest shard (a model):

- indexer keys: ``ceil(ceil(L / 64) / N)`` whole pages of 64 tokens (the kernel fetches pages);
- MLA gathered: ``min(L, k) / N`` selected tokens (the expected share; recent tokens are spread
  round-robin too, 32 pages of the last 2048 tokens over N shards). A selection concentrated on
  one shard would not shrink: not modelled;
- fixed, not divided by N: indexer q + its lane-padded weight column
  ``H_i * (D * 2 + 128 * 4)`` (``indexer.traffic``), MLA q + out ``H * (q_dim + v_dim) * 2``
  (``mla.traffic``; q_dim 640, fp8 576: its kernel reads q as given), and the
  indexer's f32 score row: the kernels write scores over the row's full width on every shard
  (the local tables keep the global shape) and the selection reads them: ``2 * 4 * L`` B ("as
  implemented"; a shard-local width would remove it). The selection's compute, ``merge_topk``'s
  sort of ``N * k`` candidates and the MLA index preparation are not modelled.
- exchange per device: candidates, two ring all-gathers of ``k * 4`` B each: ``8k`` B of its
  own, ``(N - 1) * 8k`` B received (and sent, forwarding); LSE merge, three ring all-reduces of
  ``H * v_dim * 4 + 2 * H * 4`` B: ``2 (N - 1) / N`` times that sent and received per device.

Time model (a ROOFLINE MODEL, no measurement), per decode row per layer on one device:
``t(N) = max(idx bytes / HBM BW, idx flops / peak) + max(MLA bytes / HBM BW, MLA flops / peak)
+ exchanged bytes / ICI + alpha * ring steps / rows``. Flops: indexer ``2 * H_i * D`` per key
read, MLA ``2 * H * (q_dim + v_dim)`` per selected token, at the bf16 peak. HBM bandwidth,
bf16 peak and HBM capacity per device: ``pallas_kernels.aot.chip_info`` (the
``pltpu.get_tpu_info_for_chip`` facts). ICI: the chip's bidirectional ICI bandwidth from
Google Cloud's TPU pages (``CHIP_DOCS``, cited), halved to one direction (what a device can
send while it receives) and divided by the devices per chip: the chip's TOTAL egress over all
its links (optimistic for the exchange: a ring on one torus axis uses 2 of the 4 ports of a
v5e / v6e chip; ``--ici-fraction 0.5`` models that). Ring steps: ``N - 1`` per all-gather,
``2 (N - 1)`` per all-reduce, 5 collectives as written (no combining): ``8 (N - 1)`` steps per
layer. ``alpha`` (default 1 us per ring step) is an ASSUMPTION, not from a spec (the order of
the 1 us link latency ASTRA-sim's TPU v3 validation uses, ``LATENCY_NOTE``); ``rows`` decode
rows share one collective (a batch), so latency is divided by them. Scenarios: ``bandwidth``
(alpha 0), ``latency, 1 row`` (one long sequence decoding alone), ``latency, B rows``.
"Pays": t(N) < t(1) (lower per-row latency; sharding never saves total device time). The
break-even is the smallest L (multiples of 64 up to ``--max-context``) where it pays; the 61
layers scale both sides alike, so it is per layer.

Unit: a JAX device. v5e / v6e: one device per chip. TPU7x: each chip is two devices (two
TensorCores, "two TPU devices" in its programming model; 8 devices on the 4-chip topology),
and ``chip_info`` is per device (103 GB, 3.7 TB/s = half the cited 192 GiB, 7380 GB/s); its
per-device ICI is taken as half the chip's (two devices on a chip exchange over the on-chip
die-to-die link, not modelled). The fits table is per chip (tpu7x: both devices).

Fits: cache bytes per token = 61 * (latent + keys); tokens per chip = HBM / that (page
multiples), "cache only, before any weights"; and with a weight share: DeepSeek-V3's 671B
parameters (V3.2 keeps that architecture; the indexer's own weights are not counted) at 1 byte
(fp8; scales and bf16 parts ignored) spread over ``--weight-chips`` chips (default 64). One
sequence over N chips holds N times the per-chip tokens. MTP layer, activations, scratch: not
counted.

What-ifs (not what the code does; off by default): ``--lse-out-bytes 2`` sends out in bf16
in the LSE merge; ``--score-row local`` gives each shard a score row over its own pages only.
Sensitivity: ``--ici-fraction``, ``--alpha-us``, ``--batch-rows``.

The report: ``python -m scripts.cost.context_cost [--quick] [--out DIR]``
(``scripts/cost/context_cost.py``; ``build(...)`` here returns its data).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from pallas_kernels import aot
from pallas_kernels.chips import CHIPS as CHIP_SPECS
from pallas_kernels.chips import NAMES as CHIP_NAMES
from pallas_kernels.mla.compile_cases import (
    FP8_DIM,
    MLA_DIM,
    MLA_PAGE,
    MLA_V_DIM,
)
from reference.formats import fp8_cache, packed_cache
from reference.formats.cache_format import CacheFormat
from reference.quant import fp8

LABEL = "a model (arithmetic from the repo's byte constants and cited chip specs; not measured)"

LAYERS = 61
INDEX_HEADS, INDEX_DIM = 64, fp8.INDEX_HEAD_DIM  # 64, 128
PAGE = MLA_PAGE  # 64
TOPK = 2048
MLA_HEADS = (128, 16)  # all heads; 128 over TP 8
LATENT = fp8.LATENT_DIM  # 576
V_DIM = MLA_V_DIM  # 512
LANES = 128
F32, I32, BF16 = 4, 4, 2

SHARDS = (1, 2, 4, 8, 16)
CONTEXTS = tuple(2**p for p in range(15, 21))  # 32K .. 1M
SPEEDUP_AT = (2**15, 2**17, 2**20)  # 32K, 128K, 1M
MAX_CONTEXT = 2**24  # break-even search bound (16M tokens)
ALPHA_US = 1.0
BATCH_ROWS = 64
WEIGHT_PARAMS = 671e9  # DeepSeek-V3 model card (MODEL_DOC); 1 byte each at fp8
WEIGHT_CHIPS = 64

MODEL_DOC = "https://huggingface.co/deepseek-ai/DeepSeek-V3 (README: 671B total parameters)"
LATENCY_NOTE = ("assumption; ASTRA-sim's TPU v3 validation models a 1 us link latency: "
                "https://astra-sim.github.io/astra-sim-docs/validation/hardware/tpu-validation.html")


@dataclass(frozen=True)
class ChipDoc:
    """Public chip specs (per CHIP) from Google Cloud's TPU pages: HBM capacity and bandwidth,
    bidirectional ICI bandwidth, devices (TensorCores JAX sees) per chip, and the page."""

    hbm: str
    hbm_bw_gbps: float
    ici_bidir_gbps: float
    devices_per_chip: int
    url: str


CHIP_DOCS = {c.name: ChipDoc(c.hbm_doc, c.hbm_bw_gbps, c.ici_bidir_gbps, c.devices_per_chip,
                             c.url) for c in CHIP_SPECS.values()}


@dataclass(frozen=True)
class Fmt:
    """Cache bytes per token per layer: indexer keys and latent; the MLA kernel's query width
    and any XLA query layout bytes per head (fp8)."""

    name: str
    key_bytes: float
    latent_bytes: int
    q_dim: int = MLA_DIM
    q_prep_per_head: int = 0
    timed: bool = True

    @property
    def token_bytes(self) -> float:
        return self.key_bytes + self.latent_bytes


BF16_KEY = INDEX_DIM * BF16  # 256
FORMATS = (
    Fmt("bf16", BF16_KEY, CacheFormat.BF16.row_bytes(MLA_DIM)),  # 1280
    Fmt("packed", BF16_KEY, CacheFormat.PACKED_BF16.row_bytes(MLA_DIM)),  # 1536
    Fmt("fp8", fp8_cache.index_bytes_per_token(PAGE), CacheFormat.FP8.row_bytes(FP8_DIM),
        q_dim=FP8_DIM),  # 136 + 1024; q read as given
    Fmt("bf16 unpadded 576 (ref)", BF16_KEY, LATENT * BF16, timed=False),  # 1152
    Fmt("fp8 GPU layout (ref)", fp8.INDEX_TOKEN_BYTES, fp8.LATENT_BYTES, timed=False),  # 132+656
)
assert packed_cache.packed_words(MLA_DIM) * 4 == FORMATS[1].latent_bytes
assert fp8_cache.LATENT_TOKEN_BYTES == FORMATS[2].latent_bytes


@dataclass(frozen=True)
class Chip:
    """Per-device facts (``aot.chip_info``) and the ICI egress the model uses."""

    name: str
    hbm_bw: float  # B/s per device
    hbm_bytes: float  # per device
    peak: float  # bf16 flop/s per device
    devices_per_chip: int
    ici_egress: float  # B/s per device, one direction

    @classmethod
    def of(cls, name: str, ici_fraction: float) -> Chip:
        info, doc = aot.chip_info(name), CHIP_DOCS[name]
        egress = doc.ici_bidir_gbps * 1e9 / 2 / doc.devices_per_chip * ici_fraction
        return cls(name, float(info.mem_bw_bytes_per_second), float(info.hbm_capacity_bytes),
                   float(info.bf16_ops_per_second), doc.devices_per_chip, egress)


@dataclass(frozen=True)
class Scenario:
    """A time-model scenario; ``out_bytes`` and ``score_local`` are what-ifs (defaults: as
    implemented)."""

    name: str
    alpha_s: float  # seconds per ring step
    rows: int  # decode rows sharing one collective
    out_bytes: int = F32  # bytes per element of the out the LSE merge all-reduces
    score_local: bool = False  # score row over the shard's own pages only (L / N)


# ----------------------------------------------------------------------------- bytes


def tokens(n: float) -> str:
    """1024-based K / M token counts."""
    if n >= 2**20:
        return f"{n / 2**20:.2f}M"
    if n >= 2**10:
        return f"{n / 2**10:.1f}K" if n % 2**10 else f"{n // 2**10}K"
    return str(int(n))


def ceil_div(a, b):
    return -(-a // b)


def kv_read(fmt: Fmt, L, n: int) -> dict:
    """KV bytes the busiest of ``n`` shards reads per decode row per layer (arrays over L)."""
    L = np.asarray(L, np.int64)
    own_pages = ceil_div(ceil_div(L, PAGE), n)
    keys = own_pages * PAGE * fmt.key_bytes
    selected = np.minimum(L, TOPK) / n
    return {"index_keys": keys, "mla_gathered": selected * fmt.latent_bytes,
            "key_tokens": own_pages * PAGE, "selected": selected}


def fixed_read(fmt: Fmt, L, heads: int, n: int = 1, score_local: bool = False) -> dict:
    """Bytes per decode row per layer that context sharding does not divide (the score row as
    implemented: the row's full width on every shard; ``score_local``: the what-if of a
    shard-local width, its own key tokens)."""
    L = np.asarray(L, np.int64)
    width = kv_read(fmt, L, n)["key_tokens"] if score_local else L
    # the q rows and the weights, one lane-dense [1, H] row (lane-padded to whole 128 lanes)
    return {"index_q": INDEX_HEADS * INDEX_DIM * BF16 + -(-INDEX_HEADS // LANES) * LANES * F32,
            "mla_q_out": heads * ((fmt.q_dim + V_DIM) * BF16 + fmt.q_prep_per_head),
            "score_row": 2 * F32 * width}


def exchange(n: int, heads: int, out_bytes: int = F32) -> dict:
    """Bytes one device exchanges per decode row per layer (ring collectives)."""
    lse_payload = heads * V_DIM * out_bytes + 2 * heads * F32
    return {"candidates_own": 2 * TOPK * I32 if n > 1 else 0,
            "candidates_received": (n - 1) * 2 * TOPK * I32,
            "lse_payload": lse_payload if n > 1 else 0,
            "lse_ring": 2 * (n - 1) / n * lse_payload,
            "ring_steps": 2 * (n - 1) + 3 * 2 * (n - 1),
            "collectives": 5 if n > 1 else 0}


# ----------------------------------------------------------------------------- time


def row_time(chip: Chip, fmt: Fmt, L, n: int, heads: int, sc: Scenario) -> np.ndarray:
    """Roofline seconds per decode row per layer on the busiest device (module docstring)."""
    kv, fx = kv_read(fmt, L, n), fixed_read(fmt, L, heads, n, sc.score_local)
    idx_bytes = kv["index_keys"] + fx["index_q"] + fx["score_row"]
    idx_flops = 2 * INDEX_HEADS * INDEX_DIM * kv["key_tokens"]
    mla_bytes = kv["mla_gathered"] + fx["mla_q_out"]
    mla_flops = 2 * heads * kv["selected"] * (fmt.q_dim + V_DIM)
    t = (np.maximum(idx_bytes / chip.hbm_bw, idx_flops / chip.peak)
         + np.maximum(mla_bytes / chip.hbm_bw, mla_flops / chip.peak))
    if n > 1:
        ex = exchange(n, heads, sc.out_bytes)
        t = t + (ex["candidates_received"] + ex["lse_ring"]) / chip.ici_egress
        t = t + sc.alpha_s * ex["ring_steps"] / sc.rows
    return t


def break_even(chip: Chip, fmt: Fmt, n: int, heads: int, sc: Scenario, max_context: int,
               ) -> dict:
    """Smallest L (a multiple of 64, up to ``max_context``) with t(n) < t(1), or never."""
    L = np.arange(1, max_context // PAGE + 1, dtype=np.int64) * PAGE
    pays = row_time(chip, fmt, L, n, heads, sc) < row_time(chip, fmt, L, 1, heads, sc)
    if not pays.any():
        return {"context": None, "label": f"never (<= {tokens(max_context)})",
                "stays_paying": True}
    i = int(np.argmax(pays))
    return {"context": int(L[i]), "label": tokens(int(L[i])), "stays_paying": bool(pays[i:].all())}


# ----------------------------------------------------------------------------- fits


def fits(chip_name: str, fmt: Fmt, weight_chips: int) -> dict:
    """Tokens of cache per chip (61 layers, page multiples) with no weights and with a share."""
    info, doc = aot.chip_info(chip_name), CHIP_DOCS[chip_name]
    hbm = float(info.hbm_capacity_bytes) * doc.devices_per_chip
    per_token = LAYERS * fmt.token_bytes
    weights = WEIGHT_PARAMS / weight_chips
    out = {"chip": chip_name, "format": fmt.name, "bytes_per_token_61_layers": per_token,
           "hbm_per_chip": hbm, "weights_per_chip": weights}
    for tag, free in (("cache_only", hbm), ("with_weights", hbm - weights)):
        pages = max(int(free // (per_token * PAGE)), 0)
        out[f"tokens_per_chip_{tag}"] = pages * PAGE
        out[f"sequence_context_{tag}"] = {n: n * pages * PAGE for n in SHARDS}
    return out


def build(quick: bool, alpha_us: float, batch_rows: int, ici_fraction: float,
          weight_chips: int, max_context: int, out_bytes: int = F32,
          score_local: bool = False) -> dict:
    shards = (1, 2, 4) if quick else SHARDS
    contexts = (2**15, 2**17) if quick else CONTEXTS
    speed_at = (2**15, 2**17) if quick else SPEEDUP_AT
    max_context = min(max_context, 2**22) if quick else max_context
    timed = [f for f in FORMATS if f.timed]
    chips = [Chip.of(c, ici_fraction) for c in CHIP_NAMES]
    what_if = {"out_bytes": out_bytes, "score_local": score_local}
    scenarios = [Scenario("bandwidth", 0.0, 1, **what_if),
                 Scenario("latency, 1 row", alpha_us * 1e-6, 1, **what_if),
                 Scenario(f"latency, {batch_rows} rows", alpha_us * 1e-6, batch_rows,
                          **what_if)]

    exchange_rows = []
    for n in shards:
        r = {"N": n}
        for h in MLA_HEADS:
            ex = exchange(n, h)
            r[f"H{h}"] = ex
            r[f"H{h}_total"] = ex["candidates_received"] + ex["lse_ring"]
            r[f"H{h}_lse_bf16_out"] = exchange(n, h, out_bytes=BF16)["lse_ring"]
        exchange_rows.append(r)

    read_rows = []
    for fmt in timed:
        for L in contexts:
            for n in shards:
                kv = kv_read(fmt, L, n)
                fx = fixed_read(fmt, L, MLA_HEADS[0], n, score_local)
                ex = exchange(n, MLA_HEADS[0], out_bytes)
                kv_total = float(kv["index_keys"] + kv["mla_gathered"])
                read_rows.append({
                    "format": fmt.name, "L": L, "N": n,
                    "index_keys": float(kv["index_keys"]),
                    "mla_gathered": float(kv["mla_gathered"]), "kv_read": kv_total,
                    "fixed_H128": float(fx["index_q"] + fx["mla_q_out"]),
                    "score_row": float(fx["score_row"]),
                    "exchanged_H128": ex["candidates_received"] + ex["lse_ring"],
                    "candidates_received": ex["candidates_received"],
                    "lse_ring_H128": ex["lse_ring"]})

    pay_rows = []
    for chip in chips:
        for fmt in timed:
            for h in MLA_HEADS:
                for sc in scenarios:
                    r = {"chip": chip.name, "format": fmt.name, "heads": h, "scenario": sc.name,
                         "break_even": {}, "speedup": {}, "t1_us": {}}
                    for L in speed_at:
                        r["t1_us"][L] = float(row_time(chip, fmt, L, 1, h, sc)) * 1e6
                    for n in shards[1:]:
                        r["break_even"][n] = break_even(chip, fmt, n, h, sc, max_context)
                        r["speedup"][n] = {
                            L: float(row_time(chip, fmt, L, 1, h, sc)
                                     / row_time(chip, fmt, L, n, h, sc)) for L in speed_at}
                    pay_rows.append(r)

    fit_rows = [fits(c, f, weight_chips) for c in CHIP_NAMES for f in FORMATS]
    return {
        "label": LABEL,
        "config": {"quick": quick, "layers": LAYERS, "index_heads": INDEX_HEADS,
                   "index_dim": INDEX_DIM, "page": PAGE, "k": TOPK, "mla_heads": MLA_HEADS,
                   "latent": LATENT, "v_dim": V_DIM, "shards": shards, "contexts": contexts,
                   "speedup_at": speed_at, "max_context": max_context, "alpha_us": alpha_us,
                   "batch_rows": batch_rows, "ici_fraction": ici_fraction,
                   "lse_out_bytes": out_bytes, "score_row": "local" if score_local else "full",
                   "weight_params": WEIGHT_PARAMS, "weight_chips": weight_chips,
                   "model_doc": MODEL_DOC, "latency_note": LATENCY_NOTE},
        "formats": [asdict(f) | {"token_bytes": f.token_bytes} for f in FORMATS],
        "chips": [asdict(c) | {"doc": asdict(CHIP_DOCS[c.name])} for c in chips],
        "scenarios": [asdict(s) for s in scenarios],
        "exchange": exchange_rows, "read": read_rows, "pays": pay_rows, "fits": fit_rows,
    }
