"""scripts/cost/context_cost.py --quick: the model's structure and the facts that hold by definition
(no exchange without sharding, per-device reads shrink with N, the candidate merge does not
depend on the context, the fitting context is linear in N, break-evens are positive or
"never"). No threshold on the model's numbers: they are its outcome, not a contract."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from pallas_kernels import chips  # noqa: E402
from pallas_kernels.measure import context_cost as cc  # noqa: E402
from scripts.cost import context_cost as context_cost_script  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_cost")
    return context_cost_script.main(["--quick", "--out", str(out)]), out


def test_outputs_written(run):
    data, out = run
    saved = json.loads((out / "context_cost.json").read_text())
    assert saved["config"] == json.loads(json.dumps(data["config"]))
    assert len(saved["pays"]) == len(data["pays"]) and len(saved["fits"]) == len(data["fits"])
    md = (out / "context_cost.md").read_text()
    assert "a model" in md and "Break-even" in md and "Longest context" in md


def test_format_bytes_are_the_repo_constants():
    by = {f.name: f for f in cc.FORMATS}
    assert (by["bf16"].key_bytes, by["bf16"].latent_bytes) == (256, 1280)
    assert (by["packed"].key_bytes, by["packed"].latent_bytes) == (256, 1536)
    assert (by["fp8"].key_bytes, by["fp8"].latent_bytes) == (136, 1024)


def test_no_exchange_without_sharding(run):
    data, _ = run
    one = [r for r in data["exchange"] if r["N"] == 1]
    assert one and all(r["H128_total"] == 0 and r["H16_total"] == 0 for r in one)
    assert all(r["exchanged_H128"] == 0 for r in data["read"] if r["N"] == 1)
    for h in cc.MLA_HEADS:
        ex = cc.exchange(1, h)
        assert ex["ring_steps"] == 0 and ex["collectives"] == 0
    # N = 1 has no latency term whatever alpha is
    chip = cc.Chip.of(chips.DEFAULT, 1.0)
    fmt = cc.FORMATS[0]
    slow = cc.Scenario("x", 1.0, 1)
    assert cc.row_time(chip, fmt, 4096, 1, 128, slow) == cc.row_time(
        chip, fmt, 4096, 1, 128, cc.Scenario("y", 0.0, 1))


def test_reads_shrink_with_shards(run):
    data, _ = run
    by = {}
    for r in data["read"]:
        by.setdefault((r["format"], r["L"]), []).append((r["N"], r["kv_read"], r["index_keys"]))
    assert by
    for rows in by.values():
        rows.sort()
        assert len(rows) == len(data["config"]["shards"])
        for (_, kv_a, keys_a), (_, kv_b, keys_b) in zip(rows, rows[1:], strict=False):
            assert kv_b < kv_a and keys_b < keys_a


def test_candidate_bytes_do_not_depend_on_context(run):
    data, _ = run
    seen = {}
    for r in data["read"]:
        seen.setdefault(r["N"], set()).add(r["candidates_received"])
    assert all(len(v) == 1 for v in seen.values())
    for n, (v,) in seen.items():
        assert v == (n - 1) * 8 * cc.TOPK


def test_fitting_context_is_linear_in_shards(run):
    data, _ = run
    for r in data["fits"]:
        for tag in ("cache_only", "with_weights"):
            per_chip = r[f"tokens_per_chip_{tag}"]
            assert per_chip >= 0 and per_chip % cc.PAGE == 0
            for n, ctx in r[f"sequence_context_{tag}"].items():
                assert ctx == int(n) * per_chip
        assert r["tokens_per_chip_with_weights"] <= r["tokens_per_chip_cache_only"]


def test_break_even_positive_or_never(run):
    data, _ = run
    assert data["pays"]
    for r in data["pays"]:
        assert set(r["break_even"]) == set(data["config"]["shards"][1:])
        for be in r["break_even"].values():
            if be["context"] is None:
                assert be["label"].startswith("never")
            else:
                assert 0 < be["context"] <= data["config"]["max_context"]
                assert be["context"] % cc.PAGE == 0
        for sp in r["speedup"].values():
            assert all(math.isfinite(v) and v > 0 for v in sp.values())
