"""Numeric rules: the fp8 e4m3 scale rules (``fp8``), DeepSeek-V4's QAT simulations (``qat``) and
the precision regimes' names and bf16 rounding (``bf16``). Imports only ``reference.core``."""
