"""The V4.1 per-layer resolution map (``reference.v41.config``): the released config's 43 entries
against issue 31's description, the tiny config, and every refusal with its message."""

from __future__ import annotations

import dataclasses
import re

import pytest

from reference.v41 import CandidateUse, Mode, V41Config, resolve_layers, v41_flash, v41_tiny


def _expected_flash():
    """Issue 31, written out: layers 0-1 SWA; ratio 2 on 2-19 with KV sources 2, 8, 14 (each FULL,
    the five after it REUSE); ratio 1 on 20-39, KV source 20 (FULL, the candidate source), REINDEX
    24, 28, 32, 36 (candidate consumers), REUSE elsewhere; 3 MTP entries, SWA."""
    rows = [(0, Mode.SWA, None, None, CandidateUse.NONE)] * 2
    for src in (2, 8, 14):
        rows.append((2, Mode.FULL, src, src, CandidateUse.NONE))
        rows += [(2, Mode.REUSE, src, src, CandidateUse.NONE)] * 5
    rows.append((1, Mode.FULL, 20, 20, CandidateUse.PRODUCES))
    rows += [(1, Mode.REUSE, 20, 20, CandidateUse.NONE)] * 3
    for src in (24, 28, 32, 36):
        rows.append((1, Mode.REINDEX, 20, src, CandidateUse.CONSUMES))
        rows += [(1, Mode.REUSE, 20, src, CandidateUse.NONE)] * 3
    rows += [(0, Mode.SWA, None, None, CandidateUse.NONE)] * 3
    return rows


def test_released_config_map_all_43_entries():
    plans = resolve_layers(v41_flash())
    assert len(plans) == 43
    got = [(p.ratio, p.mode, p.kv_source, p.index_source, p.candidates) for p in plans]
    assert got == _expected_flash()
    assert [p.layer for p in plans] == list(range(43))
    assert [p.mtp for p in plans] == [False] * 40 + [True] * 3
    counts = {m: sum(p.mode is m for p in plans) for m in Mode}
    assert counts == {Mode.SWA: 5, Mode.FULL: 4, Mode.REINDEX: 4, Mode.REUSE: 30}


def test_released_values():
    c = v41_flash()
    assert (c.n_layers, c.n_mtp_layers, c.n_heads, c.head_dim) == (40, 3, 64, 512)
    assert c.rope_head_dim == 64
    assert (c.window_size, c.index_n_heads, c.index_head_dim, c.index_topk) == (128, 32, 128, 512)
    assert c.candidate_source_layer_id == 20
    assert (c.candidate_topk_blocks, c.candidate_block_size) == (2048, 8)
    assert (c.rms_norm_eps, c.rope_theta, c.compress_rope_theta) == (1e-20, 10000.0, 160000.0)


def test_tiny_config_has_every_mode_and_role():
    plans = resolve_layers(v41_tiny())
    assert [p.mode for p in plans] == [Mode.SWA, Mode.FULL, Mode.REUSE, Mode.FULL, Mode.REUSE,
                                       Mode.REINDEX, Mode.REUSE, Mode.REUSE, Mode.SWA]
    assert [p.candidates for p in plans].count(CandidateUse.PRODUCES) == 1
    assert plans[5].candidates is CandidateUse.CONSUMES and plans[5].kv_source == 3
    assert plans[-1].mtp


def test_lists_become_tuples_and_negative_candidate_disables():
    c = dataclasses.replace(v41_tiny(), compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1, 0],
                            candidate_source_layer_id=-1)
    assert isinstance(c.compress_ratios, tuple) and c.candidate_source_layer_id is None
    assert all(p.candidates is CandidateUse.NONE for p in resolve_layers(c))


FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)

