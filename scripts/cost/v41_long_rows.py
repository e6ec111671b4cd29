"""DeepSeek-V4.1's long indexer rows (issue 31, Deliver 6): AOT compiles (libtpu on CPU, no TPU)
of the package's existing token top-k at ratio 1 and V4.1's indexer dims (32 heads x 128,
top-512) with rows of 128K and 1M entries, per chip: XLA's memory analysis of the compiled
program, the score kernel's VMEM, HBM bytes and DMAs from its traffic model, and whether the
top-k's temporaries are bounded by the score chunk and k (not by rows x context).

Keys as the package stores them: bf16 pages, the fp8 index pages ``u8[P, G, 4, 128]``
(``reference.formats.fp8_index_pages``), or V4.1's own fp4 index pages (e2m1 with ue8m0 scales
per 32, ``reference.v41.index_pages``: 68 B an entry at pages of 128; ``index_topk_v41``; no jnp
reference reads them, so their ``reference_temp`` is not measured).

What bounds the memory (``pallas_kernels.indexer.scoring``): the kernel writes one chunk of
``C`` rows of f32 scores ``[C, N]`` with ``C * N * 4 <= SCORE_CHUNK_BYTES`` (64 MiB; at least
one row block), then the selection (XLA) reduces the chunk to ``[C, k]``; longer batches loop
over chunks (``fori_loop``). So the program's temporaries are the chunk (once for the
approximate top-k; the exact ``lax.top_k``, a tiled sort, up to 7 chunk-sized arrays:
``CHUNK_COPIES``) plus ``O(T * k)``: ``temp_bound``. Two kernel buffers are NOT bounded by the
chunk and grow with ``N``: its VMEM score rows ``f32[2, L, N]`` (``chunk_score_bytes``) and
the page table it scalar-prefetches into SMEM (``i32[S * N / page]``). XLA may place a small
chunk in VMEM (``S(1)``) instead of HBM: the memory analysis' temp bytes are HBM only, so the
largest XLA array and the XLA arrays in VMEM are read from the compiled HLO too
(``xla_arrays``; their sum, capped at the chip's VMEM, is an upper bound: XLA reuses buffers).
The jnp reference path (``implementation="xla"``) is compiled beside it for contrast.

Nothing here is a TPU time; every number is XLA's compile-time memory analysis or a model.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m scripts.cost.v41_long_rows [--quick] [--exact]
        [--chips v5e,v6e,tpu7x] [--formats bf16,fp8 pages,fp4 pages] [--candidates]
        [--no-reference] [--markdown]

``--candidates``: beside each fp4-pages case, a V4.1 candidate consumer's top-k
(``index_topk_v41(candidates=i32[T, 2048])``, blocks of 8: exact, ``restricted_topk`` ranking
only the 16384 candidate entries of each row, against ``temp_bound``'s consumer form: two
chunks plus ``CANDIDATE_ENTRY_BYTES`` a candidate entry) and the candidate source's selection
(``index_select_v41(num_blocks=2048)``: its exact top-k and its blocks); the HBM models read
every page (an upper bound: the pages read depend on the ids, ``v41_candidate_reads``).
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from dataclasses import dataclass

import jax.numpy as jnp

from pallas_kernels import aot, tpu
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES, chunk_rows
from pallas_kernels.measure.hlo import shape_bytes

MiB = 2 ** 20
# Chunk-sized XLA arrays of the selection. The approximate top-k (``approx_max_k``) reads the
# scores chunk and its masked copy (fused into its input): 1 chunk live. The exact top-k
# (``lax.top_k`` over a chunk) is a tiled sort on TPU: the scores, the masked scores, the values
# tiled [512, N * C / 512] and their copies, an iota of indices and its copy, 7 chunk-sized
# arrays in the compiled HLO (4 x 1M on every chip): 8 allows for one more.
CHUNK_COPIES = {False: 1, True: 8}
# Beyond the chunks: the work list, page-table copies and the selection's per-row candidates
# (``approx_max_k`` aggregates to at most 4 * k per row before its sort), with room to spare.
FIXED_SLACK_BYTES = 4 * MiB
CANDIDATE_BYTES_PER_K = 64  # per row and per unit of k: 4 k candidates x (value + index) x 2
# A candidate consumer's restricted top-k (``reference.v41.restricted_topk`` over the gathered
# candidate entries): its arrays per row and candidate entry (gathered scores, keys, entry ids,
# masks, the sort's copies: ~50 B measured at 4 x 1M and 32 x 128K), with room to spare; and
# its chunk copies: the chunk, plus on tpu7x memory-space assignment's copy of it between
# VMEM and HBM (measured at 4 x 1M and 32 x 128K). No sort over the chunk.
CANDIDATE_ENTRY_BYTES = 64
CANDIDATE_CHUNK_COPIES = 2


@dataclass(frozen=True)
class XlaArray:
    """An array result of an instruction outside fusion bodies (a buffer XLA allocates)."""

    name: str
    shape: str
    bytes: int
    vmem: bool  # memory space S(1)


_LINE_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+([a-z0-9]+\[[\d,]*\])(\{[^}]*\})?\s+"
                      r"([\w\-]+)\(")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_NOT_BUFFERS = ("parameter", "bitcast", "get-tuple-element", "tuple", "constant")


def xla_arrays(hlo_text: str) -> list[XlaArray]:
    """Array results of the compiled module's instructions outside fusion bodies (entry, loop
    bodies; parameters, bitcasts and tuple plumbing left out, and calls whose result aliases an
    operand: the indexer's ladder levels write one score buffer in turn), largest first."""
    fused = set(re.findall(r"\sfusion\(.*?calls=%?([\w.\-]+)", hlo_text))
    out, comp = [], ""
    for line in hlo_text.splitlines():
        c = _COMP_RE.match(line)
        if c:
            comp = c.group(1)
            continue
        m = _LINE_RE.match(line)
        if (not m or comp in fused or m.group(4) in _NOT_BUFFERS
                or "output_to_operand_aliasing" in line):  # its operand's buffer, written
            continue
        out.append(XlaArray(m.group(1), m.group(2), shape_bytes(m.group(2)),
                            "S(1)" in (m.group(3) or "")))
    return sorted(out, key=lambda a: -a.bytes)


