"""``python -m dsa_jax tpu-bench`` / ``scripts.bench.tpu_bench`` (``dsa_jax.measure.tpu_bench``)
off a TPU: it refuses without ``--allow-cpu`` (exit 2, saying why); with it, the same code runs
a few rows at tiny shapes (kernels interpreted) and writes the table; every row it would time
on a TPU is listed, and each kernel row's inputs are a valid decode batch of exactly its
compile case's argument shapes. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsa_jax import __main__ as cli
from dsa_jax.measure import tpu_bench
from pallas_kernels import chips

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_off_a_tpu_it_times_nothing_and_exits_2(capsys):
    assert jax.default_backend() != "tpu"
    assert cli.main(["tpu-bench"]) == 2
    want = tpu_bench.NEEDS_TPU.format(backend=jax.default_backend())
    assert want in capsys.readouterr().err
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "scripts.bench.tpu_bench"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs a TPU: found cpu; nothing timed" in p.stderr, p.stderr


def test_allow_cpu_writes_the_table(tmp_path):
    only = ["selection", "streamindex_topk", "v4_compressor"]
    assert tpu_bench.main(["--allow-cpu", "--quick", "--iters", "2", "--warmup", "0",
                           "--only", ",".join(only), "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "tpu_bench.json").read_text())
    assert got["backend"] == "cpu" and got["quick"] and got["chip"] is None
    rows = got["rows"]
    sel = [r for r in rows if r["group"] == "selection"]
    assert [r["name"] for r in rows if r["group"] == "kernel"] == only[1:]
    assert {r["name"] for r in sel} == {"lax.top_k", "reference.select_topk",
                                        f"lax.approx_max_k(recall_target="
                                        f"{tpu_bench.APPROX_RECALL})"}
    assert len(sel) == 3 * 2  # the quick columns
    for r in rows:
        assert r["iters"] == 2 and 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"], r
    for r in sel:  # the model bytes of a selection: its f32 scores read once
        rows_, cols = map(int, r["shape"].split("[")[1].split("]")[0].split(","))
        assert r["model_bytes"] == 4 * rows_ * cols
        assert r["model_gb_per_s"] == pytest.approx(r["model_bytes"] / r["median_us"] / 1e3)
    md = (tmp_path / "tpu_bench.md").read_text().splitlines()
    assert "NOT a TPU" in md[0]
    assert sum(ln.startswith("| ") for ln in md) == 1 + len(rows)  # header + one line a row


def test_every_row_is_listed():
    quick = tpu_bench.cases(None, quick=True)
    names = [c.name for c in quick if c.group == "kernel"]
    assert names == ["streamindex_topk", "streamindex_page_topk", "sparse_mla",
                     "page_sparse_mla"] + ["v4_attention_fused_packed"] * 2 + [
                         "v4_attention_fused_fp8"] * 2 + ["v4_compressor"]
    assert [c.name for c in quick if c.group == "step"] == ["dsa_jax.dsa_step",
                                                           "dsa_jax.v4_step"]
    gate = tpu_bench.gate_cases(chips.NAMES[0])
    assert [(c.name, c.shape) for c in gate] == [
        (name, shape) for name, shape in [
            ("streamindex_topk", "decode 64x4096"), ("streamindex_page_topk", "decode 64x4096"),
            ("sparse_mla", "decode64x8192_h128_k2048_packed"),
            ("page_sparse_mla", "decode64x8192_h128_p32x64_bf16")]
        + [(f"v4_attention_fused{f}", s) for f in ("", "_fp8")
           for s in ("flash_csa_decode64x8192_h64_k512", "flash_hca_decode64x8192_h64")]
        + [("v4_compressor", s) for s in ("csa_d512_decode64", "hca_d512_decode64",
                                          "index_d128_decode64")]]
    assert all(c.model_bytes > 0 for c in gate)
    shapes = {c.shape for c in tpu_bench.selection_cases()}
    assert shapes == {f"f32[64,{n}] k=512" for n in (2048, 8192, 131072)}


def test_gate_inputs_are_decode_batches_of_the_compile_shapes(monkeypatch):
    """Each gate row's arguments have its compile case's shapes and dtypes; page tables are
    distinct pages of the cache; selected entries are distinct and inside the context."""
    monkeypatch.setattr(tpu_bench, "_rand",  # no gigabytes of random numbers: shapes only
                        lambda rng, s, scale=1.0: np.broadcast_to(np.zeros((), s.dtype), s.shape))
    from pallas_kernels.indexer import compile_cases as icases
    from pallas_kernels.mla import compile_cases as mcases
    from pallas_kernels.v4_attention import compile_cases as vcases
    from pallas_kernels.v4_compressor import compile_cases as ccases

    specs = {}
    for cs in (icases.token_cases(True), icases.page_cases(True), mcases.compile_cases(),
               vcases.compile_cases(True, "packed"), vcases.compile_cases(True, "fp8"),
               ccases.compile_cases()):
        specs.update({(c.kernel, c.shape): c.specs for c in cs})
    for case in tpu_bench.gate_cases(chips.NAMES[-1]):
        fn, args = case.build()
        assert callable(fn)
        want = jax.tree.map(lambda s: (s.shape, np.dtype(s.dtype)), specs[case.name, case.shape])
        have = jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), list(args))
        assert have == want, case
        ints = [a for a in jax.tree.leaves(args) if a.dtype == np.int32 and a.ndim >= 1]
        for a in ints:
            assert a.min() >= 0, case
        for a in (a for a in ints if a.ndim == 2):  # selected entries: distinct per row
            assert all(len(set(r)) == len(r) for r in a[:4].tolist()), case


def test_the_steps_build():
    for case in tpu_bench.step_cases(decode=2):
        fn, args = case.build()
        assert callable(fn) and jax.tree.leaves(args)
