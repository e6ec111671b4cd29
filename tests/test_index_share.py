"""IndexShare layer map: GLM-5.2 pattern and refusals (ValueError, never assert)."""

from __future__ import annotations

import pytest

from reference import build_index_share_map, glm_index_share_pattern


def test_glm_pattern_maps_each_shared_layer_to_the_nearest_preceding_full_layer():
    types = glm_index_share_pattern(78)
    assert len(types) == 78 and types[:8] == ["full"] * 3 + ["shared"] * 3 + ["full", "shared"]
    full_slot, src_slot, num_full = build_index_share_map(types, 0, 78)
    assert num_full == 3 + 75 // 4 == len(full_slot)
    assert sorted(full_slot.values()) == list(range(num_full))
    for layer, t in enumerate(types):
        nearest = max(i for i in range(layer + 1) if types[i] == "full")
        assert src_slot[layer] == full_slot[nearest]
        assert (layer in full_slot) == (t == "full")


def test_none_means_every_layer_is_full():
    full_slot, src_slot, num_full = build_index_share_map(None, 0, 4)
    assert full_slot == src_slot == {0: 0, 1: 1, 2: 2, 3: 3} and num_full == 4


@pytest.mark.parametrize("types,skip,n,match", [
    (["shared", "full"], 0, 2, "layer 0 is 'shared' but no 'full' layer precedes it"),
    (["full", "dense"], 0, 2, "unknown indexer_type 'dense' at layer 1"),
    (["full"], 0, 2, r"len\(indexer_types\) must equal num_layers: 1 != 2"),
    (["full"], -1, 1, "skip_offset .* must be an int >= 0, got skip_offset=-1"),
    (["full"], 1.5, 1, "skip_offset"),
    ("full", 0, 4, "sequence of per-layer strings"),
])
def test_bad_maps_are_refused_with_value_error(types, skip, n, match):
    with pytest.raises(ValueError, match=match):
        build_index_share_map(types, skip, n)


def test_refusal_survives_python_optimise_mode():
    import subprocess
    import sys

    code = ("from reference import build_index_share_map as b\n"
            "try:\n b(['shared'], 0, 1)\nexcept ValueError:\n print('refused')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.stdout.strip() == "refused"
