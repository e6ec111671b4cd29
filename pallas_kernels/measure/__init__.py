"""The measurement library: what the cost reports, the compile gates and the traffic tests use
to measure a kernel or a whole op without a TPU (XLA's TPU cost split of AOT compiles, the
Pallas interpreter's HBM byte / DMA counter, AOT compile helpers).

Modules: ``xla_cost`` (XLA's cost model of a compiled program, kernels vs glue, and the verdicts
on its gathers / scatters), ``hlo`` (the optimized-HLO text parsing it reads),
``interpret_counter`` (HBM bytes and DMAs counted while a kernel runs in interpret mode;
imported by nothing in the package, which must import on any jax). The AOT compile helpers
stay at ``pallas_kernels.aot`` (every family's compile cases and ``pallas_kernels.tpu`` use
them). The old paths ``pallas_kernels.xla_cost`` and ``pallas_kernels._interpret_counter`` are
shims."""
