"""Bytes per decode row of DeepSeek-V4 attention (``pallas_kernels.v4``) vs the minimum, per chip:
the traffic model and XLA's TPU cost analysis of the AOT-compiled program (libtpu on CPU; no
TPU runs).

Programs: the compile-gate cases of ``pallas_kernels.v4.compile_cases`` (64 decode rows x 8192
tokens, window 128 in pages of 64, compressed pages of 64 entries): Flash CSA (H=64, ratio 4,
top-512), Flash HCA (H=64, ratio 128: every visible entry, 64 at 8192), Pro CSA (H=128, ratio 4,
top-1024); paths: the fused kernel (the default) on packed bf16 and on fp8 MODEL1 caches, on
packed bf16 with ``run_grain="exact"`` (``fused exact``: page runs move the wanted rows only,
ragged ends one row a DMA; the default ``"tiles"`` widens them to 8-row tiles), and the two-pass
form (``fused=False``, two MLA kernel calls merged in XLA) on packed bf16 caches.

Columns, per decode row (a call's bytes / 64):

- ``gathered``: window rows + selected entries a row reads (128 + 512, 128 + 64, 128 + 1024);
- ``min``: those rows once at the stored bytes (packed bf16 1024 B; fp8 640 B per token) plus q
  read and out written once (the traffic model's ``bytes_min``);
- ``min@bf16``: the same at 1024 B per row whatever the format (the packed minimum: fp8's
  ratio against it shows the storage format's gain, none for a token-sparse gather);
- ``model``: the traffic model's bytes moved (fp8: 1024 B per token, its 2 DMAs: the 512 B
  record and the 512 B rope row shared with 3 tokens), and ``model / min``;
- ``DMAs``: the model's DMA descriptors (gathers, list loads, block copies);
- ``XLA``: XLA's ``bytes accessed`` of the whole program (the kernels' declared estimates plus
  the XLA glue: row facts, index building, the two-pass merge), and ``XLA / min``.

Usage: ``python -m scripts.cost.v4_cost [--quick] [--chips v5e,v6e,tpu7x] [--markdown PATH]``
(``--quick``: Flash CSA on one chip).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from pallas_kernels import chips as chip_specs  # noqa: E402
from pallas_kernels import xla_cost  # noqa: E402
from pallas_kernels.v4 import compile_cases as v4cases  # noqa: E402
from pallas_kernels.v4.fused import FP8_STORED_BYTES  # noqa: E402
from pallas_kernels.v4_attention.compile_cases import exact_run_cases  # noqa: E402
from reference.v4_attention import HEAD_DIM  # noqa: E402

PATHS = (("fused", True, "packed"), ("fused", True, "fp8"), ("fused exact", True, "packed"),
         ("two-pass", False, "packed"))
LABELS = {"flash_csa": "Flash CSA (H=64, top-512)", "flash_hca": "Flash HCA (H=64, ratio 128)",
          "pro_csa": "Pro CSA (H=128, top-1024)"}


def rows_for(chips, quick: bool) -> list[dict]:
    """One dict per (chip, shape, path): the columns of the module docstring, per decode row."""
    out = []
    for chip in chips:
        for path, fused, fmt in PATHS:
            cases = (exact_run_cases() if path == "fused exact"
                     else v4cases.compile_cases(fused, fmt))
            for case in cases:
                shape = case.shape.split("_decode")[0]
                if quick and shape != "flash_csa":
                    continue
                dims = next(s for s in v4cases.SHAPES if s[0] == case.shape)
                _, rows, context, _, ratio, k = dims
                gathered = v4cases.WINDOW + (k if ratio == 4 else context // ratio)
                cost = xla_cost.analyze(case.compile(chip))
                t = case.traffic(chip)
                min_bf16 = t.bytes_min + (rows * gathered * (2 * HEAD_DIM - FP8_STORED_BYTES)
                                          if fmt == "fp8" else 0)
                out.append(dict(chip=chip, shape=shape, path=path, fmt=fmt, gathered=gathered,
                                min=t.bytes_min / rows, min_bf16=min_bf16 / rows,
                                model=t.bytes_moved / rows, dmas=t.dmas / rows,
                                xla=cost.total_bytes / rows,
                                loop=cost.has_loop))
    return out


def markdown(rows: list[dict]) -> str:
    head = ("| chip | shape | path | cache | gathered rows | min B/row | min@bf16 B/row | "
            "model B/row | model / min | DMAs/row | XLA B/row | XLA / min |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(
            f"| {r['chip']} | {LABELS[r['shape']]} | {r['path']} | "
            f"{'fp8 MODEL1' if r['fmt'] == 'fp8' else 'packed bf16'} | {r['gathered']} | "
            f"{r['min']:,.0f} | {r['min_bf16']:,.0f} | {r['model']:,.0f} | "
            f"{r['model'] / r['min']:.4f}x | {r['dmas']:,.1f} | {r['xla']:,.0f} | "
            f"{r['xla'] / r['min']:.2f}x |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--chips", default=None,
                    help=f"comma-separated, default {','.join(chip_specs.NAMES)} "
                         f"(--quick: {chip_specs.DEFAULT})")
    ap.add_argument("--markdown", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    chips = chip_specs.parse(args.chips, (chip_specs.DEFAULT,) if args.quick else chip_specs.NAMES)
    table = markdown(rows_for(chips, args.quick))
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
