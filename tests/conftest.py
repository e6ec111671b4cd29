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
    """The long tests (``@pytest.mark.slow``) first, the rest in collection order (a stable
    sort, the same on every pytest-xdist worker). With the README's ``--dist worksteal`` the
    workers split the queue and an idle one steals from the other's tail, so a long test that
    started first ends while the short ones are shared; started last it would be the suite's
    tail (issue 26: the lock-step run alone is ~8 min on 2 cores)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
