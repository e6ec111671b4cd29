"""Segment witnesses: the serving policy (``reference.witnesses.policy``) and the experiment side,
baseline selectors, nulls and coverage / recall statistics (``reference.witnesses.nulls``).

The package is the old ``reference/witnesses.py`` split in two; it re-exports every name that
module had, so old imports work."""

from __future__ import annotations

from reference.witnesses.nulls import (
    attention_mass_recall,
    local_selector,
    locality_null,
    random_null,
    random_selector,
    segment_coverage,
)
from reference.witnesses.policy import (
    MAX_TOPOLOGY_SEGMENTS,
    WITNESS_FILLS,
    LearnedKeepOutOfRange,
    RowsMismatch,
    SegmentsOutOfRange,
    WitnessError,
    apply_topology_witnesses,
    check_witness_policy,
    merge_topology_witnesses,
    scatter_topology_witnesses,
    segment_of,
    topology_witness_indices,
)

__all__ = [
    "LearnedKeepOutOfRange",
    "MAX_TOPOLOGY_SEGMENTS",
    "RowsMismatch",
    "SegmentsOutOfRange",
    "WITNESS_FILLS",
    "WitnessError",
    "apply_topology_witnesses",
    "attention_mass_recall",
    "check_witness_policy",
    "local_selector",
    "locality_null",
    "merge_topology_witnesses",
    "random_null",
    "random_selector",
    "scatter_topology_witnesses",
    "segment_coverage",
    "segment_of",
    "topology_witness_indices",
]
