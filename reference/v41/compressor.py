"""DeepSeek-V4.1's ratio-1 and ratio-2 KV compressors, pure ``jnp``, in the official bf16 regime,
over a ragged batch with per-sequence state; chunk-invariant bit for bit.

Source (read, restated, not copied): the official ``inference/model.py`` of the
``deepseek-ai/DeepSeek-V4.1-Flash`` release, read in a byte-identical vendored copy (header
"Vendored from huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash, revision dba1be0a40aa..., file
inference/model.py"; code-index file id 70871433627): ``Compressor.__init__`` / ``forward``,
``Attention._compress_kv`` (RoPE then ``fp4_act_quant(latent, 16, True, e4m3)``),
``precompute_freqs_cis``, ``apply_rotary_emb``, ``RMSNorm``.

The math. The caller applies the projections (as ``reference.v4_compressor``): ``kv = wkv(x)``
and, for ratio 2, ``score = wgate(x)``, both ``[T, d]`` (no ``coff``: V4.1 has no overlap).

- **Ratio 1** (no gate, no state, no f32): entry ``j`` is token ``j``; ``latent = norm(kv)`` with
  ``kv`` the bf16 output of the bf16 ``wkv`` (rounded to bf16 here).
- **Ratio 2** (``wkv`` / ``wgate`` in f32 on ``x.float()``): entry ``j`` pools tokens ``2 j`` and
  ``2 j + 1`` per channel ``c``: ``pooled[c] = sum_k softmax_k(score[k, c]) kv[k, c]`` in f32,
  **no** ``ape``; then ``latent = norm(bf16(pooled))``.
- ``norm`` is the official ``RMSNorm``: ``bf16(weight * (x * rsqrt(mean(x**2) + eps)))`` in f32,
  ``eps = rms_norm_eps = 1e-20`` (``V41Config``), the weight the checkpoint's (bf16 values).
- **RoPE** on the last ``rope_dim = 64`` dims, interleaved pairs, entry ``j`` at position
  ``r j`` (the group's first token), the compressed layers' tables (``compressed_rope_tables``:
  theta 160000 with YaRN factor 16 over 65536, beta 32 / 1), f32 arithmetic on the bf16 latent,
  the result written back in bf16.
- **Quantizer**: the compressed-kv fp4 / e4m3-16 rule over all ``d`` dims, after RoPE, applied
  in place (quantize, dequantize: ``reference.v41.formats``); the dequantized row is exact in
  bf16.

``output`` picks the stage returned: ``"latent"`` (normed, pre-RoPE: the indexer's input for
index keys, ``k_norm(wk(latent))``), ``"roped"`` (what ``encode_compressed_kv`` stores as bytes)
or ``"cache"`` (default: the dequantized row attention reads). The three are one computation;
``encode_compressed_kv`` of ``"cache"`` rows is not always the bytes of ``"roped"`` rows (an e4m3
scale that rounded up does not round-trip), so a cache writer encodes ``"roped"``.

Visibility: entry ``j`` completes when token ``r j + r - 1`` arrives and is visible to a query at
``p`` iff ``j < (p + 1) // r`` (``reference.core.batch.entries_of_tokens(p + 1, r)``).

Batch, masking, output layout and paged writes: exactly ``reference.v4_compressor``'s
(``cu_q_lens i32[S+1]``, ``kv_lens i32[S]`` including this step's tokens, ``distribution
i32[3]``, ``state_slots i32[S]``; ``CompressedEntries`` with ``max_entries(T, S, r) = T // r + S``
slots sorted by sequence then entry; ``seq_facts`` / ``enumerate_entries`` reused as they are).

**The state** (ratio 2 only; ratio 1 keeps none and takes ``state=None``):
``reference.v4_compressor.CompressorState`` with ``R = r = 2`` rows per slot, ``kv`` and
``score`` ``f32[num_slots, 2, d]``. Row ``k`` holds the kv and score rows of the latest token
``t`` with ``t % 2 == k`` (written when ``t >= kv_len - 2``). The official code parks a prefill's
trailing odd token (an even position) in row 0 and fills row ``p % 2`` at each decode step; the
ring holds the same values. Generalised here (the official code has no chunked prefill): a chunk
starting on an odd position ``p`` takes token ``p - 1`` from row 0. Rows no entry needs are never
read, so the state is a pure function of the tokens and any split into prefill chunks and
decodes gives bit-identical entries (every sum is ``reference.v4_compressor``'s fixed tree).

Assumptions beyond the official text: the cos / sin tables are ``reference.v4_compressor``'s
(cos / sin of the f32 angle rounded once from f64; torch's ``polar`` evaluates them in f32,
which may differ by an ulp); the norm's mean is a fixed pairwise tree (torch's reduction order
is unspecified).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.core import checks as _checks
from reference.quant.bf16 import round_bf16
from reference.v4_compressor import ref as v4
from reference.v41.config import RATIOS, V41Config, v41_flash
from reference.v41.formats import (
    compressed_kv_bytes,
    decode_compressed_kv,
    encode_compressed_kv,
)

__all__ = [
    "COMPRESSED_RATIOS", "OUTPUTS", "compress_step", "compressed_rope_tables",
    "init_compressor_state", "max_entries", "visible_entries", "write_compressed_entries",
]

COMPRESSED_RATIOS = tuple(r for r in RATIOS if r)  # (1, 2): the ratios that compress
OUTPUTS = ("latent", "roped", "cache")
_FLASH = v41_flash()


def _ratio(ratio) -> int:
    if isinstance(ratio, bool) or ratio not in COMPRESSED_RATIOS:
        raise ValueError(f"V4.1 compression ratio must be one of {COMPRESSED_RATIOS}, got "
                         f"ratio={ratio!r}")
    return int(ratio)


def max_entries(num_rows: int, num_seqs: int, ratio: int) -> int:
    """Static bound on the entries one step completes, ``num_rows // ratio + num_seqs``
    (``reference.v4_compressor.max_entries``' rule, whose ratio check admits only 4 / 128)."""
    return num_rows // _ratio(ratio) + num_seqs


def visible_entries(pos: jax.Array | int, ratio: int) -> jax.Array | int:
    """Entries a query at absolute position ``pos`` (i32, any shape) may see: ``(pos + 1) //
    ratio`` (entry ``j`` visible iff ``j < `` this), same shape."""
    return batch.entries_of_tokens(pos + 1, _ratio(ratio))


def compressed_rope_tables(num_positions: int, config: V41Config | None = None):
    """``(cos, sin)``, each ``f32[num_positions, rope_dim // 2]``: the compressed layers' RoPE
    (``config``'s ``compress_rope_theta`` with YaRN; default V4.1-Flash: 160000, factor 16 over
    65536, beta 32 / 1, ``rope_dim`` 64), built by ``reference.v4_compressor.rope_tables``."""
    c = _FLASH if config is None else config
    return v4.rope_tables(num_positions, c.rope_head_dim, theta=c.compress_rope_theta,
                          factor=c.rope_factor, original_seq_len=c.original_seq_len,
                          beta_fast=c.beta_fast, beta_slow=c.beta_slow)


def init_compressor_state(num_slots: int, dim: int, ratio: int = 2) -> v4.CompressorState | None:
    """A fresh ratio-2 pool, ``CompressorState`` of kv 0 and score ``-inf``, both ``f32[num_slots,
    2, dim]`` (any initial content works: no stale row is read); ratio 1: ``None``."""
    if _ratio(ratio) == 1:
        return None
    num_slots = _checks.positive_int("num_slots", num_slots)
    shape = (num_slots, ratio, _checks.positive_int("dim", dim))
    return v4.CompressorState(jnp.zeros(shape, jnp.float32),
                              jnp.full(shape, -jnp.inf, jnp.float32))


# ---------------------------------------------------------------------------------------------
# Static checks.

def check_step_args(kv, score, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
                    distribution, ratio, output) -> None:
    """``compress_step``'s static checks (also the Pallas entry's,
    ``pallas_kernels.v41_compressor``): ``ValueError`` / ``TypeError`` naming the numbers."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got output={output!r}")
    _checks.rank("norm_weight", norm_weight, 1)
    _checks.floating("norm_weight", norm_weight)
    d = int(np.shape(norm_weight)[0])
    _checks.rank("kv", kv, 2)
    _checks.floating("kv", kv)
    if np.shape(kv)[0] < 1 or np.shape(kv)[1] != d:
        raise ValueError(f"kv must have shape [T >= 1, d = norm_weight.shape[0] = {d}], got "
                         f"{tuple(np.shape(kv))}")
    if ratio == 1:
        if score is not None or state is not None:
            raise ValueError("ratio 1 has no gate and no state: pass score=None and state=None")
    else:
        _checks.floating("score", score)
        if np.shape(score) != np.shape(kv):
            raise ValueError(f"score must have kv's shape {tuple(np.shape(kv))}, got "
                             f"{tuple(np.shape(score))}")
        if not isinstance(state, v4.CompressorState):
            raise TypeError(f"state must be a CompressorState, got {type(state).__name__}")
        _checks.rank("state.kv", state.kv, 3)
        want = (int(np.shape(state.kv)[0]), ratio, d)
        for name, x in (("state.kv", state.kv), ("state.score", state.score)):
            if tuple(np.shape(x)) != want or jnp.result_type(x) != jnp.float32:
                raise ValueError(f"{name} must be f32[num_slots, ratio, d] = f32{want}, got "
                                 f"{jnp.result_type(x)}{tuple(np.shape(x))}")
    v4.check_rope_tables(cos, sin, d)
    v4.check_batch_vectors(kv_lens, state_slots, cu_q_lens, distribution)


# ---------------------------------------------------------------------------------------------
# The step.

def _gather(kv, score, state, s: v4.SeqFacts, seq, entry, valid, ratio):
    """Each entry's ``ratio`` tokens, slot-major ``(gate, vals)`` both ``f32[r, E, d]``: token
    ``q = r j + k`` from this step's rows when ``q >= kv_old``, else from state row ``q % r``.
    Unused output slots read nothing (gate 0, kv 0); ratio 1 has no gate (``None``)."""
    num_rows, d = kv.shape
    k = jnp.arange(ratio, dtype=jnp.int32)[:, None]
    q = ratio * entry[None, :] + k
    kv_old = s.kv_old[seq][None, :]
    in_chunk = valid[None, :] & (q >= kv_old)
    row = jnp.where(in_chunk, s.q_start[seq][None, :] + q - kv_old, num_rows)

    def take(x, idx):
        return jnp.take(x.reshape(-1, d), idx, axis=0, mode="fill", fill_value=0)

    vals = take(kv, row)
    if ratio == 1:
        return None, vals
    in_state = valid[None, :] & (q >= 0) & ~in_chunk
    srow = jnp.where(in_state, s.slot[seq][None, :] * ratio + q % ratio, state.kv.size // d)
    gate = jnp.where(in_chunk[..., None], take(score, row), take(state.score, srow))
    vals = jnp.where(in_chunk[..., None], vals, take(state.kv, srow))
    return jnp.where(valid[None, :, None], gate, 0.0), vals


def _update_state(kv, score, state, s: v4.SeqFacts, kv_lens, cu_q_lens, distribution, ratio):
    """Write each token that is the latest of its ring row (``p >= kv_len - r``) into row
    ``p % r`` of its sequence's slot; nothing else changes."""
    rf = batch.row_facts(kv.shape[0], kv_lens, cu_q_lens, distribution)
    pos = rf.abs_pos
    write = rf.in_seq & s.ok[rf.seq] & (pos >= 0) & (pos >= kv_lens[rf.seq] - ratio)
    target = jnp.where(write, s.slot[rf.seq] * ratio + pos % ratio, state.kv.shape[0] * ratio)
    d = state.kv.shape[-1]
    new_kv = state.kv.reshape(-1, d).at[target].set(kv, mode="drop")
    new_score = state.score.reshape(-1, d).at[target].set(score, mode="drop")
    return v4.CompressorState(new_kv.reshape(state.kv.shape), new_score.reshape(state.kv.shape))


def _finish(pooled, norm_weight, cos, sin, entry, valid, ratio, eps, output):
    """bf16 cast, norm (bf16 out), RoPE at ``r j`` (bf16 out), fp4 QAT; row-wise only."""
    rows = round_bf16(v4.rms_norm(round_bf16(pooled), norm_weight, eps))
    if output != "latent":
        pos = jnp.where(valid, ratio * entry, 0)
        rows = round_bf16(v4.apply_rope(rows, cos[pos], sin[pos]))
    if output == "cache":
        rows = decode_compressed_kv(encode_compressed_kv(rows))
    return jnp.where(valid[:, None], rows, 0.0)


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "output"))
def _compress(kv, score, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
              distribution, ratio, eps, output):
    num_rows, num_seqs = kv.shape[0], kv_lens.shape[0]
    num_slots = 1 if state is None else state.kv.shape[0]
    if state is None:  # ratio 1 keeps no state: its slots are not read
        state_slots = jnp.zeros_like(state_slots)
    s = v4.seq_facts(kv_lens, cu_q_lens, distribution, state_slots, num_rows, num_slots)
    seq, entry, valid = v4.enumerate_entries(s, max_entries(num_rows, num_seqs, ratio), ratio,
                                             cos.shape[0])
    gate, vals = _gather(kv, score, state, s, seq, entry, valid, ratio)
    pooled = vals[0] if ratio == 1 else v4._pool(gate, vals)
    rows = _finish(pooled, norm_weight, cos, sin, entry, valid, ratio, eps, output)
    entries = v4.CompressedEntries(rows, jnp.where(valid, seq, -1), jnp.where(valid, entry, -1))
    if ratio == 1:
        return entries, None
    return entries, _update_state(kv, score, state, s, kv_lens, cu_q_lens, distribution, ratio)


