"""DeepSeek-V4.1's released attention code (``inference/model.py``, unmodified, from a directory
given at run time) on CPU torch stand-ins for its GPU kernels, against this package's V4.1
statement (``reference.statements.deepseek_v41``): ``kernels_cpu`` (the stand-ins), ``run`` (the
table)."""
