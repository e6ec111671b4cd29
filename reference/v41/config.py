"""DeepSeek-V4.1's per-layer resolution: one declared map from the config to each layer's mode,
KV source, index source and candidate use, validated once.

Where it comes from (read, restated, not copied): the official ``inference/model.py`` of the
``deepseek-ai/DeepSeek-V4.1-Flash`` release (vendored in public repositories; its
``Indexer.forward`` around l.527-580 and ``Attention._compress_kv`` around l.739-763) keeps one
mutable runtime (``shared_attn``) that KV-source layers publish their compressed pool and index
keys to, that index-source layers publish their top-k to, and that the candidate source publishes
its candidate blocks to; every other layer reads whatever was published last. sglang's dsv41 code
(``layers/attention/dsv4/dsv41_*``, ``v41_indexer/``, ``candidate_blocks.py``) resolves the same
roles from the config lists. The facts this map states:

- ``compress_ratios`` has one entry per backbone layer then one per MTP layer; ratios are 0
  (sliding window only), 1 or 2; MTP entries are 0.
- **Modes** of a backbone layer ``L`` with ratio ``r``: ``SWA`` if ``r == 0``; ``FULL`` if ``L``
  is a KV source (it compresses, publishes a pool and index keys, and runs its own indexer:
  query, ``weights_proj``, top-k); ``REINDEX`` if ``L`` is an index source but not a KV source
  (its own query and weights over the published keys); ``REUSE`` otherwise (the last published
  top-k).
- **Sources by publication order**: ``L``'s KV source is the last KV source at or before ``L``,
  its index source the last index source at or before ``L``. The released config also satisfies
  "the last source *of the same ratio*"; a config where the two readings differ is refused, so
  either reading is this map. (Since every KV source is an index source, a disagreement on the
  index source implies one on the KV source; both are checked.)
- **Candidates**: the candidate source (a KV source, hence ``FULL``) keeps its own top-k
  unrestricted and publishes per-row candidate blocks; every index source after it
  (``Indexer.uses_candidates``: ``candidate_source_layer_id < layer_id``) restricts its top-k to
  them; ``REUSE`` layers copy the top-k they reuse. The blocks index the candidate source's
  pool, so a consumer must read that pool (same ratio, same KV source). Where fewer than
  ``index_topk`` candidate entries are finite the official code attends masked entries and
  sglang returns -1; ``candidate_topk_blocks * candidate_block_size - (candidate_block_size - 1)
  >= index_topk`` (the newest block may hold a single visible entry) makes them agree, and is
  required.

Every refusal is a ``ValueError`` naming the layer and the numbers. ``V41Config`` validates on
construction (it calls ``resolve_layers``), so an invalid config never exists.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

__all__ = ["CandidateUse", "LayerPlan", "Mode", "V41Config", "resolve_layers", "v41_flash",
           "v41_tiny"]

RATIOS = (0, 1, 2)
HEAD_DIM = 512  # V4.1-Flash's kv row (window and compressed), RoPE tail included
INDEX_HEAD_DIM = 128  # V4.1-Flash's index head (query heads and keys)


class Mode(enum.StrEnum):
    """How a layer gets its compressed entries (module docstring)."""
    SWA = "swa"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


class CandidateUse(enum.StrEnum):
    """A layer's part in the candidate-block restriction."""
    NONE = "none"
    PRODUCES = "produces"
    CONSUMES = "consumes"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One entry of the map. ``kv_source`` / ``index_source``: layer ids (``None`` for ``SWA``);
    ``mtp``: an MTP layer (index ``>= n_layers``; always ``SWA``)."""
    layer: int
    ratio: int
    mode: Mode
    kv_source: int | None
    index_source: int | None
    candidates: CandidateUse
    mtp: bool = False


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"V41Config.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"V41Config.{name} must be >= {low}, got {name}={value}")
    return value


@dataclasses.dataclass(frozen=True)
class V41Config:
    """The attention-side fields of a DeepSeek-V4.1 config (names as in the release's
    ``config.json`` / ``ModelArgs``). ``candidate_source_layer_id``: ``None`` (or negative, as the
    official code spells it) disables candidates. Lists are stored as tuples."""
    n_layers: int
    n_mtp_layers: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    n_heads: int = 64
    head_dim: int = HEAD_DIM
    rope_head_dim: int = 64
    window_size: int = 128
    index_n_heads: int = 32
    index_head_dim: int = INDEX_HEAD_DIM
    index_topk: int = 512
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # the projections around attention (V4.1-Flash: hidden_size 5120, q_lora_rank 1280,
    # o_groups 8, o_lora_rank 1024): read by the layer statement (reference.statements)
    dim: int = 5120
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            value = getattr(self, name)
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise TypeError(f"V41Config.{name} must be a sequence of ints, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        cand = self.candidate_source_layer_id
        if cand is not None and _int("candidate_source_layer_id", cand, -(2 ** 31)) < 0:
            object.__setattr__(self, "candidate_source_layer_id", None)
        _int("n_layers", self.n_layers, 1)
        _int("n_mtp_layers", self.n_mtp_layers, 0)
        for name in ("candidate_topk_blocks", "candidate_block_size", "n_heads", "head_dim",
                     "rope_head_dim", "window_size", "index_n_heads", "index_head_dim",
                     "index_topk", "original_seq_len", "dim", "q_lora_rank", "o_groups",
                     "o_lora_rank"):
            _int(name, getattr(self, name), 1)
        if self.n_heads % self.o_groups:
            raise ValueError(f"V41Config.o_groups={self.o_groups} must divide n_heads="
                             f"{self.n_heads} (each output group projects whole heads)")
        resolve_layers(self)


def v41_flash() -> V41Config:
    """DeepSeek-V4.1-Flash's released values (40 backbone layers + 3 MTP)."""
    return V41Config(
        n_layers=40, n_mtp_layers=3,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
        kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8)


