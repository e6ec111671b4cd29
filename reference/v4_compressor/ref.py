"""The DeepSeek-V4 compressor (learned gated pooling of ``r`` tokens into one compressed entry),
over a ragged batch with per-sequence state carried across steps. Pure ``jnp``, f32, jittable.

The math (``shared/SPEC.md``, "DeepSeek-V4 attention"; the official ``inference/model.py``,
``Compressor``). The caller applies the projections: ``kv = wkv(x)``, ``score = wgate(x)``, both
``f32[T, coff * d]`` with ``coff = 2`` for ratio 4 (overlapping groups) and 1 for ratio 128.
For a token at absolute position ``p`` the gate is ``score + ape[p % r]``. Entry ``j`` of a
sequence pools the slots of group ``[r j, r j + r)`` per channel ``c``:

- ratio 128: the group's 128 tokens, half 0 (the whole ``d``-wide row);
- ratio 4: 8 slots, the previous group's 4 tokens ``r (j - 1) + k`` with the *first* half of
  their rows (channels ``[0, d)``), then the group's own 4 tokens with the *second* half
  (channels ``[d, 2 d)``). Group 0 has no previous group: those 4 slots are score ``-inf``,
  kv 0;

``pooled[c] = sum_k softmax_k(gate[k, c]) kv[k, c]``, then the weighted RMSNorm ``pooled *
rsqrt(mean(pooled**2) + eps) * norm_weight``, then RoPE on the last ``rope_dim`` dims
(interleaved pairs ``(2 i, 2 i + 1)`` rotated by angle ``r j * inv_freq[i]``: the group's *first*
token position). Entry ``j`` completes when token ``r j + r - 1`` arrives (``(p + 1) % r == 0``);
it is visible to a query at ``p`` iff ``j < (p + 1) // r``.

Batch (``reference.core.batch``): ``cu_q_lens i32[S+1]``, ``kv_lens i32[S]`` in tokens including
this step's, ``distribution i32[3]`` (only sequences ``i < distribution[2]`` are active); row ``t``
of sequence ``i`` is the token at ``kv_len - q_len + (t - q_start)``. Sequence ``i`` owns state slot
``state_slots[i]`` of the pool.

**The state contract** (``CompressorState``; ``R = coff * r`` rows per slot, 8 or 128). Slot row
``k`` is a ring: after a sequence has seen tokens ``[0, n)``, row ``k`` holds the kv row and the
gate row ``score + ape[t % r]`` (both the whole ``coff * d`` wide projections, f32) of the
*latest* token ``t < n`` with ``t % R == k``. Rows with no such token (``k >= n``) hold whatever
the slot held before (``init_compressor_state`` gives kv 0, gate ``-inf``); nothing ever reads
them. So the state is a pure function of the sequence's tokens and the slot's initial content:
any split of a sequence into prefill chunks and decode steps leaves bit-identical state, and
entries are bit-identical because every entry is computed by the same arithmetic from the same
gathered values, wherever (chunk or state) they came from. Every token an entry completing in
this step needs that precedes the step lies in the last ``R`` tokens before it (ratio 4 reads
back at most ``r + kv_old % r <= 2 r - 1`` tokens, ratio 128 at most ``kv_old % r <= r - 1``),
so the ring suffices.
A new sequence needs no reset of its slot (its stale rows are never read). A decode step writes
one row per sequence; the official code keeps (previous group, current group) halves and copies
one to the other at each completion, which holds the same values in another order.

Masking rules (jit cannot refuse runtime values): a sequence is skipped (no entry, no state
write) unless it is active, its state slot lies in ``[0, num_slots)``, ``0 <= q_len <= kv_len``
and its rows lie in ``[0, T)``. An entry whose RoPE position ``r j`` lies past the tables is not
emitted. Two active sequences sharing a state slot is a broken batch (unspecified result).

Output: at most ``max_entries(T, S, ratio) = T // r + S`` entries complete in a step (a sequence
with ``q`` new tokens completes at most ``(q + r - 1) // r <= q // r + 1``), so the entries come
in fixed-size arrays, sorted by sequence then entry number, the unused tail masked
(``CompressedEntries``). ``write_entries`` stores them in a paged compressed cache, whose page
table ``cu_lens`` counts *entries* (``reference.v4_attention.PagedKV``'s rule): entry ``j`` of
sequence ``i`` goes to page slot ``cu_lens[i] // page_size + j // page_size``, offset ``j %
page_size``.

Precision: everything f32 (``precision="bf16"`` adds the official bf16 roundings to
``finish_entries``, nothing else). Every sum and max (the softmax over slots, the pooled sum, the
norm's mean) is a fixed pairwise tree of elementwise ops (``_tree``), so an entry's bits do not
depend on the step's shapes (XLA's reductions do). The official model casts the pooled row to bf16
before the norm (its activations are bf16); the default keeps f32 throughout. Chunk invariance is
exact in both. The RoPE tables follow the official f32 steps (``yarn_inv_freq``). The official QAT
simulations (``act_quant`` on the nope dims of an attention entry; Hadamard + FP4 on an indexer
entry) are not applied here: entries leave unquantized, and ``write_entries`` quantizes only as the
cache format stores them.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import batch
from reference.core import checks as _checks
from reference.formats import fp8_cache, model1
from reference.quant.bf16 import check_precision, rounding
from reference.v4_compressor.pool import pool_coff

RATIOS = (4, 128)
ROPE_DIM = model1.V4_ROPE  # the V4 rope head dim
COMPRESS_ROPE_THETA = 160000.0
ROPE_FACTOR = 16.0
ORIGINAL_SEQ_LEN = 65536
BETA_FAST = 32
BETA_SLOW = 1
NORM_EPS = 1e-6


def compressor_coff(ratio: int) -> int:
    """Projection width factor: 2 for the overlapping ratio 4, 1 for ratio 128 (else
    ValueError)."""
    if isinstance(ratio, bool) or ratio not in RATIOS:
        raise ValueError(f"compression ratio must be one of {RATIOS}, got ratio={ratio!r}")
    return pool_coff(ratio)  # the geometry table (``pool``)


def state_rows(ratio: int) -> int:
    """Rows ``R = coff * r`` of one state slot (8 for ratio 4, 128 for ratio 128)."""
    return compressor_coff(ratio) * ratio


def max_entries(num_rows: int, num_seqs: int, ratio: int) -> int:
    """Static bound on the entries one step can complete: ``num_rows // ratio + num_seqs``."""
    compressor_coff(ratio)
    return num_rows // ratio + num_seqs


