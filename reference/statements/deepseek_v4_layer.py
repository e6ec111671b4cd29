"""The per-token ends of the DeepSeek-V4 layer statement (``reference.statements.deepseek_v4``),
public so that the paged step's callers compute exactly what the statement computes: the RoPE
tables of a layer type (``rope_tables``), the projections that feed attention
(``project_layer_inputs``: query, window key, the compressors' and the indexer's inputs) and the
output stage (``layer_output``: inverse RoPE, grouped ``wo_a``, ``wo_b``). The statement's
``_layer`` calls these same functions, so ``dsa_jax.v4_project`` / ``dsa_jax.v4_output`` equal
its pieces by construction, in both precision regimes (the statement's module docstring,
"Precision regimes").

Tokens carry their own absolute positions (``positions i32[S]``, any order: each token is
independent here), so a ragged batch of many sequences projects in one call. Positions index the
RoPE tables of ``max_seq_len`` rows: a position ``>= max_seq_len`` (or negative) is refused when
concrete (``dsa_jax``); traced, it is clipped by ``jnp.take`` (unspecified result)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from reference.quant.bf16 import V4_DEFAULT_PRECISION, rounding
from reference.quant.qat import act_quant_sim, fp4_act_quant_sim, hadamard_rotate
from reference.statements.deepseek_v4_config import V4AttentionConfig
from reference.v4_compressor import ref as vc

__all__ = ["BF16_WEIGHTS", "layer_output", "project_layer_inputs", "rope_tables"]

# The Linear weights the official model holds in bf16 (in the released fp8 config: e4m3 with block
# scales, whose values are bf16-exact); the bf16 regime rounds them to bf16. The compressors'
# wkv / wgate, the ape, the norm weights and attn_sink are f32 parameters there (model.py).
BF16_WEIGHTS = ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                "indexer.wq_b.weight", "indexer.weights_proj.weight")


@functools.lru_cache(maxsize=16)
def rope_tables(config: V4AttentionConfig, max_seq_len: int):
    """``(cos, sin) f32[max_seq_len, rope_head_dim // 2]`` (NumPy) of this layer type:
    compressed layers ``compress_rope_theta`` with YaRN, window-only layers ``rope_theta``
    without (module docstring of ``reference.statements.deepseek_v4``). Cached per
    ``(config, max_seq_len)``."""
    c = config
    with jax.ensure_compile_time_eval():  # constants, also when first called under a trace
        if c.compress_ratio:
            tables = vc.rope_tables(max_seq_len, c.rope_head_dim, theta=c.compress_rope_theta,
                                    factor=c.rope_factor, original_seq_len=c.original_seq_len,
                                    beta_fast=c.beta_fast, beta_slow=c.beta_slow)
        else:
            tables = vc.rope_tables(max_seq_len, c.rope_head_dim, theta=c.rope_theta,
                                    original_seq_len=0)
    return tuple(np.asarray(t) for t in tables)


def _regime_params(params, precision):
    """``params`` (f32) with ``BF16_WEIGHTS`` rounded to bf16 under ``"bf16"``."""
    rb = rounding(precision)
    return {k: rb(v) if k in BF16_WEIGHTS else v for k, v in params.items()}


def _identity(x):
    return x


def _linear(x, params, name, rb=_identity):
    """``rb(x @ W.T)``: an f32 matmul (f32 accumulation), its output rounded by ``rb``."""
    return rb(x @ params[name].astype(jnp.float32).T)


def _head_norm(q, eps, precision):
    """The weightless per-head RMSNorm ``q * rsqrt(mean(q**2) + eps)`` of ``q f32[..., D]``.
    ``"bf16"``: the official bf16 tensor ops, each rounded (five roundings: ``q**2``, the mean
    (an f32 sum), ``+ eps``, ``rsqrt``, the product)."""
    if precision == "f32":
        return q * lax.rsqrt(jnp.mean(q * q, axis=-1, keepdims=True) + jnp.float32(eps))
    rb = rounding(precision)
    mean = rb(jnp.sum(rb(q * q), axis=-1, keepdims=True) / jnp.float32(q.shape[-1]))
    return rb(q * rb(lax.rsqrt(rb(mean + jnp.float32(eps)))))


def _nope_fp8(config: V4AttentionConfig):
    """The QAT fp8 simulation of the nope dims of a key row (the rope dims kept)."""
    nope = config.nope_head_dim

    def f(rows):
        return jnp.concatenate([act_quant_sim(rows[..., :nope]), rows[..., nope:]], axis=-1)
    return f


def _rope_at(config, max_seq_len, positions):
    cos, sin = rope_tables(config, max_seq_len)
    return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)


def project_layer_inputs(params, x, positions, config: V4AttentionConfig, max_seq_len: int,
                         qat: bool = False, precision: str = V4_DEFAULT_PRECISION):
    """The inputs attention takes from the tokens ``x f32[..., S, dim]`` at ``positions
    i32[S]``, as the statement computes them (f32 ``params`` by the checkpoint's names; the
    regime's rounding of the bf16 weights and of ``x`` applied here). Returns a dict:

    - ``q [..., S, n_heads, head_dim]``: ``rope(head_norm(wq_b(q_norm(wq_a(x)))))``;
    - ``window_kv [..., S, head_dim]``: ``rope(kv_norm(wkv(x)))`` (QAT: the nope dims fp8);
    - compressed layers: ``kv`` / ``score [..., S, head_dim]``, the compressor's projections;
    - ratio 4: ``index_q [..., S, index_n_heads, index_head_dim]`` (QAT: Hadamard then fp4),
      ``index_weights [..., S, index_n_heads]`` (the scale folded in), ``index_kv`` /
      ``index_score [..., S, index_head_dim]``, the indexer's compressor projections.

    Under ``"bf16"`` each value holds bf16 values in f32, rounded at the regime's points."""
    c, r = config, config.compress_ratio
    rb = rounding(precision)
    params, x = _regime_params(params, precision), rb(x)
    lead = x.shape[:-1]
    cos_p, sin_p = _rope_at(c, max_seq_len, positions)  # [S, rd / 2]
    qr = rb(vc.rms_norm(_linear(x, params, "wq_a.weight", rb), params["q_norm.weight"],
                        c.norm_eps))
    q = _linear(qr, params, "wq_b.weight", rb).reshape(*lead, c.n_heads, c.head_dim)
    q = rb(vc.apply_rope(_head_norm(q, c.norm_eps, precision), cos_p[:, None], sin_p[:, None]))
    kv = rb(vc.rms_norm(_linear(x, params, "wkv.weight", rb), params["kv_norm.weight"],
                        c.norm_eps))
    kv = rb(vc.apply_rope(kv, cos_p, sin_p))
    out = dict(q=q, window_kv=_nope_fp8(c)(kv) if qat else kv)
    if r:
        # the compressors' projections: f32 weights on the (rounded) x, not rounded
        out["kv"] = _linear(x, params, "compressor.wkv.weight")
        out["score"] = _linear(x, params, "compressor.wgate.weight")
    if r == 4:
        iq = _linear(qr, params, "indexer.wq_b.weight", rb).reshape(*lead, c.index_n_heads,
                                                                   c.index_head_dim)
        iq = rb(vc.apply_rope(iq, cos_p[:, None], sin_p[:, None]))
        if qat:
            iq = fp4_act_quant_sim(rb(hadamard_rotate(iq)))
        out["index_q"] = iq
        # bf16: the projection rounded, then the product with the f32 scale rounded
        out["index_weights"] = rb(_linear(x, params, "indexer.weights_proj.weight", rb)
                                  * jnp.float32(c.index_head_dim ** -0.5
                                                * c.index_n_heads ** -0.5))
        out["index_kv"] = _linear(x, params, "indexer.compressor.wkv.weight")
        out["index_score"] = _linear(x, params, "indexer.compressor.wgate.weight")
    return out


def layer_output(params, o, positions, config: V4AttentionConfig, max_seq_len: int,
                 precision: str = V4_DEFAULT_PRECISION):
    """The output stage on attention's ``o f32[..., S, n_heads, head_dim]`` at ``positions
    i32[S]``: inverse RoPE on the last ``rope_head_dim`` dims, the heads in ``o_groups``
    contiguous groups each through its ``wo_a`` block, ``wo_b``. Returns ``f32[..., S, dim]``
    (bf16 values under ``"bf16"``: each stage rounded)."""
    c = config
    rb = rounding(precision)
    params = _regime_params(params, precision)
    cos_p, sin_p = _rope_at(c, max_seq_len, positions)
    o = rb(vc.apply_rope(o, cos_p[:, None], -sin_p[:, None]))  # the inverse rotation
    lead = o.shape[:-2]
    o = o.reshape(*lead, c.o_groups, c.n_heads * c.head_dim // c.o_groups)
    wo_a = params["wo_a.weight"].reshape(c.o_groups, c.o_lora_rank, -1)
    o = rb(jnp.einsum("...gd,grd->...gr", o, wo_a)).reshape(*lead, c.o_groups * c.o_lora_rank)
    return _linear(o, params, "wo_b.weight", rb)
