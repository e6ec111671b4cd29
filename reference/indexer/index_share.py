"""IndexShare: which layers own an indexer and whose top-k every layer consumes."""

from __future__ import annotations

from collections.abc import Sequence

INDEXER_TYPES = ("full", "shared")


def glm_index_share_pattern(num_layers: int = 78, leading_full: int = 3,
                            shared_run: int = 3) -> list[str]:
    """The GLM-5.2 pattern: ``leading_full`` full layers, then repeating shared x3 + full."""
    types = ["full"] * min(leading_full, num_layers)
    while len(types) < num_layers:
        block = ["shared"] * shared_run + ["full"]
        types.extend(block[: num_layers - len(types)])
    return types


def build_index_share_map(
    indexer_types: Sequence[str] | None,
    skip_offset: int,
    num_layers: int,
) -> tuple[dict[int, int], dict[int, int], int]:
    """Static IndexShare layer -> slot mapping.

    Args:
      indexer_types: per layer ``"full"`` (own indexer, own key-cache slot) or ``"shared"``
        (reuse the top-k of the nearest preceding full layer); ``None`` means all full.
      skip_offset: GLM-5.2's ``index_skip_topk_offset``: an int >= 0 carried by the model config.
        It does not change the layer -> slot mapping (it is validated here so that a bad config
        fails at load time, and is otherwise unused by this map).
      num_layers: number of layers.

    Returns:
      ``(full_slot, src_slot, num_full)``: ``full_slot[layer]`` is the indexer-key slot of each
      full layer; ``src_slot[layer]`` the slot whose top-k the layer consumes (its own if full);
      ``num_full`` the number of full layers (== number of indexer-key buffers).

    Raises:
      ValueError: length mismatch, unknown type, a shared layer before any full layer, a bad
        ``skip_offset`` or ``num_layers``.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got num_layers={num_layers!r}")
    if isinstance(skip_offset, bool) or not isinstance(skip_offset, int) or skip_offset < 0:
        raise ValueError(f"skip_offset (index_skip_topk_offset) must be an int >= 0, got "
                         f"skip_offset={skip_offset!r}")
    if indexer_types is None:
        indexer_types = ["full"] * num_layers
    if isinstance(indexer_types, str):
        raise ValueError("indexer_types must be a sequence of per-layer strings, got a str")
    if len(indexer_types) != num_layers:
        raise ValueError(f"len(indexer_types) must equal num_layers: {len(indexer_types)} != "
                         f"{num_layers}")
    full_slot: dict[int, int] = {}
    src_slot: dict[int, int] = {}
    last_slot = -1
    for layer, itype in enumerate(indexer_types):
        if itype == "full":
            last_slot = len(full_slot)
            full_slot[layer] = last_slot
        elif itype == "shared":
            if last_slot < 0:
                raise ValueError(f"layer {layer} is 'shared' but no 'full' layer precedes it")
        else:
            raise ValueError(f"unknown indexer_type {itype!r} at layer {layer}; expected one of "
                             f"{INDEXER_TYPES}")
        src_slot[layer] = last_slot
    return full_slot, src_slot, len(full_slot)
