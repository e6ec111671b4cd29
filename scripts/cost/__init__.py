"""Cost reports: XLA's whole-op cost model, AOT compiles for every chip, interpreter byte
counts, the context-parallel model (``scripts/README.md``)."""
