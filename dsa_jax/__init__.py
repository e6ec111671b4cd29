"""dsa-jax public API: one layout declaration, four ops behind one backend flag, the cache
writer, the multi-layer DSA step (IndexShare), opt-in checkify validation, mesh sharding.

- ``PagedLayout`` / ``aligned_page_size`` / ``LayoutError``: the paged layout, declared once.
- ``Batch`` (``dsa_jax.batch``): the ragged paged batch as one pytree, built once per engine
  step (``Batch.from_packed`` / ``Batch.from_fixed_stride``) and passed to every op and the
  V3.2 step as ``batch=`` / ``meta`` in place of the metadata arrays.
- ``indexer_topk``, ``page_topk`` (``dsa_jax.indexer``), ``sparse_mla``, ``page_sparse_mla``
  (``dsa_jax.mla``): the references' arguments (or ``batch=``) plus ``implementation=``
  (``"xla"``, ``"pallas"``, an ordered list, ``None``; ``backend=`` the older spelling; env
  ``DSA_USE_PALLAS``; ``dsa_jax.backend``), a typed ``config=`` and the common ``validate`` /
  ``kernel_options`` / ``layer`` / ``layout`` (``dsa_jax.dispatch``). Empty batches
  (``T = 0`` rows, ``S = 0`` sequences) are served (``dsa_jax.dispatch.empty_batch``).
- ``update_kv_cache``: write this step's rows into the paged caches (jitted, donated).
- ``dsa_step``: cache update, top-k on full layers, sparse MLA on every layer.
- ``check_batch`` / ``run_checked``: the runtime rules behind ``validate=True``.
- ``sharded_dsa_step``: the step on a ``jax.sharding.Mesh`` (data x model).
- ``IndexerBlocks`` / ``MlaBlocks``: typed, validated block configs of the two kernel families
  (``kernel_options={"blocks": ...}`` on an op; ``indexer_blocks=`` / ``mla_blocks=`` on a step).
- ``CacheFormat``: a paged cache's storage format (f32, bf16, packed bf16), from its dtype.
- ``pack_cache`` / ``unpack_cache`` / ``packed_words``: the packed bf16 latent cache the
  token-sparse kernel gathers single rows from (``reference.packed_cache``), and
  ``PerformanceWarning``, emitted when a call takes a documented slow path (a plain bf16 cache
  packed on every call).
- ``quantize_fp8`` / ``dequantize_fp8`` (the indexer's per-block rule) and
  ``quantize_latent_fp8`` / ``dequantize_latent_fp8`` (FlashMLA's latent-cache rule): the fp8
  quantizers of ``reference.fp8``, bit-exact with DeepSeek-V3.2's rules.
- fp8 caches (``reference.fp8_cache``; declare them with ``PagedLayout(index_cache_format="fp8",
  latent_cache_format="fp8")``, every op takes them where it takes a cache):
  ``Fp8IndexCache`` / ``Fp8LatentCache``, ``quantize_index_cache`` / ``dequantize_index_cache``,
  ``quantize_latent_cache`` / ``dequantize_latent_cache``, and the GPU byte layouts
  ``latent_cache_to_flashmla`` / ``latent_cache_from_flashmla`` (FlashMLA V32, 656 B per
  token) and ``index_cache_to_paged_fp8`` / ``index_cache_from_paged_fp8`` (vLLM / DeepGEMM).
- DeepSeek-V4 attention (``dsa_jax/v4_attention.py``; ``dsa_jax.v4_attention`` is the
  function, import the module's names with ``from dsa_jax.v4_attention import ...``):
  ``V4Layout`` (window + compressed caches, declared once), ``PagedKV`` (a cache with its page
  table), ``v4_attention`` (window union compressed entries, one softmax, attention sink;
  ``backend=`` as the other ops).
- The DeepSeek-V4 compressor (``dsa_jax.v4_compressor``): ``v4_compress_step``, one step of
  the gated pooling into compressed entries with the state ring carried across steps
  (``reference.v4_compressor.compress_step``'s arguments plus ``backend=`` and the Pallas
  knobs ``interpret=`` / ``vmem_limit_bytes=``; returns ``(CompressedEntries,
  CompressorState)``).
- The DeepSeek-V4 step (``dsa_jax/v4_step.py``; ``dsa_jax.v4_step`` is the function, import
  the module's names with ``from dsa_jax.v4_step import ...``): ``v4_step`` (window writes,
  compressors, CSA indexer top-k, ``v4_attention`` per layer over stacked caches read in
  place), its declarations in ``dsa_jax.v4_model`` (``V4ModelLayout``, the NamedTuples
  ``V4StepInputs``, ``V4StepParams``, ``V4Caches``, ``V4States``, ``V4BatchMeta``,
  ``V4StepResult``, and ``init_v4_states``), its argument checks (``dsa_jax.v4_step_checks``)
  and cache writes (``dsa_jax.v4_step_writes``), and ``sharded_v4_step`` (data x model mesh).
- The DeepSeek-V4.1 step (``dsa_jax/v41_step.py``; ``dsa_jax.v41_step`` is the function):
  ``v41_step`` (every layer of a ``V41Config`` over stacked caches in V4.1's fp8 / fp4 formats,
  read in place, KV / index / candidate sources threaded through the layers; the jnp path), its
  declarations in ``dsa_jax.v41_model`` (``V41StepLayout``, ``V41Caches``, ``V41Meta``,
  ``V41StepResult``, ``init_v41_caches``, ``init_v41_states``, ``v41_meta``).
- The DeepSeek-V4 layer around the step (``dsa_jax.v4_layer``): ``v4_project`` (one layer's
  step inputs from its tokens ``x [T, dim]`` at ``positions``), ``v4_output`` (the layer output
  from the step's ``out[l]``), ``v4_rope_tables`` (a layer type's RoPE tables); the dense
  statement's own pieces, ``precision="bf16"`` (the official regime, the default of the V4
  layer and step) or ``"f32"``.
- The DeepSeek-V4 fp8 cache (``reference.v4_cache``: FlashMLA's MODEL1 rule, 448 e4m3 in 7
  ue8m0-scaled tiles of 64 + 64 bf16 rope; 640 B per token on TPU): ``Fp8V4Cache``,
  ``quantize_v4_cache`` / ``dequantize_v4_cache``, the row writer ``write_v4_rows``, and
  FlashMLA's MODEL1 pages (584 B per token) ``v4_cache_to_flashmla`` / ``v4_cache_from_flashmla``.
- Segment witnesses (``reference.witnesses``) re-exported.
"""

