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
    # a verdict a newcomer can read, then the times measured
    assert "\nverdict: reference only - the V3.2 DSA step ran on the jnp reference, no NaN " \
           "(add --dsa-use-pallas to compare the Pallas kernels)\ntimings: reference " in out.stdout


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
    assert ("verdict: OK - the V3.2 DSA step ran on the reference and Pallas agrees with it "
            "(top-k sets identical on all 10 rows; output max |diff| ") in text
    assert "within atol = rtol = 2e-05)\ntimings: reference " in text
    assert "; pallas " in text and "(one call incl. compile; interpret mode" in text


def test_devices_runs_sharded_and_matches_single_device(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # run() appends to it
    assert main([*TINY, "--devices", "4", "--tp", "2"]) == 0  # conftest: 8 CPU devices
    text = capsys.readouterr().out
    assert "mesh: data=2 x model=2 (4 devices)" in text
    assert "sharded vs single-device (data shard 0): max |diff| 0.00e+00" in text
    assert ("\nverdict: reference only - the V3.2 DSA step (sharded over 4 devices; data shard 0 "
            "within tolerance of one device) ran on the jnp reference") in text


def test_v4_flash_quick_runs_the_v4_step(capsys):
    """``run --model v4-flash --quick`` (shrunk further): the V4 step on every layer type."""
    assert main(["run", "--model", "v4-flash", "--quick", "--no-progress", "--context", "256",
                 "--prefill", "8", "--decode", "1", "--topk", "16"]) == 0
    text = capsys.readouterr().out
    assert "4 layers ['SWA', 'SWA', 'CSA', 'HCA']" in text
    assert "reference: first step" in text and "NaN in out: False" in text
    assert "\nverdict: reference only - the V4-Flash step ran on the jnp reference" in text
    assert "\ntimings: reference " in text and " ms steady" in text


def test_v41_flash_quick_runs_the_v41_step_against_its_statement(capsys):
    """``run --model v4.1-flash --quick``: the V4.1 step on every mode of the tiny config, each
    sequence's rows against the statement run alone."""
    assert main(["run", "--model", "v4.1-flash", "--quick", "--no-progress", "--decode",
                 "1"]) == 0
    text = capsys.readouterr().out
    assert ("9 layers ['swa/0', 'full/2', 'reuse/2', 'full/1', 'reuse/1', 'reindex/1', "
            "'reuse/1', 'reuse/1', 'swa/0']") in text
    assert "NaN in out: False" in text
    assert "top-k sets differ on 0 (sequence, layer) pairs" in text
    assert "\nverdict: reference only - the V4.1 step ran on the jnp reference" in text


def test_v41_statement_check_fails_a_step_that_disagrees():
    """``v41_cli._statement_check`` on a made-up step result (outputs off by far): not ok."""
    import numpy as np

    from dsa_jax import v41_cli
    from dsa_jax.v41_step import V41StepLayout
    from reference.statements import deepseek_v41 as s41

    c = v41_cli.config(True)
    layout = V41StepLayout(c, 4, 8)
    params = s41.init_params(c, seed=0)
    x = np.random.default_rng(0).standard_normal((len(c.compress_ratios), 8, c.dim),
                                                 dtype=np.float32)
    want = s41.attention_stack(params, x[:, None], 0, s41.init_state(c, 1, 8), c,
                               return_selection=True)
    good = np.asarray(want[0][:, 0, 6:8], np.float32)
    topk = np.stack([np.asarray(want[2].topk[i][0, 6:8]) for i in layout.index_layers])

    def check(out):
        res = type("R", (), {"out": out, "topk": topk})
        return v41_cli._statement_check(params, [x], res, [2], [8], c, layout)

    assert check(good)[1]
    line, ok = check(good * 1.5)
    assert not ok and "outputs max" in line


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


def _exit_status(argv):
    """``main(argv)``'s exit status, in-process: argparse exits, the run returns."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


# Bad flags are refused before anything runs (argparse: the usage line, one message naming the
# flag and the value, exit 2); a combination only the layout can judge is its ValueError in one
# line, exit 2. None of these runs a step.
BAD_FLAGS = [
    (["--topk", "0"], "argument --topk: must be an integer >= 1, got 0"),
    (["--layers", "0"], "argument --layers: must be an integer >= 1, got 0"),
    (["--context", "-5"], "argument --context: must be an integer >= 1, got -5"),
    (["--context", "0"], "argument --context: must be an integer >= 1, got 0"),
    (["--prefill", "0"], "argument --prefill: must be an integer >= 1, got 0"),
    (["--heads", "-2"], "argument --heads: must be an integer >= 1, got -2"),
    (["--page-size", "0"], "argument --page-size: must be an integer >= 1, got 0"),
    (["--devices", "0"], "argument --devices: must be an integer >= 1, got 0"),
    (["--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
    (["--decode", "-1"], "argument --decode: must be an integer >= 0, got -1"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["--num-segments", "65"], "argument --num-segments: must be an integer in [0, 64], got 65"),
    (["--num-segments", "-1"], "argument --num-segments: must be an integer in [0, 64], got -1"),
    (["--topk", "many"], "argument --topk: must be an integer >= 1, got 'many'"),
    (["--devices", "3", "--tp", "2"], "--devices 3 must be a multiple of --tp 2"),
    (["--devices", "2", "--tp", "2", "--heads", "3"], "--heads 3 must be divisible by --tp 2"),
    (["--context", "16"], "--prefill 32 (the --quick default) is longer than --context 16"),
    (["--context", "2", "--prefill", "1"], "--context 2 is shorter than the MTP sequence's"),
    (["--model", "v4-flash", "--layers", "44"], "--layers 44: V4-Flash has 43 attention layers"),
    (["--model", "v4-flash", "--topk", "0"], "argument --topk: must be an integer >= 1, got 0"),
    (["--model", "v4-flash", "--cache-format", "fp8"], "--cache-format applies to --model v3.2"),
    (["--model", "v4-flash", "--devices", "2"], "--devices applies to --model v3.2 only"),
    (["--model", "v4.1-flash", "--heads", "4"], "--heads does not apply to --model v4.1-flash"),
    (["--model", "v4.1-flash", "--cache-format", "fp8"],
     "--cache-format does not apply to --model v4.1-flash"),
    # refused by the layout (a ValueError): one line, no traceback
    (["--cache-format", "fp8", "--page-size", "16"],
     "dsa_jax: error: the fp8 index cache needs page_size to be a multiple of 32"),
    (["--model", "v4-flash", "--page-size", "3"],
     "dsa_jax: error: window_page_size=3 does not divide window_size=128"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_are_one_error_line_with_exit_status_2(flags, message, capsys):
    assert _exit_status(["run", "--quick", "--no-progress", *flags]) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    assert "Traceback" not in err + out
    if message.startswith("dsa_jax: error:"):
        assert err.count("\n") == 1, err
    else:
        assert err.startswith("usage: python -m dsa_jax run"), err
        assert "python -m dsa_jax run: error: " in err
    assert "verdict" not in out  # nothing ran


def test_help_is_plain_text_and_names_both_models(capsys):
    for argv in (["--help"], ["run", "--help"]):
        assert _exit_status(argv) == 0
        text = capsys.readouterr().out
        assert "`" not in text and "**" not in text, text
        assert "V4" in text, text
    assert "--model v4-flash" in text and "examples:" in text and "exit status:" in text
    # --quick says what it means for each model, from the sizes the runs use
    text = " ".join(text.split())
    assert "v3.2: context 512, prefill 32, 4 MLA heads, top-k 128, 2 layers, page 16" in text
    assert ("v4-flash: context 512, prefill 32, 2 heads, 8 indexer heads, top-k 64, 4 layers "
            "(SWA, SWA, CSA, HCA), page 16") in text


def test_the_verdict_fails_with_exit_status_1_when_pallas_disagrees():
    """``cli_common.compare`` / ``verdict`` on made-up results (no step run): other top-k sets
    on a row, or an output off beyond the tolerance, is a FAILED verdict and exit status 1."""
    import numpy as np

    from dsa_jax.cli_common import Timing, compare, verdict

    rng = np.random.default_rng(0)
    out = rng.standard_normal((2, 5, 3, 8))
    topk = np.tile(np.arange(4), (1, 5, 1))
    timings = {"reference": Timing(1.0, 0.01, False), "pallas": Timing(9.0, None, True)}
    nan = {"reference": False, "pallas": False}
    same = compare(out, out + 1e-7, topk, topk.copy(), "v3.2")
    lines, status = verdict("the step", nan, timings, same)
    assert status == 0 and lines[0].startswith("verdict: OK - the step ran"), lines
    assert lines[1] == ("timings: reference 1.00 s first call (incl. compile), 10.0 ms steady; "
                        "pallas 9.00 s (one call incl. compile; interpret mode, not a TPU "
                        "timing)")
    other = topk.copy()
    other[0, 2, 0] = 7
    off = out.copy()
    off[1, 4] += 1e-3
    lines, status = verdict("the step", nan, timings, compare(out, off, topk, other, "v3.2"))
    assert status == 1
    assert lines[0].startswith("verdict: FAILED - Pallas picks other top-k sets than the "
                               "reference on 1 of 5 rows (top-k overlap min 0.7500); Pallas "
                               "output off the reference beyond the tolerance"), lines
    lines, status = verdict("the step", {"reference": True}, timings, None)
    assert status == 1 and lines[0] == "verdict: FAILED - NaN in the reference output"
