"""The DeepSeek-V4 compressor on TPU (Pallas): ``compress_step`` takes
``reference.v4_compressor.compress_step``'s arguments (plus ``interpret=`` and
``vmem_limit_bytes=``; ``rope_rows=``: the RoPE tables in the kernel's row layout, built once by
``rope_rows(cos, sin)``) and returns its ``(CompressedEntries, CompressorState)``: a pool kernel
over the completing entries and an in-place state kernel (``kernel``), their traffic model
(``traffic``) and AOT compile cases (``compile_cases``)."""

from pallas_kernels.v4_compressor.finish import rope_rows
from pallas_kernels.v4_compressor.kernel import compress_step

__all__ = ["compress_step", "rope_rows"]
