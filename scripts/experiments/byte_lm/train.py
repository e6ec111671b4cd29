"""Training loops: the LM (next-byte cross-entropy) and the indexers (KL, LM frozen)."""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from scripts.experiments.byte_lm import data as data_mod
from scripts.experiments.byte_lm import model as M

LN2 = math.log(2.0)


def train_lm(params, corpus_train: np.ndarray, cfg: M.LMConfig, *, steps: int, batch: int,
             lr: float, seed: int, max_seconds: float | None = None, log=print):
    """Adam on random windows of ``context + 1`` bytes. Stops early (recorded) if
    ``max_seconds`` runs out. Returns ``(params, info)``."""

    def loss_fn(p, toks):
        nll, _ = M.token_nll(p, toks, cfg)
        return nll.mean()

    @jax.jit
    def step_fn(p, st, toks, i):
        loss, g = jax.value_and_grad(loss_fn)(p, toks)
        rate = M.lr_schedule(i, steps, lr, max(steps // 20, 10))
        p, st, gn = M.adam_update(p, g, st, rate, weight_decay=0.1)
        return p, st, loss

    rng = np.random.default_rng([seed, 1])
    state = M.adam_init(params)
    t0 = time.perf_counter()
    losses, done = [], 0
    for i in range(steps):
        toks = data_mod.random_windows(corpus_train, rng, batch, cfg.context + 1)
        params, state, loss = step_fn(params, state, jnp.asarray(toks), i)
        done = i + 1
        if i % max(steps // 10, 1) == 0 or i == steps - 1:
            lv = float(loss)
            losses.append((i, lv / LN2))
            log(f"    lm step {i:5d}  train bits/byte {lv / LN2:.3f}  "
                f"{time.perf_counter() - t0:.0f}s")
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            log(f"    lm: time budget reached after {done} steps")
            break
    jax.block_until_ready(params)
    secs = time.perf_counter() - t0
    return params, {"steps": done, "steps_planned": steps, "batch": batch,
                     "tokens_trained": done * batch * cfg.context, "seconds": secs,
                     "train_bits_per_byte_log": losses, "peak_lr": lr, "seed": seed}


@functools.partial(jax.jit, static_argnames=("cfg",))
def eval_nll(params, toks, cfg: M.LMConfig):
    return M.token_nll(params, toks, cfg)[0]


def bits_per_byte(params, windows: np.ndarray, cfg: M.LMConfig, chunk: int = 4) -> np.ndarray:
    """Per-token bits ``f64[N, T]`` of predicting ``windows[:, 1:]`` (dense model)."""
    out = [np.asarray(eval_nll(params, jnp.asarray(windows[i:i + chunk]), cfg))
           for i in range(0, len(windows), chunk)]
    return np.concatenate(out).astype(np.float64) / LN2


def train_indexers(lm_params, corpus_train: np.ndarray, cfg: M.LMConfig,
                   icfg: M.IndexerConfig, layers: tuple[int, ...], *, steps: int, batch: int,
                   lr: float, seed: int, max_seconds: float | None = None, log=print):
    """One indexer per layer in ``layers``, trained jointly (sum of the layers' KLs) with the LM
    frozen. Returns ``(indexer params {layer: dict}, info)``."""
    key = jax.random.PRNGKey(seed + 1000)
    ips = {str(layer): M.init_indexer(jax.random.fold_in(key, layer), cfg.d_model, icfg)
           for layer in layers}

    def loss_fn(ips, toks):
        _, aux = M.forward(lm_params, toks, cfg, collect=layers)
        kls = [M.indexer_kl(ips[str(layer)], jax.lax.stop_gradient(aux[layer][0]),
                            aux[layer][1], icfg) for layer in layers]
        return sum(kls), jnp.stack(kls)

    @jax.jit
    def step_fn(ips, st, toks, i):
        (loss, kls), g = jax.value_and_grad(loss_fn, has_aux=True)(ips, toks)
        rate = M.lr_schedule(i, steps, lr, max(steps // 20, 5))
        ips, st, _ = M.adam_update(ips, g, st, rate)
        return ips, st, kls

    rng = np.random.default_rng([seed, 2])
    state = M.adam_init(ips)
    t0 = time.perf_counter()
    log_kl, done = [], 0
    for i in range(steps):
        toks = data_mod.random_windows(corpus_train, rng, batch, cfg.context)
        ips, state, kls = step_fn(ips, state, jnp.asarray(toks), i)
        done = i + 1
        if i % max(steps // 10, 1) == 0 or i == steps - 1:
            kv = [float(x) for x in kls]
            log_kl.append((i, kv))
            log(f"    indexer step {i:5d}  KL (nats) per layer {np.round(kv, 3).tolist()}  "
                f"{time.perf_counter() - t0:.0f}s")
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            log(f"    indexer: time budget reached after {done} steps")
            break
    jax.block_until_ready(ips)
    return ips, {"steps": done, "steps_planned": steps, "batch": batch,
                 "windows_trained": done * batch, "seconds": time.perf_counter() - t0,
                 "train_kl_log": log_kl, "peak_lr": lr, "seed": seed}


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def eval_nll_aux(params, toks, cfg: M.LMConfig, layer: int):
    """Dense per-token NLL (nats) and ``(h, head-mean attention)`` of ``layer``."""
    nll, aux = M.token_nll(params, toks, cfg, collect=(layer,))
    return nll, aux[layer]
