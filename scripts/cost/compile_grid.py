"""Compile grid: which shape / dtype / block combinations Mosaic accepts, per kernel and chip.

Every combination is AOT-compiled for real TPU generations through libtpu on CPU
(``pallas_kernels.aot.aot_compile``; no TPU runs) via the public Pallas entries only:
``streamindex_topk``, ``streamindex_page_topk``, ``sparse_mla``, ``page_sparse_mla``. A result is
``compiled``, ``failed`` (the entry accepted the arguments, tracing or Mosaic failed: the report
keeps the first informative line of the error) or ``rejected`` (the entry's own argument checks
refused the combination with a ValueError / TypeError before lowering).

Grid (issue 14 item 5). Shared axes: batch ``decode`` (4 sequences, one row each,
``one_token_per_seq=True``) or ``mixed`` (3 decode sequences plus one 32-row prefill sequence,
``one_token_per_seq=False``: the general path), page size 8..256, context 512 / 4096 (every
sequence's kv_len; capacity = context), q dtype bf16 / f32.

- indexer (token and page top-k): heads 1, 2, 8, 64; index dim 128; keys f32 / bf16;
  ``block_rows`` default / 1 / 4 / 16 (mixed only: decode always runs 1-row blocks) and
  ``block_pages`` default / 1 / 2 / 8; k = 256 tokens, ``k_pages = min(16, pages_per_seq)``.
- MLA (token and page sparse): heads 1, 8, 16, 128; latent D 128 / 256 / 640 (v_dim = 512 at
  640, else D); cache f32 / bf16 / packed (``reference.packed_cache``); ``tokens_per_block``
  default / 8 / 64 / 256 (token), ``pages_per_block`` default / 1 / 4 (page); k = 512 tokens,
  ``k_pages = min(8, pages_per_seq)``.

"default" blocks are what the entry picks on that chip: the indexer gets ``chip=``; the MLA
entries ask ``pallas_kernels.tpu.device_chip()``, which honours the ``jax.default_device`` the
AOT compile runs under, so the chip's block table and VMEM cap apply, as on a TPU.

The full product is large (``--full``, per chip: 3,840 per indexer kernel, 6,912 sparse_mla,
5,184 page_sparse_mla; ~1-2.5 s each, so about a day for three chips); by default a seeded
random sample of ``--sample N`` combinations per kernel is compiled. ``--where AXIS=V1,V2``
(repeatable) restricts an axis before sampling (``default`` names the default block;
``--sample 0`` keeps every remaining combination), so a structured sub-grid can be measured,
e.g. every page size x batch x key dtype at default blocks.

Usage: ``python -m scripts.cost.compile_grid [--kernels K1,K2] [--chips v5e,v6e,tpu7x]
[--full | --sample N] [--seed S] [--where AXIS=V,...]... [--markdown PATH] [--json PATH]
[--list]``. Run one process at a time (each compile uses the whole libtpu compiler).
"""

# No ``from __future__ import annotations``: the dataclass then needs no sys.modules entry,
# so a test can load this file by path with importlib alone.
import argparse
import functools
import itertools
import json
import os
import random
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels import aot  # noqa: E402
from pallas_kernels import chips as chip_specs  # noqa: E402
from reference import packed_cache  # noqa: E402

INDEXER_KERNELS = ("streamindex_topk", "streamindex_page_topk")
MLA_KERNELS = ("sparse_mla", "page_sparse_mla")
KERNELS = INDEXER_KERNELS + MLA_KERNELS
DEFAULT = None  # a block knob left to the entry

# Batch shapes: sequences and query rows. mixed = 3 decode rows + one prefill of 32 rows.
DECODE_SEQS, MIXED_DECODE_SEQS, PREFILL_ROWS = 4, 3, 32
INDEX_K, INDEX_K_PAGES = 256, 16
MLA_K, MLA_K_PAGES, MLA_SCALE = 512, 8, 0.1

_SHARED = dict(batch=("decode", "mixed"), page_size=(8, 16, 32, 64, 128, 256),
               context=(512, 4096), q_dtype=("bf16", "f32"))
AXES: dict[str, dict[str, tuple]] = {
    **{k: dict(_SHARED, heads=(1, 2, 8, 64), dim=(128,), cache=("f32", "bf16"),
               block_rows=(DEFAULT, 1, 4, 16), block_pages=(DEFAULT, 1, 2, 8))
       for k in INDEXER_KERNELS},
    "sparse_mla": dict(_SHARED, heads=(1, 8, 16, 128), dim=(128, 256, 640),
                       cache=("f32", "bf16", "packed"), tokens_per_block=(DEFAULT, 8, 64, 256)),
    "page_sparse_mla": dict(_SHARED, heads=(1, 8, 16, 128), dim=(128, 256, 640),
                            cache=("f32", "bf16", "packed"), pages_per_block=(DEFAULT, 1, 4)),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "packed": jnp.uint32}