def v41_tiny() -> V41Config:
    """A tiny config with every mode and candidate role (8 layers + 1 MTP): SWA 0, FULL 1 (ratio
    2), REUSE 2, FULL 3 (ratio 1, candidate source), REUSE 4, REINDEX 5 (consumer), REUSE 6-7,
    MTP 8; 2 candidate blocks of 4 entries, top-4 (``2 * 4 - 3 = 5 >= 4``)."""
    return V41Config(
        n_layers=8, n_mtp_layers=1, compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1, 0),
        kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5),
        candidate_source_layer_id=3, candidate_topk_blocks=2, candidate_block_size=4,
        n_heads=2, head_dim=64, rope_head_dim=16, window_size=8, index_n_heads=2,
        index_head_dim=32, index_topk=4, dim=32, q_lora_rank=16, o_groups=2, o_lora_rank=8)


def _check_entries(c: V41Config) -> None:
    total = c.n_layers + c.n_mtp_layers
    if len(c.compress_ratios) != total:
        raise ValueError(f"compress_ratios has {len(c.compress_ratios)} entries; n_layers + "
                         f"n_mtp_layers = {c.n_layers} + {c.n_mtp_layers} = {total}")
    for layer, r in enumerate(c.compress_ratios):
        if isinstance(r, bool) or not isinstance(r, int) or r not in RATIOS:
            raise ValueError(f"layer {layer}: compress ratio {r!r} is not one of {RATIOS}")
        if layer >= c.n_layers and r != 0:
            raise ValueError(f"layer {layer} (MTP layer {layer - c.n_layers}): compress ratio {r}, "
                             f"MTP entries must be 0")


def _check_ids(c: V41Config, name: str) -> tuple[int, ...]:
    ids = getattr(c, name)
    for i, layer in enumerate(ids):
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < c.n_layers:
            raise ValueError(f"{name}[{i}] = {layer!r} is not a backbone layer in "
                             f"[0, {c.n_layers})")
        if i and layer <= ids[i - 1]:
            raise ValueError(f"{name} must be strictly increasing: entry {i} is {layer} after "
                             f"{ids[i - 1]}")
        if c.compress_ratios[layer] == 0:
            raise ValueError(f"layer {layer} is in {name} but has compress ratio 0")
    return ids


