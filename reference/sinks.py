"""Moved to reference/mla/sinks.py; kept so old imports work."""

from __future__ import annotations

from reference.mla.sinks import (
    apply_sink,
    check_sink,
    merge_states,
    sink_factor,
)

__all__ = [
    "apply_sink",
    "check_sink",
    "merge_states",
    "sink_factor",
]
