"""A statement of the official DeepSeek-V4.1 attention stack (issue 31, deliverable 1): every
layer of a ``V41Config`` in order over one chunk of tokens, dense (not paged), pure ``jnp``,
jittable, in the official bf16 regime (or f32) with V4.1's own quantizers. The independent
definition a V4.1 step is to be checked against; it does not use ``reference.v4_attention``.

Read from the release's ``inference/model.py`` (``Attention``, ``Compressor``, ``Indexer``,
``select_candidate_blocks``; vendored byte-identical in public repositories) and restated; no
code is copied. The official code threads one mutable runtime (``shared_attn``) through the
layers: KV sources publish their compressed pool and index keys, index sources their top-k, the
candidate source its candidate blocks, and every other layer reads what was published last. Here
that runtime is a value threaded through the loop over ``reference.v41.resolve_layers``' plans.

Layer ``L`` (its ``LayerPlan``) on the tokens ``x[L] f32[B, S, dim]`` (its input after
``attn_norm``) at positions ``p = start_pos + t``:

- RoPE: interleaved pairs on the last ``rope_head_dim`` dims. A compressed layer (ratio 1 or 2)
  uses ``compress_rope_theta`` with YaRN for every rotation (query, window key, entries, index
  query and keys); a ratio-0 layer ``rope_theta`` without YaRN. Entry ``j`` sits at ``j * r``.
- query: ``qr = q_norm(wq_a(x))``, ``q = rope(wq_b(qr))`` (no per-head norm, unlike V4).
- window key: ``rope(kv_norm(wkv(x)))`` in V4.1's window format (fp8 e4m3, ue8m0 scale per 32
  over all ``head_dim`` dims, ``reference.v41.formats``); ``K = V``; ``p`` sees the tokens
  ``max(0, p - window_size + 1) .. p``.
- FULL (a KV source) compresses its tokens. Ratio 1: ``latent = compressor.norm(
  compressor.wkv(x))`` per token (bf16 weight). Ratio 2: f32 ``wkv`` / ``wgate`` on the f32 ``x``,
  entry ``j`` = ``sum_i softmax_i(score) kv`` per channel over tokens ``2j, 2j + 1`` (no ``ape``),
  cast to bf16, then the norm. Entry ``j`` exists once token ``(j + 1) r - 1`` is in. It
  publishes the pool ``fp4(rope_j(latent))`` (e2m1, e4m3 scale per 16) and the index keys
  ``fp4(rope_j(indexer.k_norm(indexer.wk(latent))))`` (e2m1, ue8m0 per 32, no Hadamard), both
  from the pre-RoPE latent.
- FULL and REINDEX score the published keys: ``iq = fp4(rope(indexer.wq_b(qr)))``, ``w =
  weights_proj(x) * index_head_dim**-0.5 * index_n_heads**-0.5``, ``score_j = sum_h w_h
  relu(iq_h . k_j)`` on the visible entries ``j < (p + 1) // r`` (``-inf`` elsewhere). The
  candidate source (PRODUCES) publishes its rows' candidate blocks
  (``reference.v41.candidate_blocks``); a consumer (CONSUMES) takes its top ``index_topk``
  among them, any other index source among every visible entry (``restricted_topk``: the
  declared order, NaN first, then value descending, then the lower entry; ``-1`` where fewer
  entries are finite). The top-k is published; REUSE layers attend the last published one.
- attention: one softmax per head over the window keys union the chosen entries of the last
  published pool, scale ``head_dim**-0.5``, the head's ``attn_sink`` in the denominator only
  (``reference.statements.deepseek_v4``'s ``_attend``: the same ``sparse_attn``).
- output: inverse RoPE at ``p``, the heads in ``o_groups`` groups each through its ``wo_a``
  block, ``wo_b``.

Precision (``precision``, ``reference.quant.bf16``): ``"bf16"`` (the default) rounds as the V4
statement's official regime (its module docstring): the input, the bf16 weights
(``BF16_WEIGHTS``), every Linear output once, each RMSNorm once, each RoPE once, the indexer's
dots / products / head sum, attention's probabilities and output; the ratio-2 compressor's
projections, softmax and pooling stay f32 until the pooled row's cast. ``"f32"`` rounds nothing
(the quantizers still apply: they are the cache formats). Not simulated, as in the V4
statement: the fp8 activation quantization inside the release's fp8 GEMMs.

Calls: a prefill at ``start_pos = 0``, then chunks (one-token decodes as the official code, or
any length) whose state holds exactly the tokens ``[0, start_pos)``. ``start_pos`` may be traced.
The state (``V41State``) keeps every token's window key and each KV source's per-token compressor
inputs, and entries are pooled from them on every call, so a chunk starting at an odd position
takes its partner from the state and the split of the tokens into chunks changes no entry."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import checks as _checks
from reference.quant.bf16 import V4_DEFAULT_PRECISION, check_precision, rounding
from reference.statements import deepseek_v41_layer as L
from reference.statements.deepseek_v4_config import random_params
from reference.v4_compressor import ref as vc
from reference.v41 import formats
from reference.v41.config import LayerPlan, Mode, V41Config, resolve_layers

__all__ = ["BF16_WEIGHTS", "V41Selection", "V41State", "attention_stack", "check_params",
           "init_params", "init_state", "param_shapes"]

BF16_WEIGHTS = L.BF16_WEIGHTS  # the weights the bf16 regime rounds (deepseek_v41_layer)


class V41State(NamedTuple):
    """The stack's dense state for ``B`` sequences of at most ``M`` tokens, ``K`` KV sources.

    - ``window f32[L, B, M, D]``: token ``q``'s window key of layer ``L`` (as stored: decoded
      from the window format) at row ``q``;
    - ``kv``, ``score f32[K, B, M, D]``: the ``k``-th KV source's compressor inputs per token
      (ratio 1: the latent in ``kv``, ``score`` unused; ratio 2: the f32 ``wkv`` / ``wgate``
      projections)."""

    window: jax.Array
    kv: jax.Array
    score: jax.Array


class V41Selection(NamedTuple):
    """What a call published, per layer (``None`` where the layer publishes nothing):
    ``topk[L] i32[B, S, index_topk]`` (entry numbers, ``-1`` tail) on FULL and REINDEX layers,
    ``candidates i32[B, S, candidate_topk_blocks]`` (block ids, ``-1`` tail) of the candidate
    source, ``scores[L] f32[B, S, M // r]`` (``-inf`` off the visible entries)."""

    topk: tuple
    scores: tuple
    candidates: jax.Array | None


def _kv_sources(config: V41Config) -> tuple[int, ...]:
    return tuple(config.kv_source_layer_ids)


def param_shapes(config: V41Config, layer: int) -> dict[str, tuple[int, ...]]:
    """The attention parameters layer ``layer`` reads, by the release's checkpoint names, and
    their shapes (torch ``Linear`` weights ``[out, in]``)."""
    c = config
    plan = resolve_layers(c)[layer]
    d, dim = c.head_dim, c.dim
    shapes = {
        "attn_sink": (c.n_heads,),
        "wq_a.weight": (c.q_lora_rank, dim),
        "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.n_heads * d, c.q_lora_rank),
        "wkv.weight": (d, dim),
        "kv_norm.weight": (d,),
        "wo_a.weight": (c.o_groups * c.o_lora_rank, c.n_heads * d // c.o_groups),
        "wo_b.weight": (dim, c.o_groups * c.o_lora_rank),
    }
    if plan.mode is Mode.FULL:
        shapes["compressor.wkv.weight"] = (d, dim)
        shapes["compressor.norm.weight"] = (d,)
        if plan.ratio == 2:
            shapes["compressor.wgate.weight"] = (d, dim)
        shapes["indexer.wk.weight"] = (c.index_head_dim, d)
        shapes["indexer.k_norm.weight"] = (c.index_head_dim,)
    if plan.mode in (Mode.FULL, Mode.REINDEX):
        shapes["indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes["indexer.weights_proj.weight"] = (c.index_n_heads, dim)
    return shapes


def init_params(config: V41Config, seed: int = 0) -> list[dict[str, jax.Array]]:
    """Random f32 parameters of every layer (``param_shapes``) for tests: weights ``N(0, 1 /
    in)``, norm weights ``1 + N(0, 0.1)``, ``attn_sink`` ``N(0, 1)``."""
    rng = np.random.default_rng(seed)
    return [random_params(param_shapes(config, layer), rng)
            for layer in range(len(config.compress_ratios))]


def _state_shapes(config: V41Config, batch: int, max_seq_len: int) -> V41State:
    b, m, d, k = batch, max_seq_len, config.head_dim, len(_kv_sources(config))
    return V41State((len(config.compress_ratios), b, m, d), (k, b, m, d), (k, b, m, d))


def init_state(config: V41Config, batch: int, max_seq_len: int) -> V41State:
    """The empty state (zeros) for ``batch`` sequences of at most ``max_seq_len`` tokens."""
    _check_config(config, _checks.positive_int("max_seq_len", max_seq_len))
    shapes = _state_shapes(config, _checks.positive_int("batch", batch), max_seq_len)
    return V41State(*(jnp.zeros(s, jnp.float32) for s in shapes))


# ---------------------------------------------------------------------------------------------
# The pieces of a layer.

def _fmt(encode, decode):
    return lambda x: decode(encode(x))


_WINDOW = _fmt(formats.encode_window_kv, formats.decode_window_kv)
_POOL = _fmt(formats.encode_compressed_kv, formats.decode_compressed_kv)
_INDEX = _fmt(formats.encode_index_fp4, formats.decode_index_fp4)


def _latents(params, kv, score, ratio, eps, rb):
    """Every entry's pre-RoPE latent ``f32[B, M // r, D]`` from the per-token history."""
    if ratio == 1:
        return kv
    b, m, d = kv.shape
    kv, score = kv.reshape(b, m // 2, 2, d), score.reshape(b, m // 2, 2, d)
    pooled = jnp.sum(kv * jax.nn.softmax(score, axis=2), axis=2)
    return rb(vc.rms_norm(rb(pooled), params["compressor.norm.weight"], eps))


def _publish(params, latent, ratio, c, cos, sin, rb):
    """The pool and the index keys of the entries ``latent f32[B, E, D]`` (entry ``j`` at
    position ``j * r``), as stored (decoded from their formats)."""
    e = latent.shape[1]
    pool, keys = L.entry_rows(params, latent, cos[: e * ratio: ratio], sin[: e * ratio: ratio],
                              c, rb)
    return _POOL(pool), _INDEX(keys)


def _index(params, x, qr, keys, pos, plan: LayerPlan, c, cos_p, sin_p, cands, rb, precision):
    """This layer's index scores, its top-k and (candidate source) its candidate blocks."""
    iq, w = L.index_query(params, x, qr, cos_p, sin_p, c, rb)
    e = keys.shape[1]
    lens = (pos + 1) // plan.ratio  # [S]
    score = L.index_score(iq, keys, w, precision)
    score = jnp.where(jnp.arange(e)[None, None, :] < lens[None, :, None], score, -jnp.inf)
    b, s = x.shape[:2]
    flat = None if cands is None else cands.reshape(b * s, -1)
    top, flat = L.select(score.reshape(b * s, e), jnp.tile(lens, b), plan, c, flat)
    return score, top.reshape(b, s, -1), None if flat is None else flat.reshape(b, s, -1)


def _chosen(topk, e):
    """``bool[B, S, e]``: the entries ``topk i32[B, S, k]`` names (``-1`` names none)."""
    b, s, _ = topk.shape
    slot = jnp.where(topk >= 0, topk, e)
    bi, si = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    return jnp.zeros((b, s, e + 1), bool).at[bi, si, slot].set(True)[..., :e]


# ---------------------------------------------------------------------------------------------
# The stack.

def _layer(params, x, pos, start_pos, state, plan, c, pub, precision):
    """One layer; ``pub``: the runtime (pool, keys, topk, candidates), updated and returned
    with the layer's output, its window rows and (FULL) its compressor history."""
    rb = rounding(precision)
    params = L.regime_params(params, precision)
    x, (window, kv_hist, score_hist) = rb(x), state
    cos, sin = L.rope_tables(c, plan.ratio, window.shape[1])
    cos_p, sin_p = jnp.take(cos, pos, axis=0), jnp.take(sin, pos, axis=0)
    b, s, _ = x.shape
    qr, q, window_row = L.project(params, x, cos_p, sin_p, c, rb)
    window = jax.lax.dynamic_update_slice_in_dim(
        window, _WINDOW(window_row), start_pos, axis=1)
    j = jnp.arange(window.shape[1])
    key_ok = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - c.window_size)
    keys, key_ok = window, jnp.broadcast_to(key_ok[None], (b, s, window.shape[1]))
    if plan.mode is Mode.FULL:
        k_in, s_in = L.compress_inputs(params, x, plan.ratio, c.rms_norm_eps, rb)
        kv_hist = jax.lax.dynamic_update_slice_in_dim(kv_hist, k_in, start_pos, axis=1)
        score_hist = jax.lax.dynamic_update_slice_in_dim(score_hist, s_in, start_pos, axis=1)
        latent = _latents(params, kv_hist, score_hist, plan.ratio, c.rms_norm_eps, rb)
        pub["pool"], pub["keys"] = _publish(params, latent, plan.ratio, c, cos, sin, rb)
    score = None
    if plan.mode in (Mode.FULL, Mode.REINDEX):
        score, pub["topk"], pub["candidates"] = _index(
            params, x, qr, pub["keys"], pos, plan, c, cos_p, sin_p, pub["candidates"], rb,
            precision)
    if plan.mode is not Mode.SWA:
        keys = jnp.concatenate([keys, pub["pool"]], axis=1)
        key_ok = jnp.concatenate([key_ok, _chosen(pub["topk"], pub["pool"].shape[1])], axis=2)
    o = L.attend(q, keys, key_ok, params["attn_sink"], c.head_dim ** -0.5, rb)
    return L.layer_output(params, o, c, cos_p, sin_p, rb), window, kv_hist, score_hist, score


@functools.partial(jax.jit, static_argnames=("config", "precision"))
def _stack(params, xs, start_pos, state, config, precision):
    c, s = config, xs.shape[2]
    pos = start_pos + jnp.arange(s, dtype=jnp.int32)
    sources = _kv_sources(c)
    pub = {"pool": None, "keys": None, "topk": None, "candidates": None}
    outs, windows, kvs, scs, tops, scores = [], [], list(state.kv), list(state.score), [], []
    for plan in resolve_layers(c):
        full = plan.mode is Mode.FULL
        k = sources.index(plan.layer) if full else None
        out, window, kv_h, sc_h, score = _layer(
            params[plan.layer], xs[plan.layer], pos, start_pos,
            (state.window[plan.layer], kvs[k] if full else None, scs[k] if full else None),
            plan, c, pub, precision)
        if full:
            kvs[k], scs[k] = kv_h, sc_h
        outs.append(out)
        windows.append(window)
        scores.append(score)
        tops.append(pub["topk"] if score is not None else None)
    new = V41State(jnp.stack(windows), jnp.stack(kvs) if kvs else state.kv,
                   jnp.stack(scs) if scs else state.score)
    out = jnp.stack(outs)
    out = out if precision == "f32" else out.astype(jnp.bfloat16)
    return out, new, V41Selection(tuple(tops), tuple(scores), pub["candidates"])


# ---------------------------------------------------------------------------------------------
# Checks and the entry.

def _check_config(c: V41Config, max_seq_len: int) -> None:
    if not isinstance(c, V41Config):
        raise TypeError(f"config must be a V41Config, got {type(c).__name__}")
    for name, block in (("head_dim", formats.WINDOW_BLOCK), ("index_head_dim",
                                                             formats.INDEX_BLOCK)):
        if getattr(c, name) % block:
            raise ValueError(f"config.{name}={getattr(c, name)} must be a multiple of {block} "
                             f"(its cache format's scale block)")
    if c.rope_head_dim % 2 or c.rope_head_dim > min(c.head_dim, c.index_head_dim):
        raise ValueError(f"config.rope_head_dim={c.rope_head_dim} must be even and at most "
                         f"head_dim={c.head_dim} and index_head_dim={c.index_head_dim}")
    if 2 in c.compress_ratios and max_seq_len % 2:
        raise ValueError(f"max_seq_len={max_seq_len} must be even: ratio-2 layers pool pairs")


def check_params(params, c: V41Config) -> None:
    """Refuse ``params`` unless a list of one dict per layer with ``param_shapes``' names and
    shapes (floating), naming the layer, the mode and the numbers."""
    n = len(c.compress_ratios)
    if not isinstance(params, list | tuple) or len(params) != n:
        got = len(params) if isinstance(params, list | tuple) else type(params).__name__
        raise ValueError(f"params must be a list of {n} per-layer dicts (one per "
                         f"compress_ratios entry), got {got}")
    for layer, p in enumerate(params):
        want = param_shapes(c, layer)
        if sorted(p) != sorted(want):
            missing = sorted(set(want) - set(p))
            extra = sorted(set(p) - set(want))
            raise ValueError(f"params[{layer}] (mode {resolve_layers(c)[layer].mode.value}): "
                             f"missing {missing}, unexpected {extra}")
        for name, shape in want.items():
            if tuple(np.shape(p[name])) != shape:
                raise ValueError(f"params[{layer}][{name!r}] must have shape {shape}, got "
                                 f"{tuple(np.shape(p[name]))}")
            _checks.floating(f"params[{layer}][{name!r}]", p[name])


def attention_stack(params, xs, start_pos, state: V41State, config: V41Config, *,
                    precision: str = V4_DEFAULT_PRECISION, return_selection: bool = False):
    """Every attention layer of ``config`` over one chunk (module docstring).

    Args:
      params: list of per-layer dicts (``param_shapes(config, layer)``), one per
        ``compress_ratios`` entry (MTP layers included).
      xs: ``f32|bf16[L, B, S, dim]``, each layer's input (after its ``attn_norm``).
      start_pos: i32 scalar (Python int or traced): tokens before this chunk, all in ``state``.
      state: ``V41State`` holding exactly the tokens ``[0, start_pos)`` (``init_state``).
      config: ``V41Config`` (static).
      precision: ``"bf16"`` (default, the official regime) or ``"f32"``; static.
      return_selection: also return the ``V41Selection``.

    Returns ``(out [L, B, S, dim], state)`` (``bf16`` under ``"bf16"``) and the selection when
    asked. Bad params, shapes, dtypes or a concrete ``start_pos`` outside ``[0, M - S]`` raise
    ValueError naming them; a traced ``start_pos`` out of range gives an unspecified result."""
    check_precision(precision)
    _check_config(config, state.window.shape[2] if isinstance(state, V41State) else 0)
    check_params(params, config)
    _checks.rank("xs", xs, 4)
    _checks.floating("xs", xs)
    _checks.dim("xs", xs, 0, len(config.compress_ratios), "len(config.compress_ratios)")
    _checks.dim("xs", xs, 3, config.dim, "config.dim")
    if not isinstance(state, V41State):
        raise TypeError(f"state must be a V41State (init_state), got {type(state).__name__}")
    want = _state_shapes(config, np.shape(xs)[1], state.window.shape[2])
    for name, got, ref in zip(V41State._fields, state, want, strict=True):
        if np.shape(got) != ref:
            raise ValueError(f"state.{name} has shape {np.shape(got)}, the config and xs give "
                             f"{ref}")
    s, m = np.shape(xs)[2], state.window.shape[2]
    if s < 1:
        raise ValueError(f"xs must hold at least one token, got shape {tuple(np.shape(xs))}")
    if isinstance(start_pos, int | np.integer):
        if not 0 <= start_pos <= m - s:
            raise ValueError(f"start_pos={start_pos} with S={s} tokens must fit max_seq_len={m} "
                             f"(0 <= start_pos <= {m - s})")
    else:
        _checks.rank("start_pos", start_pos, 0)
        _checks.integer("start_pos", start_pos)
    f32 = [{k: jnp.asarray(v, jnp.float32) for k, v in p.items()} for p in params]
    out, new, sel = _stack(f32, jnp.asarray(xs, jnp.float32), jnp.asarray(start_pos, jnp.int32),
                           state, config, precision)
    return (out, new, sel) if return_selection else (out, new)
