"""sglang-jax's DSA sparse-MLA calls, with its names, arguments and results, computed by this
package's cache writer and ``dsa_jax.page_sparse_mla`` (issue 29; the MLA side). Re-exported
by ``dsa_jax.engines.sglang_jax``.

Read from sgl-project/sglang-jax at commit ``cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176``:

- ``python/sgl_jax/srt/kernels/dsa/sparse_mla.py``: ``sparse_mla_page_level`` (decode, one
  query row per sequence) turns each row's selection into a page list ``[hit pages ..., the
  new token's page]`` (hit pages: the first ``k_pages_max - 1`` entries of ``topk_pages``, or
  the lowest ``k_pages_max - 1`` pages the token ``topk_indices`` touch, less the new token's
  page) and runs the dense MLA v2 kernel over it with ``kv_len = n_hit * page_size + new_off +
  1``: every token of each hit page, and the new token's page up to the token itself. The
  kernel writes ``[new_kv_c | new_k_pe]`` at the token's slot ``kv_len - 1`` first and
  attends it; ``s = (q . k) * sm_scale`` in f32; ``o`` is ``ql_nope.dtype[T, H,
  kv_lora_rank]``, the latent (value = the first ``kv_lora_rank`` cache columns), not yet
  up-projected. ``page_indices`` is the packed table (sequence ``i``'s pages from slot
  ``cu_kv_lens[i] // page_size``); ``distribution`` is not read (the kernel gets ``[T, T, T]``).
- ``python/sgl_jax/srt/kernels/mla/v2/kernel.py``: the pool ``[P, ps / kv_packing,
  kv_packing, align(lkv, 128) + align(r, 128)]`` (``get_kv_cache_shape``), a row ``[c_kv (0:512)
  | k_pe (512:576) | zeros (576:640)]``, cache dtype equal to ``new_kv_c``'s.
- ``python/sgl_jax/srt/kernels/dsa/sparse_mla_prefill.py``: ``prefill_write_and_attend``
  (single-sequence, single-shot extend): writes each row at flat slot ``loc[t]`` (``-1``
  dropped), takes the page table ``clip(loc[::ps] // ps, 0, P - 1)``, and attends every token
  ``kp`` of each listed page with ``kp <= positions[t]`` and ``kp < T``; ``o`` is
  ``f32[T, H, kv_lora_rank]``.
- ``python/sgl_jax/srt/layers/attention/dsa_sparse_backend.py`` (the caller): ``_run_sparse``
  passes ``md.seq_lens`` / ``page_indices`` / ``cu_q_lens`` / ``cu_kv_lens`` /
  ``distribution``, ``page_size = cache.shape[1] * cache.shape[2]``, ``pages_per_seq =
  len(page_indices) // S``, ``k_pages_max = 512`` (or ``DSA_PAGE_TOPK + 1``), ``sm_scale`` as
  a Python float (``layer.scaling`` or ``1 / sqrt(qk_nope + qk_rope)``); ``_run_sparse_prefill``
  passes ``forward_batch.positions`` / ``out_cache_loc`` and casts ``o`` to ``ql.dtype``.

The pool is written and returned in its own 4-D layout (this step's rows scattered into it
directly, ``_write_pool``) and read in place: the Pallas page kernel takes it as a
``pallas_kernels.mla.pool.TokenPackedCache`` (one DMA per selected page of ``[ps / k, k, D]``,
no copy in the program); the jnp reference (``implementation="xla"``) reads the row-major
reshape ``[P, ps, D]`` (token ``t`` of a page is row ``t`` either way). Why not the reshape for
both: on TPU it is no bitcast (XLA tiles ``bf16[P, ps / 2, 2, 640]`` as ``T(2,128)(2,1)`` and
``bf16[P, ps, 640]`` as ``T(8,128)(2,1)``), so it copies the whole pool on the way in and again
on the way out. Measured (AOT, 8 decode rows x 8K context, H = 16, an 84 MB pool; XLA-side
bytes against the kernel's 21 MB): 676 MB through the reshape, 4.4 MB in place on v5e, v6e and
tpu7x (the row write plus the 2.2 MB of index preparation a ``[P, ps, D]`` cache costs too;
``scripts/cost/engine_glue.py`` prints every chip).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsa_jax import backend as _backend
from dsa_jax.batch import Batch
from dsa_jax.cache import write_slots
from dsa_jax.layout import PagedLayout
from dsa_jax.mla import page_sparse_mla
from pallas_kernels.mla import pool as mla_pool
from reference.core.batch import row_facts
from reference.core.checks import FLOAT_DTYPES, positive_int

__all__ = ["prefill_write_and_attend", "sparse_mla_page_level"]

_DTYPES = FLOAT_DTYPES  # the pools served: the float dtypes every op reads


def pool_view(where: str, cache_kv):
    """sglang-jax's 4-D pool ``[P, ps / kv_packing, kv_packing, D]`` (``kv_packing = 32 //
    bits``) as ``[P, ps, D]``: a row-major reshape, token ``t`` of a page row ``t`` either way
    (a ``bitcast`` on CPU; on TPU only where XLA's tilings agree, ``D = 128``: module
    docstring). Checked by ``check_pool`` (``where`` names the call in its messages)."""
    check_pool(where, cache_kv)
    shape = tuple(cache_kv.shape)
    return cache_kv.reshape(shape[0], shape[1] * shape[2], shape[3])


def check_pool(where: str, cache_kv) -> None:
    """``ValueError`` for a pool that is not ``[P, ps / kv_packing, kv_packing, D]``;
    ``NotImplementedError`` for a dtype other than bf16 / f32 (sglang-jax's uint8 fp8 records
    with inline e8m0 scales are not this package's fp8 caches)."""
    shape = tuple(cache_kv.shape)
    if len(shape) != 4:
        raise ValueError(f"{where}: cache_kv must be 4-D [P, ps / kv_packing, kv_packing, D], "
                         f"got shape {list(shape)}")
    dtype = jnp.dtype(cache_kv.dtype)
    if dtype not in _DTYPES:
        raise NotImplementedError(
            f"{where}: cache_kv dtype {dtype} is not served (bf16 / f32 only; sglang-jax's "
            f"uint8 fp8 records with inline e8m0 scales are not this package's fp8 layouts)")
    packing = 32 // (dtype.itemsize * 8)
    if shape[2] != packing:
        raise ValueError(f"{where}: cache_kv dim 2 (kv_packing) must be 32 // bits = {packing} "
                         f"for {dtype}, got shape {list(shape)}")


def _check_pool(where: str, cache_kv, ql_nope, q_pe, new_kv_c, new_k_pe, kv_lora_rank):
    """Check the shapes; return ``(the pool as a TokenPackedCache, kv_lora_rank, rope)``."""
    check_pool(f"sglang_jax.{where}", cache_kv)
    shape = tuple(cache_kv.shape)
    lkv = positive_int("kv_lora_rank", kv_lora_rank, f"sglang_jax.{where}")
    if lkv % 128:
        raise NotImplementedError(
            f"sglang_jax.{where}: kv_lora_rank={lkv} is not a multiple of 128: sglang-jax pads"
            f" c_kv and k_pe to 128 each, the package pads their concatenation")
    rope = int(np.shape(q_pe)[-1])
    dims = {"ql_nope.shape[-1]": np.shape(ql_nope)[-1], "new_kv_c.shape[-1]":
            np.shape(new_kv_c)[-1], "kv_lora_rank": lkv}
    if len(set(dims.values())) != 1 or np.shape(new_k_pe)[-1] != rope:
        raise ValueError(f"sglang_jax.{where}: {dims} must agree and new_k_pe.shape[-1] = "
                         f"{np.shape(new_k_pe)[-1]} must equal q_pe.shape[-1] = {rope}")
    if np.ndim(ql_nope) != 3 or np.shape(q_pe)[:2] != np.shape(ql_nope)[:2]:
        raise ValueError(f"sglang_jax.{where}: ql_nope {list(np.shape(ql_nope))} and q_pe "
                         f"{list(np.shape(q_pe))} must be [T, H, *] with equal T, H")
    padded = -(-(lkv + rope) // 128) * 128
    if shape[3] != padded:
        raise ValueError(f"sglang_jax.{where}: cache_kv dim 3 must be {padded} (kv_lora_rank "
                         f"+ rope dim rounded up to 128), got {list(shape)}")
    return mla_pool.TokenPackedCache(jnp.asarray(cache_kv)), lkv, rope


def _write_pool(pool: mla_pool.TokenPackedCache, page_id, offset, rows):
    """Store ``rows f[T, D]`` at token ``offset`` of page ``page_id`` straight into the 4-D
    pool (``pool[page_id, offset // k, offset % k]``, one scatter, no reshape); ``page_id`` out
    of ``[0, P)`` drops the row. Returns the updated pool."""
    k = pool.pool.shape[2]
    at = (page_id, offset // k, offset % k)
    return mla_pool.TokenPackedCache(pool.pool.at[at].set(rows.astype(pool.dtype), mode="drop"))


def _attend(q, pool: mla_pool.TokenPackedCache, pages, batch: Batch, *, sm_scale: float,
            v_dim: int, implementation, kernel_options):
    """``dsa_jax.page_sparse_mla`` over the pool: the Pallas kernel reads it in place (the
    ``TokenPackedCache``), the jnp reference reads its row-major view (module docstring). An
    implementation list is tried in order, as ``dsa_jax``'s ops try it."""
    tried = _backend.candidates("page_sparse_mla", implementation, None, kernel_options)

    def call(name):
        cache = pool.view() if name == "xla" else pool
        return page_sparse_mla(q, cache, topk_pages=pages, batch=batch, sm_scale=sm_scale,
                               v_dim=v_dim, backend="reference" if name == "xla" else "pallas",
                               kernel_options=kernel_options)

    return _backend.first_serving("page_sparse_mla", [(name, name) for name, _, _ in tried],
                                  call, group=implementation is not None)


def _rows(new_kv_c, new_k_pe, width: int):
    """``[c_kv | k_pe | zeros]`` rows of the cache's width."""
    rows = jnp.concatenate([jnp.asarray(new_kv_c, jnp.float32),
                            jnp.asarray(new_k_pe, jnp.float32)], axis=-1)
    return jnp.pad(rows, ((0, 0), (0, width - rows.shape[-1])))


def _query(ql_nope, q_pe, width: int, dtype):
    q = jnp.concatenate([jnp.asarray(ql_nope, dtype), jnp.asarray(q_pe, dtype)], axis=-1)
    return jnp.pad(q, ((0, 0), (0, 0), (0, width - q.shape[-1])))


def _page_list(topk_indices, topk_pages, new_page, page_size: int, pages_per_seq: int,
               k_pages_max: int):
    """sglang-jax's per-row page list: ``k_pages_max - 1`` hit slots (``-1`` = none), then
    the new token's page."""
    from dsa_jax.engines.sglang_jax import _touched_pages  # the compute_topk_pages rule

    hits = k_pages_max - 1
    if hits == 0:
        return new_page[:, None]
    if topk_pages is None:
        idx = jnp.asarray(topk_indices).astype(jnp.int32)
        idx = jnp.where((idx >= 0) & (idx // page_size == new_page[:, None]), -1, idx)
        listed = _touched_pages(idx, page_size, pages_per_seq, hits)
    else:
        raw = jnp.asarray(topk_pages).astype(jnp.int32)[:, :hits]
        listed = jnp.where((raw >= 0) & (raw != new_page[:, None]), raw, -1)
        listed = jnp.pad(listed, ((0, 0), (0, hits - listed.shape[1])), constant_values=-1)
    return jnp.concatenate([listed, new_page[:, None]], axis=1)


def sparse_mla_page_level(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, topk_indices,
                          page_indices, cu_q_lens, cu_kv_lens, distribution, topk_pages=None,
                          *, sm_scale: float, page_size: int, pages_per_seq: int,
                          kv_lora_rank: int, k_pages_max: int = 64,
                          num_kv_pages_per_block=None, num_queries_per_block=None,
                          vmem_limit_bytes=None, implementation=None, kernel_options=None):
    """sglang-jax's ``sparse_mla_page_level``: write this step's latent rows, then absorbed
    MLA over the rows' selected pages and the new token's page, by ``dsa_jax.update_kv_cache``'s
    slot rule / ``write_rows`` and ``dsa_jax.page_sparse_mla``.

    Args:
      ql_nope: ``f32|bf16[T, H, kv_lora_rank]`` absorbed query; q_pe: ``[T, H, r]`` rope query.
      new_kv_c: ``[T, kv_lora_rank]``; new_k_pe: ``[T, r]``: this step's latent row per query
        row, written (cast to the cache dtype) at the row's token slot before attending.
      cache_kv: ``bf16[P, ps / 2, 2, D]`` or ``f32[P, ps, 1, D]``, ``D = round_up(kv_lora_rank
        + r, 128)`` (640), rows ``[c_kv | k_pe | zeros]``.
      kv_lens: ``i32[S]`` this step's token included. page_indices, cu_q_lens, cu_kv_lens,
        distribution: the packed batch (``dsa_jax.Batch.from_packed``).
      topk_indices: ``i32[T, k]`` sequence-local token top-k (read when ``topk_pages`` is
        ``None``). topk_pages: ``i32[T, *]`` sequence-local pages, ``-1`` = none, or ``None``.
      sm_scale: static float (the logit scale). page_size: must equal the cache's. pages_per_seq:
        the page-table stride (capacity, pages). kv_lora_rank: the latent (value) dim, a
        multiple of 128. k_pages_max: page slots per row (the new token's page included).
      num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes: sglang-jax's Pallas
        knobs; accepted and not forwarded (they change no result).
      implementation: as ``dsa_jax.page_sparse_mla``; ``"pallas"`` reads the pool in place
        (module docstring), ``"xla"`` through its row-major view.
      kernel_options: the Pallas entry's knobs (``interpret``, block sizes...), as
        ``dsa_jax.page_sparse_mla``'s; ignored by ``"xla"``.

    Returns:
      ``(o ql_nope.dtype[T, H, kv_lora_rank], cache_kv)``: ``o`` in latent space, the cache in
      the 4-D layout with this step's rows written and nothing else changed.

    Differences kept (the decode batches sglang-jax sends agree exactly): rows outside every
    active sequence (``kv_len == 0`` padding, rows past ``cu_q_lens[S]``, sequences at or past
    ``distribution[2]``) write nothing and give zeros, where sglang-jax writes them into its
    sentinel page ``P - 1`` (or, for rows past ``cu_q_lens[S]``, the last sequence's slot);
    tokens at or past ``kv_len`` of a listed page and listed pages ``>= pages_per_seq`` are not
    attended (sglang-jax reads whole pages through ``page_indices``; its indexer lists
    neither); a sequence with several rows attends causally per row and writes each row at its
    own slot (sglang-jax's page-level call is decode-only); ``distribution`` is honoured; new
    rows of another dtype are cast to the cache's (sglang-jax's kernel refuses them).
    """
    where = "sparse_mla_page_level"
    pool, lkv, rope = _check_pool(where, cache_kv, ql_nope, q_pe, new_kv_c, new_k_pe,
                                  kv_lora_rank)
    num_pages, ps, width = pool.shape
    if positive_int("page_size", page_size, f"sglang_jax.{where}") != ps:
        raise ValueError(f"sglang_jax.{where}: page_size={page_size} but cache_kv holds "
                         f"{ps} tokens per page ({list(cache_kv.shape)})")
    pps = positive_int("pages_per_seq", pages_per_seq, f"sglang_jax.{where}")
    kpm = positive_int("k_pages_max", k_pages_max, f"sglang_jax.{where}")
    del num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes
    layout = PagedLayout(page_size=ps, pages_per_seq=pps, latent_dim=lkv, rope_dim=rope)
    num_rows = int(np.shape(ql_nope)[0])
    page_id, offset = write_slots(layout, num_rows, num_pages, kv_lens, page_indices, cu_q_lens,
                                  cu_kv_lens, distribution)
    pool = _write_pool(pool, page_id, offset, _rows(new_kv_c, new_k_pe, width))
    kv = jnp.asarray(kv_lens).astype(jnp.int32)
    seq = row_facts(num_rows, kv, jnp.asarray(cu_q_lens, jnp.int32),
                    jnp.asarray(distribution, jnp.int32)).seq  # clipped to [0, S)
    new_page = (jnp.maximum(kv[seq] - 1, 0) // ps).astype(jnp.int32) if kv.shape[0] else \
        jnp.zeros((num_rows,), jnp.int32)
    pages = _page_list(topk_indices, topk_pages, new_page, ps, pps, kpm)
    batch = Batch.from_packed(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
                              page_size=ps, pages_per_seq=pps)
    dtype = jnp.result_type(ql_nope)
    o = _attend(_query(ql_nope, q_pe, width, dtype), pool, pages, batch,
                sm_scale=float(sm_scale), v_dim=lkv, implementation=implementation,
                kernel_options=kernel_options)
    return o, pool.pool


def prefill_write_and_attend(ql, qpe, kvc, kpe, cache, topk_pages, positions, loc, *,
                             kv_lora_rank: int, page_size: int, sm_scale: float,
                             read_block=None, interpret: bool = False, implementation=None,
                             kernel_options=None):
    """sglang-jax's ``prefill_write_and_attend`` (one sequence, one-shot extend): write each
    row at flat cache slot ``loc[t]``, then attend the rows' selected pages, by ``write_rows``
    and ``dsa_jax.page_sparse_mla``.

    Args:
      ql ``[T, H, kv_lora_rank]``, qpe ``[T, H, r]``, kvc ``[T, kv_lora_rank]``, kpe ``[T, r]``,
        cache (as ``sparse_mla_page_level``), topk_pages ``i32[T, K]`` sequence-local pages
        (``-1`` = none), positions ``i32[T]`` the causal bound, loc ``i32[T]`` flat slot
        (``page * page_size + offset``; outside ``[0, P * page_size)``, e.g. ``-1``: not
        written).
      kv_lora_rank, page_size (must equal the cache's), sm_scale: as sglang-jax.
      read_block: ``None`` or ``page_size`` (page-level units); another unit size is a
        ``NotImplementedError``. interpret: sglang-jax's Pallas switch; accepted, not read.
      implementation, kernel_options: as ``sparse_mla_page_level``.

    Returns:
      ``(o f32[T, H, kv_lora_rank], cache)`` (sglang-jax's dtypes). Row ``t`` attends token
      ``kp`` of each listed page iff ``kp <= positions[t]`` and ``kp < T``, through the page
      table ``clip(loc[::page_size] // page_size, 0, P - 1)`` (sglang-jax's, valid for its
      stated scope): each row is served as a one-row sequence of ``clip(positions[t] + 1, 0,
      T)`` tokens over that table, so the rule is sglang-jax's exactly. Listed pages past the
      table (``>= ceil(T / page_size)``) hold no token ``< T`` and are skipped, as there.
    """
    where = "prefill_write_and_attend"
    pool, lkv, rope = _check_pool(where, cache, ql, qpe, kvc, kpe, kv_lora_rank)
    num_pages, ps, width = pool.shape
    if positive_int("page_size", page_size, f"sglang_jax.{where}") != ps:
        raise ValueError(f"sglang_jax.{where}: page_size={page_size} but cache holds {ps} "
                         f"tokens per page ({list(cache.shape)})")
    if read_block is not None and read_block != ps:
        raise NotImplementedError(f"sglang_jax.{where}: read_block={read_block!r} is not "
                                  f"served (only page-level units, read_block=page_size={ps})")
    del interpret
    num_rows = int(np.shape(ql)[0])
    loc = jnp.asarray(loc).astype(jnp.int32)
    ok = (loc >= 0) & (loc < num_pages * ps)
    pool = _write_pool(pool, jnp.where(ok, loc // ps, num_pages), jnp.where(ok, loc % ps, 0),
                       _rows(kvc, kpe, width))
    if num_rows == 0:
        return jnp.zeros((0,) + np.shape(ql)[1:], jnp.float32), pool.pool
    table = jnp.clip(loc[::ps] // ps, 0, num_pages - 1)
    kv_lens = jnp.clip(jnp.asarray(positions).astype(jnp.int32) + 1, 0, num_rows)
    batch = Batch.from_fixed_stride(
        kv_lens, jnp.broadcast_to(table, (num_rows, table.shape[0])),
        jnp.arange(num_rows + 1, dtype=jnp.int32),
        jnp.array([num_rows, num_rows, num_rows], jnp.int32), page_size=ps)
    o = _attend(_query(ql, qpe, width, jnp.float32), pool, topk_pages, batch,
                sm_scale=float(sm_scale), v_dim=lkv, implementation=implementation,
                kernel_options=kernel_options)
    return o, pool.pool
