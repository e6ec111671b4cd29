"""Old path of ``pallas_kernels.measure.xla_cost`` (the cost report and verdicts) and
``pallas_kernels.measure.hlo`` (the HLO text parsing), which this module was before the split:
every name anything imported from here, re-exported. New code imports
``pallas_kernels.measure``."""

from __future__ import annotations

from pallas_kernels.measure.hlo import (  # noqa: F401
    LARGE_RESULT_BYTES,
    IndexedOp,
    KernelCall,
    LargeResult,
    Loop,
    _Instr,
    _instructions,
    _source_table,
    dims,
    has_while,
    parse_indexed_ops,
    parse_instructions,
    parse_kernel_calls,
    parse_large_results,
    parse_loops,
    shape_bytes,
    strip_layout,
)
from pallas_kernels.measure.xla_cost import (  # noqa: F401
    HOT_PATH_ALLOWED,
    NEGLIGIBLE_LOOP_STATE_BYTES,
    ROW_SLICE_ELEMS,
    Allowed,
    Verdict,
    XlaCost,
    analyze,
    classify,
    compile_program,
    cost_dict,
    is_per_element,
)
