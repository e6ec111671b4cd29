"""Static checks of the indexer top-k arguments (token and page top-k share them)."""

from __future__ import annotations

import jax
import numpy as np

from reference.core import checks as _checks
from reference.formats import fp8_cache
from reference.indexer.selection import check_selection_args
from reference.quant import fp8
from reference.quant.bf16 import check_precision


def _check_query(q, cache_kv) -> None:
    """f32/bf16, or float8_e4m3fn with an fp8 index cache (its scale folded into the weights)."""
    if np.dtype(jax.numpy.result_type(q)) == fp8.FP8_DTYPE:
        if isinstance(cache_kv, fp8_cache.Fp8IndexCache):
            return
        raise ValueError("q has dtype float8_e4m3fn, which needs an fp8 index cache "
                         "(Fp8IndexCache); cache_kv is an array of dtype "
                         f"{jax.numpy.result_type(cache_kv)}")
    _checks.floating("q", q)


def check_indexer_args(q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                       distribution, *, pages_per_seq: int, one_token_per_seq: bool) -> None:
    """Refuse inconsistent shapes/dtypes/statics, naming the argument and the numbers."""
    fp8_cache.refuse_other_kind("cache_kv", cache_kv, wanted="index")
    _checks.rank("q", q, 3)
    _check_query(q, cache_kv)
    num_rows, heads, dim = np.shape(q)
    _checks.rank("weights", weights, 2)
    _checks.floating("weights", weights)
    _checks.dim("weights", weights, 0, num_rows, "q.shape[0] (T)")
    _checks.dim("weights", weights, 1, heads, "q.shape[1] (H)")
    if isinstance(cache_kv, fp8_cache.Fp8IndexCache):
        fp8_cache.check_index_cache("cache_kv", cache_kv)
        _checks.dim("q", q, 2, fp8.INDEX_HEAD_DIM, "the fp8 index cache's head dim")
    else:
        _checks.paged_cache("cache_kv", cache_kv, dim, "q.shape[2] (D)")
    num_seqs = _checks.ragged_metadata(seq_lens, page_indices, cu_q_lens, cu_kv_lens,
                                       distribution)
    _checks.positive_int("pages_per_seq", pages_per_seq)
    if not isinstance(one_token_per_seq, bool):
        raise TypeError(f"one_token_per_seq must be a bool, got {one_token_per_seq!r}")
    if one_token_per_seq and num_rows != num_seqs:
        raise ValueError(f"one_token_per_seq=True needs one row per sequence: q.shape[0] (T) = "
                         f"{num_rows} != len(seq_lens) (S) = {num_seqs}")


def check_compression_ratio(compression_ratio, *, page_size: int, pages_per_seq: int) -> int:
    """Refuse a ``compression_ratio`` that is not a Python int >= 1 (``TypeError`` /
    ``ValueError``), or one whose token positions cannot be i32: the capacity of
    ``pages_per_seq * page_size`` entries spans ``* r`` tokens, which must stay below ``2**31``
    (the kernels compare ``(j + 1) * r <= p + 1`` in i32). Any page size is valid in entry
    units (``reference.core.batch``: a page of entries spans whole groups). Returns ``r``."""
    r = _checks.positive_int("compression_ratio", compression_ratio)
    cap = pages_per_seq * page_size
    if r > 1 and cap * r >= 2**31:
        raise ValueError(f"compression_ratio={r} times the capacity of pages_per_seq "
                         f"{pages_per_seq} x page_size {page_size} = {cap} entries is {cap * r} "
                         f"tokens, past i32 positions (2**31)")
    return r


def check_topk_args(arrays, *, k: int, k_name: str, pages_per_seq: int, one_token_per_seq: bool,
                    num_segments: int, recall_target: float, exact: bool,
                    fill: str = "tail", refuse_full_overwrite: bool = False,
                    compression_ratio: int = 1) -> None:
    """Every top-k entry's static checks (reference and Pallas, token and page): the indexer
    arguments ``arrays = (q, weights, cache_kv, seq_lens, page_indices, cu_q_lens, cu_kv_lens,
    distribution)``, the ``compression_ratio`` (``check_compression_ratio``), then the
    selection statics (``k_name`` names the budget in messages)."""
    check_indexer_args(*arrays, pages_per_seq=pages_per_seq, one_token_per_seq=one_token_per_seq)
    check_compression_ratio(compression_ratio, page_size=int(arrays[2].shape[-2]),
                            pages_per_seq=pages_per_seq)
    check_selection_args(k, recall_target, exact, num_segments, k_name=k_name, fill=fill,
                         refuse_full_overwrite=refuse_full_overwrite)


INDEX_QUANTS = (None, "fp4_sim")
INDEX_QUANT_DIM = 128  # the Hadamard rotation and the fp4 blocks of DeepSeek-V4's index heads


def check_index_quant(index_quant, dim: int, cache_kv) -> None:
    """Refuse an unknown ``index_quant``, or ``"fp4_sim"`` with a head dim other than 128 or
    with an fp8 index cache (that cache is the other format), naming the values."""
    if index_quant not in INDEX_QUANTS:
        raise ValueError(f"index_quant must be one of {INDEX_QUANTS}, got {index_quant!r}")
    if index_quant is None:
        return
    if dim != INDEX_QUANT_DIM:
        raise ValueError(f"index_quant={index_quant!r} rotates the {INDEX_QUANT_DIM} index dims; "
                         f"q.shape[2] (D) = {dim}")
    if isinstance(cache_kv, fp8_cache.Fp8IndexCache):
        raise ValueError(f"index_quant={index_quant!r} simulates FP4 on f32/bf16 keys; an fp8 "
                         "index cache (Fp8IndexCache) is the other format")


def check_index_precision(precision, index_quant, cache_kv) -> str:
    """The scoring ``precision`` of a top-k entry (``reference.quant.bf16.check_precision``:
    ``"f32"`` or ``"bf16"``, else ``ValueError`` naming ``precision``). ``"bf16"`` (DeepSeek-V4's
    official rounding, ``scores.index_scores``) is defined on f32/bf16 q and keys only: with
    ``index_quant`` set or an fp8 index cache it is refused (``ValueError`` naming both).
    Returns ``precision``."""
    check_precision(precision)
    if precision == "f32":
        return precision
    if index_quant is not None:
        raise ValueError(f"precision={precision!r} with index_quant={index_quant!r} is not "
                         "defined (the bf16 scores take f32/bf16 q and keys as given)")
    if isinstance(cache_kv, fp8_cache.Fp8IndexCache):
        raise ValueError(f"precision={precision!r} with an fp8 index cache (Fp8IndexCache) is "
                         "not defined (the bf16 scores take f32/bf16 q and keys as given)")
    return precision