def compress_step(
    kv,  # f32|bf16[T, d]: wkv(x) rows (ratio 1: the bf16 projection; ratio 2: f32)
    score,  # f32[T, d]: wgate(x) rows (ratio 2); None for ratio 1
    norm_weight,  # f32|bf16[d]: the compressor's RMSNorm weight
    cos,  # f32[num_positions, rope_dim // 2]: compressed_rope_tables(...)[0]
    sin,  # f32[num_positions, rope_dim // 2]
    state: v4.CompressorState | None,  # ratio 2: f32[num_slots, 2, d] x 2; ratio 1: None
    state_slots,  # i32[S]: each sequence's slot of the state pool (ignored for ratio 1)
    kv_lens,  # i32[S]: tokens including this step's
    cu_q_lens,  # i32[S + 1]
    distribution,  # i32[3]
    *,
    ratio: int,
    eps: float = _FLASH.rms_norm_eps,
    output: str = "cache",
) -> tuple[v4.CompressedEntries, v4.CompressorState | None]:
    """One step of a V4.1 compressor (ratio 1 or 2) over a ragged batch (module docstring):
    every entry completing with this step's tokens, normed, roped at ``r j`` and quantized as
    the official bf16 model does, and the advanced state.

    Returns ``(entries, state)``: ``reference.v4_compressor.CompressedEntries`` with ``E = T //
    r + S`` slots (``rows f32[E, d]`` holding bf16 values: the ``output`` stage, ``"latent"`` /
    ``"roped"`` / ``"cache"``; ``seq`` / ``entry i32[E]``, ``-1`` and zero rows past the last
    entry), and the new ``CompressorState`` (ratio 2; ``None`` for ratio 1). Bad shapes,
    dtypes, a ratio other than 1 / 2 or an unknown ``output`` raise ``ValueError`` /
    ``TypeError`` naming the numbers."""
    ratio = _ratio(ratio)
    check_step_args(kv, score, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
                distribution, ratio, output)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return _compress(f32(kv), None if score is None else f32(score), f32(norm_weight), f32(cos),
                     f32(sin), state, i32(state_slots), i32(kv_lens), i32(cu_q_lens),
                     i32(distribution), ratio=ratio, eps=float(eps), output=output)


