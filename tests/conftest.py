"""Test environment: CPU only (libtpu is installed for AOT compiles, not for running), 8 host
devices for the sharding tests. Set before jax is imported anywhere."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# pytest-xdist workers each load libtpu for the AOT compile gates.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()