def chunk_score_bytes(case: aot.CompileCase, chip: str,
                      chunk_bytes: int) -> tuple[int, int, int]:
    """``(C, C * N * 4, 2 * L * N * 4)``: rows and f32 bytes of one score chunk of ``case`` on
    ``chip``, and the kernel's double-buffered VMEM score rows ``f32[2, L, N]`` (``L``: the top
    of the row-block ladder, capped at ``C``): the one kernel buffer that grows with ``N``."""
    q, cache = case.specs[0], case.specs[2]
    rows, pps = q.shape[0], case.specs[4].shape[0] // case.specs[3].shape[0]
    keywords = case.fn_for_chip(chip).keywords
    page = _page_size(cache, keywords)
    otp = "decode" in case.tags
    block_rows = keywords.get("block_rows")
    blocks = resolve_blocks(None, block_rows=block_rows, block_pages=None, chip=chip,
                            one_token_per_seq=otp, pages_per_seq=pps, page_size=page,
                            page_mode=False, mosaic=True)
    width = pps * page
    c = chunk_rows(rows, width, blocks.block_rows, chunk_bytes)
    top = 1 if otp else min(blocks.block_rows, c)
    return c, c * width * 4, 2 * top * width * 4


def _page_size(cache, keywords: dict) -> int:
    """Entries per page of a bf16 ``[P, ps, D]``, fp8-pages or fp4-pages ``u8[P, G, 4, 128]``
    spec (fp4 pages: the entry's ``page_size``)."""
    if "page_size" in keywords:
        return keywords["page_size"]
    if cache.dtype == jnp.uint8:
        from reference.formats import fp8_index_pages
        return fp8_index_pages.page_size_of(cache.shape[1])
    return cache.shape[1]


