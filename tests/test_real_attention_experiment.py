"""scripts/experiments/real_attention_experiment.py --quick: only what must hold by construction
(shapes, equal budgets, the oracle's recall is an upper bound, the seed's coverage contract,
finite bits per byte), never the experiment's outcome. The quick run is the notebook's: one
test (marked ``notebooks``; CI reruns it on the newest jax) executes
scripts/experiments/real_attention_experiment.ipynb and runs every check on its result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

from reference.witnesses import scatter_topology_witnesses, segment_coverage  # noqa: E402
from scripts.experiments import real_attention_experiment as rae  # noqa: E402
from scripts.experiments.byte_lm import measure as X  # noqa: E402
from scripts.experiments.byte_lm import model as M  # noqa: E402

CFG = rae.quick_config()


def _execute_notebook(out: Path):
    """The quick experiment, by executing the notebook (so the notebook is tested and CI pays
    for the run once): ``(result, out, executed notebook)``, the result read back from
    ``out/real_attention.json``."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(rae.NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAE_SIZE", "quick")
        mp.setenv("RAE_OUT", str(out))
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={
            "metadata": {"path": str(ROOT / "scripts/experiments")}}).execute()
    return json.loads((out / "real_attention.json").read_text()), out, nb


@pytest.mark.slow  # about a minute: started first (tests/conftest.py)
@pytest.mark.notebooks
def test_the_notebooks_quick_run_holds_what_it_must_by_construction(tmp_path):
    """One test runs the notebook and every check (a module fixture shared by several tests ran
    it once per pytest-xdist worker that drew one of them); each failing check is reported."""
    run = _execute_notebook(tmp_path)
    failed = []
    for check in (check_outputs_and_shapes, check_budgets_are_equal_across_selections,
                  check_oracle_recall_bounds_every_selection, check_witness_coverage_contract,
                  check_bits_per_byte_are_finite):
        try:
            check(run)
        except AssertionError as err:
            failed.append(f"{check.__name__}: {err}")
    assert not failed, "\n\n".join(failed)


def _cells():
    return [(layer, k, s) for layer in CFG.layers for k in CFG.ks for s in CFG.segments
            if s <= k]


def check_outputs_and_shapes(run):
    result, out, nb = run
    # The notebook displayed both plots of every layer.
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) >= 2 * len(CFG.layers)
    assert result["config"]["layers"] == list(CFG.layers)  # the quick settings ran
    for name in ("real_attention.json", "real_attention.md", "lm.npz", "indexer.npz"):
        assert (out / name).stat().st_size > 0, name
    for layer in CFG.layers:
        assert (out / f"recall_coverage_L{layer}.png").stat().st_size > 0
        assert (out / f"bits_per_byte_L{layer}.png").stat().st_size > 0
    lm = np.load(out / "lm.npz")
    embed = next(v for k, v in lm.items() if "embed" in k)
    assert embed.shape == (CFG.lm.vocab, CFG.lm.d_model)
    assert len(lm.files) == 2 + 8 * CFG.lm.n_layers  # embed, lnf, 8 arrays per block
    ix = np.load(out / "indexer.npz")
    assert len(ix.files) == 3 * len(CFG.layers)
    recs = result["records"]
    assert len(recs) == len(_cells()) * len(X.SELECTIONS)
    assert {(r["layer"], r["k"], r["S"]) for r in recs} == set(_cells())
    t = CFG.lm.context
    for r in recs:
        assert r["rows"] == CFG.eval_windows * (t - r["k"])  # rows with context > k
        assert len(r["recall_per_window"]) == len(r["bpb_per_window"]) == CFG.eval_windows
    assert result["lm"]["tokens_trained"] == result["lm"]["steps"] * CFG.lm_batch * t
    assert result["data"]["train_files"] > 0 and result["data"]["held_out_files"] > 0


def check_budgets_are_equal_across_selections(run):
    for r in run[0]["records"]:
        assert r["budget"] == [r["k"]], r  # every metric row: exactly k distinct valid tokens


