"""Benchmarks and runs on the local devices: kernel timings against the seed baseline, the
witness merge, the two-process context-sharded step."""
