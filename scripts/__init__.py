"""The repository's scripts, run as modules from the repository root
(``python -m scripts.cost.v4_step_cost --quick``; ``scripts/README.md`` lists them). Not
installed with the package: reusable measurement code lives in ``pallas_kernels.measure`` and
``dsa_jax.measure``."""