def temp_bound(chunk_bytes: int, rows: int, k: int, exact: bool,
               selection: str | None = None, chunk_rows: int | None = None) -> int:
    """Declared bound on the top-k program's XLA temporaries (HBM temp plus XLA arrays in
    VMEM): ``CHUNK_COPIES[exact]`` score chunks, ``CANDIDATE_BYTES_PER_K * k`` per row and
    ``FIXED_SLACK_BYTES``. Independent of the context ``N`` beyond the chunk.
    ``selection="consumer"`` (a candidate consumer's exact top-k among its
    ``candidate_topk_blocks * candidate_block_size`` entries): ``CANDIDATE_CHUNK_COPIES``
    chunks, no sort over them, plus ``CANDIDATE_ENTRY_BYTES`` per candidate entry of each row
    of one chunk (``chunk_rows``, the chunk's rows; default all ``rows``): the selection runs
    a chunk at a time, so only one chunk's candidates are live.
    ``"source"`` (the candidate source: its exact top-k, then its blocks' max-pool and top
    blocks): the exact bound plus the blocks' sort, ``CHUNK_COPIES[True]`` chunks of
    ``1 / candidate_block_size`` the size."""
    cfg = icases.v41_flash()
    if selection == "consumer":
        entries = cfg.candidate_topk_blocks * cfg.candidate_block_size
        live = rows if chunk_rows is None else min(rows, chunk_rows)
        return (CANDIDATE_CHUNK_COPIES * chunk_bytes + CANDIDATE_ENTRY_BYTES * entries * live
                + CANDIDATE_BYTES_PER_K * k * rows + FIXED_SLACK_BYTES)
    blocks = CHUNK_COPIES[True] * chunk_bytes // cfg.candidate_block_size
    return (CHUNK_COPIES[exact] * chunk_bytes + CANDIDATE_BYTES_PER_K * k * rows
            + FIXED_SLACK_BYTES + (blocks if selection == "source" else 0))


