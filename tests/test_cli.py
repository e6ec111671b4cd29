"""``python -m dsa_jax run``: the README's main-job command works; every flag is explained."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_jax.__main__ import _parser, main
from pallas_kernels import chips

ROOT = Path(__file__).resolve().parents[1]
TINY = ["run", "--quick", "--no-progress", "--context", "64", "--prefill", "4", "--topk", "16",
        "--decode", "1"]


def test_the_readme_command_runs_in_a_fresh_process_without_tpu_probe_noise():
    # As a new user runs it: no JAX_PLATFORMS (the tests set it), libtpu installed, no TPU.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-m", "dsa_jax", "run", "--quick", "--no-progress"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    for noise in ("host bounds", "TPU_WORKER_HOSTNAMES", "E0000"):
        assert noise not in out.stderr, out.stderr[-3000:]
    assert "reference: first step" in out.stdout
    assert "witness coverage (8 segments, fill tail): mean 1.000" in out.stdout
    assert "NaN in out: False" in out.stdout


def test_aot_topology_load_is_quiet_and_still_compiles():
    """Loading libtpu for an AOT topology (every compile script) prints libtpu's TPU-host probe
    on a machine without a TPU unless ``aot`` holds it back."""
    code = ("import jax, jax.numpy as jnp\n"
            "from pallas_kernels import aot\n"
            "aot.aot_compile(lambda x: x * 2, [jax.ShapeDtypeStruct((8, 128), jnp.float32)],"
            f" {chips.DEFAULT!r}, 'double')\n"
            "print('compiled')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
    for noise in ("host bounds", "TPU_WORKER_HOSTNAMES", "E0000"):
        assert noise not in out.stderr, out.stderr[-3000:]


def test_every_flag_is_explained_in_help():
    run = next(a for a in _parser()._actions if a.dest == "cmd").choices["run"]
    for action in run._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    text = run.format_help()
    for flag in ("--quick", "--dsa-use-pallas", "--devices", "--tp", "--num-segments",
                 "--layers", "--page-size"):
        assert flag in text


def test_pallas_agrees_with_the_reference_and_is_reported(capsys):
    assert main([*TINY, "--dsa-use-pallas"]) == 0
    text = capsys.readouterr().out
    assert "pallas: one step" in text and "interpret mode" in text
    assert "agreement pallas vs reference: top-k overlap mean 1.0000" in text


def test_devices_runs_sharded_and_matches_single_device(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # run() appends to it
    assert main([*TINY, "--devices", "4", "--tp", "2"]) == 0  # conftest: 8 CPU devices
    text = capsys.readouterr().out
    assert "mesh: data=2 x model=2 (4 devices)" in text
    assert "sharded vs single-device (data shard 0): max |diff| 0.00e+00" in text


def test_v4_flash_quick_runs_the_v4_step(capsys):
    """``run --model v4-flash --quick`` (shrunk further): the V4 step on every layer type."""
    assert main(["run", "--model", "v4-flash", "--quick", "--no-progress", "--context", "256",
                 "--prefill", "8", "--decode", "1", "--topk", "16"]) == 0
    text = capsys.readouterr().out
    assert "4 layers ['SWA', 'SWA', 'CSA', 'HCA']" in text
    assert "reference: one step" in text and "NaN in out: False" in text


def test_v4_build_makes_fp8_caches():
    """``v4_cli.build(..., window_format=, compressed_format=, index_format=)``: fp8 caches of
    the layout's formats (concrete: the quantized history; ``spec=True``: their parts' specs);
    the reference step runs on the concrete ones. The defaults stay f32 arrays."""
    from argparse import Namespace

    import numpy as np

    from dsa_jax import v4_cli
    from dsa_jax.v4_step import v4_step
    from reference import fp8_cache, v4_cache

    s = v4_cli.sizes(Namespace(quick=True, context=256, prefill=8, heads=2, topk=16, layers=4,
                               page_size=32))
    fmts = dict(window_format="fp8", compressed_format="fp8", index_format="fp8")
    for spec in (True, False):
        layout, inputs, params, caches, states, meta = v4_cli.build(
            np.random.default_rng(0), s, [1, 8], [100, 8], spec=spec, **fmts)
        assert (layout.window_cache_format, layout.compressed_cache_format) == ("fp8", "fp8")
        for f in caches._fields:
            want = fp8_cache.Fp8IndexCache if f == "csa_index" else v4_cache.Fp8V4Cache
            assert isinstance(getattr(caches, f), want), f
    with pytest.raises(ValueError, match=r"precision='bf16'.*caches\.csa_index, an "
                                         r"Fp8IndexCache.*precision='f32'"):
        v4_step(inputs, params, caches, states, meta, layout=layout)  # the default regime
    out = v4_step(inputs, params, caches, states, meta, layout=layout, backend="reference",
                  precision="f32").out  # an fp8 index cache: the f32 regime
    assert not np.isnan(np.asarray(out)).any()
    plain = v4_cli.build(np.random.default_rng(0), s, [1, 8], [100, 8])[3]
    assert all(isinstance(x, np.ndarray) for x in plain)