def check_oracle_recall_bounds_every_selection(run):
    by = {(r["layer"], r["k"], r["S"], r["selection"]): r for r in run[0]["records"]}
    for layer, k, s in _cells():
        oracle = by[(layer, k, s, "oracle")]["recall"]
        for name in X.SELECTIONS:
            assert by[(layer, k, s, name)]["recall"] <= oracle + 1e-6, (layer, k, s, name)


def check_witness_coverage_contract(run):
    by = {(r["layer"], r["k"], r["S"], r["selection"]): r for r in run[0]["records"]}
    for layer, k, s in _cells():
        for name in X.WITNESS:
            r = by[(layer, k, s, name)]
            # Seed: every segment is covered when the reserved tail is padding.
            if r["coverage_padded_tail_rows"] is not None:
                assert r["coverage_padded_tail_rows"] == 1.0, r
            # With S <= k each witness meets a new segment and each overwritten slot uncovers
            # at most one: the merge never lowers a row's coverage.
            assert r["coverage"] >= by[(layer, k, s, "indexer")]["coverage"] - 1e-12
            assert 0.0 <= r["coverage"] <= 1.0 and 0.0 <= r["recall"] <= 1.0


def check_bits_per_byte_are_finite(run):
    result = run[0]
    assert math.isfinite(result["lm"]["held_out_bits_per_byte"])
    for dense in result["layers"].values():
        assert math.isfinite(dense["bpb_all"]) and math.isfinite(dense["indexer_kl_nats"])
    for r in result["records"]:
        assert math.isfinite(r["bpb_all"]) and math.isfinite(r["bpb_late"])


def test_notebook_matches_its_builder(tmp_path):
    built = rae.build_notebook(tmp_path / "nb.ipynb")
    assert built.read_text() == rae.NOTEBOOK.read_text(), (
        "scripts/experiments/real_attention_experiment.ipynb is stale: python -m "
        "scripts.experiments.real_attention_experiment --write-notebook")


def test_fill_lowest_writes_the_row_end_and_keeps_the_prefix():
    # L = 16, S = 4: the seed's overwrite example and a padded row.
    rows = np.array([[0, 1, 2, 3, 4, 8, 12, 13], [5, 9, 2, 3, -1, -1, -1, -1]], np.int32)
    ctx = np.array([16, 16])
    out = X.fill_lowest(rows, ctx, 4)
    np.testing.assert_array_equal(out[0], rows[0])  # no segment missing: identity
    np.testing.assert_array_equal(out[1], [5, 9, 2, 3, -1, -1, -1, 12])  # witness of segment 3
    tail = np.asarray(scatter_topology_witnesses(jnp.asarray(rows), jnp.asarray(ctx), 4))
    np.testing.assert_array_equal(tail[1], [5, 9, 2, 3, 12, -1, -1, -1])
    rng = np.random.default_rng(0)
    for _ in range(20):
        length, k, s = int(rng.integers(20, 200)), 16, int(rng.integers(1, 17))
        row = rng.choice(length, size=k, replace=False).astype(np.int32)[None]
        got = X.fill_lowest(row, np.array([length]), s)
        wit = np.asarray(X.dsa_jax.topology_witness_indices(
            jnp.asarray(row), jnp.asarray([length], jnp.int32), s))[0]
        wit = wit[wit >= 0]
        np.testing.assert_array_equal(got[0, :k - wit.size], row[0, :k - wit.size])
        np.testing.assert_array_equal(got[0, k - wit.size:], wit)
        assert segment_coverage(got[0], length, s) >= segment_coverage(row[0], length, s)


def test_restricting_to_every_causal_token_is_dense():
    cfg = M.LMConfig(n_layers=2, d_model=32, n_heads=2, context=16)
    params = M.init_lm(jax.random.PRNGKey(0), cfg)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    dense = M.token_nll(params, toks, cfg)[0]
    full = np.tile(np.asarray(X.dsa_jax.local_selector(16, 16)), (2, 1))
    allowed = jnp.asarray(X.allowed_mask(full, 2, 16))
    restricted = M.token_nll(params, toks, cfg, restrict_layer=1, allowed=allowed)[0]
    np.testing.assert_allclose(np.asarray(restricted), np.asarray(dense), rtol=1e-6)