from dsa_jax.backend import BACKENDS, resolve_backend
from dsa_jax.batch import Batch
from dsa_jax.cache import update_kv_cache, write_slots
from dsa_jax.indexer import indexer_topk, page_topk
from dsa_jax.layout import LayoutError, PagedLayout, aligned_page_size
from dsa_jax.mla import page_sparse_mla, sparse_mla
from dsa_jax.sharding import sharded_dsa_step, sharded_v4_step
from dsa_jax.step import BatchMeta, StepInputs, StepResult, dsa_step
from dsa_jax.v4_attention import V4Layout, V4LayoutWarning, v4_attention
from dsa_jax.v4_compressor import compress_step as v4_compress_step
from dsa_jax.v4_layer import v4_output, v4_project, v4_rope_tables
from dsa_jax.v4_model import (
    V4BatchMeta,
    V4Caches,
    V4ModelLayout,
    V4States,
    V4StepInputs,
    V4StepParams,
    V4StepResult,
    init_v4_states,
)
from dsa_jax.v4_step import v4_step
from dsa_jax.v41_model import (
    V41Caches,
    V41Meta,
    V41StepLayout,
    V41StepResult,
    init_v41_caches,
    init_v41_states,
    v41_meta,
)
from dsa_jax.v41_step import v41_step
from dsa_jax.validate import check_batch, run_checked
from pallas_kernels import IndexerBlocks, MlaBlocks, PerformanceWarning
from reference import build_index_share_map, glm_index_share_pattern
from reference.formats.cache_format import CacheFormat
from reference.formats.fp8_cache import (
    Fp8IndexCache,
    Fp8LatentCache,
    dequantize_index_cache,
    dequantize_latent_cache,
    index_cache_from_paged_fp8,
    index_cache_to_paged_fp8,
    latent_cache_from_flashmla,
    latent_cache_to_flashmla,
    quantize_index_cache,
    quantize_latent_cache,
)
from reference.formats.model1 import (
    Fp8V4Cache,
    dequantize_v4_cache,
    quantize_v4_cache,
    v4_cache_from_flashmla,
    v4_cache_to_flashmla,
    write_v4_rows,
)
from reference.formats.packed_cache import pack_cache, packed_words, unpack_cache
from reference.quant.fp8 import (
    dequantize_fp8,
    dequantize_latent_fp8,
    quantize_fp8,
    quantize_latent_fp8,
)
from reference.v4_attention import PagedKV
from reference.witnesses import (
    MAX_TOPOLOGY_SEGMENTS,
    LearnedKeepOutOfRange,
    RowsMismatch,
    SegmentsOutOfRange,
    WitnessError,
    apply_topology_witnesses,
    attention_mass_recall,
    local_selector,
    locality_null,
    merge_topology_witnesses,
    random_null,
    random_selector,
    scatter_topology_witnesses,
    segment_coverage,
    segment_of,
    topology_witness_indices,
)

