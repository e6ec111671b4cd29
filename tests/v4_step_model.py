"""A tiny DeepSeek-V4 model for the V4 step tests and the CLI: per-layer statement configs and
params (``reference.deepseek_v4``), the projections the step takes and the output projection
(``dsa_jax.v4_project`` / ``v4_output``: the statement's own pieces), and the paged batch
(page tables per family, NaN-filled caches, state pools)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsa_jax.v4_layer import v4_output, v4_project
from dsa_jax.v4_step import (
    V4BatchMeta,
    V4Caches,
    V4ModelLayout,
    V4StepInputs,
    V4StepParams,
    init_v4_states,
)
from pallas_kernels.v4_compressor import rope_rows
from reference import deepseek_v4 as dv4
from reference import v4_compressor as vc


def configs(ratios, **overrides):
    """One ``V4AttentionConfig`` per layer (head_dim 512: the V4 op's only head)."""
    kw = dict(head_dim=512, n_heads=2, o_groups=2, compress_ratios=tuple(ratios))
    kw.update(overrides)
    return [dv4.tiny_config(**kw, layer_id=i) for i in range(len(ratios))]


def project(params, x, pos, cfg, max_seq_len, qat, precision="f32"):
    """The step's per-layer inputs for tokens ``x f32[S, dim]`` at positions ``pos i32[S]``:
    ``dsa_jax.v4_project`` (the statement's own ``project_layer_inputs``)."""
    return v4_project(params, x, pos, cfg, max_seq_len=max_seq_len, qat=qat, precision=precision)


def finish(params, o, pos, cfg, max_seq_len, precision="f32"):
    """The statement's output side on ``o f32[S, H, 512]``: ``dsa_jax.v4_output`` (inverse
    RoPE, ``wo_a``, ``wo_b``; the statement's own ``layer_output``)."""
    return v4_output(params, o, pos, cfg, max_seq_len=max_seq_len, precision=precision)


def step_params(cfgs, params, max_seq_len) -> V4StepParams:
    """The compressor params of each family, stacked in layer order, and the entry tables
    (also in the Pallas compressor's row layout, as a model keeps them)."""
    def stack(ratio, name):
        xs = [params[i][name] for i, c in enumerate(cfgs) if c.compress_ratio == ratio]
        return jnp.stack(xs) if xs else None
    cos, sin = vc.rope_tables(max_seq_len)
    return V4StepParams(cos, sin, stack(4, "compressor.ape"), stack(4, "compressor.norm.weight"),
                        stack(4, "indexer.compressor.ape"),
                        stack(4, "indexer.compressor.norm.weight"),
                        stack(128, "compressor.ape"), stack(128, "compressor.norm.weight"),
                        rope_rows(cos, sin))  # the Pallas compressor's row layout


def step_inputs(cfgs, per_layer, attn_sink) -> V4StepInputs:
    """``V4StepInputs`` from ``per_layer[l]`` (``project``'s dicts over the step's rows)."""
    def stack(ratio, key):
        xs = [p[key] for p, c in zip(per_layer, cfgs, strict=True) if c.compress_ratio == ratio]
        return jnp.stack(xs) if xs else None
    return V4StepInputs(
        jnp.stack([p["q"] for p in per_layer]), jnp.stack([p["window_kv"] for p in per_layer]),
        stack(4, "kv"), stack(4, "score"), stack(4, "index_q"), stack(4, "index_weights"),
        stack(4, "index_kv"), stack(4, "index_score"), stack(128, "kv"), stack(128, "score"),
        attn_sink)


def table(num_seqs, pages_per_seq, page_size, seed):
    """A shuffled packed page table: ``(page_indices i32[S * pps], cu_lens i32[S+1],
    num_pages)`` (one spare page, never referenced)."""
    num_pages = num_seqs * pages_per_seq + 1
    ids = np.random.default_rng(seed).permutation(num_pages)[:num_seqs * pages_per_seq]
    cu = np.arange(num_seqs + 1) * pages_per_seq * page_size
    return jnp.asarray(ids, jnp.int32), jnp.asarray(cu, jnp.int32), num_pages


class PagedModel:
    """The paged side of a test: layout, NaN-filled caches, state pools, page tables."""

    def __init__(self, ratios, num_seqs, max_seq_len, *, index_topk=8, num_slots=None,
                 window_page_size=16, csa_page_size=8, hca_page_size=4, window_size=128):
        count = {r: sum(1 for x in ratios if x == r) for r in (0, 4, 128)}
        pps = lambda n, ps: -(-n // ps)  # noqa: E731
        self.layout = V4ModelLayout(
            tuple(ratios), window_page_size, pps(max_seq_len, window_page_size), window_size,
            csa_page_size=csa_page_size if count[4] else None,
            csa_pages_per_seq=pps(max_seq_len // 4, csa_page_size) if count[4] else None,
            hca_page_size=hca_page_size if count[128] else None,
            hca_pages_per_seq=pps(max(max_seq_len // 128, 1), hca_page_size)
            if count[128] else None, index_topk=index_topk)
        lay = self.layout
        self.window = table(num_seqs, lay.window_pages_per_seq, window_page_size, 1)
        self.csa = table(num_seqs, lay.csa_pages_per_seq, csa_page_size, 2) if count[4] else None
        self.hca = (table(num_seqs, lay.hca_pages_per_seq, hca_page_size, 3)
                    if count[128] else None)

        def nan(n, pages, ps, width=512):
            return jnp.full((n, pages, ps, width), jnp.nan, jnp.float32) if n else None
        wp = self.window[2]
        self.caches = V4Caches(
            nan(count[0], wp, window_page_size), nan(count[4], wp, window_page_size),
            nan(count[4], self.csa[2], csa_page_size) if count[4] else None,
            nan(count[4], self.csa[2], csa_page_size, 128) if count[4] else None,
            nan(count[128], wp, window_page_size),
            nan(count[128], self.hca[2], hca_page_size) if count[128] else None)
        self.num_seqs = num_seqs
        self.num_slots = num_slots or num_seqs + 1
        self.states = init_v4_states(lay, self.num_slots)
        self.state_slots = jnp.asarray((np.arange(num_seqs) + 1) % self.num_slots, jnp.int32)

    def meta(self, kv_lens, q_lens, decode: bool) -> V4BatchMeta:
        s = len(kv_lens)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)])
        dist = [s if decode else 0, s, s]
        fam = lambda t: (None, None) if t is None else t[:2]  # noqa: E731
        return V4BatchMeta(jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu_q, jnp.int32),
                           jnp.asarray(dist, jnp.int32), self.state_slots, *self.window[:2],
                           *fam(self.csa), *fam(self.hca))

    def batch_meta(self, seqs, kv_lens, q_lens, num_decode) -> V4BatchMeta:
        """The metadata of a step over the sequences ``seqs`` (ids, in batch order: the
        ``num_decode`` one-token decodes first, then the chunks), ``kv_lens`` / ``q_lens`` per
        batch position. Shapes stay those of all ``num_seqs`` sequences (one compile): the
        sequences not in the step follow as inactive padding (``distribution[2] =
        len(seqs)``, ``kv_len`` and ``q_len`` 0), and every page table is re-packed in batch
        order (each sequence keeps its pages and its state slot)."""
        n = len(seqs)
        order = list(seqs) + [i for i in range(self.num_seqs) if i not in seqs]
        kv = np.zeros(self.num_seqs, np.int32)
        q = np.zeros(self.num_seqs, np.int32)
        kv[:n], q[:n] = kv_lens, q_lens
        cu_q = np.concatenate([[0], np.cumsum(q)])

        def fam(t):
            if t is None:
                return None, None
            ids = np.asarray(t[0]).reshape(self.num_seqs, -1)
            return jnp.asarray(ids[order].reshape(-1)), t[1]
        return V4BatchMeta(jnp.asarray(kv), jnp.asarray(cu_q, jnp.int32),
                           jnp.asarray([num_decode, n, n], jnp.int32),
                           jnp.asarray(np.asarray(self.state_slots)[order]), *fam(self.window),
                           *fam(self.csa), *fam(self.hca))
