"""DeepSeek-V4.1 (issue 31), reference side: the per-layer resolution map (``config``: modes, KV
and index sources, candidate use, validated) and the cache quantizers as stored formats
(``formats``: window fp8 / ue8m0-32, compressed fp4 / e4m3-16, index fp4 / ue8m0-32), per-row
candidate selection (``candidates``) and the ratio-1 / ratio-2 compressors (``compressor``).
Imports only ``reference.core``, ``reference.quant``, ``reference.formats``,
``reference.indexer`` and ``reference.v4_compressor``; ``docs/v41.md`` states them."""

from reference.v41.config import (
    CandidateUse,
    LayerPlan,
    Mode,
    V41Config,
    resolve_layers,
    v41_flash,
    v41_tiny,
)
from reference.v41.formats import (
    COMPRESSED_BLOCK,
    E2M1_GRID,
    INDEX_BLOCK,
    WINDOW_BLOCK,
    compressed_kv_bytes,
    decode_compressed_kv,
    decode_index_fp4,
    decode_window_kv,
    encode_compressed_kv,
    encode_index_fp4,
    encode_window_kv,
    index_fp4_bytes,
    window_kv_bytes,
)

__all__ = [
    "COMPRESSED_BLOCK",
    "E2M1_GRID",
    "INDEX_BLOCK",
    "WINDOW_BLOCK",
    "CandidateUse",
    "LayerPlan",
    "Mode",
    "V41Config",
    "compressed_kv_bytes",
    "decode_compressed_kv",
    "decode_index_fp4",
    "decode_window_kv",
    "encode_compressed_kv",
    "encode_index_fp4",
    "encode_window_kv",
    "index_fp4_bytes",
    "resolve_layers",
    "v41_flash",
    "v41_tiny",
    "window_kv_bytes",
]

# per-row candidate selection (issue 31, Deliver 4; docs/v41.md "Candidate selection")
from reference.v41.candidates import (  # noqa: E402
    candidate_blocks,
    candidate_mask,
    candidate_pages,
    restricted_topk,
    sort_key,
)

__all__ += [
    "candidate_blocks",
    "candidate_mask",
    "candidate_pages",
    "restricted_topk",
    "sort_key",
]

# The ratio-1 / ratio-2 compressors (reference.v41.compressor).
from reference.v41.compressor import (  # noqa: E402
    COMPRESSED_RATIOS,
    OUTPUTS,
    compress_step,
    compressed_rope_tables,
    init_compressor_state,
    max_entries,
    visible_entries,
    write_compressed_entries,
)

__all__ += [
    "COMPRESSED_RATIOS",
    "OUTPUTS",
    "compress_step",
    "compressed_rope_tables",
    "init_compressor_state",
    "max_entries",
    "visible_entries",
    "write_compressed_entries",
]