def _check_sources(c: V41Config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    kv = _check_ids(c, "kv_source_layer_ids")
    index = _check_ids(c, "index_source_layer_ids")
    for layer in kv:
        if layer not in index:
            raise ValueError(f"layer {layer} is a KV source but not an index source (index "
                             f"sources {index}): its indexer makes the index keys")
    cand = c.candidate_source_layer_id
    if cand is not None and (cand not in kv or cand not in index):
        raise ValueError(f"candidate source layer {cand} must be both a KV source {kv} and an "
                         f"index source {index}")
    return kv, index


def _source(c: V41Config, layer: int, ids: tuple[int, ...], what: str) -> int:
    """The last ``what`` source at or before ``layer``; refuse a config where it is not the last
    source of ``layer``'s ratio."""
    r = c.compress_ratios[layer]
    before = [s for s in ids if s <= layer]
    same = [s for s in before if c.compress_ratios[s] == r]
    if not same:
        raise ValueError(f"layer {layer} (ratio {r}) has no {what} source of ratio {r} at or "
                         f"before it ({what} sources {ids}, ratios "
                         f"{tuple(c.compress_ratios[s] for s in ids)})")
    if before[-1] != same[-1]:
        raise ValueError(f"layer {layer} (ratio {r}): the last published {what} source is layer "
                         f"{before[-1]} (ratio {c.compress_ratios[before[-1]]}), the last {what} "
                         f"source of ratio {r} is layer {same[-1]}; publication order and "
                         f"same-ratio resolution differ")
    return same[-1]


def _check_candidates(c: V41Config, plans: list[LayerPlan]) -> None:
    cand = c.candidate_source_layer_id
    if cand is None:
        return
    block, blocks, k = c.candidate_block_size, c.candidate_topk_blocks, c.index_topk
    if blocks * block - (block - 1) < k:
        raise ValueError(f"candidate source layer {cand}: candidate_topk_blocks * "
                         f"candidate_block_size - (candidate_block_size - 1) = {blocks} * {block} "
                         f"- {block - 1} = {blocks * block - (block - 1)} < index_topk = {k}")
    for p in plans:
        if p.candidates is not CandidateUse.CONSUMES:
            continue
        if p.ratio != c.compress_ratios[cand]:
            raise ValueError(f"candidate consumer layer {p.layer} has ratio {p.ratio}, the "
                             f"candidate source layer {cand} ratio {c.compress_ratios[cand]}")
        if p.kv_source != cand:
            raise ValueError(f"candidate consumer layer {p.layer} reads the pool of KV source "
                             f"{p.kv_source}, the candidate blocks index the pool of layer {cand}")


def _plan(c: V41Config, layer: int, kv: tuple[int, ...], index: tuple[int, ...]) -> LayerPlan:
    r = c.compress_ratios[layer]
    if layer >= c.n_layers or r == 0:
        return LayerPlan(layer, r, Mode.SWA, None, None, CandidateUse.NONE, layer >= c.n_layers)
    kv_src, index_src = _source(c, layer, kv, "KV"), _source(c, layer, index, "index")
    mode = (Mode.FULL if layer in kv else Mode.REINDEX if layer in index else Mode.REUSE)
    cand = c.candidate_source_layer_id
    use = (CandidateUse.NONE if cand is None or mode is Mode.REUSE or layer < cand else
           CandidateUse.PRODUCES if layer == cand else CandidateUse.CONSUMES)
    return LayerPlan(layer, r, mode, kv_src, index_src, use)


def resolve_layers(config: V41Config) -> tuple[LayerPlan, ...]:
    """The map: one ``LayerPlan`` per ``compress_ratios`` entry (backbone then MTP layers), from
    the rules in the module docstring. Refuses (``ValueError`` naming the layer and numbers): a
    ratio outside {0, 1, 2}, an MTP entry not 0, a source id out of range / unsorted / of ratio 0,
    a compressed layer without a KV or index source of its ratio at or before it, a KV source that
    is not an index source, a candidate source that is not both, a candidate consumer of another
    ratio or pool, a candidate budget below ``index_topk``, and a layer whose publication-order
    source differs from the last source of its ratio."""
    _check_entries(config)
    kv, index = _check_sources(config)
    plans = [_plan(config, layer, kv, index) for layer in range(len(config.compress_ratios))]
    _check_candidates(config, plans)
    return tuple(plans)