class CompressorState(NamedTuple):
    """The per-sequence partial state pool (module docstring, "the state contract").

    ``kv: f32[num_slots, R, coff * d]`` the ring of kv rows; ``score: f32[num_slots, R, coff * d]``
    the ring of gate rows (``score + ape[p % r]``); ``R = coff * r``."""

    kv: jax.Array
    score: jax.Array


class CompressedEntries(NamedTuple):
    """The entries a step completes, ``E = max_entries(T, S, r)`` slots, sorted by sequence then
    entry number; slots past the last entry have ``seq = entry = -1`` and zero rows.

    ``rows: f32[E, d]`` normed and roped (unquantized); ``seq: i32[E]`` the sequence index;
    ``entry: i32[E]`` the sequence-local entry number ``j`` (its group is ``[r j, r j + r)``)."""

    rows: jax.Array
    seq: jax.Array
    entry: jax.Array


def init_compressor_state(num_slots: int, ratio: int, dim: int) -> CompressorState:
    """A fresh pool: kv 0 and gate ``-inf`` everywhere, ``f32[num_slots, R, coff * dim]``."""
    num_slots = _checks.positive_int("num_slots", num_slots)
    dim = _checks.positive_int("dim", dim)
    shape = (num_slots, state_rows(ratio), compressor_coff(ratio) * dim)
    return CompressorState(jnp.zeros(shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32))


# ---------------------------------------------------------------------------------------------
# RoPE.

