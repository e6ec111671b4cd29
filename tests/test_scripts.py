"""CI runs every script's ``--quick`` mode (issue 7): each must exit 0 and write its outputs.

These are smoke runs of the reproducible benchmarks, not timing assertions: no number they
print is checked against a threshold here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels import chips
from tests.isolated import optimised_flags

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout=600, optimized=False):
    """``python *args`` from the repository root; ``optimized``: XLA:CPU compiles at XLA's
    defaults, not the suite's -O0 (``tests/isolated.py``'s ``optimised_flags``)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if optimized:
        env["XLA_FLAGS"] = optimised_flags(env.get("XLA_FLAGS", ""))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_bench_quick(tmp_path):
    # at a 2K context (the default 8K is the benchmark's; 2K is the smallest that keeps the
    # rows' 32 pages) and one timed repetition: a smoke run of the whole script, every CPU row
    # and ratio; the seed's general paths cost O(S * T * context); one AOT row of the quick
    # two (the page top-k at 4096 @128K: 10 s of XLA's TPU top-k vs 23 s for the token one);
    # optimised CPU compiles: it times the CPU paths (27.6 s -> 23.3 s, 40 -> 34 CPU-s, session 26)
    stdout = _run(["-m", "scripts.bench.bench", "--quick", "--reps", "1", "--context", "2048",
                   "--aot-op", "page top-k", "--out", str(tmp_path)], tmp_path, optimized=True)
    assert (tmp_path / "bench.json").exists() and "seed sparse_mla / ours" in stdout
    assert "| chunked prefill 4096 @128K | page top-k (ours) | " in stdout


@pytest.mark.slow
def test_tpu_compile_report_quick(tmp_path):
    # one chip, the first case of two kernels (page top-k and sparse MLA: one of each kernel
    # module, the two cheapest compiles; 2 AOT compiles, was 6 with every kernel, whose token
    # top-k alone is XLA's TPU top_k at 64 x 4096): every quick case compiles on every chip in
    # tests/test_compile_{indexer,mla}.py; this checks the report itself
    _run(["-m", "scripts.cost.tpu_compile_report", "--quick", "--chips", chips.DEFAULT,
          "--limit", "1", "--kernels", "streamindex_page_topk,sparse_mla",
          "--out", str(tmp_path)], tmp_path)
    text = (tmp_path / "tpu_compile_report.md").read_text()
    assert "FAILED" not in text and "Not reported" not in text


@pytest.mark.slow
def test_witness_experiment_quick(tmp_path):
    # the script end to end on its tiny grid (tests/test_witness_experiment.py's: both sources,
    # every selection, table, JSON and both plots); --quick's L=2048 grid is the notebook's
    _run(["-m", "scripts.experiments.witness_experiment", "--tiny", "--no-docs",
          "--out", str(tmp_path)], tmp_path)
    assert (tmp_path / "witness.json").exists()
    for name in ("witness.md", "witness_synthetic.png", "witness_indexer.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_bench_witness_merge_quick(tmp_path):
    stdout = _run(["-m", "scripts.bench.bench_witness_merge", "--quick"], tmp_path)
    assert "ratio (median merge / median copy)" in stdout
    assert "ratio (median lowest-fill merge / median copy)" in stdout


def test_hbm_traffic_quick(tmp_path):
    # the script end to end with its own counter on one quick case (the compressor's: the
    # cheapest to count); every quick case's counts equal the model in tests/test_hbm_traffic.py,
    # which also runs the script's main on all of them (with its fixtures' counts)
    _run(["-m", "scripts.cost.hbm_traffic", "--quick", "--kernels", "v4_compressor",
          "--out", str(tmp_path)], tmp_path)
    assert any(tmp_path.iterdir())


@pytest.mark.slow
def test_v4_cost_quick(tmp_path):
    out = tmp_path / "v4_cost.md"
    stdout = _run(["-m", "scripts.cost.v4_cost", "--quick", "--markdown", str(out)], tmp_path)
    text = out.read_text()
    assert text in stdout.replace("\r", "") or text.strip() in stdout
    assert "fp8 MODEL1" in text and "two-pass" in text and "Flash CSA" in text
