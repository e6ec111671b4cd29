"""Moved to reference/mla/args.py; kept so old imports work."""

from __future__ import annotations

from reference.mla.args import (
    FP8_Q_DIMS,
    check_mla_args,
)

__all__ = [
    "FP8_Q_DIMS",
    "check_mla_args",
]