# ---------------------------------------------------------------------------------------------
# The stored compressed cache.

def write_compressed_entries(cache, entries: v4.CompressedEntries, page_indices, cu_lens, *,
                             pages_per_seq: int, layer: int | None = None) -> jax.Array:
    """Store ``entries`` (``output="roped"`` rows) as V4.1 compressed-kv bytes
    (``encode_compressed_kv``: fp4 / e4m3-16, ``9 d / 16`` bytes a row) in a paged cache
    ``u8[P, page_size, 9 d / 16]`` (or stacked ``u8[L, P, page_size, 9 d / 16]`` with
    ``layer``) and return it. Slots: ``reference.v4_compressor.entry_slots`` (``cu_lens i32[S +
    1]`` in entries, ``page_indices i32[N]``; dropped entries write nothing)."""
    pages_per_seq = _checks.positive_int("pages_per_seq", pages_per_seq)
    want_rank = 3 if layer is None else 4
    _checks.rank("cache", cache, want_rank)
    if jnp.result_type(cache) != jnp.uint8:
        raise ValueError(f"cache must have dtype uint8, got {jnp.result_type(cache)}")
    for name, x in (("page_indices", page_indices), ("cu_lens", cu_lens)):
        _checks.rank(name, x, 1)
        _checks.integer(name, x)
    num_pages, page_size, width = np.shape(cache)[-3:]
    d = int(np.shape(entries.rows)[-1])
    if width != compressed_kv_bytes(d):
        raise ValueError(f"cache rows are {width} bytes but entries of d = {d} take "
                         f"compressed_kv_bytes({d}) = {compressed_kv_bytes(d)}")
    page_id, offset = v4.entry_slots(entries, jnp.asarray(page_indices, jnp.int32),
                                     jnp.asarray(cu_lens, jnp.int32), page_size=int(page_size),
                                     pages_per_seq=pages_per_seq, num_pages=int(num_pages))
    at = (page_id, offset) if layer is None else (layer, page_id, offset)
    return jnp.asarray(cache).at[at].set(encode_compressed_kv(entries.rows), mode="drop")
