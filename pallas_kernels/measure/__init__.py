"""The measurement library: what the cost reports, the compile gates and the traffic tests use
to measure a kernel or a whole op without a TPU (XLA's TPU cost split of AOT compiles, the
Pallas interpreter's HBM byte / DMA counter, AOT compile helpers)."""
