"""Layout probes: what the TPU compiler accepts for the cache layouts (AOT via libtpu)."""
