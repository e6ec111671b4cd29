"""Attention of each query row over an explicit list of its sequence's tokens.

The core of both sparse MLA references. Per query row ``t`` with selected tokens ``K(t)``:

    logits[t, h, j] = sm_scale * q[t, h, :] . c[j, :]          j in K(t)
    out[t, h, :]    = softmax_j(logits) @ c[j, :v_dim]
    lse[t, h]       = log(sum_j exp(logits))                     natural log

Gather rule: an entry is *valid* only if its row belongs to a sequence, ``0 <= idx <
min(kv_len, capacity_tokens)``, its page slot and page id are in range, and (``causal=True``)
``idx <= abs_pos``. Invalid entries are never gathered (``mode="fill"`` reads nothing) and
contribute exactly zero, so NaN in any slot that is not selected cannot reach the output.
A row with no valid entry gives zeros and ``lse = -inf``. Duplicate entries count once per
occurrence (a token listed twice gets twice the weight), matching a plain softmax over slots.

Cost: each row gathers its own ``n`` rows (no per-sequence copy of the cache). Rows are processed
in chunks sized so one chunk's gathered rows and logits stay within ``GATHER_BLOCK_BYTES``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.formats import fp8_cache, model1, packed_cache, stacked, tokamax_v4
from reference.quant.bf16 import rounding

GATHER_BLOCK_BYTES = 64 * 1024 * 1024


# Row-level page lookup (``token_slots``) while ``pages_per_seq`` and the one-hot's size stay
# under these. XLA's TPU model of the per-entry page-id gather is ~4.2 KB per entry whatever
# the table (550 MB at 64 x 2048 entries, v6e); the one-hot select over each row's own page-table
# row costs 40 / 142 / 550 MB at 64 / 512 / 2048 pages per sequence (scripts: issue 19 note).
ONE_HOT_MAX_PAGES = 1024
ONE_HOT_MAX_ELEMS = 1 << 27


def token_slots(idx, rows: batch.RowFacts, b: batch.RaggedBatch, *, causal: bool):
    """Flat cache slots (``page_id * page_size + offset``) of ``idx i32[R, n]``, sequence-local
    token offsets of the rows' sequences (``b.token_slots`` is the rule).

    Row-level where small enough (``ONE_HOT_MAX_*``): each row looks up its sequence's
    ``pages_per_seq`` page ids once (``b.page_ids``, the same rule), and each entry takes its
    page's id by a compare-select over that row (no per-entry gather); else per entry.

    Returns (slots i32[R, n], valid bool[R, n]); invalid slots are ``num_pages * page_size``
    (one past the end, so a fill-mode gather reads nothing).
    """
    valid = rows.in_seq[:, None] & (idx >= 0) & (idx < b.kv_eff(rows.seq)[:, None])
    if causal:
        valid &= idx <= rows.abs_pos[:, None]
    if (b.pages_per_seq <= ONE_HOT_MAX_PAGES
            and idx.shape[0] * idx.shape[1] * b.pages_per_seq <= ONE_HOT_MAX_ELEMS):
        j = jnp.arange(b.pages_per_seq, dtype=jnp.int32)
        row_pid, row_ok = b.page_ids(rows.seq[:, None], j[None, :],
                                     jnp.ones((1, b.pages_per_seq), bool))  # [R, pages]
        hit = (jnp.where(valid, idx, 0) // b.page_size)[:, :, None] == j[None, None, :]
        pid = jnp.sum(jnp.where(hit, row_pid[:, None, :], 0), axis=-1)
        valid &= jnp.any(hit & row_ok[:, None, :], axis=-1)
        offset = jnp.where(valid, idx, 0) % b.page_size
    else:
        pid, offset, valid = b.token_slots(rows.seq[:, None], idx, valid)
    flat = pid * b.page_size + offset
    return jnp.where(valid, flat, b.num_pages * b.page_size).astype(jnp.int32), valid


def _state_rows(q, rows_kv, valid, *, sm_scale: float, v_dim: int, precision: str = "f32"):
    """The unnormalized (flash) state of ``q f[R, H, D]`` over ``rows_kv f32[R, n, D]`` (zeros
    where invalid), ``valid bool[R, n]``: ``m`` the max logit, ``l = sum e^(s - m)``, ``acc =
    sum e^(s - m) v[:v_dim]`` (``reference.v4_attention.state``); an empty row gives ``acc = 0``,
    ``l = 0``, ``m = -inf``.

    ``precision="bf16"`` (``reference.quant.bf16``): q and the rows are rounded to bf16 values
    first, and the probabilities ``P = exp(s - m)`` are rounded to bf16 before ``P @ V`` while
    ``l`` sums them unrounded; logits and sums stay f32. ``"f32"``: no rounding."""
    rb = rounding(precision)
    prec = jax.lax.Precision.HIGHEST
    rows_kv = rb(rows_kv)
    logits = jnp.einsum("rhd,rnd->rhn", rb(q.astype(jnp.float32)), rows_kv, precision=prec)
    logits = jnp.where(valid[:, None, :], logits * sm_scale, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe[..., None])  # exp(-inf) = 0 for invalid entries
    denom = jnp.sum(p, axis=-1)
    # Contract over the whole latent row and slice after: slicing rows_kv first costs a copy of
    # the gathered rows (measured 6x slower on CPU than the extra v_dim..D columns).
    acc = jnp.einsum("rhn,rnd->rhd", rb(p), rows_kv, precision=prec)[..., :v_dim]
    return acc, denom, m


def _attend_rows(q, rows_kv, valid, *, sm_scale: float, v_dim: int, precision: str = "f32"):
    """``_state_rows`` normalized: (out f32[R, H, v_dim], lse f32[R, H]); the output is not
    rounded here (the caller merges parts, then rounds)."""
    acc, denom, m = _state_rows(q, rows_kv, valid, sm_scale=sm_scale, v_dim=v_dim,
                                precision=precision)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, m + jnp.log(denom), -jnp.inf)
    return out, lse


# Word caches whose gathered rows are decoded after the gather: type -> (row decoder, the flat-
# slot gather and its words per row, or None: the cache's own words array, one row per slot).
_WORD_CACHES = {
    fp8_cache.Fp8LatentCache: (fp8_cache.dequantize_latent_words, None),
    model1.Fp8V4Cache: (model1.dequantize_v4_rows, (model1.gather_v4_rows, model1.ROW_WORDS)),
    tokamax_v4.CsaCache: (tokamax_v4.decode_csa_words,
                          (tokamax_v4.gather_csa_words, tokamax_v4.CSA_WORDS)),
    tokamax_v4.PlaneCache: (tokamax_v4.decode_plane_rows,
                            (tokamax_v4.gather_plane_words, tokamax_v4.PLANE_WORDS)),
}


def _word_cache(cache):
    """``cache``'s ``_WORD_CACHES`` entry, ``(None, None)`` for an array cache."""
    return next((v for t, v in _WORD_CACHES.items() if isinstance(cache, t)), (None, None))


