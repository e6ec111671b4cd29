"""The measurement library that needs ``dsa_jax`` (its step programs): the whole-op cost
report's programs and runner (``whole_op``). What needs only ``reference`` and
``pallas_kernels`` lives in ``pallas_kernels.measure``; the reports' command lines are under
``scripts/`` (``scripts/README.md``)."""