def yarn_inv_freq(rope_dim: int = ROPE_DIM, *, theta: float = COMPRESS_ROPE_THETA,
                  factor: float = ROPE_FACTOR, original_seq_len: int = ORIGINAL_SEQ_LEN,
                  beta_fast: float = BETA_FAST, beta_slow: float = BETA_SLOW) -> np.ndarray:
    """Inverse frequencies ``f32[rope_dim // 2]`` of the official ``precompute_freqs_cis``, in
    its f32 operation order: ``1 / theta ** (2 i / rope_dim)``, and with ``original_seq_len >
    0`` YaRN's blend ``f / factor * (1 - smooth) + f * smooth``, ``smooth = 1 - clip((i - low)
    / (high - low), 0, 1)``, ``low = floor(cd(beta_fast))``, ``high = ceil(cd(beta_slow))``
    clamped to ``[0, rope_dim - 1]``, ``cd(n) = rope_dim log(original_seq_len / (2 pi n)) / (2
    log theta)`` in f64 (``high`` gets +0.001 when equal to ``low``). ``original_seq_len = 0``:
    plain RoPE (the official window-only layers, theta 10000).

    Why f32 steps rather than one rounding of the exact value: the official value rounds after
    the power, the reciprocal and each blend step; the correctly rounded one differs from it by
    up to 2 ulp here (measured against a NumPy f32 emulation at theta 160000), which moves the
    angle at position 65536 by ~1e-3. The remaining difference is the platform's f32 ``pow``
    (torch's CPU and CUDA ``pow`` are not correctly rounded either)."""
    rope_dim = _checks.positive_int("rope_dim", rope_dim)
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even (interleaved pairs), got rope_dim={rope_dim}")
    f32 = np.float32
    exps = np.arange(0, rope_dim, 2, dtype=f32) / f32(rope_dim)
    freqs = f32(1.0) / (f32(theta) ** exps)
    if original_seq_len > 0:
        def cd(n):
            return (rope_dim * math.log(original_seq_len / (n * 2 * math.pi))
                    / (2 * math.log(theta)))
        low = max(math.floor(cd(beta_fast)), 0)
        high = min(math.ceil(cd(beta_slow)), rope_dim - 1)
        high = high + 0.001 if high == low else high
        ramp = np.clip((np.arange(rope_dim // 2, dtype=f32) - f32(low)) / f32(high - low),
                       f32(0), f32(1))
        smooth = f32(1) - ramp
        freqs = freqs / f32(factor) * (f32(1) - smooth) + freqs * smooth
    return freqs.astype(f32)


def rope_tables(num_positions: int, rope_dim: int = ROPE_DIM, *,
                theta: float = COMPRESS_ROPE_THETA, factor: float = ROPE_FACTOR,
                original_seq_len: int = ORIGINAL_SEQ_LEN, beta_fast: float = BETA_FAST,
                beta_slow: float = BETA_SLOW) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)``, each ``f32[num_positions, rope_dim // 2]``: row ``p`` for position ``p``.

    As the official tables: the f32 inverse frequency (``yarn_inv_freq``), the f32 angle
    ``f32(p) * inv_freq`` (one rounding, as ``torch.outer`` in f32), then cos / sin of that angle
    rounded once from f64. Defaults: the compressed layers' theta 160000 with YaRN (factor
    16, original 65536, beta 32 / 1)."""
    num_positions = _checks.positive_int("num_positions", num_positions)
    inv = yarn_inv_freq(rope_dim, theta=theta, factor=factor, original_seq_len=original_seq_len,
                        beta_fast=beta_fast, beta_slow=beta_slow)
    angle = np.arange(num_positions, dtype=np.float32)[:, None] * inv[None, :]
    angle = angle.astype(np.float64)
    return (jnp.asarray(np.cos(angle).astype(np.float32)),
            jnp.asarray(np.sin(angle).astype(np.float32)))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x f32[..., d]`` by interleaved pairs:
    ``(a, b) -> (a cos - b sin, a sin + b cos)`` with ``cos, sin f32[..., rope_dim // 2]`` (the
    official ``apply_rotary_emb``, a complex product). The first ``d - rope_dim`` dims pass."""
    rd = 2 * cos.shape[-1]
    pairs = x[..., x.shape[-1] - rd:].reshape(*x.shape[:-1], rd // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rot = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return jnp.concatenate([x[..., :x.shape[-1] - rd], rot], axis=-1)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The official ``RMSNorm`` in f32: ``weight * (x * rsqrt(mean(x**2, -1) + eps))`` (the sum
    by ``_tree``, for shape-independent rounding)."""
    var = _tree(jnp.square(x), x.ndim - 1, jnp.add, 0.0) / jnp.float32(x.shape[-1])
    return weight * (x * jax.lax.rsqrt(var + jnp.float32(eps)))


# ---------------------------------------------------------------------------------------------
# Static checks.

def _float_2d(name: str, x, shape: tuple[int, int], why: str) -> None:
    _checks.floating(name, x)
    if tuple(np.shape(x)) != shape:
        raise ValueError(f"{name} must have shape {shape} ({why}), got {tuple(np.shape(x))}")


def _check_int_vector(name: str, x, length: int, why: str) -> None:
    _checks.rank(name, x, 1)
    _checks.integer(name, x)
    _checks.dim(name, x, 0, length, why)


def check_step_args(kv, score, ape, norm_weight, cos, sin, state, state_slots, kv_lens,
                     cu_q_lens, distribution, ratio):
    """Static checks of ``compress_step``'s arguments (ValueError / TypeError naming the
    numbers; the Pallas compressor reuses them); returns ``(T, d, coff)``."""
    coff = compressor_coff(ratio)
    _checks.rank("norm_weight", norm_weight, 1)
    d = int(np.shape(norm_weight)[0])
    _checks.rank("kv", kv, 2)
    num_rows = int(np.shape(kv)[0])
    if num_rows < 1:
        raise ValueError(f"kv has T = {num_rows} rows (shape {tuple(np.shape(kv))}): a "
                         f"compressor step needs at least one row (an empty step has nothing "
                         f"to compress; skip the call)")
    width = (num_rows, coff * d)
    why = f"coff * d = {coff} * {d} for ratio {ratio}, d = norm_weight.shape[0]"
    _float_2d("kv", kv, width, f"this step's rows x {why}")
    _float_2d("score", score, width, f"kv's shape: this step's rows x {why}")
    _float_2d("ape", ape, (ratio, coff * d), f"ratio x {why}")
    _checks.floating("norm_weight", norm_weight)
    check_rope_tables(cos, sin, d)
    if not isinstance(state, CompressorState):
        raise TypeError(f"state must be a CompressorState, got {type(state).__name__}")
    _checks.rank("state.kv", state.kv, 3)
    want = (int(np.shape(state.kv)[0]), coff * ratio, coff * d)
    for name, x in (("state.kv", state.kv), ("state.score", state.score)):
        if tuple(np.shape(x)) != want or jnp.result_type(x) != jnp.float32:
            raise ValueError(f"{name} must be f32[num_slots, coff * ratio, coff * d] = f32{want}"
                             f" for ratio {ratio}, d {d}, got {jnp.result_type(x)}"
                             f"{tuple(np.shape(x))}")
    check_batch_vectors(kv_lens, state_slots, cu_q_lens, distribution)
    return num_rows, d, coff


def check_rope_tables(cos, sin, d: int) -> None:
    """``cos`` / ``sin``: one floating shape ``[positions, rope_dim // 2]`` with ``rope_dim``
    in ``[2, d]`` (``ValueError`` / ``TypeError`` naming them and the numbers)."""
    for name, x in (("cos", cos), ("sin", sin)):
        _checks.rank(name, x, 2)
        _checks.floating(name, x)
    if np.shape(cos) != np.shape(sin):
        raise ValueError(f"cos and sin must have one shape [positions, rope_dim // 2], got "
                         f"{tuple(np.shape(cos))} and {tuple(np.shape(sin))}")
    if not 0 < 2 * np.shape(cos)[1] <= d:
        raise ValueError(f"the RoPE tables rotate rope_dim = 2 * cos.shape[1] = "
                         f"{2 * np.shape(cos)[1]} dims, which must lie in [2, d = {d}]")


def check_batch_vectors(kv_lens, state_slots, cu_q_lens, distribution) -> int:
    """The compressor step's ragged batch: ``kv_lens i32[S >= 1]``, ``state_slots i32[S]``,
    ``cu_q_lens i32[S + 1]``, ``distribution i32[3]``; returns ``S``."""
    _checks.rank("kv_lens", kv_lens, 1)
    num_seqs = int(np.shape(kv_lens)[0])
    if num_seqs < 1:
        raise ValueError(f"kv_lens must hold at least one sequence slot, got shape "
                         f"{tuple(np.shape(kv_lens))}")
    _check_int_vector("kv_lens", kv_lens, num_seqs, "S")
    _check_int_vector("state_slots", state_slots, num_seqs, "len(kv_lens)")
    _check_int_vector("cu_q_lens", cu_q_lens, num_seqs + 1, "len(kv_lens) + 1")
    _check_int_vector("distribution", distribution, 3, "3 (decode_end, prefill_end, num_seqs)")
    return num_seqs


# ---------------------------------------------------------------------------------------------
# The step.

class SeqFacts(NamedTuple):
    """Per sequence ``i32[S]`` / ``bool[S]``: ``ok`` (not skipped, module docstring), first row
    ``q_start``, length before the step ``kv_old``, after it ``kv_len``, state ``slot``."""

    ok: jax.Array
    q_start: jax.Array
    kv_old: jax.Array
    kv_len: jax.Array
    slot: jax.Array


def seq_facts(kv_lens, cu_q_lens, distribution, state_slots, num_rows, num_slots) -> SeqFacts:
    """Each sequence's ``SeqFacts`` (``ok`` applies the module docstring's masking rules) for a
    step of ``num_rows`` rows over a pool of ``num_slots`` slots."""
    num_seqs = kv_lens.shape[0]
    q_start, q_end = cu_q_lens[:-1], cu_q_lens[1:]
    kv_old = kv_lens - (q_end - q_start)
    active = jnp.arange(num_seqs) < batch.num_active_seqs(distribution, num_seqs)
    ok = (active & (state_slots >= 0) & (state_slots < num_slots) & (q_start >= 0)
          & (q_end >= q_start) & (q_end <= num_rows) & (kv_old >= 0))
    return SeqFacts(ok, q_start, kv_old, kv_lens, state_slots)


def enumerate_entries(s: SeqFacts, num_entries: int, ratio: int, table_len: int):
    """``(seq, entry, valid)`` of each of the ``num_entries`` output slots: sequence ``i``
    completes entries ``[kv_old // r, kv_len // r)`` (those whose RoPE position ``r j`` lies in
    the tables), laid out by sequence."""
    first = s.kv_old // ratio
    last = jnp.minimum(s.kv_len // ratio, -(-table_len // ratio))
    count = jnp.where(s.ok, jnp.maximum(last - first, 0), 0)
    end = jnp.cumsum(count)
    e = jnp.arange(num_entries, dtype=jnp.int32)
    seq = jnp.searchsorted(end, e, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.clip(seq, 0, count.shape[0] - 1)
    valid = e < end[-1]
    entry = first[seq] + e - (end[seq] - count[seq])
    return seq, entry.astype(jnp.int32), valid


def _gather_slots(kv, score, ape, state, s: SeqFacts, seq, entry, valid, ratio, coff):
    """The pooled slots of each entry, slot-major: ``(gate, kv)`` both ``f32[R, E, d]``. Slot
    ``k`` is token ``q = r j - (coff - 1) r + k``, half ``k // r`` (ratio 4) or 0; read from
    this step's rows when ``q >= kv_old``, else from the state ring (row ``q % R``); ``q < 0``:
    gate ``-inf``, kv 0 (group 0's missing previous group). Slot-major so that the pooling
    tree halves the leading axis (whole rows; no relayout)."""
    num_rows, d = kv.shape[0], kv.shape[1] // coff
    rows_per_slot = coff * ratio
    k = jnp.arange(rows_per_slot, dtype=jnp.int32)[:, None]
    half = k // ratio if coff == 2 else jnp.zeros_like(k)
    q = ratio * entry[None, :] - (coff - 1) * ratio + k  # [R, E] token positions
    kv_old = s.kv_old[seq][None, :]
    in_chunk = valid[None, :] & (q >= kv_old)
    in_state = valid[None, :] & (q >= 0) & ~in_chunk
    row = jnp.where(in_chunk, s.q_start[seq][None, :] + q - kv_old, num_rows) * coff + half
    srow = (s.slot[seq][None, :] * rows_per_slot + q % rows_per_slot) * coff + half
    srow = jnp.where(in_state, srow, state.kv.size // d)

    def take(x, idx):
        return jnp.take(x.reshape(-1, d), idx, axis=0, mode="fill", fill_value=0)

    ape_k = ape.reshape(ratio * coff, d)[(k % ratio) * coff + half]  # [R, 1, d], static rows
    gate = jnp.where(in_chunk[..., None], take(score, row) + ape_k,
                     jnp.where(in_state[..., None], take(state.score, srow), -jnp.inf))
    vals = jnp.where(in_chunk[..., None], take(kv, row),
                     jnp.where(in_state[..., None], take(state.kv, srow), 0.0))
    # An unused output slot pools zeros (finite, then zeroed): no NaN from an all -inf softmax.
    gate = jnp.where(valid[None, :, None], gate, 0.0)
    return gate, vals


def _tree(x: jax.Array, axis: int, op, identity: float) -> jax.Array:
    """Reduce ``axis`` of ``x`` by a fixed pairwise tree of elementwise ``op`` on halves (padded
    to a power of two with ``identity``); keeps the axis with size 1.

    Why not ``jnp.sum`` / ``jnp.max``: XLA CPU's reductions (and an ``exp`` fused behind one)
    round differently for different leading sizes (measured on jax 0.10.2: one prefill call and
    the same tokens in decode steps differed in the last bit), which would break chunk
    invariance. Elementwise ops on slices give every row the same arithmetic at any shape."""
    n = x.shape[axis]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad, constant_values=identity)
    while x.shape[axis] > 1:
        h = x.shape[axis] // 2
        x = op(jax.lax.slice_in_dim(x, 0, h, axis=axis),
               jax.lax.slice_in_dim(x, h, 2 * h, axis=axis))
    return x


def _pool(gate, vals):
    """Per-channel softmax over the slots (axis 0 of ``f32[R, E, d]``) and the weighted sum:
    ``f32[E, d]``."""
    e = jnp.exp(gate - _tree(gate, 0, jnp.maximum, -jnp.inf))
    w = e / _tree(e, 0, jnp.add, 0.0)
    return _tree(w * vals, 0, jnp.add, 0.0)[0]


def _update_state(kv, score, ape, state, s: SeqFacts, kv_lens, cu_q_lens, distribution, ratio,
                  coff):
    """Write each of this step's tokens that is the latest of its ring row (``p >= kv_len -
    R``) into row ``p % R`` of its sequence's slot; nothing else changes."""
    num_rows = kv.shape[0]
    rows_per_slot = coff * ratio
    rf = batch.row_facts(num_rows, kv_lens, cu_q_lens, distribution)
    pos = rf.abs_pos
    write = rf.in_seq & s.ok[rf.seq] & (pos >= 0) & (pos >= kv_lens[rf.seq] - rows_per_slot)
    target = jnp.where(write, s.slot[rf.seq] * rows_per_slot + pos % rows_per_slot,
                       state.kv.shape[0] * rows_per_slot)
    gate = score + ape[jnp.where(write, pos, 0) % ratio]
    width = state.kv.shape[-1]
    new_kv = state.kv.reshape(-1, width).at[target].set(kv, mode="drop")
    new_score = state.score.reshape(-1, width).at[target].set(gate, mode="drop")
    return CompressorState(new_kv.reshape(state.kv.shape), new_score.reshape(state.kv.shape))


