"""DeepSeek-V4's released attention layer (``inference/model.py``, unmodified, from a directory
given at run time) on CPU torch stand-ins for its GPU kernels, against this package's bf16
statement and step (issue 27's evidence): ``kernels_cpu`` (the stand-ins), ``run`` (the table)."""
