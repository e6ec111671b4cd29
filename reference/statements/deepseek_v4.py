"""A statement of the official DeepSeek-V4 attention layer (``inference/model.py``: ``Attention``,
``Compressor``, ``Indexer``, ``sparse_attn``), dense (not paged), pure ``jnp``, f32 or the official
bf16 regime, jittable. It is the independent definition the paged V4 step is checked against: it
does not use ``reference.v4_attention``. Written from the math in ``shared/SPEC.md`` ("DeepSeek-V4
attention") and the public code's behaviour; no code is copied.

One layer, ``config.compress_ratio = compress_ratios[layer_id]``: 0 window only, 4 CSA (window
union the indexer's top-k compressed entries), 128 HCA (window union every visible compressed
entry). For the tokens ``x f32[B, S, dim]`` at absolute positions ``p = start_pos + t``:

- query: ``qr = q_norm(wq_a(x))``, ``q = wq_b(qr)`` as ``[B, S, n_heads, head_dim]``, a
  weightless per-head RMSNorm ``q * rsqrt(mean(q**2) + norm_eps)``, RoPE at ``p`` on the last
  ``rope_head_dim`` dims (interleaved pairs). Compressed layers use ``compress_rope_theta`` with
  YaRN (``rope_factor``, ``original_seq_len``, ``beta_fast``, ``beta_slow``); window-only layers
  ``rope_theta`` without YaRN (the official code sets ``original_seq_len = 0`` there).
- window keys: ``kv = rope(kv_norm(wkv(x)))``, one ``head_dim``-wide head (512 in V4),
  **K = V = the whole row**;
  query ``p`` sees the tokens ``max(0, p - window_size + 1) .. p``.
- compressed entries (``r > 0``): the compressor (``reference.v4_compressor.compress_step``,
  learned gated pooling per channel, ratio 4 overlapping, weighted RMSNorm, RoPE at the group's
  first token) over ``compressor.*``; entry ``j`` is visible to ``p`` iff ``j < (p + 1) // r``.
  Ratio 128: every visible entry. Ratio 4: the indexer's top ``index_topk`` visible entries by
  ``score_j = sum_h w_h relu(q_h . k_j)`` (``q = rope(indexer.wq_b(qr))``, ``k`` the entries of
  its own ratio-4 compressor of width ``index_head_dim``, ``w = weights_proj(x) *
  index_head_dim**-0.5 * index_n_heads**-0.5``); fewer than ``index_topk`` visible: all of them.
  Ties go to the lower entry number (``lax.top_k``).
- attention: one softmax per head over the window keys union the chosen entries (no dedup),
  scale ``head_dim**-0.5``, the head's ``attn_sink`` logit in the denominator only:
  ``o = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))``.
- output: inverse RoPE at ``p`` on ``o``'s last ``rope_head_dim`` dims; the heads split into
  ``o_groups`` contiguous groups, each ``[n_heads / o_groups * head_dim]`` row projected by its
  own ``wo_a`` block (``wo_a.weight`` viewed as ``[o_groups, o_lora_rank, n_heads * head_dim /
  o_groups]``), then ``wo_b`` on the ``o_groups * o_lora_rank`` concatenation.

The per-token ends (the query, window key, compressor and indexer inputs; the output stage; the
RoPE tables) are the public functions of ``reference.statements.deepseek_v4_layer``
(``project_layer_inputs``, ``layer_output``, ``rope_tables``), which ``_layer`` calls and
``dsa_jax.v4_project`` / ``v4_output`` / ``v4_rope_tables`` expose.

Weights are torch ``Linear`` weights ``[out, in]`` (``y = x @ W.T``) keyed by the official
checkpoint's names (``param_shapes``), dequantized to f32/bf16 (the checkpoint's fp8 ``.scale``
tensors are the caller's business).

Calls: prefill at ``start_pos = 0``, then one-token decodes (``S = 1``, ``start_pos`` = the
length so far), as the official code; any chunk whose state holds exactly the tokens
``[0, start_pos)`` follows the same rule. ``start_pos`` may be a traced i32 scalar (one
compile serves every decode step); a Python int is checked against ``max_seq_len``.

State (``V4LayerState``, per batch row): the window ring (row ``q % window_size`` holds token
``q``'s key, for the latest ``window_size`` tokens), the compressed entries ``[max_seq_len //
r]`` (row ``j`` = entry ``j`` once complete, as stored: after the QAT simulation when on), the
indexer's compressed keys (ratio 4), and both compressors' partial states (the
``reference.v4_compressor`` ring contract; slot ``b`` = batch row ``b``).

QAT (``qat=True``, the official tilelang simulations, ``act_quant_sim`` /
``fp4_act_quant_sim``): fp8 e4m3 with ue8m0 block-64 scales on the nope dims of the window keys
and of the compressed entries (power-of-two scales: the released config's ``scale_fmt =
"ue8m0"``); on the indexer, a normalized Hadamard rotation of the whole ``index_head_dim`` row
then FP4 e2m1 with ue8m0 block-32 scales, on the query and on the compressed keys. ``qat=False``
applies none of them and skips the rotation (orthogonal: it changes no score in exact
arithmetic). Not simulated: the fp8 activation quantization inside the fp8/fp4 GEMMs of the
linear layers (``act_quant`` block 128 feeding ``fp8_gemm`` / ``fp4_gemm`` in the released fp8
config), in either regime.

Precision regimes (``precision``; ``reference.quant.bf16``). ``"f32"``: every activation and
parameter f32, no rounding. ``"bf16"`` (the default, ``V4_DEFAULT_PRECISION``, since issue 27):
the official code's regime (its default
dtype is bf16; the ``args.dtype = "bf16"`` Linears, ``F.linear``), each value rounded to bf16
(nearest even) at these points and held in f32 arrays between them:
- the input ``x``; the weights ``BF16_WEIGHTS`` (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``,
  ``wo_b``, ``indexer.wq_b``, ``indexer.weights_proj``: bf16 in the official model). The
  compressors' ``wkv`` / ``wgate``, the ``ape``, the norm weights and ``attn_sink`` are f32
  parameters there and are used as given;
- every Linear output, once (an f32-accumulated matmul of bf16 values); RMSNorm (``q_norm``,
  ``kv_norm``) computed in f32, the weight multiply included, rounded once;
- the weightless q norm as bf16 tensor ops: ``q**2``, the mean (f32 sum), ``+ eps``,
  ``rsqrt``, the product, each rounded; RoPE (and the output's inverse RoPE) computed in f32,
  rounded;
- the compressors: projections of the bf16 ``x`` with the f32 weights, gate, pooling and state
  in f32; the pooled row rounded before its norm, the norm and the RoPE rounded
  (``reference.v4_compressor.finish_entries``); the indexer's Hadamard rotation (keys and q)
  computed in f32 and rounded before the fp4 simulation;
- the indexer: ``q`` rounded after ``wq_b`` and after RoPE; ``w = bf16(bf16(weights_proj(x)) *
  f32(index_head_dim**-0.5 * index_n_heads**-0.5))``; each dot ``q_h . k_j`` rounded, ``relu``,
  each ``relu * w_h`` rounded, the head sum accumulated in f32 and rounded once; top-k on those
  bf16 scores (ties to the lower entry number, as the official CUDA ``torch.topk``; its CPU
  ``topk`` resolves exact ties in another order);
- attention: f32 logits of the bf16 q and keys, times the scale after the dot; the
  probabilities ``e^(s - m)`` rounded before ``P @ V`` (f32 accumulation) while the denominator
  sums them unrounded; the output rounded. ``m`` is the final max over the row's keys: the
  official kernel's running max per block of 64 keys can move a rounded ``P`` by 1 bf16 ulp;
- the inverse RoPE, the grouped ``wo_a`` and ``wo_b`` outputs rounded; the layer output is
  returned as bf16.
The fp8 / fp4 simulations take the bf16 values (their results are bf16-exact).

Precision and what is exact: XLA's CPU dot rounds differently for different row counts (measured on
jax 0.10.2: a 64-deep f32 product of 1 row vs the same row among 130 differed by ~1e-6 relative), so
a prefill and the same tokens in decode steps agree to f32 rounding (measured: outputs within 4e-7
of ~0.3, QAT on or off), not bit for bit; the compressor itself is chunk invariant bit for bit given
its projections (``reference.v4_compressor``). The indexer's top-k can therefore flip at near-ties;
compare selections by score (``return_selection``). Under ``"bf16"`` such an f32 difference can
round a value to the adjacent bf16 (or move a QAT code); measured on the tiny config (prefill
125-126 then 5 decodes, and 37 then 8): outputs within 1 bf16 ulp in under 0.6% of the elements,
states and CSA selections identical."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.core import checks as _checks
from reference.quant.bf16 import PRECISIONS, V4_DEFAULT_PRECISION, check_precision, rounding
from reference.quant.qat import (
    QAT_FP4_BLOCK,
    QAT_FP8_BLOCK,
    act_quant_sim,  # noqa: F401
    fp4_act_quant_sim,
    hadamard_rotate,
)
from reference.statements.deepseek_v4_config import (
    FLASH_COMPRESS_RATIOS,  # noqa: F401
    LAYER_TYPES,  # noqa: F401
    PRO_COMPRESS_RATIOS,  # noqa: F401
    V4AttentionConfig,  # noqa: F401
    _compressor_shapes,  # noqa: F401
    check_params,  # noqa: F401
    config_from_model_args,  # noqa: F401
    flash_config,  # noqa: F401
    init_params,  # noqa: F401
    param_shapes,  # noqa: F401
    pro_config,  # noqa: F401
    tiny_config,  # noqa: F401
)
from reference.statements.deepseek_v4_layer import (
    BF16_WEIGHTS,
    _identity,
    _linear,  # noqa: F401
    _nope_fp8,
    _regime_params,
    layer_output,
    project_layer_inputs,
    rope_tables,
)
from reference.v4_compressor import ref as vc

_rope = rope_tables  # the per-layer-type RoPE tables (kept under their old private name)

# The QAT simulations it applies (act_quant_sim, fp4_act_quant_sim, hadamard_rotate, their
# constants) are reference.quant.qat's.
__all__ = [
    "BF16_WEIGHTS", "FLASH_COMPRESS_RATIOS", "LAYER_TYPES", "PRECISIONS", "PRO_COMPRESS_RATIOS",
    "IndexSelection",
    "V4AttentionConfig", "V4LayerState", "attention_layer", "check_params",
    "config_from_model_args", "flash_config", "init_params", "init_state", "init_state_shapes",
    "param_shapes", "pro_config", "tiny_config",
]

# ---------------------------------------------------------------------------------------------
# State.

@dataclasses.dataclass(frozen=True)
class V4LayerState:
    """One layer's dense decode state (module docstring), a pytree with ``max_seq_len`` static.

    ``window: f32[B, window_size, head_dim]`` the ring; ``compressed: f32[B, max_seq_len // r,
    head_dim]`` (``r = 0``: ``[B, 0, head_dim]``); ``compressor`` the attention compressor's
    ``CompressorState`` (slot = batch row; ``None`` when ``r = 0``); ``index_keys: f32[B,
    max_seq_len // 4, index_head_dim]`` and ``index_compressor`` (ratio 4 only, else ``None``)."""

    window: jax.Array
    compressed: jax.Array
    compressor: vc.CompressorState | None
    index_keys: jax.Array | None
    index_compressor: vc.CompressorState | None
    max_seq_len: int


jax.tree_util.register_dataclass(
    V4LayerState, data_fields=["window", "compressed", "compressor", "index_keys",
                               "index_compressor"], meta_fields=["max_seq_len"])


def init_state(config: V4AttentionConfig, batch: int, max_seq_len: int) -> V4LayerState:
    """An empty state for ``batch`` sequences of up to ``max_seq_len`` tokens (zeros; the
    compressors' fresh pools)."""
    batch = _checks.positive_int("batch", batch)
    max_seq_len = _checks.positive_int("max_seq_len", max_seq_len)
    c, r = config, config.compress_ratio
    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
    n_entries = max_seq_len // r if r else 0
    state = V4LayerState(window=zeros((batch, c.window_size, c.head_dim)),
                         compressed=zeros((batch, n_entries, c.head_dim)), compressor=None,
                         index_keys=None, index_compressor=None, max_seq_len=max_seq_len)
    if r:
        state = dataclasses.replace(state,
                                    compressor=vc.init_compressor_state(batch, r, c.head_dim))
    if r == 4:
        state = dataclasses.replace(
            state, index_keys=zeros((batch, max_seq_len // 4, c.index_head_dim)),
            index_compressor=vc.init_compressor_state(batch, 4, c.index_head_dim))
    return state


def _check_state(state, config: V4AttentionConfig, batch: int) -> None:
    if not isinstance(state, V4LayerState):
        raise TypeError(f"state must be a V4LayerState (init_state), got "
                        f"{type(state).__name__}")
    want = init_state_shapes(config, batch, state.max_seq_len)
    for name, shape in want.items():
        part = getattr(state, name)
        got = None if part is None else tuple(np.shape(part if name in (
            "window", "compressed", "index_keys") else part.kv))
        if got != shape:
            want_text = "be absent (None)" if shape is None else f"have shape {shape}"
            raise ValueError(f"state.{name} must {want_text} for batch {batch}, "
                             f"max_seq_len {state.max_seq_len}, ratio {config.compress_ratio}, "
                             f"got {got}")


def init_state_shapes(config: V4AttentionConfig, batch: int,
                      max_seq_len: int) -> dict[str, tuple[int, ...] | None]:
    """The shapes ``init_state`` gives (a compressor state by its ``kv`` pool; ``None`` when
    absent), for checking a state passed in."""
    c, r = config, config.compress_ratio
    coff = vc.compressor_coff(r) if r else 0
    return {
        "window": (batch, c.window_size, c.head_dim),
        "compressed": (batch, max_seq_len // r if r else 0, c.head_dim),
        "compressor": (batch, coff * r, coff * c.head_dim) if r else None,
        "index_keys": (batch, max_seq_len // 4, c.index_head_dim) if r == 4 else None,
        "index_compressor": (batch, 8, 2 * c.index_head_dim) if r == 4 else None,
    }


# ---------------------------------------------------------------------------------------------
# The layer.

class IndexSelection(NamedTuple):
    """A CSA layer's indexer result: ``topk i32[B, S, k]`` entry numbers (``k = min(index_topk,
    max_seq_len // 4)``, best first, ``-1`` where fewer entries are visible) and ``scores
    f32[B, S, max_seq_len // 4]`` (``-inf`` on invisible entries)."""

    topk: jax.Array
    scores: jax.Array


def _compress(params, prefix, kv, score, start_pos, comp_state, cache, ratio, cos, sin, eps,
              finish, precision):
    """Run the compressor over this chunk's projections ``kv`` / ``score [B, S, w]``
    (``project_layer_inputs``: f32, as the official ``x.float()`` with f32 weights;
    ``reference.v4_compressor.compress_step``, one sequence per batch row), pass the
    completed entries through ``finish`` (the QAT, or identity) and store
    entry ``j`` of row ``b`` at ``cache[b, j]``. Returns ``(cache, comp_state)``."""
    b, s = kv.shape[:2]
    kv, score = kv.reshape(b * s, -1), score.reshape(b * s, -1)
    kv_lens = jnp.full((b,), start_pos + s, jnp.int32)
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * s
    distribution = jnp.array([b if s == 1 else 0, b, b], jnp.int32)
    entries, comp_state = vc.compress_step(
        kv, score, params[f"{prefix}.ape"], params[f"{prefix}.norm.weight"], cos, sin,
        comp_state, jnp.arange(b, dtype=jnp.int32), kv_lens, cu_q_lens, distribution,
        ratio=ratio, eps=eps, precision=precision)
    row = jnp.where(entries.seq >= 0, entries.seq, b)  # unused output slots: dropped
    cache = cache.at[row, entries.entry].set(finish(entries.rows), mode="drop")
    return cache, comp_state


def _window_keys(state, kv, start_pos):
    """The window's candidate keys: the ring (positions before the chunk) then the chunk.
    Returns ``(keys f32[B, W + S, D], pos i32[W + S])`` (``pos < 0``: empty ring row) and the
    updated ring (each chunk token among the last ``W`` written at row ``p % W``)."""
    w, s = state.window.shape[1], kv.shape[1]
    k = jnp.arange(w, dtype=jnp.int32)
    ring_pos = start_pos - 1 - jnp.mod(start_pos - 1 - k, w)  # latest q < start_pos, q % w == k
    chunk_pos = start_pos + jnp.arange(s, dtype=jnp.int32)
    keys = jnp.concatenate([state.window, kv], axis=1)
    pos = jnp.concatenate([ring_pos, chunk_pos])
    row = jnp.where(chunk_pos >= start_pos + s - w, chunk_pos % w, w)
    ring = state.window.at[:, row].set(kv, mode="drop")
    return keys, pos, ring


def _index_score(q, keys, w, precision):
    """``score f32[B, S, E] = sum_h w_h relu(q_h . k_j)`` for ``q f32[B, S, H, D]``, ``keys
    f32[B, E, D]``, ``w f32[B, S, H]``. ``"bf16"``: each dot rounded to bf16, each product
    ``relu(dot) * w_h`` rounded to bf16, the head sum accumulated in f32 and rounded once."""
    dots = jnp.einsum("bshd,bjd->bshj", q, keys)
    if precision == "f32":
        return jnp.einsum("bsh,bshj->bsj", w, jax.nn.relu(dots))
    rb = rounding(precision)
    return rb(jnp.sum(rb(jax.nn.relu(rb(dots)) * w[..., None]), axis=2))


def _indexer(params, inp, start_pos, state, config, qat, precision):
    """The CSA indexer on ``project_layer_inputs``'s ``inp``: update its compressed keys, score
    them, pick the top-k visible ones. Returns ``(chosen bool[B, S, E], selection, index_keys,
    index_compressor)``."""
    c = config
    s = inp["index_q"].shape[1]
    rb = rounding(precision)
    finish = (lambda k: fp4_act_quant_sim(rb(hadamard_rotate(k)))) if qat else (lambda k: k)
    cos, sin = _rope(c, state.max_seq_len)
    keys, comp = _compress(params, "indexer.compressor", inp["index_kv"], inp["index_score"],
                           start_pos, state.index_compressor, state.index_keys, 4, cos, sin,
                           c.norm_eps, finish, precision)
    q, w = inp["index_q"], inp["index_weights"]
    score = _index_score(q, keys, w, precision)
    n_visible = (start_pos + jnp.arange(s, dtype=jnp.int32) + 1) // 4  # [S]
    visible = jnp.arange(keys.shape[1])[None, :] < n_visible[:, None]  # [S, E]
    score = jnp.where(visible[None], score, -jnp.inf)
    k = min(c.index_topk, keys.shape[1])
    _, top = lax.top_k(score, k)
    valid = top < n_visible[None, :, None]
    chosen = jnp.put_along_axis(jnp.zeros(score.shape, bool), top, valid, axis=-1,
                                inplace=False)
    selection = IndexSelection(jnp.where(valid, top, -1).astype(jnp.int32), score)
    return chosen, selection, keys, comp


def _attend(q, keys, key_ok, sink, scale, rb=_identity):
    """One softmax per head over the keys (K = V), the sink logit in the denominator only.
    ``q f32[B, S, H, D]``, ``keys f32[B, N, D]``, ``key_ok bool[B, S, N]``, ``sink f32[H]``;
    returns ``f32[B, S, H, D]``. The logits are f32 dots times the scale; ``rb`` rounds the
    probabilities before ``P @ V`` (the denominator sums them unrounded) and the output.

    The max is the final one over all the row's keys. The official kernel (``sparse_attn``)
    takes a running max per block of 64 keys, so under bf16 its rounded ``P`` of an earlier
    block can differ from this one by 1 bf16 ulp."""
    logits = jnp.einsum("bshd,bnd->bshn", q, keys) * jnp.float32(scale)
    logits = jnp.where(key_ok[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)  # finite: a query always sees itself
    e = jnp.exp(logits - m)
    den = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink[:, None] - m)
    return rb(jnp.einsum("bshn,bnd->bshd", rb(e), keys) / den)


@functools.partial(jax.jit, static_argnames=("config", "qat", "precision"))
def _layer(params, x, start_pos, state, config, qat, precision):
    c, r = config, config.compress_ratio
    b, s, _ = x.shape
    rb = rounding(precision)
    params, x = _regime_params(params, precision), rb(x)
    cos, sin = _rope(c, state.max_seq_len)
    pos = start_pos + jnp.arange(s, dtype=jnp.int32)
    # query, window key, the compressors' and the indexer's inputs: the public pieces
    inp = project_layer_inputs(params, x, pos, c, state.max_seq_len, qat, precision)
    nope_fp8 = _nope_fp8(c) if qat else (lambda k: k)
    keys, key_pos, ring = _window_keys(state, inp["window_kv"], start_pos)
    key_ok = (key_pos[None, :] >= 0) & (key_pos[None, :] <= pos[:, None]) & (
        key_pos[None, :] > pos[:, None] - c.window_size)  # [S, W + S]
    key_ok = jnp.broadcast_to(key_ok[None], (b, *key_ok.shape))
    new_state = dataclasses.replace(state, window=ring)
    selection = None
    if r:
        cache, comp = _compress(params, "compressor", inp["kv"], inp["score"], start_pos,
                                state.compressor, state.compressed, r, cos, sin, c.norm_eps,
                                nope_fp8, precision)
        new_state = dataclasses.replace(new_state, compressed=cache, compressor=comp)
        if r == 4:
            chosen, selection, index_keys, index_comp = _indexer(
                params, inp, start_pos, state, c, qat, precision)
            new_state = dataclasses.replace(new_state, index_keys=index_keys,
                                            index_compressor=index_comp)
        else:
            j = jnp.arange(cache.shape[1])
            chosen = jnp.broadcast_to(j[None, None, :] < ((pos + 1) // r)[None, :, None],
                                      (b, s, cache.shape[1]))
        keys = jnp.concatenate([keys, cache], axis=1)
        key_ok = jnp.concatenate([key_ok, chosen], axis=2)
    o = _attend(inp["q"], keys, key_ok, params["attn_sink"], c.head_dim ** -0.5, rb)
    out = layer_output(params, o, pos, c, state.max_seq_len, precision)
    return (out if precision == "f32" else out.astype(jnp.bfloat16)), new_state, selection


def _check_qat(config: V4AttentionConfig) -> None:
    c = config
    if c.nope_head_dim % QAT_FP8_BLOCK:
        raise ValueError(f"qat=True needs the nope dims head_dim - rope_head_dim = "
                         f"{c.head_dim} - {c.rope_head_dim} = {c.nope_head_dim} to be a "
                         f"multiple of the fp8 block {QAT_FP8_BLOCK}")
    if c.compress_ratio == 4 and (c.index_head_dim & (c.index_head_dim - 1)
                                  or c.index_head_dim % QAT_FP4_BLOCK):
        raise ValueError(f"qat=True on a CSA layer needs index_head_dim={c.index_head_dim} to "
                         f"be a power of two (Hadamard) and a multiple of the fp4 block "
                         f"{QAT_FP4_BLOCK}")


def attention_layer(params, x, start_pos, state: V4LayerState, config: V4AttentionConfig, *,
                    qat: bool = False, return_selection: bool = False,
                    precision: str = V4_DEFAULT_PRECISION):
    """One DeepSeek-V4 attention layer over the chunk ``x f32|bf16[B, S, dim]`` at positions
    ``start_pos + t`` (module docstring).

    Args:
      params: dict of the official attention parameter names to arrays (``param_shapes``).
      x: the layer input (after ``attn_norm``), ``[B, S, dim]``.
      start_pos: i32 scalar (Python int or traced): tokens before this chunk, all in ``state``.
      state: ``V4LayerState`` holding exactly the tokens ``[0, start_pos)`` (``init_state`` for
        a prefill at 0).
      config: ``V4AttentionConfig`` (static).
      qat: apply the official QAT simulations (static).
      return_selection: also return the CSA indexer's ``IndexSelection`` (``None`` on other
        layer types).
      precision: ``"bf16"`` (the default, ``V4_DEFAULT_PRECISION``: the official regime,
        module docstring, "Precision regimes") or ``"f32"`` (every activation f32; its results
        as before the default changed); static.

    Every batch row shares ``start_pos`` (a ragged batch is checked one sequence at a time,
    ``B = 1``). Returns ``(out f32[B, S, dim], state)`` (``bf16`` under ``"bf16"``; the state
    is f32 in both, holding bf16 values under ``"bf16"``) and the selection when asked. Bad
    params, shapes, dtypes, a precision outside ``PRECISIONS`` or a concrete ``start_pos``
    outside ``[0, max_seq_len - S]`` raise ValueError naming the key, the name or the numbers;
    a traced ``start_pos`` out of range gives an unspecified result."""
    if not isinstance(config, V4AttentionConfig):
        raise TypeError(f"config must be a V4AttentionConfig, got {type(config).__name__}")
    check_precision(precision)
    check_params(params, config)
    _checks.rank("x", x, 3)
    _checks.floating("x", x)
    _checks.dim("x", x, 2, config.dim, "config.dim")
    b, s, _ = np.shape(x)
    if s < 1:
        raise ValueError(f"x must hold at least one token, got shape {tuple(np.shape(x))}")
    _check_state(state, config, b)
    if qat:
        _check_qat(config)
    if isinstance(start_pos, int | np.integer):
        if not 0 <= start_pos <= state.max_seq_len - s:
            raise ValueError(f"start_pos={start_pos} with S={s} tokens must fit max_seq_len="
                             f"{state.max_seq_len} (0 <= start_pos <= {state.max_seq_len - s})")
    else:
        _checks.rank("start_pos", start_pos, 0)
        _checks.integer("start_pos", start_pos)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    out, new_state, selection = _layer(f32, jnp.asarray(x, jnp.float32),
                                       jnp.asarray(start_pos, jnp.int32), state, config,
                                       bool(qat), precision)
    return (out, new_state, selection) if return_selection else (out, new_state)
