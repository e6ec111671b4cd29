"""scripts/experiments/witness_experiment.py on a tiny grid: definitional facts only (budgets, the
nulls,
metric ranges, what the merge guarantees by construction), and the notebook executes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

from reference.witnesses import segment_coverage  # noqa: E402
from scripts.experiments import witness_experiment as wx  # noqa: E402

CFG = wx.tiny_config()


@pytest.fixture(scope="module")
def result():
    return wx.run_experiment(CFG, log=lambda *_: None)


@pytest.fixture(scope="module")
def sources():
    return {"synthetic": wx.synthetic_source(CFG), "indexer": wx.indexer_source(CFG)}


def _cells():
    return [(k, s) for k in CFG.ks for s in CFG.segments if s <= k]


def test_grid_is_complete_and_budgets_are_equal(result):
    recs = result["records"]
    assert len(recs) == len(wx.SOURCES) * len(_cells()) * len(wx.SELECTIONS)
    for r in recs:
        assert r["budget"] == [r["k"]], r  # every row of every selection: exactly k valid slots
        assert r["rows"] == (CFG.synthetic_rows if r["source"] == "synthetic"
                             else CFG.indexer_rows)


def test_metrics_are_fractions(result):
    keys = ("coverage", "recall", "rows_full_coverage", "rows_uncovered_by_merge",
            "coverage_at_row_end", "recall_at_row_end")
    seen = set()
    for r in result["records"]:
        for key in keys:
            if key in r:  # some metrics exist only for some selections
                seen.add(key)
                assert 0.0 <= r[key] <= 1.0, (key, r)
    assert seen == set(keys)  # a renamed metric fails here instead of passing unchecked


@pytest.mark.parametrize("src", wx.SOURCES)
def test_selections_per_row(sources, src):
    attn, learned, _ = sources[src]
    length = attn.shape[1]
    np.testing.assert_allclose(attn.sum(axis=1), 1.0, rtol=1e-12)
    for k, s in _cells():
        sel = wx.selections(learned[k], length, s, CFG.seed)
        assert set(sel) == set(wx.SELECTIONS)
        for name, rows in sel.items():
            assert rows.shape == (attn.shape[0], k), name
            for row in rows:
                assert wx.valid_budget(row, length) == k, name  # distinct, in range, no padding
        # The locality null is exactly the last k tokens.
        last_k = np.broadcast_to(np.arange(length - k, length), (len(attn), k))
        np.testing.assert_array_equal(sel["locality_null"], last_k)
        # The serving merge keeps slots [0, k - S) bit-identical ...
        np.testing.assert_array_equal(sel["learned+witnesses"][:, :k - s], learned[k][:, :k - s])
        # ... and, with S <= k, never lowers coverage: every missing segment gains a witness and
        # each overwritten slot uncovers at most one segment.
        for base, merged in zip(sel["learned"], sel["learned+witnesses"], strict=True):
            assert segment_coverage(merged, length, s) >= segment_coverage(base, length, s)


@pytest.mark.parametrize("src", wx.SOURCES)
def test_padding_tail_gives_full_coverage(sources, src):
    """When the reserved tail is padding, the merged row meets every segment."""
    attn, learned, _ = sources[src]
    length = attn.shape[1]
    for k, s in _cells():
        padded = learned[k].copy()
        padded[:, k - s:] = -1
        merged = wx.selections(padded, length, s, CFG.seed)["learned+witnesses"]
        assert all(segment_coverage(row, length, s) == 1.0 for row in merged)


def test_counterfactual_keeps_budget_and_prefix(sources):
    attn, learned, _ = sources["synthetic"]
    length = attn.shape[1]
    for k, s in _cells():
        end = wx.witnesses_at_row_end(learned[k], length, s)
        np.testing.assert_array_equal(end[:, :k - s], learned[k][:, :k - s])
        assert all(wx.valid_budget(row, length) == k for row in end)


def test_indexer_topk_is_the_exact_topk_of_its_scores(result):
    # CPU: approx_max_k is exact here, so the proxy's scores rank the indexer's own top-k.
    assert all(v == 1.0 for v in result["extra"]["indexer"]["topk_agreement"].values())


def test_outputs_are_written(result, tmp_path):
    paths = wx.write_outputs(result, tmp_path, docs=False)
    for key in ("md", "json", "synthetic", "indexer"):
        assert paths[key].exists() and paths[key].stat().st_size > 0, key
    md = paths["md"].read_text()
    assert "not model quality" in md.lower() and md.count("| 16 | 4 |") == 2


def test_notebook_matches_its_builder(tmp_path):
    pytest.importorskip("nbformat", reason="nbformat is in the notebooks extra")
    built = wx.build_notebook(tmp_path / "nb.ipynb")
    assert built.read_text() == wx.NOTEBOOK.read_text(), (
        "scripts/experiments/witness_experiment.ipynb is stale: python -m "
        "scripts.experiments.witness_experiment --write-notebook")


@pytest.mark.slow
@pytest.mark.notebooks
def test_notebook_executes(tmp_path, monkeypatch):
    for mod in ("nbclient", "nbformat", "ipykernel"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} not installed (it is in the notebooks extra)")
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("WITNESS_GRID", "tiny")  # the notebook's smoke grid: seconds
    monkeypatch.setenv("WITNESS_OUT", str(tmp_path))
    nb = nbformat.read(wx.NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "scripts/experiments")}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) == 2
    assert (tmp_path / "witness.md").exists()