__all__ = [
    "BACKENDS",
    "Batch",
    "BatchMeta",
    "CacheFormat",
    "Fp8IndexCache",
    "Fp8LatentCache",
    "Fp8V4Cache",
    "IndexerBlocks",
    "LayoutError",
    "LearnedKeepOutOfRange",
    "MAX_TOPOLOGY_SEGMENTS",
    "MlaBlocks",
    "PagedKV",
    "PagedLayout",
    "PerformanceWarning",
    "RowsMismatch",
    "SegmentsOutOfRange",
    "StepInputs",
    "StepResult",
    "V41Caches",
    "V41Meta",
    "V41StepLayout",
    "V41StepResult",
    "V4BatchMeta",
    "V4Caches",
    "V4Layout",
    "V4LayoutWarning",
    "V4ModelLayout",
    "V4States",
    "V4StepInputs",
    "V4StepParams",
    "V4StepResult",
    "WitnessError",
    "aligned_page_size",
    "apply_topology_witnesses",
    "attention_mass_recall",
    "build_index_share_map",
    "check_batch",
    "dequantize_fp8",
    "dequantize_index_cache",
    "dequantize_latent_cache",
    "dequantize_latent_fp8",
    "dequantize_v4_cache",
    "dsa_step",
    "glm_index_share_pattern",
    "index_cache_from_paged_fp8",
    "index_cache_to_paged_fp8",
    "indexer_topk",
    "init_v41_caches",
    "init_v41_states",
    "init_v4_states",
    "latent_cache_from_flashmla",
    "latent_cache_to_flashmla",
    "local_selector",
    "locality_null",
    "merge_topology_witnesses",
    "pack_cache",
    "packed_words",
    "page_sparse_mla",
    "page_topk",
    "quantize_fp8",
    "quantize_index_cache",
    "quantize_latent_cache",
    "quantize_latent_fp8",
    "quantize_v4_cache",
    "random_null",
    "random_selector",
    "resolve_backend",
    "run_checked",
    "scatter_topology_witnesses",
    "segment_coverage",
    "segment_of",
    "sharded_dsa_step",
    "sharded_v4_step",
    "sparse_mla",
    "topology_witness_indices",
    "unpack_cache",
    "update_kv_cache",
    "v41_meta",
    "v41_step",
    "v4_attention",
    "v4_cache_from_flashmla",
    "v4_cache_to_flashmla",
    "v4_compress_step",
    "v4_output",
    "v4_project",
    "v4_rope_tables",
    "v4_step",
    "write_slots",
    "write_v4_rows",
]
