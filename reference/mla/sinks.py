"""Attention sinks (DeepSeek-V4, FlashMLA "MODEL1"): one learned f32 logit per head that
enters the softmax denominator only.

    o[t, h] = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink_h - m))

With ``lse = log sum_j e^(s_j)`` (the LSE of the real scores) this is FlashMLA's rule

    out *= 1 / (1 + exp(sink - lse))          the returned LSE stays ``lse`` (no sink)

so partial attention states (split-K, window + compressed, context-parallel shards) are merged
by their sink-free LSEs first and the sink is applied once, at the end (``merge_states`` then
``apply_sink``). ``sink = -inf`` means no sink (padded heads); a row with no valid entry
(``lse = -inf``) stays zeros, never NaN, whatever the sink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_sink(attn_sink, heads: int, name: str = "attn_sink") -> None:
    """Refuse an ``attn_sink`` that is not ``f32[heads]`` (``None`` passes: no sink)."""
    if attn_sink is None:
        return
    if np.ndim(attn_sink) != 1 or np.shape(attn_sink)[0] != heads:
        raise ValueError(f"{name} must have shape (H,) = ({heads},) (one logit per query head), "
                         f"got shape {tuple(np.shape(attn_sink))}")
    dt = jnp.dtype(jnp.result_type(attn_sink))
    if dt != jnp.float32:
        raise TypeError(f"{name} must be float32 (FlashMLA's sink dtype), got dtype {dt}")


def sink_factor(lse: jax.Array, attn_sink: jax.Array) -> jax.Array:
    """``1 / (1 + exp(sink - lse))`` for ``lse f32[T, H]``, ``attn_sink f32[H]``, computed
    without overflow (a sigmoid of ``lse - sink``); 1 where the sink is ``-inf``; 0 where the row
    is empty (``lse = -inf``: the output is zeros there anyway)."""
    z = lse - attn_sink[None, :].astype(jnp.float32)  # sink = -inf: z = +inf, factor 1
    return jnp.where(jnp.isneginf(lse), 0.0, jax.nn.sigmoid(z))  # empty row (z may be nan)


def apply_sink(out: jax.Array, lse: jax.Array, attn_sink: jax.Array | None) -> jax.Array:
    """Scale ``out f[T, H, V]`` by ``sink_factor``; ``None`` returns ``out`` unchanged.
    The LSE is not changed (callers return their sink-free ``lse``)."""
    if attn_sink is None:
        return out
    f = sink_factor(lse, attn_sink)
    return (out.astype(jnp.float32) * f[..., None]).astype(out.dtype)


def merge_states(outs, lses) -> tuple[jax.Array, jax.Array]:
    """Merge partial attention states ``(out_i f[T, H, V], lse_i f32[T, H])`` over disjoint
    entry sets into the attention over their union (sink-free): ``lse = logsumexp_i lse_i``,
    ``out = sum_i exp(lse_i - lse) out_i``; a state with ``lse_i = -inf`` adds nothing; all
    empty gives zeros and ``-inf``. Returns (f32 out, f32 lse)."""
    lse_all = jnp.stack([jnp.asarray(x, jnp.float32) for x in lses])
    m = jnp.max(lse_all, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_all - m_safe)
    den = jnp.sum(w, axis=0)
    num = sum(w[i][..., None] * jnp.asarray(o, jnp.float32) for i, o in enumerate(outs))
    safe = jnp.where(den > 0, den, 1.0)
    out = jnp.where(den[..., None] > 0, num / safe[..., None], 0.0)
    lse = jnp.where(den > 0, m_safe + jnp.log(safe), -jnp.inf)
    return out, lse
