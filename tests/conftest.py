"""Test environment: CPU only (libtpu is installed for AOT compiles, not for running), 8 host
devices for the sharding tests. Set before jax is imported anywhere."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# pytest-xdist workers each load libtpu for the AOT compile gates.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()



def pytest_collection_modifyitems(config, items):
    """Run the long tests (marked ``slow``) first, in their collected order: under pytest-xdist
    they then overlap the many short tests instead of finishing alone at the end (the suite's
    last minutes ran on one core when they came last). A stable sort, so every worker collects
    the same order. The longest (the strict interpreter's lockstep runs) run in a process of
    their own (``tests/isolated.py``): the worker that starts them stays clean (one worker
    segfaulted in XLA CPU's compile after running them in-process, main 4716d7b)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