@dataclass(frozen=True)
class Combo:
    """One grid point. Block knobs a kernel does not take stay None (as does a default one)."""

    kernel: str
    batch: str  # "decode" | "mixed"
    page_size: int
    heads: int
    dim: int
    cache: str  # "f32" | "bf16" | "packed"
    q_dtype: str  # "f32" | "bf16"
    context: int
    block_rows: int | None = None
    block_pages: int | None = None
    tokens_per_block: int | None = None
    pages_per_block: int | None = None

    @property
    def knobs(self) -> dict[str, int | None]:
        """The block knobs this kernel takes (None = the entry's default)."""
        return {k: getattr(self, k) for k in AXES[self.kernel] if k in _KNOBS}

    def label(self) -> str:
        knobs = " ".join(f"{k}={'default' if v is None else v}" for k, v in self.knobs.items())
        return (f"{self.batch} ps={self.page_size} H={self.heads} D={self.dim} "
                f"cache={self.cache} q={self.q_dtype} ctx={self.context} {knobs}")


_KNOBS = ("block_rows", "block_pages", "tokens_per_block", "pages_per_block")


def _value(text: str):
    return DEFAULT if text == "default" else int(text) if text.lstrip("-").isdigit() else text


def parse_where(items: list[str] | None) -> dict[str, set]:
    """``["page_size=8,16", "block_pages=default"]`` -> ``{"page_size": {8, 16}, ...}``."""
    out: dict[str, set] = {}
    valid = {f.name for f in fields(Combo)} - {"kernel"}
    for item in items or []:
        name, sep, values = item.partition("=")
        if not sep or name not in valid:
            raise ValueError(f"--where needs AXIS=V1,V2 with AXIS in {sorted(valid)}, got {item!r}")
        out[name] = {_value(v) for v in values.split(",")}
    return out


def _redundant(c: Combo) -> bool:
    """decode runs 1-row blocks whatever block_rows says: keep only its default there."""
    return c.batch == "decode" and c.block_rows is not None


def grid(kernel: str, full: bool, sample: int, seed: int,
         where: dict[str, set] | None = None) -> list[Combo]:
    """The kernel's combinations: all (``full`` or ``sample == 0``) or a seeded random sample of
    ``sample`` of them, after restricting axes by ``where`` (``{axis: allowed values}``)."""
    if kernel not in AXES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {list(AXES)}")
    axes = AXES[kernel]
    names = list(axes)
    combos = []
    for values in itertools.product(*(axes[n] for n in names)):
        c = Combo(kernel=kernel, **dict(zip(names, values, strict=True)))
        if _redundant(c):
            continue
        if where and any(getattr(c, a) not in allowed for a, allowed in where.items()):
            continue
        combos.append(c)
    if full or sample <= 0 or sample >= len(combos):
        return combos
    picked = sorted(random.Random(f"{seed}:{kernel}").sample(range(len(combos)), sample))
    return [combos[i] for i in picked]


# ----------------------------------------------------------------------------- specs


def _batch(c: Combo) -> tuple[int, int]:
    """(sequences S, query rows T) of the combination's batch."""
    if c.batch == "decode":
        return DECODE_SEQS, DECODE_SEQS
    return MIXED_DECODE_SEQS + 1, MIXED_DECODE_SEQS + PREFILL_ROWS


def _meta_specs(seqs: int, pages: int) -> list[jax.ShapeDtypeStruct]:
    i32 = jnp.int32
    return [jax.ShapeDtypeStruct((seqs,), i32), jax.ShapeDtypeStruct((pages,), i32),
            jax.ShapeDtypeStruct((seqs + 1,), i32), jax.ShapeDtypeStruct((seqs + 1,), i32),
            jax.ShapeDtypeStruct((3,), i32)]


