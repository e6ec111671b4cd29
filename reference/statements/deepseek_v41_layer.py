"""The per-token ends of the DeepSeek-V4.1 stack statement (``reference.statements.deepseek_v41``),
public so that the paged step (``dsa_jax.v41_step``) computes exactly what the statement
computes around its caches: the RoPE tables of a layer (``rope_tables``), the projections that
feed attention (``project``: the query and the window row), a KV source's compressor inputs
(``compress_inputs``), the pool and index-key rows of entries from their latent
(``entry_rows``), the index query and head weights (``index_query``), the index score
(``index_score``), one attention row set (``attend``) and the output stage (``layer_output``).
The statement's ``_layer`` calls these same functions, in both precision regimes.

Shapes: activations ``f32[B, S, ...]`` with per-token tables ``cos_p, sin_p f32[S, rope / 2]``
(the paged step passes its ragged rows as ``B = 1``, ``S = T``, each row at its own position).
Every ``rb`` is ``reference.quant.bf16.rounding(precision)``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from reference.quant.bf16 import rounding
from reference.statements.deepseek_v4 import _attend as attend
from reference.statements.deepseek_v4 import _index_score as index_score
from reference.v4_compressor import ref as vc
from reference.v41 import formats
from reference.v41.candidates import candidate_blocks, restricted_topk
from reference.v41.compressor import compressed_rope_tables
from reference.v41.config import CandidateUse, LayerPlan, V41Config

__all__ = ["BF16_WEIGHTS", "attend", "compress_inputs", "entry_rows", "index_query",
           "index_score", "layer_output", "project", "regime_params", "rope_tables",
           "select"]

# Linear weights the release holds in bf16 or fp8 (bf16-exact values): rounded to bf16 in the
# bf16 regime. The ratio-2 compressor's wkv / wgate, the norm weights and attn_sink are f32.
BF16_WEIGHTS = ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                "indexer.wq_b.weight", "indexer.weights_proj.weight", "indexer.wk.weight")


@functools.lru_cache(maxsize=16)
def rope_tables(config: V41Config, ratio: int, max_seq_len: int):
    """NumPy ``(cos, sin) f32[max_seq_len, rope_head_dim // 2]`` of a compressed layer
    (``ratio > 0``: ``compress_rope_theta`` with YaRN) or a window-only one (``rope_theta``
    without)."""
    # constants computed on the host, also when first called while tracing for another
    # platform's device (an AOT compile for a TPU topology)
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices(backend="cpu")[0]):
        t = (compressed_rope_tables(max_seq_len, config) if ratio else
             vc.rope_tables(max_seq_len, config.rope_head_dim, theta=config.rope_theta,
                            original_seq_len=0))
    return tuple(np.asarray(x) for x in t)


def regime_params(params: dict, precision: str) -> dict:
    """``params`` (f32) with ``BF16_WEIGHTS`` rounded to bf16 under ``"bf16"``."""
    rb = rounding(precision)
    return {k: rb(v) if k in BF16_WEIGHTS else v for k, v in params.items()}


def _lin(x, params, name, rb):
    """``rb(x @ W.T)``: an f32-accumulated matmul, its output rounded once."""
    return rb(x @ params[name].T)


def project(params, x, cos_p, sin_p, c: V41Config, rb):
    """``x f32[B, S, dim]`` (rounded) -> ``(qr f32[B, S, q_lora_rank], q f32[B, S, H, D],
    window_row f32[B, S, D])``: ``qr = q_norm(wq_a(x))``, ``q = rope(wq_b(qr))`` (no per-head
    norm), the window row ``rope(kv_norm(wkv(x)))`` before its fp8 format."""
    b, s, _ = x.shape
    qr = rb(vc.rms_norm(_lin(x, params, "wq_a.weight", rb), params["q_norm.weight"],
                        c.rms_norm_eps))
    q = _lin(qr, params, "wq_b.weight", rb).reshape(b, s, c.n_heads, c.head_dim)
    q = rb(vc.apply_rope(q, cos_p[:, None], sin_p[:, None]))
    kv = rb(vc.rms_norm(_lin(x, params, "wkv.weight", rb), params["kv_norm.weight"],
                        c.rms_norm_eps))
    return qr, q, rb(vc.apply_rope(kv, cos_p, sin_p))


def compress_inputs(params, x, ratio: int, eps: float, rb):
    """A KV source's per-token compressor inputs ``(kv, score) f32[B, S, D]``: ratio 1 the
    latent ``norm(wkv(x))`` (a bf16 weight in the release; ``score`` zeros), ratio 2 the f32
    ``wkv`` / ``wgate`` projections (f32 weights, used as given)."""
    if ratio == 1:
        kv = rb(vc.rms_norm(rb(x @ rb(params["compressor.wkv.weight"]).T),
                            params["compressor.norm.weight"], eps))
        return kv, jnp.zeros_like(kv)
    return x @ params["compressor.wkv.weight"].T, x @ params["compressor.wgate.weight"].T


def entry_rows(params, latent, cos_e, sin_e, c: V41Config, rb):
    """Entries' pre-RoPE latent ``f32[..., E, D]`` at their positions' tables ``cos_e, sin_e
    f32[E, rope / 2]`` -> ``(pool_row f32[..., E, D], key_row f32[..., E, index_head_dim])``,
    both roped and rounded, before their fp4 formats (the index keys from the pre-RoPE latent:
    ``k_norm(wk(latent))``)."""
    pool = rb(vc.apply_rope(latent, cos_e, sin_e))
    k = rb(vc.rms_norm(_lin(latent, params, "indexer.wk.weight", rb),
                       params["indexer.k_norm.weight"], c.rms_norm_eps))
    return pool, rb(vc.apply_rope(k, cos_e, sin_e))


def index_query(params, x, qr, cos_p, sin_p, c: V41Config, rb):
    """``(iq f32[B, S, Hi, Di], w f32[B, S, Hi])``: the index query roped and in its fp4 format
    (decoded: the values the official fp4 product reads), and the head weights ``weights_proj(x)
    * Di^-0.5 * Hi^-0.5``."""
    b, s = x.shape[:2]
    iq = _lin(qr, params, "indexer.wq_b.weight", rb).reshape(b, s, c.index_n_heads,
                                                               c.index_head_dim)
    iq = rb(vc.apply_rope(iq, cos_p[:, None], sin_p[:, None]))
    iq = formats.decode_index_fp4(formats.encode_index_fp4(iq))
    w = rb(_lin(x, params, "indexer.weights_proj.weight", rb)
           * jnp.float32(c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5))
    return iq, w


def select(score, lens, plan: LayerPlan, c: V41Config, candidates):
    """An index source's top-k over ``score f32[R, E]`` (entries ``j >= lens i32[R]`` never
    read): the candidate source publishes its rows' candidate blocks (``candidate_blocks``) and
    keeps its own top-k unrestricted, a consumer takes its top-k among ``candidates i32[R,
    candidate_topk_blocks]``, any other layer among every visible entry (``restricted_topk``).
    Returns ``(topk i32[R, index_topk], candidates)`` (the published ones, or as given)."""
    if plan.candidates is CandidateUse.PRODUCES:
        candidates = candidate_blocks(score, lens, num_blocks=c.candidate_topk_blocks,
                                      block=c.candidate_block_size)
    use = candidates if plan.candidates is CandidateUse.CONSUMES else None
    top = restricted_topk(score, lens, use, k=c.index_topk, block=c.candidate_block_size)
    return top, candidates


def layer_output(params, o, c: V41Config, cos_p, sin_p, rb):
    """Attention output ``f32[B, S, H, D]`` -> ``f32[B, S, dim]``: inverse RoPE, the heads in
    ``o_groups`` groups each through its ``wo_a`` block, ``wo_b``."""
    o = rb(vc.apply_rope(o, cos_p[:, None], -sin_p[:, None]))
    b, s = o.shape[:2]
    o = o.reshape(b, s, c.o_groups, -1)
    wo_a = params["wo_a.weight"].reshape(c.o_groups, c.o_lora_rank, -1)
    o = rb(jnp.einsum("bsgd,grd->bsgr", o, wo_a)).reshape(b, s, -1)
    return _lin(o, params, "wo_b.weight", rb)
