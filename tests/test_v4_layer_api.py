"""The public DeepSeek-V4 layer around the paged step (``dsa_jax.v4_project`` /
``v4_output`` / ``v4_rope_tables``, issue 27 deliverable 3).

f32: ``v4_project`` -> ``dsa_jax.v4_step`` (reference backend) -> ``v4_output`` reproduces the
dense statement's ``attention_layer`` on all three layer types over a prefill and decodes (the
tolerance of ``tests/test_v4_step.py``'s ``_drive``). bf16 (the default): ``v4_project`` /
``v4_output`` are compared with the statement's own pieces (``project_layer_inputs`` /
``layer_output`` as its layer calls them, batch axis included) and the window keys with the
statement's own state after a bf16 run (step == statement in bf16, both backends:
``tests/test_v4_step.py``). Then the defaults and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsa_jax
from dsa_jax import v4_output, v4_project, v4_rope_tables
from reference import deepseek_v4 as dv4
from reference.statements import deepseek_v4_layer as dl
from tests import v4_step_model as vm

RATIOS = (0, 4, 128)
MAX_SEQ = 160
WINDOW, WINDOW_PAGE = 8, 4  # a short window keeps the statement and the step cheap


def _model(seed=0):
    cfgs = vm.configs(RATIOS, window_size=WINDOW)
    return cfgs, [dv4.init_params(c, seed=seed + i) for i, c in enumerate(cfgs)]


def _project_batch(params, x, pos, c, qat):
    """One layer's step inputs over the sequences ``x[i]`` at ``pos[i]``, concatenated."""
    per = [v4_project(params, xi, pi, c, max_seq_len=MAX_SEQ, qat=qat, precision="f32")
           for xi, pi in zip(x, pos, strict=True)]
    return {k: jnp.concatenate([p[k] for p in per]) for k in per[0]}


def test_project_step_output_equal_statement_f32(qat=False):
    """A prefill of 130 tokens (an HCA entry and many CSA groups complete) then 2 one-token
    decodes, every layer against ``attention_layer`` (QAT off here: ``tests/test_v4_step.py``
    drives ``v4_project`` with QAT on through ``tests/v4_step_model.project``)."""
    cfgs, params = _model()
    schedule = [[130], [1], [1]]
    total = np.sum(schedule, axis=0)
    rng = np.random.default_rng(7)
    xs = [jnp.asarray(rng.standard_normal((int(n), cfgs[0].dim), dtype=np.float32))
          for n in total]
    pm = vm.PagedModel(RATIOS, 1, MAX_SEQ, window_size=WINDOW, window_page_size=WINDOW_PAGE)
    sp = vm.step_params(cfgs, params, MAX_SEQ)
    sink = jnp.stack([p["attn_sink"] for p in params])
    states = {(li, i): dv4.init_state(c, 1, MAX_SEQ) for li, c in enumerate(cfgs)
              for i in range(1)}
    caches, st = pm.caches, pm.states
    done = np.zeros(1, int)
    for n_step, q_lens in enumerate(schedule):
        seq_pos = [jnp.arange(d, d + q, dtype=jnp.int32) for d, q in zip(done, q_lens,
                                                                          strict=True)]
        seq_x = [xs[i][done[i]:done[i] + q] for i, q in enumerate(q_lens)]
        per_layer = [_project_batch(params[li], seq_x, seq_pos, c, qat)
                     for li, c in enumerate(cfgs)]
        meta = pm.meta(done + q_lens, q_lens, decode=max(q_lens) == 1)
        res = dsa_jax.v4_step(vm.step_inputs(cfgs, per_layer, sink), sp, caches, st, meta,
                              layout=pm.layout, qat=qat, backend="reference", precision="f32")
        caches, st = res.caches, res.states
        row = 0
        for i, q in enumerate(q_lens):
            for li, c in enumerate(cfgs):
                start = int(done[i]) if n_step == 0 else jnp.int32(done[i])
                want, states[li, i] = dv4.attention_layer(
                    params[li], seq_x[i][None], start, states[li, i], c, qat=qat,
                    precision="f32")
                got = v4_output(params[li], res.out[li, row:row + q], seq_pos[i], c,
                                max_seq_len=MAX_SEQ, precision="f32")
                np.testing.assert_allclose(
                    np.asarray(got), np.asarray(want[0]), rtol=2e-4, atol=2e-4,
                    err_msg=f"step {n_step} seq {i} layer {li} (ratio {c.compress_ratio})")
            row += q
        done = done + q_lens


def _bf16_exact(a):
    a = np.asarray(a, np.float32)
    np.testing.assert_array_equal(a, np.asarray(jnp.asarray(a).astype(jnp.bfloat16)
                                                .astype(jnp.float32)))