def _decode_rows(cache, kv, dim: int):
    """Gathered stored rows -> their feature values ``[.., dim]``: packed bf16 words are
    unpacked; fp8 latent / V4 / tokamax words are decoded (exact in bf16) and zero-padded to
    ``dim``."""
    decode = _word_cache(cache)[0]
    if decode is not None:
        kv = decode(kv)
        return jnp.pad(kv, [(0, 0)] * (kv.ndim - 1) + [(0, dim - kv.shape[-1])])
    if packed_cache.is_packed(cache):
        return packed_cache.unpack_cache(kv, dim)
    return kv


def attend_selected(q, cache, slots, valid, *, sm_scale: float, v_dim: int, layer=None,
                    precision: str = "f32", state: bool = False):
    """Attend every row of ``q: f[T, H, D]`` over its ``slots i32[T, n]`` of the flattened
    ``cache: f[num_pages, page_size, D]``, the packed bf16 cache ``u32[num_pages, page_size,
    packed_words(D)]`` of ``reference.formats.packed_cache``, an ``Fp8LatentCache``, an
    ``Fp8V4Cache``, or tokamax's ``CsaCache`` / ``PlaneCache`` (``reference.formats.tokamax_v4``;
    rows are decoded after the gather); with ``layer``, of that layer of a stacked cache, read
    in place (``reference.formats.stacked``). ``precision``: ``"f32"`` or ``"bf16"``
    (``_state_rows``: q and rows as bf16 values, P rounded to bf16 for ``P @ V``).
    Returns (out f32[T, H, v_dim], lse f32[T, H]); with ``state=True`` the unnormalized flash
    state (acc f32[T, H, v_dim], l f32[T, H], m f32[T, H]) instead (``_state_rows``)."""
    num_rows, heads, _ = q.shape
    n = slots.shape[1]
    read = stacked.resolve("cache", cache, layer)
    cache_words = read.stacked
    gather = _word_cache(cache_words)[1]
    if isinstance(cache_words, fp8_cache.Fp8LatentCache):
        cache_words = cache_words.words
    if gather is not None:  # its own flat-slot gather (two arrays, or two rows per token)
        num_slots, width = int(np.prod(cache_words.shape[:-1])), gather[1]
        take = functools.partial(gather[0], cache_words)
    else:
        # [L * P * page_size, W]: the layer, page and row dims merged (a reshape, no copy: the
        # rows are the tiled dim, whole pages of them); layer l's slot s is row l * P * ps + s
        flat_cache = cache_words.reshape(-1, cache_words.shape[-1])
        num_slots, width = flat_cache.shape
        take = functools.partial(jnp.take, flat_cache, axis=0, mode="fill", fill_value=0)
    feat = max(width, q.shape[-1])
    per_layer = num_slots // read.num_layers
    base = stacked.safe_layer(read.layer, read.num_layers) * per_layer
    per_row = 4 * (n * feat + 2 * heads * n + heads * v_dim)
    max_chunk = max(1, min(num_rows, GATHER_BLOCK_BYTES // per_row))
    n_chunks = -(-num_rows // max_chunk)
    chunk = -(-num_rows // n_chunks)  # balanced: no chunk recomputes more than n_chunks-1 rows

    rows_fn = _state_rows if state else _attend_rows

    def chunk_body(c, carry):
        s0 = jnp.minimum(c * chunk, num_rows - chunk)  # clamp: the last chunk may overlap
        sl = jax.lax.dynamic_slice_in_dim(slots, s0, chunk, 0)
        ok = jax.lax.dynamic_slice_in_dim(valid, s0, chunk, 0)
        # One flat gather (measured ~2x faster on CPU than a 2-D index gather).
        sl = jnp.where(sl < per_layer, base + sl, num_slots)  # one past: no read
        kv = take(sl.reshape(-1))
        kv = _decode_rows(cache, kv, q.shape[-1]).reshape(chunk, n, -1).astype(jnp.float32)
        res = rows_fn(jax.lax.dynamic_slice_in_dim(q, s0, chunk, 0), kv, ok,
                      sm_scale=sm_scale, v_dim=v_dim, precision=precision)
        return tuple(jax.lax.dynamic_update_slice_in_dim(x, r, s0, 0)
                     for x, r in zip(carry, res, strict=True))

    init = (jnp.zeros((num_rows, heads, v_dim), jnp.float32),
            *((jnp.zeros((num_rows, heads), jnp.float32),) if state else ()),
            jnp.full((num_rows, heads), -jnp.inf, jnp.float32))
    if n_chunks == 1:
        return chunk_body(0, init)
    return jax.lax.fori_loop(0, n_chunks, chunk_body, init)
