"""Numeric rules: the fp8 e4m3 scale rules (``fp8``) and DeepSeek-V4's QAT simulations
(``qat``). Imports only ``reference.core``."""