REFUSALS = {
    "length": (dict(compress_ratios=FLASH_RATIOS[:-1]),
               "compress_ratios has 42 entries; n_layers + n_mtp_layers = 40 + 3 = 43"),
    "ratio": (dict(compress_ratios=FLASH_RATIOS[:5] + (4,) + FLASH_RATIOS[6:]),
              "layer 5: compress ratio 4 is not one of (0, 1, 2)"),
    "mtp": (dict(compress_ratios=FLASH_RATIOS[:41] + (1, 0)),
            "layer 41 (MTP layer 1): compress ratio 1, MTP entries must be 0"),
    "range": (dict(kv_source_layer_ids=(2, 8, 14, 40)),
              "kv_source_layer_ids[3] = 40 is not a backbone layer in [0, 40)"),
    "order": (dict(index_source_layer_ids=(2, 8, 14, 20, 28, 24, 32, 36)),
              "index_source_layer_ids must be strictly increasing: entry 5 is 24 after 28"),
    "ratio 0 source": (dict(index_source_layer_ids=(1, 2, 8, 14, 20, 24, 28, 32, 36)),
                       "layer 1 is in index_source_layer_ids but has compress ratio 0"),
    "kv not index": (dict(kv_source_layer_ids=(2, 8, 14, 20, 30)),
                     "layer 30 is a KV source but not an index source"),
    "candidate not both": (dict(candidate_source_layer_id=24),
                           "candidate source layer 24 must be both a KV source (2, 8, 14, 20) "
                           "and an index source"),
    "no source of its ratio": (dict(kv_source_layer_ids=(2, 8, 14),
                                    index_source_layer_ids=(2, 8, 14, 24, 28, 32, 36),
                                    candidate_source_layer_id=None),
                               "layer 20 (ratio 1) has no KV source of ratio 1 at or before it "
                               "(KV sources (2, 8, 14), ratios (2, 2, 2))"),
    "first compressed before any source": (dict(kv_source_layer_ids=(3, 8, 14, 20),
                                                index_source_layer_ids=(3, 8, 14, 20, 24, 28, 32,
                                                                        36)),
                                           "layer 2 (ratio 2) has no KV source of ratio 2"),
    "budget": (dict(candidate_topk_blocks=64),
               "candidate source layer 20: candidate_topk_blocks * candidate_block_size - "
               "(candidate_block_size - 1) = 64 * 8 - 7 = 505 < index_topk = 512"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_flash_refusals(case):
    change, message = REFUSALS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(v41_flash(), **change)


def test_budget_boundary_is_accepted():
    # 64 blocks of 8 with the newest holding one entry: 64 * 8 - 7 = 505 entries
    c = dataclasses.replace(v41_flash(), candidate_topk_blocks=65, index_topk=513)
    assert resolve_layers(c)[20].candidates is CandidateUse.PRODUCES
    with pytest.raises(ValueError, match=re.escape("= 513 < index_topk = 514")):
        dataclasses.replace(c, index_topk=514)


# Tiny configs where the official publication order and "the last source of the same ratio"
# part ways, and candidate consumers that read another pool.
TINY_REFUSALS = {
    "publication order": (dict(compress_ratios=(0, 2, 1, 2, 1, 1, 1, 1, 0),
                               kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2),
                               candidate_source_layer_id=None),
                          "layer 3 (ratio 2): the last published KV source is layer 2 (ratio 1), "
                          "the last KV source of ratio 2 is layer 1"),
    "consumer of another ratio": (dict(compress_ratios=(0, 1, 1, 2, 2, 2, 2, 2, 0),
                                       kv_source_layer_ids=(1, 3),
                                       index_source_layer_ids=(1, 3, 5),
                                       candidate_source_layer_id=1),
                                  "candidate consumer layer 3 has ratio 2, the candidate source "
                                  "layer 1 ratio 1"),
    "consumer of another pool": (dict(compress_ratios=(0, 1, 1, 1, 1, 1, 1, 1, 0),
                                      kv_source_layer_ids=(1, 3),
                                      index_source_layer_ids=(1, 3, 5),
                                      candidate_source_layer_id=1),
                                 "candidate consumer layer 3 reads the pool of KV source 3, the "
                                 "candidate blocks index the pool of layer 1"),
}


@pytest.mark.parametrize("case", sorted(TINY_REFUSALS))
def test_tiny_refusals(case):
    change, message = TINY_REFUSALS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(v41_tiny(), **change)


def test_bad_field_types():
    with pytest.raises(TypeError, match="V41Config.n_layers must be an int"):
        dataclasses.replace(v41_tiny(), n_layers=8.0)
    with pytest.raises(ValueError, match="V41Config.index_topk must be >= 1, got index_topk=0"):
        dataclasses.replace(v41_tiny(), index_topk=0)
    with pytest.raises(TypeError, match="V41Config.compress_ratios must be a sequence"):
        dataclasses.replace(v41_tiny(), compress_ratios=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v41_tiny().n_layers = 9


def test_config_is_hashable_and_equal_by_value():
    assert v41_flash() == v41_flash() and hash(v41_flash()) == hash(v41_flash())
    assert isinstance(v41_flash(), V41Config)