def test_bf16_project_and_output_are_the_statements_pieces(qat=True):
    """Under ``"bf16"``: ``v4_project`` / ``v4_output`` equal ``project_layer_inputs`` /
    ``layer_output`` as the statement's layer calls them (``x [1, S, dim]`` inside a jit), the
    rounded values are bf16-exact, and ``window_kv`` equals the window ring the statement
    stores after a bf16 prefill. The window-only and the CSA layer (both RoPE tables; an HCA
    layer's inputs are a subset of a CSA layer's). QAT on: every rounding point of the regime
    plus the QAT simulations on the bf16 values."""
    cfgs, params = _model(seed=3)
    s = WINDOW  # the whole prefill stays in the statement's window ring
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((s, cfgs[0].dim), dtype=np.float32))
    pos = jnp.arange(s, dtype=jnp.int32)
    for li, c in enumerate(cfgs[:2]):  # both RoPE tables; ratio 128 reads a subset of ratio 4
        got = v4_project(params[li], x, pos, c, max_seq_len=MAX_SEQ, qat=qat, precision="bf16")
        ref = jax.jit(dl.project_layer_inputs, static_argnums=(3, 4, 5, 6))(
            params[li], x[None], pos, c, MAX_SEQ, qat, "bf16")
        assert sorted(got) == sorted(ref)
        for k in got:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k][0]),
                                          err_msg=f"layer {li} {k}")
        for k in ("q", "window_kv", "index_q", "index_weights"):
            if k in got:
                _bf16_exact(got[k])
        _, state = dv4.attention_layer(params[li], x[None], 0, dv4.init_state(c, 1, MAX_SEQ),
                                       c, qat=qat, precision="bf16")
        np.testing.assert_array_equal(np.asarray(state.window[0, :s]),
                                      np.asarray(got["window_kv"]), err_msg=f"layer {li}")
        o = jnp.asarray(rng.standard_normal((s, c.n_heads, c.head_dim), dtype=np.float32))
        o = o.astype(jnp.bfloat16).astype(jnp.float32)  # attention's output is bf16 there
        out = v4_output(params[li], o, pos, c, max_seq_len=MAX_SEQ, precision="bf16")
        assert out.dtype == jnp.bfloat16
        ref_out = jax.jit(dl.layer_output, static_argnums=(3, 4, 5))(
            params[li], o[None], pos, c, MAX_SEQ, "bf16")
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                      np.asarray(ref_out[0]))


def test_rope_tables_per_layer_type():
    cfgs, _ = _model()
    cos0, sin0 = v4_rope_tables(cfgs[0], MAX_SEQ)
    cos4, _ = v4_rope_tables(cfgs[1], MAX_SEQ)
    cos128, _ = v4_rope_tables(cfgs[2], MAX_SEQ)
    assert cos0.shape == sin0.shape == (MAX_SEQ, cfgs[0].rope_head_dim // 2)
    np.testing.assert_array_equal(cos4, cos128)  # compressed layers share theta and YaRN
    assert not np.array_equal(cos0, cos4)
    assert dv4._rope(cfgs[1], MAX_SEQ)[0] is cos4  # the statement's own (cached) tables
    # the step's compressed-entry tables are the compressed layers' tables
    np.testing.assert_array_equal(np.asarray(vm.step_params(cfgs, _model()[1], MAX_SEQ).cos),
                                  cos4)


def _args():
    cfgs, params = _model()
    c = cfgs[1]
    return dict(params=dict(params[1]), x=jnp.ones((3, c.dim), jnp.float32),
                positions=jnp.arange(3, dtype=jnp.int32), config=c)


@pytest.mark.parametrize("change,match", [
    (lambda a: a["params"].pop("indexer.wq_b.weight"), r"missing 'indexer\.wq_b\.weight'"),
    (lambda a: a["params"].__setitem__("wkv.weight", jnp.ones((3, 4))),
     r"params\['wkv\.weight'\] must have shape \(\d+, \d+\), got \(3, 4\)"),
    (lambda a: a.__setitem__("x", jnp.ones((3, 5))), r"config\.dim = \d+, got 5"),
    (lambda a: a.__setitem__("positions", jnp.asarray([0, 1, MAX_SEQ])),
     rf"max_seq_len={MAX_SEQ}.*position {MAX_SEQ}"),
    (lambda a: a.__setitem__("positions", jnp.asarray([0, -1, 2])), r"position -1"),
    (lambda a: a.__setitem__("positions", jnp.arange(2)), r"one position per token"),
])
def test_project_refuses(change, match):
    a = _args()
    change(a)
    with pytest.raises(ValueError, match=match):
        v4_project(a["params"], a["x"], a["positions"], a["config"], max_seq_len=MAX_SEQ)


def test_refuses_unknown_precision_and_bad_output_shapes():
    a = _args()
    with pytest.raises(ValueError, match=r"\('f32', 'bf16'\).*'fp16'"):
        v4_project(a["params"], a["x"], a["positions"], a["config"], max_seq_len=MAX_SEQ,
                   precision="fp16")
    c = a["config"]
    o = jnp.ones((3, c.n_heads, c.head_dim), jnp.float32)
    with pytest.raises(ValueError, match=r"\('f32', 'bf16'\).*'f16'"):
        v4_output(a["params"], o, a["positions"], c, max_seq_len=MAX_SEQ, precision="f16")
    with pytest.raises(ValueError, match=rf"config\.head_dim = {c.head_dim}, got 7"):
        v4_output(a["params"], jnp.ones((3, c.n_heads, 7)), a["positions"], c,
                  max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError, match=rf"max_seq_len={MAX_SEQ}.*position {MAX_SEQ + 4}"):
        v4_output(a["params"], o, jnp.asarray([0, 1, MAX_SEQ + 4]), c, max_seq_len=MAX_SEQ)
    p = dict(a["params"])
    p["wo_b.weight"] = jnp.ones((2, 2))
    with pytest.raises(ValueError, match=r"params\['wo_b\.weight'\].*got \(2, 2\)"):
        v4_output(p, o, a["positions"], c, max_seq_len=MAX_SEQ)


def test_traced_positions_are_not_checked_but_compile():
    """Under ``jit`` the positions are traced: no range check (documented), one compile."""
    a = _args()
    f = jax.jit(lambda p, x, pos: v4_project(p, x, pos, a["config"], max_seq_len=MAX_SEQ))
    got = f(a["params"], a["x"], a["positions"])
    want = v4_project(a["params"], a["x"], a["positions"], a["config"], max_seq_len=MAX_SEQ)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
