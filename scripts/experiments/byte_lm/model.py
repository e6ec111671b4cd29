"""A byte-level causal transformer and a lightning indexer, in pure JAX (no flax/optax).

LM: token embedding (tied with the output), ``n_layers`` pre-norm blocks (RMSNorm, multi-head
causal attention with RoPE on every head dim, a GELU MLP of width ``4 * d_model``), final
RMSNorm. Parameters are a nested dict of f32 arrays; ``forward`` can

- return, for chosen layers, the attention block's input (the normed hidden state ``h``) and
  the layer's attention probabilities averaged over its heads (``f32[B, T, T]``);
- restrict ONE layer's attention to a selection: ``allowed: bool[B, T, T]`` is AND-ed with the
  causal mask before that layer's softmax (dense attention restricted to the selected tokens).

Lightning indexer (one per chosen layer, DeepSeek-V3.2 style): from the frozen layer's ``h``,
``q = h Wq`` (``Hi`` heads of dim ``Di``), a single shared key ``k = h Wk`` (dim ``Di``), and
per-head weights ``w = (h Ww) / sqrt(Hi)`` from the query token; RoPE on the first half of the
``Di`` dims of ``q`` and ``k``. The score is exactly ``reference.index_scores``:
``s[t, u] = sum_h w[t, h] relu(q[t, h] . k[u])``.

Adam is written out (``adam_init`` / ``adam_update``) with bias correction and global-norm
gradient clipping.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from reference.index_scores import index_scores

NEG = -1e30


@dataclasses.dataclass(frozen=True)
class LMConfig:
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    context: int = 1024
    vocab: int = 256


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    heads: int = 4
    head_dim: int = 32


def param_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def init_lm(key, cfg: LMConfig) -> dict:
    d = cfg.d_model
    keys = jax.random.split(key, 1 + 4 * cfg.n_layers)
    std = 0.02
    proj_std = std / math.sqrt(2 * cfg.n_layers)
    layers = []
    for i in range(cfg.n_layers):
        k1, k2, k3, k4 = keys[1 + 4 * i:5 + 4 * i]
        layers.append({
            "ln1": jnp.ones(d), "ln2": jnp.ones(d),
            "wqkv": std * jax.random.normal(k1, (d, 3 * d)),
            "wo": proj_std * jax.random.normal(k2, (d, d)),
            "w1": std * jax.random.normal(k3, (d, 4 * d)), "b1": jnp.zeros(4 * d),
            "w2": proj_std * jax.random.normal(k4, (4 * d, d)), "b2": jnp.zeros(d),
        })
    return {"embed": std * jax.random.normal(keys[0], (cfg.vocab, d)), "layers": layers,
            "lnf": jnp.ones(d)}


def rmsnorm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def rope(x, positions):
    """RoPE over the last dim of ``x[..., T, (H,) D]``-shaped arrays; ``positions: [T]``.
    ``x`` has shape ``[B, T, H, D]`` or ``[B, T, D]``."""
    d = x.shape[-1]
    half = d // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    ang = positions[:, None].astype(jnp.float32) * freq[None, :]  # [T, half]
    if x.ndim == 4:
        ang = ang[:, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:]],
                           axis=-1)


def forward(params, tokens, cfg: LMConfig, *, collect=(), restrict_layer: int = -1,
            allowed=None):
    """Logits ``f32[B, T, V]`` and ``{layer: (h f32[B, T, d], attn f32[B, T, T])}`` for the
    layers in ``collect`` (static tuple). ``restrict_layer`` / ``allowed``: see module doc."""
    b, t = tokens.shape
    d, nh = cfg.d_model, cfg.n_heads
    dh = d // nh
    pos = jnp.arange(t)
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    x = params["embed"][tokens]
    out = {}
    for i, lp in enumerate(params["layers"]):
        h = rmsnorm(x, lp["ln1"])
        q, k, v = jnp.split(h @ lp["wqkv"], 3, axis=-1)
        q = rope(q.reshape(b, t, nh, dh), pos)
        k = rope(k.reshape(b, t, nh, dh), pos)
        v = v.reshape(b, t, nh, dh)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dh)
        mask = causal[None, None]
        if i == restrict_layer and allowed is not None:
            mask = mask & allowed[:, None]
        logits = jnp.where(mask, logits, NEG)
        p = jax.nn.softmax(logits, axis=-1)
        if i in collect:
            out[i] = (h, p.mean(axis=1))
        o = jnp.einsum("bhts,bshd->bthd", p, v).reshape(b, t, d)
        x = x + o @ lp["wo"]
        h2 = rmsnorm(x, lp["ln2"])
        x = x + jax.nn.gelu(h2 @ lp["w1"] + lp["b1"]) @ lp["w2"] + lp["b2"]
    x = rmsnorm(x, params["lnf"])
    return x @ params["embed"].T, out


def token_nll(params, tokens, cfg: LMConfig, **kw):
    """Per-token negative log-likelihood (nats) of ``tokens[:, 1:]``: ``f32[B, T - 1]``."""
    logits, aux = forward(params, tokens[:, :-1], cfg, **kw)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return nll, aux


# --------------------------------------------------------------------------------------------
# Adam
# --------------------------------------------------------------------------------------------


def adam_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, lr, *, b1=0.9, b2=0.95, eps=1e-8, clip=1.0,
                weight_decay=0.0):
    """One Adam(W) step with global-norm clipping; returns ``(params, state, grad_norm)``."""
    gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    scale = jnp.minimum(1.0, clip / (gnorm + 1e-12))
    grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
    t = state["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1 = 1 - b1 ** t.astype(jnp.float32)
    c2 = 1 - b2 ** t.astype(jnp.float32)

    def step(p, m, v):
        upd = (m / c1) / (jnp.sqrt(v / c2) + eps)
        if weight_decay and p.ndim >= 2:
            upd = upd + weight_decay * p
        return p - lr * upd

    params = jax.tree_util.tree_map(step, params, m, v)
    return params, {"m": m, "v": v, "t": t}, gnorm


def lr_schedule(step, total, peak, warmup):
    """Linear warmup then cosine decay to 10% of ``peak``."""
    step = jnp.asarray(step, jnp.float32)
    warm = peak * (step + 1) / warmup
    frac = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
    cos = peak * (0.1 + 0.9 * 0.5 * (1 + jnp.cos(math.pi * frac)))
    return jnp.where(step < warmup, warm, cos)


# --------------------------------------------------------------------------------------------
# Lightning indexer
# --------------------------------------------------------------------------------------------


def init_indexer(key, d_model: int, cfg: IndexerConfig) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    hi, di = cfg.heads, cfg.head_dim
    return {"wq": jax.random.normal(k1, (d_model, hi * di)) / math.sqrt(d_model),
            "wk": jax.random.normal(k2, (d_model, di)) / math.sqrt(d_model),
            "ww": 0.1 * jax.random.normal(k3, (d_model, hi)) / math.sqrt(d_model)}


def indexer_qwk(ip, h, cfg: IndexerConfig):
    """``q f32[B, T, Hi, Di]``, ``w f32[B, T, Hi]``, ``k f32[B, T, Di]`` from ``h f32[B, T, d]``.
    RoPE on the first half of the dims (the rest position-free), as DeepSeek-V3.2's indexer."""
    b, t, _ = h.shape
    hi, di = cfg.heads, cfg.head_dim
    rd = di // 2
    pos = jnp.arange(t)
    q = (h @ ip["wq"]).reshape(b, t, hi, di) / math.sqrt(di)
    k = h @ ip["wk"]
    q = jnp.concatenate([rope(q[..., :rd], pos), q[..., rd:]], axis=-1)
    k = jnp.concatenate([rope(k[..., :rd], pos), k[..., rd:]], axis=-1)
    w = (h @ ip["ww"]) / math.sqrt(hi)
    return q, w, k


def indexer_scores(ip, h, cfg: IndexerConfig):
    """``f32[B, T, T]``: ``reference.index_scores`` per window (non-causal entries included)."""
    q, w, k = indexer_qwk(ip, h, cfg)
    return jax.vmap(index_scores)(q, w, k)


def indexer_kl(ip, h, attn, cfg: IndexerConfig):
    """Mean over query rows of ``KL(attn_row || softmax over causal positions of scores)``;
    ``attn`` (the frozen layer's head-mean attention) is a constant."""
    t = h.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    s = jnp.where(causal[None], indexer_scores(ip, h, cfg), NEG)
    logq = jax.nn.log_softmax(s, axis=-1)
    p = jax.lax.stop_gradient(attn)
    logp = jnp.log(jnp.where(p > 0, p, 1.0))
    kl = jnp.sum(jnp.where(causal[None] & (p > 0), p * (logp - logq), 0.0), axis=-1)
    return kl.mean()
