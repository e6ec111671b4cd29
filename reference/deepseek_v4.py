"""Moved to reference/statements/deepseek_v4.py (the dense layer statement) and
reference/quant/qat.py (its QAT simulations); kept so old imports work."""

from __future__ import annotations

from reference.quant.qat import (
    FP4_AMAX_FLOOR,
    FP4_MAX,
    FP8_AMAX_FLOOR,
    FP8_MAX,
    QAT_FP4_BLOCK,
    QAT_FP8_BLOCK,
    _hadamard_matrix,  # noqa: F401
    act_quant_sim,
    fp4_act_quant_sim,
    hadamard_rotate,
)
from reference.statements.deepseek_v4 import (  # noqa: F401
    FLASH_COMPRESS_RATIOS,
    LAYER_TYPES,
    PRO_COMPRESS_RATIOS,
    IndexSelection,
    V4AttentionConfig,
    V4LayerState,
    _nope_fp8,
    _rope,
    attention_layer,
    check_params,
    config_from_model_args,
    flash_config,
    init_params,
    init_state,
    init_state_shapes,
    param_shapes,
    pro_config,
    tiny_config,
)

__all__ = [
    "FLASH_COMPRESS_RATIOS",
    "FP4_AMAX_FLOOR",
    "FP4_MAX",
    "FP8_AMAX_FLOOR",
    "FP8_MAX",
    "IndexSelection",
    "LAYER_TYPES",
    "PRO_COMPRESS_RATIOS",
    "QAT_FP4_BLOCK",
    "QAT_FP8_BLOCK",
    "V4AttentionConfig",
    "V4LayerState",
    "act_quant_sim",
    "attention_layer",
    "check_params",
    "config_from_model_args",
    "flash_config",
    "fp4_act_quant_sim",
    "hadamard_rotate",
    "init_params",
    "init_state",
    "init_state_shapes",
    "param_shapes",
    "pro_config",
    "tiny_config",
]
