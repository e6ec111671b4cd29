"""The DeepSeek-V4.1 attention-stack statement (``reference.statements.deepseek_v41``, issue 31
deliverable 1) against a float64 oracle of the official bf16 regime written from the definition
(``tests/v41_bf16_oracle.py``), on the tiny config with every mode (SWA, FULL at ratios 2 and 1,
REUSE, REINDEX consuming candidates, the candidate source, an MTP layer); chunk invariance over a
prefill then decodes crossing pair, window and candidate-block boundaries; the refusals."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from reference.statements import deepseek_v41 as s41
from reference.statements.deepseek_v41_layer import rope_tables
from reference.v41 import CandidateUse, Mode, resolve_layers, v41_tiny
from tests import v41_bf16_oracle as oracle
from tests.v4_bf16_oracle import out_error, ulp

C = v41_tiny()
M = 64  # max_seq_len
N = 44  # tokens: 11 candidate blocks of 4 at ratio 1, more than the budget of 2
PLANS = resolve_layers(C)


def _inputs(seed, n=N):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((len(PLANS), 1, n, C.dim), dtype=np.float32)


def _tables():
    """The statement's RoPE tables per ratio kind (the oracle takes them as given)."""
    return {r: rope_tables(C, r, M) for r in (0, 1, 2)}


@pytest.fixture(scope="module")
def prefill():
    params = s41.init_params(C, seed=3)
    xs = _inputs(4)
    out, state, sel = s41.attention_stack(params, xs, 0, s41.init_state(C, 1, M), C,
                                          return_selection=True)
    want = oracle.stack(params, xs[:, 0], C, _tables())
    return params, xs, out, state, sel, want


def test_the_tiny_config_has_every_mode_and_candidate_role():
    modes = {(p.mode, p.ratio) for p in PLANS}
    assert {(Mode.SWA, 0), (Mode.FULL, 2), (Mode.FULL, 1), (Mode.REUSE, 2), (Mode.REUSE, 1),
            (Mode.REINDEX, 1)} <= modes
    assert {p.candidates for p in PLANS} == set(CandidateUse)
    assert PLANS[-1].mtp and PLANS[-1].mode is Mode.SWA


def test_every_layer_meets_the_f64_oracle(prefill):
    """Each layer's output within bf16 ulps of the oracle's (each row's largest value's ulp):
    at most 2 ulp, mean under 0.2, under 2% of the elements at 1 ulp or more."""
    _, _, out, _, _, want = prefill
    for plan, w in zip(PLANS, want, strict=True):
        mx, mean, frac = out_error(np.asarray(out[plan.layer, 0], np.float64), w["out"])
        print(f"layer {plan.layer} ({plan.mode.value}, r{plan.ratio}): max {mx:.2f} mean "
              f"{mean:.3f} ulp, {frac:.4f} >= 1")
        assert mx <= 2 and mean < 0.2 and frac < 0.02, (plan, mx, mean, frac)


