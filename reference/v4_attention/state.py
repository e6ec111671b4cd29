"""The flash-state protocol of DeepSeek-V4 attention split into parts (tokamax's ``mla_swa``
then ``sparse_mla``; ``docs/engines/tokamax.md`` sections 3.4 and 4): a part returns its
*unnormalized* state over the entries it read, the next part resumes from it, and the last
applies the sink, once.

A state of query row ``t``, head ``h`` over an entry set ``X`` (logits ``s_x = sm_scale * q .
row_x``, values ``v_x = row_x``):

    m   = max_x s_x                                  f32[T, H]   (-inf: X empty)
    l   = sum_x e^(s_x - m)                          f32[T, H]   (0: X empty)
    acc = sum_x e^(s_x - m) v_x                      f32[T, H, D]

It is defined up to the choice of ``m`` (``(acc, l, m)`` and ``(acc e^d, l e^d, m - d)`` are the
same state); ``m`` is the max logit as tokamax returns it. Resuming (``resume``) over a disjoint
set ``Y``: ``m' = max(m_X, m_Y)``, ``acc' = acc_X e^(m_X - m') + acc_Y e^(m_Y - m')``, likewise
``l'``: the state of ``X u Y``. Finishing with sink logits ``z f32[H]`` (``finish``):

    out = acc / (l + e^(z - m))

which is tokamax's rule and the FlashMLA one ``reference.mla.sinks`` implements, ``out = (acc /
l) / (1 + e^(z - lse))`` with ``lse = m + log l``: ``(acc / l, m + log l)`` is the normalized,
sink-free LSE state that ``sinks.merge_states`` merges, and ``finish`` is ``sinks.apply_sink``
on it (so the sink rule, its ``-inf`` sink and its empty-row zeros are written once, there).
A state whose ``l = 0`` (an empty set, or tokamax's invalid rows ``acc = l = m = 0``) finishes
to zeros.

Precision: each part's ``acc``, ``l``, ``m`` are f32 (``reference.mla.attend``'s ``precision``
rounding applies within a part). An external state passes through whatever dtype its caller
stored it in (tokamax keeps ``acc`` in ``q.dtype``: bf16 rounding between the parts).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from reference.mla import attend, sinks


class FlashState(NamedTuple):
    """An unnormalized attention state (module docstring): ``acc f32[T, H, D]``, ``l
    f32[T, H]``, ``m f32[T, H]``. A pytree."""

    acc: jax.Array
    l: jax.Array  # noqa: E741 (the flash-attention name)
    m: jax.Array


def empty_state(num_rows: int, heads: int, dim: int) -> FlashState:
    """The state of no entry: ``acc = 0``, ``l = 0``, ``m = -inf``."""
    return FlashState(jnp.zeros((num_rows, heads, dim), jnp.float32),
                      jnp.zeros((num_rows, heads), jnp.float32),
                      jnp.full((num_rows, heads), -jnp.inf, jnp.float32))


def part_state(q: jax.Array, cache, slots: jax.Array, valid: jax.Array, *, sm_scale: float,
               precision: str = "f32", layer=None) -> FlashState:
    """The state of ``q f32|bf16[T, H, D]`` over its ``slots i32[T, n]`` (flat slots, ``valid
    bool[T, n]``) of ``cache``: any cache ``reference.mla.attend.attend_selected`` reads
    (including tokamax's ``CsaCache`` / ``PlaneCache``, read by slot), ``v_dim = D``."""
    acc, l_, m = attend.attend_selected(q, cache, slots, valid, sm_scale=sm_scale,
                                        v_dim=q.shape[-1], layer=layer, precision=precision,
                                        state=True)
    return FlashState(acc, l_, m)


def resume(prev: FlashState, part: FlashState) -> FlashState:
    """The state over both parts' (disjoint) entry sets: ``prev`` (e.g. tokamax's window state,
    any float dtype, upcast to f32) rescaled to the larger max and added to ``part``. Two
    empty states give the empty state (no NaN)."""
    m1, m2 = (jnp.asarray(s.m, jnp.float32) for s in (prev, part))
    m = jnp.maximum(m1, m2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a1, a2 = jnp.exp(m1 - m_safe), jnp.exp(m2 - m_safe)  # 0 for an empty side (m = -inf)
    acc = (jnp.asarray(prev.acc, jnp.float32) * a1[..., None]
           + jnp.asarray(part.acc, jnp.float32) * a2[..., None])
    l_ = jnp.asarray(prev.l, jnp.float32) * a1 + jnp.asarray(part.l, jnp.float32) * a2
    return FlashState(acc, l_, m)


def normalized(st: FlashState) -> tuple[jax.Array, jax.Array]:
    """``(out f32[T, H, D], lse f32[T, H])``: the sink-free LSE state of ``reference.mla.sinks``
    (``acc / l``, ``m + log l``; zeros and ``-inf`` where ``l = 0``)."""
    pos = st.l > 0
    safe = jnp.where(pos, st.l, 1.0)
    out = jnp.where(pos[..., None], st.acc / safe[..., None], 0.0)
    lse = jnp.where(pos, st.m + jnp.log(safe), -jnp.inf)
    return out, lse


def finish(st: FlashState, attn_sink: jax.Array | None) -> jax.Array:
    """``f32[T, H, D]``: ``acc / (l + e^(sink - m))`` (module docstring), by
    ``sinks.apply_sink`` on ``normalized(st)``; ``attn_sink=None``: ``acc / l``."""
    out, lse = normalized(st)
    return sinks.apply_sink(out, lse, attn_sink)
