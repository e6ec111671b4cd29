"""Test environment: CPU only (libtpu is installed for AOT compiles, not for running), 8 host
devices for the sharding tests, XLA:CPU's quick compiles. Set before jax is imported anywhere."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# pytest-xdist workers each load libtpu for the AOT compile gates.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# 8 host devices; XLA:CPU's LLVM backend without its expensive optimisation passes (the suite
# compiles thousands of small programs and runs each a few times: measured 16-30% less CPU
# per test file). These two flags reach only the LLVM backends: the AOT-compiled TPU programs
# of the kernel gates are byte-identical with and without them (BENCHMARKS.md, issue 26), and
# the CPU numerics stay IEEE (no fast-math either way).
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
              "--xla_llvm_disable_expensive_passes=true"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()