def finish_entries(pooled, norm_weight, cos, sin, seq, entry, valid, *, ratio: int,
                   eps: float, precision: str = "f32") -> CompressedEntries:
    """The pooled rows ``f32[E, d]`` of the output slots ``(seq, entry, valid)``
    (``enumerate_entries``) as ``CompressedEntries``: the weighted RMSNorm, RoPE at the group's
    first position ``r j``, unused slots zeroed and marked ``-1``. Row-wise arithmetic only
    (``rms_norm``'s fixed tree), so a row's bits do not depend on ``E``.

    ``precision="bf16"`` (``reference.quant.bf16``; the official bf16 model): the pooled row is
    rounded to bf16 before the norm, the norm's (f32) result and the RoPE's (f32) result are
    rounded to bf16 (rows stay ``f32`` arrays holding bf16 values). ``"f32"``: no rounding."""
    rb = rounding(precision)
    rows = rb(rms_norm(rb(pooled), norm_weight, eps))
    pos = jnp.where(valid, ratio * entry, 0)
    rows = rb(apply_rope(rows, cos[pos], sin[pos]))
    return CompressedEntries(jnp.where(valid[:, None], rows, 0.0), jnp.where(valid, seq, -1),
                             jnp.where(valid, entry, -1))


@functools.partial(jax.jit, static_argnames=("ratio", "eps", "precision"))
def _compress(kv, score, ape, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
              distribution, ratio, eps, precision):
    coff = compressor_coff(ratio)
    num_rows, num_seqs = kv.shape[0], kv_lens.shape[0]
    s = seq_facts(kv_lens, cu_q_lens, distribution, state_slots, num_rows, state.kv.shape[0])
    seq, entry, valid = enumerate_entries(s, max_entries(num_rows, num_seqs, ratio), ratio,
                                          cos.shape[0])
    gate, vals = _gather_slots(kv, score, ape, state, s, seq, entry, valid, ratio, coff)
    entries = finish_entries(_pool(gate, vals), norm_weight, cos, sin, seq, entry, valid,
                             ratio=ratio, eps=eps, precision=precision)
    new_state = _update_state(kv, score, ape, state, s, kv_lens, cu_q_lens, distribution,
                              ratio, coff)
    return entries, new_state