def measure(case: aot.CompileCase, chip: str, *, k: int, exact: bool,
            chunk_bytes: int = SCORE_CHUNK_BYTES, selection: str | None = None) -> dict:
    """Compile ``case`` for ``chip``; XLA's memory analysis, the HLO's arrays, the traffic
    model and the bound verdict (``ok=False`` and ``error`` when Mosaic/XLA refuse)."""
    q = case.specs[0]
    rows = q.shape[0]
    page = _page_size(case.specs[2], case.fn_for_chip(chip).keywords)
    width = case.specs[4].shape[0] // case.specs[3].shape[0] * page
    row = {"chip": chip, "case": case.shape, "rows": rows, "N": width}
    t0 = time.perf_counter()
    try:
        compiled = case.compile(chip)
    except aot.CompileError as e:
        first = e.message.split(" :: ")[0].splitlines()[0]
        return row | {"ok": False, "error": first[:240], "compile_s": time.perf_counter() - t0}
    row["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    arrays = xla_arrays(compiled.as_text())
    c, chunk, row_buffer = chunk_score_bytes(case, chip, chunk_bytes)
    model = case.traffic(chip)
    # XLA reuses buffers: the sum of the arrays it places in VMEM over-counts; the chip never
    # holds more than its VMEM at once
    vmem_xla = min(sum(a.bytes for a in arrays if a.vmem), tpu.chip_vmem(chip))
    bound = temp_bound(chunk, rows, k, exact, selection, c)
    largest = arrays[0] if arrays else XlaArray("-", "-", 0, False)
    return row | {
        "ok": True, "temp": mem.temp_size_in_bytes, "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes, "largest": largest, "xla_vmem": vmem_xla,
        "chunk_rows": c, "chunk_bytes": chunk, "bound": bound,
        "bounded": mem.temp_size_in_bytes + vmem_xla <= bound and largest.bytes <= chunk,
        "full_scores": rows * width * 4, "kernel_vmem": model.vmem_bytes,
        "row_buffer": row_buffer,
        "hbm_per_row": model.bytes_moved / rows, "dmas": model.dmas}


def reference_temp(case: aot.CompileCase, chip: str, *, k: int, exact: bool) -> int | str:
    """HBM temp bytes of the jnp reference path (``dsa_jax.indexer_topk(implementation=
    "xla")``) at ``case``'s specs, or the refusal's first words."""
    import dsa_jax

    pps = case.specs[4].shape[0] // case.specs[3].shape[0]
    fn = functools.partial(dsa_jax.indexer_topk, k=k, pages_per_seq=pps, exact=exact,
                           one_token_per_seq="decode" in case.tags, implementation="xla")
    try:
        return aot.aot_compile(fn, case.specs, chip, case.shape).memory_analysis(
        ).temp_size_in_bytes
    except aot.CompileError as e:
        return e.message.split(" :: ")[0].splitlines()[0][:160]


def _mib(b) -> str:
    return f"{b / MiB:.1f}" if isinstance(b, int | float) else str(b)


def markdown(rows: list[dict]) -> str:
    """One table row per chip x case."""
    head = ("| chip | case | compile s | XLA temp MiB | XLA arrays in VMEM MiB | largest XLA "
            "array | score chunk (rows, MiB) | bound MiB | bounded | rows x N x 4 MiB | kernel "
            "VMEM MiB (model) | kernel score rows f32[2, L, N] MiB | HBM MB/row (model) | jnp "
            "reference temp MiB |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['chip']} | {r['case']} | {r['compile_s']:.1f} | refused: "
                         f"{r['error']} |" + " |" * 10)
            continue
        big = r["largest"]
        lines.append(
            f"| {r['chip']} | {r['case']} | {r['compile_s']:.1f} | {_mib(r['temp'])} | "
            f"{_mib(r['xla_vmem'])} | {big.shape} {'VMEM' if big.vmem else 'HBM'} | "
            f"{r['chunk_rows']}, {_mib(r['chunk_bytes'])} | {_mib(r['bound'])} | "
            f"{'yes' if r['bounded'] else 'NO'} | {_mib(r['full_scores'])} | "
            f"{_mib(r['kernel_vmem'])} | {_mib(r['row_buffer'])} | "
            f"{r['hbm_per_row'] / 1e6:.1f} | "
            f"{_mib(r.get('reference_temp', '-'))} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one chip, the 4 x 1M decode alone")
    p.add_argument("--exact", action="store_true", help="lax.top_k instead of approx_max_k")
    p.add_argument("--chips", default=",".join(aot.CHIPS))
    p.add_argument("--formats", default=",".join(icases.V41_KEY_FORMATS))
    p.add_argument("--shapes", default="", help="substring filter on the case names")
    p.add_argument("--candidates", action="store_true",
                   help="also a candidate consumer's top-k (fp4 pages, exact, among "
                        "candidate_topk_blocks blocks)")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    chips = a.chips.split(",")[:1] if a.quick else a.chips.split(",")
    names = [n for n, v in icases.V41_LONG_SHAPES.items()
             if (v[4] or not a.quick) and a.shapes in n]
    k = icases.v41_flash().index_topk
    out = []
    for chip in chips:
        for name in names:
            for fmt in a.formats.split(","):
                case = icases.v41_long_case(name, fmt, exact=a.exact)
                r = measure(case, chip, k=k, exact=a.exact)
                if r["ok"] and not a.no_reference and fmt != "fp4 pages":
                    r["reference_temp"] = reference_temp(case, chip, k=k, exact=a.exact)
                out.append(r)
                print(_summary(r), flush=True)
                for sel in icases.V41_SELECTIONS if a.candidates and fmt == "fp4 pages" else ():
                    case = icases.v41_long_case(name, fmt, exact=True, selection=sel)
                    out.append(measure(case, chip, k=k, exact=True, selection=sel))
                    print(_summary(out[-1]), flush=True)
    if a.markdown:
        print(markdown(out))
    return out


def _summary(r: dict) -> str:
    if not r["ok"]:
        return f"{r['chip']:6} {r['case']}: REFUSED ({r['compile_s']:.1f} s) {r['error']}"
    return (f"{r['chip']:6} {r['case']}: {r['compile_s']:.1f} s, temp {_mib(r['temp'])} MiB, "
            f"XLA VMEM {_mib(r['xla_vmem'])} MiB, largest {r['largest'].shape}"
            f"{' (VMEM)' if r['largest'].vmem else ''}, chunk {r['chunk_rows']} rows "
            f"{_mib(r['chunk_bytes'])} MiB, bound {_mib(r['bound'])} MiB "
            f"{'bounded' if r['bounded'] else 'NOT BOUNDED'}, rows x N x 4 "
            f"{_mib(r['full_scores'])} MiB, kernel VMEM {_mib(r['kernel_vmem'])} MiB (model), "
            f"kernel score rows f32[2, L, N] {_mib(r['row_buffer'])} MiB, "
            f"HBM {r['hbm_per_row'] / 1e6:.1f} MB/row, dmas {r['dmas']}, reference temp "
            f"{_mib(r.get('reference_temp', '-'))} MiB")


if __name__ == "__main__":
    main()
