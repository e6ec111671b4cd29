"""The DeepSeek-V4.1 compressors on TPU (Pallas): ``compress_step`` takes
``reference.v41.compress_step``'s arguments (plus ``interpret=`` and ``vmem_limit_bytes=``) and
returns its ``(CompressedEntries, CompressorState | None)``: ratio 2 on the V4 pool and state
kernels (``pallas_kernels.v4_compressor``) at pooling ratio 2 (``kernel``), ratio 1 row-wise
(nothing to pool or carry); the traffic model (``traffic``) and the AOT compile cases
(``compile_cases``)."""

from pallas_kernels.v41_compressor.kernel import compress_step

__all__ = ["compress_step"]