def compress_step(
    kv,  # f32|bf16[T, coff * d]: this step's wkv(x) rows
    score,  # f32|bf16[T, coff * d]: this step's wgate(x) rows (ape not added)
    ape,  # f32[r, coff * d]: the learned position bias, row p % r
    norm_weight,  # f32[d]: the RMSNorm weight
    cos,  # f32[num_positions, rope_dim // 2]: rope_tables(...)[0]
    sin,  # f32[num_positions, rope_dim // 2]
    state: CompressorState,  # f32[num_slots, coff * r, coff * d] x 2
    state_slots,  # i32[S]: each sequence's slot of the state pool
    kv_lens,  # i32[S]: tokens including this step's
    cu_q_lens,  # i32[S + 1]
    distribution,  # i32[3]
    *,
    ratio: int,
    eps: float = NORM_EPS,
    precision: str = "f32",  # "bf16": finish_entries' bf16 rounding points
) -> tuple[CompressedEntries, CompressorState]:
    """One step of the V4 compressor over a ragged batch (module docstring): pool every group
    that completes with this step's tokens, norm it, rope it at the group's first position, and
    advance each sequence's state ring.

    Returns ``(entries, state)``: ``CompressedEntries`` with ``E = max_entries(T, S, ratio)``
    slots (``rows f32[E, d]``, ``seq``/``entry i32[E]``, ``-1`` and zero rows past the last
    entry), and the updated ``CompressorState`` (only the rows of this step's tokens change;
    jit the caller with the state donated to update it in place). ``precision``: ``"f32"`` or
    ``"bf16"`` (``finish_entries``; the pooling and the state are f32 in both, as the official
    code's). Bad shapes, dtypes, a ratio other than 4 / 128 or an unknown precision raise
    ``ValueError`` naming the numbers."""
    check_precision(precision)
    check_step_args(kv, score, ape, norm_weight, cos, sin, state, state_slots, kv_lens,
                     cu_q_lens, distribution, ratio)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return _compress(f32(kv), f32(score), f32(ape), f32(norm_weight), f32(cos), f32(sin),
                     state, jnp.asarray(state_slots, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                     jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(distribution, jnp.int32),
                     ratio=ratio, eps=float(eps), precision=precision)


# ---------------------------------------------------------------------------------------------
# The compressed cache.

def entry_slots(entries: CompressedEntries, page_indices, cu_lens, *, page_size: int,
                pages_per_seq: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """``(page_id i32[E], offset i32[E])`` of each entry in a paged cache whose ``cu_lens``
    counts entries (module docstring); ``page_id == num_pages`` where the entry is dropped: an
    unused output slot, an entry at or past the capacity ``pages_per_seq * page_size``, a page
    slot outside ``page_indices`` or a page id outside ``[0, num_pages)``
    (``reference.core.batch.lookup_page``, the package's one slot rule)."""
    ok = (entries.seq >= 0) & (entries.entry >= 0)
    ok &= entries.entry < batch.capacity_tokens(page_size, pages_per_seq)
    seq = jnp.where(ok, entries.seq, 0)
    j = jnp.where(ok, entries.entry, 0)
    slot = cu_lens[seq] // page_size + j // page_size
    page_id, found = batch.lookup_page(page_indices, slot, num_pages)
    ok &= found
    return jnp.where(ok, page_id, num_pages).astype(jnp.int32), (j % page_size).astype(jnp.int32)


def write_entries(cache, entries: CompressedEntries, page_indices, cu_lens, *,
                  pages_per_seq: int, layer=None, index_scale_fmt: str | None = "ue8m0"):
    """Store ``entries`` in the paged compressed cache and return it (nothing else changes).

    ``cache``: ``f32|bf16[P, page_size, d]`` (or a stacked ``[L, P, page_size, d]`` with ``layer``):
    the rows cast to its dtype; ``reference.formats.model1.Fp8V4Cache`` (``d = 512``): FlashMLA's
    MODEL1 quantization (``write_v4_rows``); ``reference.formats.fp8_cache.Fp8IndexCache`` (``d =
    128``): the V3.2 indexer key rule with ``index_scale_fmt``. ``page_indices i32[N]``, ``cu_lens
    i32[S + 1]`` in entries, ``pages_per_seq`` static. Drop rule: ``entry_slots``."""
    pages_per_seq = _checks.positive_int("pages_per_seq", pages_per_seq)
    d = int(np.shape(entries.rows)[-1])
    for name, x in (("page_indices", page_indices), ("cu_lens", cu_lens)):
        _checks.rank(name, x, 1)
        _checks.integer(name, x)
    if isinstance(cache, model1.Fp8V4Cache | fp8_cache.Fp8IndexCache):
        num_pages, page_size, width = cache.shape[-3:]
    else:
        _checks.rank("cache", cache, 3 if layer is None else 4)
        _checks.floating("cache", cache)
        num_pages, page_size, width = np.shape(cache)[-3:]
    if width != d:
        raise ValueError(f"cache rows are {width} wide but the entries are d = {d} wide "
                         f"(cache shape {tuple(cache.shape)})")
    page_id, offset = entry_slots(entries, jnp.asarray(page_indices, jnp.int32),
                                  jnp.asarray(cu_lens, jnp.int32), page_size=int(page_size),
                                  pages_per_seq=pages_per_seq, num_pages=int(num_pages))
    if isinstance(cache, model1.Fp8V4Cache):
        flat = jnp.where(page_id < num_pages, page_id * page_size + offset, -1)
        return model1.write_v4_rows(cache, flat, entries.rows, layer=layer)
    if isinstance(cache, fp8_cache.Fp8IndexCache):
        return fp8_cache.write_index_rows(cache, page_id, offset, entries.rows,
                                          scale_fmt=index_scale_fmt, layer=layer)
    at = (page_id, offset) if layer is None else (layer, page_id, offset)
    return cache.at[at].set(entries.rows.astype(cache.dtype), mode="drop")
