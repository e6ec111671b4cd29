"""The context-sharded step under ``jax.distributed`` with 2 processes on this machine
(``scripts/bench/multiprocess_step.py``): the same result as the single-device step, in bounded
time,
with no process left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_processes_run_the_context_sharded_step_and_match_one_device():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # workers set their own
    out = subprocess.run([sys.executable, "-m", "scripts.bench.multiprocess_step",
                          "--timeout", "240"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for i in range(2):
        assert (f"[process {i}] 2 processes, 8 devices, mesh {{'ctx': 2, 'data': 2, 'model': 2}}"
                f": top-k identical") in text, text[-4000:]
    assert "all processes agree with the single-device step" in text
    assert _workers() == [], "worker processes left behind"


def _workers() -> list[str]:
    """Command lines of running ``multiprocess_step.py --worker`` processes (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"scripts.bench.multiprocess_step" in args and b"--worker" in args:
            found.append(b" ".join(args).decode(errors="replace"))
    return found