def pages_per_seq(c: Combo) -> int:
    return -(-c.context // c.page_size)


def v_dim(c: Combo) -> int:
    return 512 if c.dim == 640 else c.dim


def call_for(c: Combo, chip: str):
    """``(fn, specs)``: the entry with its statics bound, and its argument specs."""
    seqs, rows = _batch(c)
    pps = pages_per_seq(c)
    pages = seqs * pps
    q = jax.ShapeDtypeStruct((rows, c.heads, c.dim), DTYPES[c.q_dtype])
    words = packed_cache.packed_words(c.dim) if c.cache == "packed" else c.dim
    cache = jax.ShapeDtypeStruct((pages, c.page_size, words), DTYPES[c.cache])
    meta = _meta_specs(seqs, pages)
    knobs = c.knobs
    if c.kernel in INDEXER_KERNELS:
        entry = getattr(pallas_kernels, c.kernel)
        k = {"k": INDEX_K} if c.kernel == "streamindex_topk" else {
            "k_pages": min(INDEX_K_PAGES, pps)}
        fn = functools.partial(entry, **k, pages_per_seq=pps,
                               one_token_per_seq=c.batch == "decode", chip=chip, **knobs)
        weights = jax.ShapeDtypeStruct((rows, c.heads), jnp.float32)
        return fn, [q, weights, cache, *meta]
    entry = getattr(pallas_kernels, c.kernel)
    width = MLA_K if c.kernel == "sparse_mla" else min(MLA_K_PAGES, pps)
    selected = jax.ShapeDtypeStruct((rows, width), jnp.int32)
    fn = functools.partial(entry, sm_scale=MLA_SCALE, pages_per_seq=pps, v_dim=v_dim(c),
                           **knobs)
    kv_lens, table, cu_q, cu_kv, dist = meta
    return fn, [q, cache, kv_lens, selected, table, cu_q, cu_kv, dist]


# ----------------------------------------------------------------------------- compile

# Wrapper prefixes in front of Mosaic's own words (dropped from the reported line).
_PREFIXES = ("MosaicError: ", "JaxRuntimeError: ", "XlaRuntimeError: ", "INTERNAL: ",
             "Mosaic failed to compile TPU kernel: ")


def first_line(message: str) -> str:
    """The first informative line of an error message, wrapper prefixes dropped."""
    for ln in message.splitlines():
        ln = ln.strip()
        while ln.startswith(_PREFIXES):
            ln = ln.removeprefix(next(p for p in _PREFIXES if ln.startswith(p))).strip()
        if ln:
            return ln[:300]
    return ""


def mlir_op(message: str) -> str:
    """Mosaic's "The MLIR operation involved" compressed to ``op : operand types`` ("" if
    absent): which load / store / DMA / reshape the error is about."""
    lines = message.splitlines()
    for i, ln in enumerate(lines[:-1]):
        if ln.strip().startswith("The MLIR operation involved"):
            op = lines[i + 1].strip()
            name = op.split('"')[1] if op.count('"') >= 2 else op.split("(")[0]
            types = op.rpartition(" : ")[2] if " : " in op else ""
            return f"{name} : {types}"[:300]
    return ""


def _rejected(exc: BaseException | None) -> bool:
    """The entry's own argument checks refused it: a ValueError / TypeError raised from
    package code (the innermost frame is outside jax), before anything was lowered."""
    if not isinstance(exc, (ValueError, TypeError)):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    inner = frames[-1].filename if frames else ""
    return "/jax/" not in inner and "/jaxlib/" not in inner


_last_chip: list[str] = []


def compile_result(c: Combo, chip: str) -> tuple[str, str, str]:
    """``(status, message, op)``: ``("compiled", "", "")``, ``("failed", first error line,
    Mosaic's MLIR op)`` or ``("rejected", first error line, "")``."""
    aot.check_chip(chip)
    if _last_chip[-1:] != [chip]:  # traced jaxprs of another chip must not be reused
        jax.clear_caches()
        _last_chip[:] = [chip]
    try:
        fn, specs = call_for(c, chip)
    except (ValueError, TypeError) as e:
        return "rejected", first_line(f"{type(e).__name__}: {e}"), ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bf16 sparse_mla slow-path warning
            aot.aot_compile(fn, specs, chip, c.label())
    except aot.CompileError as e:
        if _rejected(e.__cause__):
            return "rejected", first_line(e.message), ""
        return "failed", first_line(e.message), mlir_op(e.message)
    return "compiled", "", ""


def compile_combo(c: Combo, chip: str) -> tuple[bool, str]:
    """``(ok, message)``: True and "" if it compiled for ``chip``, else False and the first
    informative line of the error (the entry's refusal or Mosaic's message)."""
    status, msg, _ = compile_result(c, chip)
    return status == "compiled", msg


# ----------------------------------------------------------------------------- report


def run(combos: list[Combo], chips: list[str], log=sys.stderr) -> list[dict]:
    """Compile every combination for every chip (chip-major, so caches are cleared once per
    chip); one result dict per (combination, chip)."""
    results = []
    total = len(combos) * len(chips)
    n = 0
    for chip in chips:
        for c in combos:
            n += 1
            t0 = time.perf_counter()
            status, msg, op = compile_result(c, chip)
            dt = time.perf_counter() - t0
            results.append({**asdict(c), "chip": chip, "status": status, "message": msg,
                            "op": op, "seconds": round(dt, 2)})
            print(f"[{n}/{total}] {chip:5s} {c.kernel:21s} {c.label():90s} {status} {dt:.1f}s"
                  + (f"  {msg[:120]}" if msg else ""), file=log, flush=True)
            if n % 100 == 0:
                jax.clear_caches()
    return results


def _fmt(v) -> str:
    return "default" if v is None else str(v)


def markdown(results: list[dict]) -> str:
    """Counts per chip and kernel, failure rates per axis value, then every failure."""
    out = ["## Counts per chip and kernel", "",
           "| chip | kernel | combos | accepted | compiled | failed | rejected |",
           "|---|---|---:|---:|---:|---:|---:|"]
    by = defaultdict(Counter)
    for r in results:
        by[(r["chip"], r["kernel"])][r["status"]] += 1
    for (chip, kernel), cnt in sorted(by.items()):
        n = sum(cnt.values())
        out.append(f"| {chip} | {kernel} | {n} | {n - cnt['rejected']} | {cnt['compiled']} | "
                   f"{cnt['failed']} | {cnt['rejected']} |")
    out += ["", "## Failed / accepted per axis value (all chips)", ""]
    for kernel in KERNELS:
        rows = [r for r in results if r["kernel"] == kernel and r["status"] != "rejected"]
        if not rows:
            continue
        out.append(f"### {kernel}")
        out.append("")
        for axis in AXES[kernel]:
            tally = defaultdict(Counter)
            for r in rows:
                tally[_fmt(r[axis])][r["status"]] += 1
            if len(tally) < 2 and not any(t["failed"] for t in tally.values()):
                continue
            cells = ", ".join(f"{v}: {t['failed']}/{sum(t.values())}"
                              for v, t in tally.items())
            out.append(f"- {axis}: {cells}")
        out.append("")
    out += ["## Messages (count per chip, kernel, status)", "",
            "| chip | kernel | status | count | message |", "|---|---|---|---:|---|"]
    msgs = Counter((r["chip"], r["kernel"], r["status"], r["message"]) for r in results
                   if r["status"] != "compiled")
    for (chip, kernel, status, msg), n in sorted(msgs.items()):
        out.append(f"| {chip} | {kernel} | {status} | {n} | {msg.replace('|', '/')} |")
    out += ["", "## Failures", "", "| chip | kernel | combination | message | MLIR op |",
            "|---|---|---|---|---|"]
    for r in results:
        if r["status"] == "failed":
            c = Combo(**{f.name: r[f.name] for f in fields(Combo)})
            out.append(f"| {r['chip']} | {r['kernel']} | {c.label()} | "
                       f"{r['message'].replace('|', '/')} | {r['op'].replace('|', '/')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--chips", default=",".join(chip_specs.NAMES))
    p.add_argument("--full", action="store_true", help="every combination (long)")
    p.add_argument("--sample", type=int, default=20,
                   help="random combinations per kernel (default 20; 0 = all after --where)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--where", action="append", metavar="AXIS=V1,V2",
                   help="restrict an axis before sampling (repeatable; 'default' = the "
                        "entry's default block)")
    p.add_argument("--list", action="store_true", help="print the combinations, compile none")
    p.add_argument("--markdown", type=Path, help="also write the report here")
    p.add_argument("--json", type=Path, help="write every result here")
    args = p.parse_args(argv)
    chips = [aot.check_chip(c) for c in args.chips.split(",") if c]
    where = parse_where(args.where)
    combos = [c for k in args.kernels.split(",") if k
              for c in grid(k, args.full, args.sample, args.seed,
                            {a: v for a, v in where.items() if a in AXES[k]})]
    if args.list:
        for c in combos:
            print(c.kernel, c.label())
        print(f"{len(combos)} combinations x {len(chips)} chips")
        return 0
    t0 = time.perf_counter()
    results = run(combos, chips)
    report = markdown(results)
    report += f"\n{len(results)} compiles in {time.perf_counter() - t0:.0f} s\n"
    print(report)
    if args.markdown:
        args.markdown.write_text(report)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
