"""sglang-jax's DSA indexer calls, with its names, arguments and results, computed by this
package's ops (issue 29; the indexer side).

Read from sgl-project/sglang-jax at commit ``cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176``:

- ``python/sgl_jax/srt/layers/attention/dsa_sparse_backend.py`` (the caller,
  ``--attention-backend dsa_sparse``): ``_maybe_index`` views the ``[P, ps / 2, 2, D]`` bf16
  index cache as ``[P, ps, D]`` by a reshape, and calls ``streamindex_topk_ref`` /
  ``streamindex_page_topk_ref`` (packed table, ``one_token_per_seq=True`` on decode), or under
  ``DSA_INDEXER_KERNEL=1`` the Pallas ``streamindex_topk`` on the 4-D cache with a fixed-stride
  table repacked from the packed one (``_fixed_stride_pages``), ``compression_ratio=1``,
  ``num_kv_pages_per_block=64``, ``num_queries_per_block=1``; then ``compute_topk_pages(topk,
  page_size=..., pages_per_seq=..., k_pages_max=512)`` when IndexShare threads pages.
- ``python/sgl_jax/srt/kernels/dsa/streamindex_topk.py`` (vendored from tpu-inference):
  ``streamindex_topk(q, indexer_weights, cache_kv, seq_lens, page_indices, cu_q_lens,
  distribution, *, k, compression_ratio, num_kv_pages_per_block, num_queries_per_block,
  vmem_limit_bytes, decode_req_batch_size)`` -> ``i32[T, k]``: score ``sum_h w[h] * relu(q_h .
  key_j)`` in f32 (weights cast to f32), candidates ``j < seq_len // r`` and ``j <= pos // r``,
  ``approx_max_k(recall_target=1.0)``, ``-1`` where the score is ``-inf``.
- ``python/sgl_jax/srt/kernels/dsa/sparse_mla.py``: ``compute_topk_pages(topk_indices, *,
  page_size, pages_per_seq, k_pages_max)`` -> ``i32[T, k_pages_max]``: the distinct
  sequence-local pages the row's token top-k touches, ascending, ``-1`` padded (the lowest
  ``k_pages_max`` when more are touched).
- ``python/sgl_jax/srt/kernels/dsa/ref.py``: ``streamindex_topk_ref`` /
  ``streamindex_page_topk_ref``, whose arguments are a prefix of this package's references
  (same default ``recall_target=0.70``); re-exported here unchanged.

The index cache ``[P, ps / kv_packing, kv_packing, D]`` (``kv_packing = 32 // bits``: 2 for
bf16, two tokens per 32-bit word; 1 for f32) is read through the row-major reshape to the
package's ``[P, ps, D]``: token ``t`` of a page is row ``t`` either way, and XLA emits the
reshape as a ``bitcast`` (checked on CPU in ``tests/test_engines_sglang_jax.py``). On TPU it is
a bitcast too at the index dim ``D = 128`` (one lane tile: XLA's ``T(2,128)(2,1)`` tiling of
``bf16[P, ps / 2, 2, 128]`` and ``T(8,128)(2,1)`` of ``bf16[P, ps, 128]`` are the same bytes;
f32 ``[P, ps, 1, 128]`` likewise), measured by AOT compiles (``scripts/cost/engine_glue.py``,
``indexer_view`` vs ``indexer_plain``: equal XLA bytes, no pool-sized copy, on v5e, v6e and
tpu7x). A wider index cache would be a relayout copy per call (``bf16[P, 32, 2, 256]``: an XLA
``reshape``), as the MLA pool's is; the MLA side therefore reads its pool in place
(``pallas_kernels.mla.pool``).

The MLA side (``sparse_mla_page_level``, ``prefill_write_and_attend``) lives in
``dsa_jax.engines.sglang_jax_mla`` and is re-exported here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsa_jax import backend as _backend
from dsa_jax.batch import Batch
from dsa_jax.engines.sglang_jax_mla import (
    pool_view,
    prefill_write_and_attend,
    sparse_mla_page_level,
)
from dsa_jax.indexer import indexer_topk
from reference import streamindex_page_topk_ref, streamindex_topk_ref
from reference.core.checks import positive_int

__all__ = ["compute_topk_pages", "index_cache_view", "prefill_write_and_attend",
           "sparse_mla_page_level", "streamindex_page_topk_ref", "streamindex_topk",
           "streamindex_topk_ref"]

# sglang-jax's streamindex_topk.DEFAULT_VMEM_LIMIT_BYTES (a Pallas knob; see streamindex_topk).
DEFAULT_VMEM_LIMIT_BYTES = 100 * 1024 * 1024
# The top-k sglang-jax's kernel takes: approx_max_k at recall 1.0 (exact).
_RECALL = 1.0


def index_cache_view(cache_kv: jax.Array) -> jax.Array:
    """sglang-jax's 4-D index cache as the package's 3-D one, zero-copy.

    Args:
      cache_kv: ``bf16[P, ps / 2, 2, D]`` or ``f32[P, ps, 1, D]`` (``dim 2 = 32 // bits``, as
        sglang-jax's ``get_kv_cache_shape`` lays out its pools).

    Returns:
      ``[P, ps, D]``, the same dtype: a row-major reshape, a ``bitcast`` in XLA (on TPU too at
      ``D = 128``, the index dim; module docstring).

    Raises:
      ValueError: not 4-D, or dim 2 is not ``32 // bits`` of the dtype.
      NotImplementedError: a dtype other than bf16 / f32 (sglang-jax's uint8 records with
        inline e8m0 scales are not this package's fp8 index cache, ``Fp8IndexCache``).
    """
    return pool_view("sglang_jax", cache_kv)


def _check_knobs(num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes,
                 decode_req_batch_size) -> None:
    for name, v in (("num_kv_pages_per_block", num_kv_pages_per_block),
                    ("num_queries_per_block", num_queries_per_block)):
        vals = (v,) if v is None or isinstance(v, (int, np.integer)) else tuple(v)
        if len(vals) not in (1, 3) or not all(
                x is None or (isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                              and x >= 1) for x in vals):
            raise ValueError(f"sglang_jax.streamindex_topk: {name} must be None, a positive "
                             f"int or a (decode, prefill, mixed) triple of them, got {v!r}")
    for name, v in (("vmem_limit_bytes", vmem_limit_bytes),
                    ("decode_req_batch_size", decode_req_batch_size)):
        positive_int(name, v, "sglang_jax.streamindex_topk")


def streamindex_topk(q, indexer_weights, cache_kv, seq_lens, page_indices, cu_q_lens,
                     distribution, *, k: int, compression_ratio: int,
                     num_kv_pages_per_block=None, num_queries_per_block=None,
                     vmem_limit_bytes: int = DEFAULT_VMEM_LIMIT_BYTES,
                     decode_req_batch_size: int = 4, implementation=None) -> jax.Array:
    """sglang-jax's ``streamindex_topk``: the lightning indexer's token top-k over a 4-D paged
    cache with a fixed-stride page table, by ``dsa_jax.indexer_topk``.

    Args:
      q: ``f32|bf16[T, H, D]`` index queries (all sequences' rows, concatenated).
      indexer_weights: ``f32|bf16[T, H]`` per-head weights (cast to f32, as sglang-jax does).
      cache_kv: ``bf16[P, ps / 2, 2, D]`` or ``f32[P, ps, 1, D]`` index keys (read through
        ``index_cache_view``, zero-copy); ``D`` must equal ``q``'s.
      seq_lens: ``i32[S]`` KV length per sequence, in tokens, this step's rows included.
      page_indices: ``i32[S * pages_per_seq]`` fixed-stride: sequence ``i``'s page ``j`` at
        ``i * pages_per_seq + j`` (``pages_per_seq = len(page_indices) // S``).
      cu_q_lens: ``i32[S + 1]`` row offsets of each sequence's query rows.
      distribution: ``i32[3]`` ``(decode_end, prefill_end, num_seqs)``; sglang-jax sends
        ``[n, n, n]`` (decode) and ``[0, 0, n]`` (extend).
      k: the token budget per row (static, >= 1).
      compression_ratio: must be 1 (sglang-jax's only value: GLM index keys are per token).
      num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes,
        decode_req_batch_size: sglang-jax's Pallas tuning knobs. Checked (positive ints; the
        first two may be ``(decode, prefill, mixed)`` triples or ``None``) and not forwarded:
        they change no result, and this package's kernel sizes its blocks from its own tables
        (``dsa_jax.IndexerBlocks``).
      implementation: ``"xla"``, ``"pallas"``, an ordered list or ``None`` (the platform
        default), as ``dsa_jax.indexer_topk``.

    Returns:
      ``i32[T, k]`` sequence-local token offsets, best first, ``-1`` tail; rows outside every
      sequence all ``-1``. Ties between equal scores may be ordered differently from
      sglang-jax's kernel (compare by score).

    Raises:
      NotImplementedError: ``compression_ratio != 1``: sglang-jax's rule makes entry ``j``
        visible to position ``p`` iff ``j <= p // r`` (and ``j < seq_len // r``), this
        package's iff ``j < (p + 1) // r``; they agree only on each sequence's last row.
        Also a cache dtype other than bf16 / f32 (``index_cache_view``).
      ValueError: a cache that is not ``[P, ps / kv_packing, kv_packing, D]``, ``D`` unequal
        to ``q``'s (sglang-jax zero-pads ``q`` to a multiple of 128 and reads that many cache
        columns), ``len(page_indices)`` not a multiple of ``S``, or a bad knob.

    Differences kept (sglang-jax never sends these batches): its kernel runs the sequences
    ``[0, distribution[1])`` with one query row each (``static_q_len=1``), so a sequence there
    with more rows gets ``-1`` in all but its first row from sglang-jax and its full top-k
    here (on every row, the package's causal rule).
    """
    if not isinstance(compression_ratio, (int, np.integer)) or compression_ratio != 1:
        raise NotImplementedError(
            f"sglang_jax.streamindex_topk: compression_ratio={compression_ratio!r} is not served"
            f" (only 1): sglang-jax shows entry j to position p iff j <= p // r, "
            f"dsa_jax.indexer_topk iff j < (p + 1) // r")
    _check_knobs(num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes,
                 decode_req_batch_size)
    cache = index_cache_view(cache_kv)
    num_pages, page_size, dim = cache.shape
    if q.shape[-1] != dim:
        raise ValueError(f"sglang_jax.streamindex_topk: q head dim {q.shape[-1]} != cache_kv "
                         f"dim {dim} (pad q with zeros to the cache's D)")
    num_seqs = int(np.shape(seq_lens)[0])
    num_slots = int(np.shape(page_indices)[0])
    if num_seqs == 0:
        return jnp.full((q.shape[0], k), -1, jnp.int32)
    if num_slots == 0 or num_slots % num_seqs:
        raise ValueError(f"sglang_jax.streamindex_topk: len(page_indices) = {num_slots} must "
                         f"be a positive multiple of len(seq_lens) = {num_seqs}")
    batch = Batch.from_fixed_stride(seq_lens, jnp.reshape(page_indices, (num_seqs, -1)),
                                    cu_q_lens, distribution, page_size=page_size)
    weights = jnp.asarray(indexer_weights).astype(jnp.float32)
    return indexer_topk(q, weights, cache, batch=batch, k=k, recall_target=_RECALL,
                        implementation=implementation)


def compute_topk_pages(topk_indices, *, page_size: int, pages_per_seq: int,
                       k_pages_max: int, implementation=None) -> jax.Array:
    """sglang-jax's ``compute_topk_pages``: the distinct sequence-local pages each row's token
    top-k touches.

    Args:
      topk_indices: ``i32[T, k]`` sequence-local token offsets, ``-1`` = none
        (``streamindex_topk``'s result).
      page_size: tokens per page (static, >= 1).
      pages_per_seq: the page-table stride (static, >= 1); offsets at or past
        ``pages_per_seq * page_size`` touch no page.
      k_pages_max: slots per row (static, >= 1).
      implementation: ``None`` or ``"xla"`` (jnp; there is no kernel for this index
        transform): any other name is a ``ValueError`` listing ``("xla",)``.

    Returns:
      ``i32[T, k_pages_max]``: the touched pages in ascending order, ``-1`` padded; a row
      touching more than ``k_pages_max`` pages keeps its lowest ``k_pages_max`` (sglang-jax's
      rule, kept).
    """
    _backend.chosen_names("compute_topk_pages", ("xla",), implementation, None)
    for name, v in (("page_size", page_size), ("pages_per_seq", pages_per_seq),
                    ("k_pages_max", k_pages_max)):
        positive_int(name, v, "sglang_jax.compute_topk_pages")
    idx = jnp.asarray(topk_indices)
    if idx.ndim != 2 or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"sglang_jax.compute_topk_pages: topk_indices must be an integer "
                         f"[T, k] array, got {idx.dtype}{list(idx.shape)}")
    return _touched_pages(idx.astype(jnp.int32), int(page_size), int(pages_per_seq),
                          int(k_pages_max))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _touched_pages(idx, page_size: int, pages_per_seq: int, k_pages_max: int):
    rows = idx.shape[0]
    page = idx // page_size
    ok = (idx >= 0) & (page < pages_per_seq)
    # One hit column per page plus a sink column for the offsets that touch none.
    hit = jnp.zeros((rows, pages_per_seq + 1), jnp.bool_)
    hit = hit.at[jnp.arange(rows)[:, None], jnp.where(ok, page, pages_per_seq)].set(True)
    cols = jnp.arange(pages_per_seq, dtype=jnp.int32)
    # The touched pages first, ascending; the rest after them (sort keys >= pages_per_seq).
    keyed = jnp.sort(jnp.where(hit[:, :pages_per_seq], cols, cols + pages_per_seq), axis=1)
    keep = min(k_pages_max, pages_per_seq)
    out = jnp.where(keyed[:, :keep] < pages_per_seq, keyed[:, :keep], -1)
    return jnp.pad(out, ((0, 0), (0, k_pages_max - keep)), constant_values=-1)