def test_selections_score_as_the_oracles(prefill):
    """Per indexing layer and row: the picks, scored by the oracle, equal the oracle's top-k's
    scores within one ulp of the row's best (bf16 ties are common); the candidate source's
    blocks are the oracle's on every row; every consumer pick lies in a candidate block of its
    row; on most rows the sets are identical."""
    _, _, _, _, sel, want = prefill
    cands = np.asarray(sel.candidates[0])
    for plan, w in zip(PLANS, want, strict=True):
        if "picks" not in w:
            assert sel.topk[plan.layer] is None
            continue
        got = np.asarray(sel.topk[plan.layer][0])
        same = 0
        for t, row in enumerate(got):
            pick = row[row >= 0]
            assert len(pick) == len(w["picks"][t]) == min(C.index_topk, (t + 1) // plan.ratio)
            mine = np.sort(w["scores"][t, pick])
            ref = np.sort(w["scores"][t, w["picks"][t]])
            if len(ref):
                atol = ulp(max(np.abs(ref).max(), 2.0 ** -126))
                np.testing.assert_allclose(mine, ref, rtol=0, atol=atol,
                                           err_msg=f"layer {plan.layer} row {t}")
            same += set(pick) == set(w["picks"][t])
            if plan.candidates is CandidateUse.CONSUMES:
                assert set(pick // C.candidate_block_size) <= set(cands[t][cands[t] >= 0]), t
        assert same >= 0.9 * len(got), (plan.layer, same)
        if plan.candidates is CandidateUse.PRODUCES:
            assert [set(r[r >= 0]) for r in cands] == w["cands"]


def test_a_consumer_differs_from_its_unrestricted_top_k(prefill):
    """The restriction binds: on some row the REINDEX consumer's oracle top-k over every visible
    entry is not its top-k among the candidates (else the test would not tell them apart)."""
    _, _, _, _, _, want = prefill
    plan = next(p for p in PLANS if p.candidates is CandidateUse.CONSUMES)
    w = want[plan.layer]
    lens = (np.arange(N) + 1) // plan.ratio
    free = oracle.topk(w["scores"], lens, C.index_topk)
    assert any(set(a) != set(b) for a, b in zip(free, w["picks"], strict=True))


@pytest.mark.parametrize("split", [(25,), (7, 18)], ids=["25", "7-18"])
def test_chunks_then_decodes_equal_one_prefill(prefill, split):
    """Chunks (a first chunk of 25 tokens ends on an even position: its last token waits for
    its ratio-2 partner; 7 then 18 starts a chunk on an odd position) then one-token decodes
    to ``N``:
    every output equals the one prefill's (bit for bit measured; allowed: 1 ulp in 0.5% of the
    elements), every selection and candidate set identical."""
    params, xs, out, _, sel, _ = prefill
    state = s41.init_state(C, 1, M)
    starts = list(np.cumsum((0, *split))) + list(range(sum(split) + 1, N + 1))
    outs, tops, cands = [], [], []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        pos = a if a == 0 else jnp.int32(a)
        o, state, s = s41.attention_stack(params, xs[:, :, a:b], pos, state, C,
                                          return_selection=True)
        outs.append(np.asarray(o, np.float64))
        tops.append(s.topk)
        cands.append(np.asarray(s.candidates))
    got = np.concatenate(outs, axis=2)
    want = np.asarray(out, np.float64)
    err = np.abs(got - want) / ulp(np.abs(want).max(axis=-1, keepdims=True))
    assert err.max() <= 1 and (err > 0).mean() <= 0.005, (err.max(), (err > 0).mean())
    for layer, t in enumerate(sel.topk):
        if t is not None:
            np.testing.assert_array_equal(
                np.concatenate([np.asarray(x[layer]) for x in tops], axis=1), np.asarray(t))
    np.testing.assert_array_equal(np.concatenate(cands, axis=1), np.asarray(sel.candidates))


def test_refusals_name_the_argument_and_the_numbers():
    params = s41.init_params(C, seed=0)
    xs = _inputs(0, 4)
    st = s41.init_state(C, 1, M)
    with pytest.raises(TypeError, match="V41Config"):
        s41.attention_stack(params, xs, 0, st, object())
    with pytest.raises(ValueError, match="list of 9 per-layer dicts"):
        s41.attention_stack(params[:-1], xs, 0, st, C)
    bad = [dict(p) for p in params]
    del bad[3]["indexer.wk.weight"]
    with pytest.raises(ValueError, match=r"params\[3\] \(mode full\): missing \['indexer.wk"):
        s41.attention_stack(bad, xs, 0, st, C)
    bad = [dict(p) for p in params]
    bad[2]["indexer.wq_b.weight"] = bad[1]["indexer.wq_b.weight"]  # layer 2 reuses: no indexer
    with pytest.raises(ValueError, match=r"params\[2\] \(mode reuse\).*unexpected \['indexer"):
        s41.attention_stack(bad, xs, 0, st, C)
    bad = [dict(p) for p in params]
    bad[0]["wkv.weight"] = bad[0]["wkv.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"params\[0\]\['wkv.weight'\] must have shape"):
        s41.attention_stack(bad, xs, 0, st, C)
    with pytest.raises(ValueError, match="xs"):
        s41.attention_stack(params, xs[..., :-1], 0, st, C)
    with pytest.raises(ValueError, match="start_pos=61 with S=4 tokens must fit max_seq_len=64"):
        s41.attention_stack(params, xs, 61, st, C)
    with pytest.raises(ValueError, match=r"state.window has shape \(9, 1, 64, 64\), the config "
                                         r"and xs give \(9, 2, 64, 64\)"):
        s41.attention_stack(params, np.concatenate([xs, xs], axis=1), 0, st, C)
    with pytest.raises(ValueError, match="max_seq_len=63 must be even"):
        s41.init_state(C, 1, 63)
    with pytest.raises(ValueError, match="precision"):
        s41.attention_stack(params, xs, 0, st, C, precision="f16")
    odd = dataclasses.replace(C, head_dim=48, rope_head_dim=16)
    with pytest.raises(ValueError, match="head_dim=48 must be a multiple of 32"):
        s41.init_state(odd, 1, M)
