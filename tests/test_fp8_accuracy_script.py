"""scripts/experiments/fp8_accuracy.py --quick: the result's shape and the facts that hold by
definition
(fractions in [0, 1], ties forgiven >= plain, errors finite and >= 0). No accuracy thresholds:
the numbers are the experiment's outcome, not a contract."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from scripts.experiments import fp8_accuracy as fa  # noqa: E402

FRACTIONS = ("forgiven_vs_f64_mean", "forgiven_vs_f64_min", "plain_vs_f64_mean",
             "plain_vs_f64_min", "plain_vs_bf16_mean", "plain_vs_bf16_min")
ERRORS = ("rel_err_vs_f64_mean", "rel_err_vs_f64_max", "rel_err_vs_bf16_mean",
          "rel_err_vs_bf16_max", "cache_rel_rms", "logit_sd")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_accuracy")
    return fa.main(["--quick", "--out", str(out)]), out


def test_outputs_written(run):
    result, out = run
    saved = json.loads((out / "fp8_accuracy.json").read_text())
    assert saved["config"] == json.loads(json.dumps(result["config"]))
    assert len(saved["indexer"]) == len(result["indexer"]) and len(saved["mla"]) == len(
        result["mla"])
    md = (out / "fp8_accuracy.md").read_text()
    assert "Indexer top-k overlap" in md and "Sparse MLA relative error" in md


def test_indexer_records(run):
    result, _ = run
    cfg = fa.quick_config()
    recs = result["indexer"]
    cells = {(d, c) for d in cfg.dists for c in cfg.contexts}
    assert {(r["distribution"], r["context"], r["keys"], r["q"]) for r in recs} == {
        (d, c, keys, q) for d, c in cells for keys, q in fa.INDEX_VARIANTS}
    for r in recs:
        assert r["rows"] == cfg.seqs
        has_ref = (r["keys"], r["q"]) not in (("f32", "f32"), ("bf16", "bf16"))
        assert ("plain_vs_bf16_mean" in r) == has_ref, r
        for key in FRACTIONS:
            if key in r:
                assert 0.0 <= r[key] <= 1.0, (key, r)
        # every token of the f64 top-k set scores >= the threshold: forgiving ties only adds
        assert r["forgiven_vs_f64_mean"] >= r["plain_vs_f64_mean"], r
        assert r["forgiven_vs_f64_min"] >= r["plain_vs_f64_min"], r
        assert cfg.k <= r["worst_true_rank"] <= max(cfg.contexts), r
        assert math.isfinite(r["max_shortfall_sd"]) and r["max_shortfall_sd"] >= 0.0, r
        assert math.isfinite(r["keys_rel_rms"]) and r["keys_rel_rms"] >= 0.0, r


def test_mla_records(run):
    result, _ = run
    cfg = fa.quick_config()
    recs = result["mla"]
    assert {(r["distribution"], r["context"], r["sm_scale"], r["cache"]) for r in recs} == {
        (d, c, s, cache) for d in cfg.dists for c in cfg.contexts for s in cfg.sm_scales
        for cache in fa.LATENT_CACHES}
    for r in recs:
        assert r["rows"] == cfg.seqs
        assert ("rel_err_vs_bf16_mean" in r) == (r["cache"] == "fp8"), r
        for key in ERRORS:
            if key in r:
                assert math.isfinite(r[key]) and r[key] >= 0.0, (key, r)
        assert r["rel_err_vs_f64_max"] >= r["rel_err_vs_f64_mean"], r


def test_overlap_metrics_by_definition():
    """A hand-made row: scores with a tie at the threshold, a selection that takes the other
    tied token. Ties forgiven: full credit; plain: one miss."""
    import numpy as np

    scores = np.array([[5.0, 3.0, 3.0, 1.0]])
    m = fa.overlap_metrics(np.array([[0, 2]]), scores, 2, ref=np.array([[0, 1]]))
    assert m["forgiven_vs_f64_mean"] == 1.0  # token 2 ties the k-th score (3.0)
    assert m["plain_vs_f64_mean"] == 0.5  # stable f64 top-2 is {0, 1}
    assert m["plain_vs_bf16_mean"] == 0.5
    assert m["max_shortfall_sd"] == 0.0
    m = fa.overlap_metrics(np.array([[0, 3]]), scores, 2)
    assert m["forgiven_vs_f64_mean"] == 0.5 and m["worst_true_rank"] == 4
    assert m["max_shortfall_sd"] == pytest.approx(2.0 / np.std(scores[0]))


def test_f64_helpers_match_the_oracle():
    """The script's own float64 scores and attention agree with tests/oracle.py."""
    import dataclasses

    import numpy as np
    from oracle import mla_oracle, token_candidates

    cfg = dataclasses.replace(fa.quick_config(), seqs=2, page_size=32, k=16, mla_heads=4,
                              v_dim=8)
    rng = np.random.default_rng(0)
    b = fa.decode_batch(rng, cfg, 96, 4, fa.INDEX_DIM, "heavy")
    scores = fa.true_scores(b, 96)
    cands = token_candidates(*b.args(), b.pages_per_seq)
    for r, cand in enumerate(cands):
        want = np.array([cand[s] for s in range(96)])
        np.testing.assert_allclose(scores[r], want, rtol=1e-12, atol=1e-9)

    m = fa.decode_batch(rng, cfg, 96, cfg.mla_heads, fa.LATENT_DIM, "scaled")
    sel = np.stack([rng.permutation(96)[:cfg.k] for _ in range(cfg.seqs)]).astype(np.int32)
    want, _ = mla_oracle(m.q, m.cache, m.seq_lens, sel, m.page_indices, m.cu_q_lens,
                         m.cu_kv_lens, m.distribution, sm_scale=0.1, v_dim=cfg.v_dim,
                         pages_per_seq=m.pages_per_seq)
    for i in range(cfg.seqs):
        pages, offs = fa.token_slots(m, i, sel[i])
        got, _ = fa.mla_f64(m.q[i], m.cache[pages, offs].astype(np.float64), 0.1, cfg.v_dim)
        np.testing.assert_allclose(got, want[i], rtol=1e-10, atol=1e-12)
