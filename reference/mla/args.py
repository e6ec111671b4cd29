"""Static checks of the sparse MLA arguments (token and page sparse MLA share them)."""

from __future__ import annotations

import numpy as np

from reference.core import checks as _checks
from reference.formats import fp8_cache, packed_cache
from reference.quant import fp8

FP8_Q_DIMS = (fp8.LATENT_DIM, 640)  # the fp8 latent cache holds 576 features; q may be padded


def check_mla_args(q, cache_kv, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens,
                   distribution, *, sm_scale, pages_per_seq: int, v_dim: int,
                   selected_name: str) -> None:
    """Refuse inconsistent shapes/dtypes/statics, naming the argument and the numbers."""
    _checks.rank("q", q, 3)
    _checks.floating("q", q)
    num_rows, _, dim = np.shape(q)
    fp8_cache.refuse_other_kind("cache_kv", cache_kv, wanted="latent")
    if isinstance(cache_kv, fp8_cache.Fp8LatentCache):
        fp8_cache.check_latent_cache("cache_kv", cache_kv)
        if dim not in FP8_Q_DIMS:
            raise ValueError(f"with the fp8 latent cache q.shape[2] must be one of {FP8_Q_DIMS} "
                             f"(576 = 512 + 64 features, or zero-padded to 640), got {dim}")
        dim = fp8.LATENT_NOPE  # the value dim bound below: values are the nope features
    elif packed_cache.is_packed(cache_kv):  # bf16 rows stored as u32 words (packed_cache)
        _checks.rank("cache_kv", cache_kv, 3)
        _checks.dim("cache_kv", cache_kv, 2, packed_cache.packed_words(dim),
                    "packed_words(q.shape[2]) for a packed u32 cache")
    else:
        _checks.paged_cache("cache_kv", cache_kv, dim, "q.shape[2] (D_qk)")
    _checks.ragged_metadata(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
                            seq_lens_name="kv_lens")
    _checks.rank(selected_name, selected, 2)
    _checks.integer(selected_name, selected)
    _checks.dim(selected_name, selected, 0, num_rows, "q.shape[0] (T)")
    _checks.positive_int("pages_per_seq", pages_per_seq)
    _checks.positive_int("v_dim", v_dim)
    if v_dim > dim:
        raise ValueError(f"v_dim must be <= the latent dim ({dim} for this cache): v_dim={v_dim}"
                         f" > {dim}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a static Python float, got {sm_scale!r}")
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and positive, got sm_scale={sm_scale}")
