"""The declarations of the DeepSeek-V4.1 step (``dsa_jax.v41_step``): its layout (every static
number, derived from a ``V41Config`` and the page size), its caches, states, batch metadata and
result, and the constructors of empty ones.

Caches (``V41Caches``; V4.1's stored formats, ``reference.v41.formats``, in TPU page layouts of
whole 128-lane rows at V4.1-Flash's dims), stacked and read in place by stack row:

- ``window u32[L, Pw, R, W]``: every layer's window kv (fp8 e4m3, ue8m0 per 32) as window pages
  (``reference.v41.window_pages``: a 512-B record row per token, then scale rows; ``W = 128``
  and 544 B a token at ``D = 512`` and pages of 128, 528 at multiples of 256), page table
  ``window_page_indices`` / ``window_cu_lens`` in tokens;
- per compressed ratio ``r`` in {1, 2} that has a KV source, row ``k`` of each stack the
  ``k``-th KV source of that ratio (page table ``r{r}_page_indices`` / ``r{r}_cu_lens`` in
  entries of ratio ``r``; ``None`` for a ratio without KV sources):
  ``pool{r} u32[Kr, Pr, R, W]``, the compressed kv (fp4 e2m1, e4m3 per 16) as pool pages
  (``reference.v41.pool_pages``: two entries' codes a record row, sixteen entries' scales a
  scale row; 288 B an entry at ``D = 512`` and page sizes that are multiples of 128), and
  ``keys{r} u8[Kr, Pr, G, 4, 128]``, the index keys (fp4, ue8m0 per 32) as V4.1 index pages
  (``reference.v41.index_pages``: entries along lanes, 68 B an entry at page sizes that are
  multiples of 128; what the Pallas indexer reads with one DMA a page);
- ``cand u32[1, P1 * R, 128]`` (``layout.block_keys`` only, else ``None``): the candidate
  source's index keys once more, in the block layout (``reference.v41.index_blocks``: a block of
  8 entries one 512-B row, 68 B an entry at pages of 128), on its ratio's page table: what a
  candidate consumer's Pallas top-k reads, only its candidate blocks
  (``pallas_kernels.indexer.v41_candidates``). The price: 68 B an entry of that one source.

States (``V41States``): one ``reference.v4_compressor.CompressorState`` (``f32[num_slots, 2,
D]`` kv and score) per ratio-2 KV source, in layer order; ratio 1 keeps none. Sequence ``i``
uses slot ``state_slots[i]``."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import checks
from reference.v41 import index_blocks, index_pages, pool_pages, window_pages
from reference.v41.compressor import COMPRESSED_RATIOS, init_compressor_state
from reference.v41.config import CandidateUse, Mode, V41Config, resolve_layers

__all__ = ["V41Caches", "V41Meta", "V41StepLayout", "V41StepResult", "init_v41_caches",
           "init_v41_states", "v41_meta"]


@dataclasses.dataclass(frozen=True)
class V41StepLayout:
    """Every static number of a V4.1 step (hashable; a jit static): the ``config``, one
    ``page_size`` (tokens or entries per page, every cache; it divides 128 or is a multiple of
    it: the index pages' lanes) and ``max_seq_len`` (tokens a sequence may hold: each cache's
    capacity follows, ``pages_per_seq``)."""

    config: V41Config
    page_size: int
    max_seq_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.config, V41Config):
            raise TypeError(f"V41StepLayout: config must be a V41Config, got "
                            f"{type(self.config).__name__}")
        index_pages.check_geometry(self.page_size, self.config.index_head_dim)
        checks.positive_int("max_seq_len", self.max_seq_len)
        if 2 in self.config.compress_ratios and self.max_seq_len % 2:
            raise ValueError(f"V41StepLayout: max_seq_len={self.max_seq_len} must be even "
                             f"(ratio-2 layers pool pairs)")

    @property
    def num_layers(self) -> int:
        return len(self.config.compress_ratios)

    def pages_per_seq(self, ratio: int) -> int:
        """Page-table stride of the cache of ``ratio`` (0: the window, in tokens; 1 / 2: its
        pool and keys, in entries): ``ceil(max_seq_len // max(r, 1) / page_size)``."""
        return -(-(self.max_seq_len // max(ratio, 1)) // self.page_size)

    @functools.cached_property
    def sources(self) -> dict[int, tuple[int, ...]]:
        """The KV source layers of each compressed ratio, in layer order (their stack rows)."""
        plans = resolve_layers(self.config)
        return {r: tuple(p.layer for p in plans if p.mode is Mode.FULL and p.ratio == r)
                for r in COMPRESSED_RATIOS}

    def source_slot(self, layer: int) -> tuple[int, int]:
        """``(ratio, row)``: where KV source ``layer``'s pool and keys live."""
        r = self.config.compress_ratios[layer]
        return r, self.sources[r].index(layer)

    @functools.cached_property
    def candidate_source(self) -> int | None:
        """The candidate source layer (``CandidateUse.PRODUCES``), or None."""
        return next((p.layer for p in resolve_layers(self.config)
                     if p.candidates is CandidateUse.PRODUCES), None)

    @functools.cached_property
    def block_keys(self) -> bool:
        """Whether the candidate source's keys are also kept in the block layout (``cand``): a
        candidate source, and index heads, candidate blocks and a page size the layout holds
        (``index_blocks.check_geometry``: 128, 8, a multiple of 8 dividing 128 or a multiple
        of it; V4.1-Flash's). Otherwise consumers read whole pages holding candidates."""
        c = self.config
        try:
            index_blocks.check_geometry(self.page_size, c.index_head_dim, c.candidate_block_size)
        except ValueError:
            return False
        return self.candidate_source is not None

    @functools.cached_property
    def index_layers(self) -> tuple[int, ...]:
        """The layers that run a top-k (FULL and REINDEX), in order: the rows of ``topk``."""
        return tuple(p.layer for p in resolve_layers(self.config)
                     if p.mode in (Mode.FULL, Mode.REINDEX))


class V41Caches(NamedTuple):
    """The stacked byte caches (module docstring); ``None`` for a ratio without KV sources."""

    window: jax.Array
    pool1: jax.Array | None
    keys1: jax.Array | None
    pool2: jax.Array | None
    keys2: jax.Array | None
    cand: jax.Array | None = None


class V41Meta(NamedTuple):
    """One step's batch: ``kv_lens i32[S]`` (tokens, this step's included), ``cu_q_lens
    i32[S + 1]``, ``distribution i32[3]`` (``reference.core.batch``), ``state_slots i32[S]``,
    and each cache family's page table ``i32[N]`` and ``cu_lens i32[S + 1]`` in its unit."""

    kv_lens: jax.Array
    cu_q_lens: jax.Array
    distribution: jax.Array
    state_slots: jax.Array
    window_page_indices: jax.Array
    window_cu_lens: jax.Array
    r1_page_indices: jax.Array
    r1_cu_lens: jax.Array
    r2_page_indices: jax.Array
    r2_cu_lens: jax.Array


class V41StepResult(NamedTuple):
    """``out [L, T, dim]`` (bf16 under ``"bf16"``), ``topk i32[Li, T, index_topk]`` (the top-k
    of each FULL / REINDEX layer, ``layout.index_layers``; sequence-local entries, ``-1`` tail),
    ``candidates i32[T, candidate_topk_blocks]`` (the candidate source's blocks; ``None``
    without one), the caches and the states."""

    out: jax.Array
    topk: jax.Array
    candidates: jax.Array | None
    caches: V41Caches
    states: tuple


def init_v41_caches(layout: V41StepLayout, num_seqs: int) -> V41Caches:
    """Zeroed caches with ``pages_per_seq`` pages per sequence for ``num_seqs`` sequences."""
    c, ps, n = layout.config, layout.page_size, checks.positive_int("num_seqs", num_seqs)

    out = {"window": jnp.zeros((layout.num_layers, n * layout.pages_per_seq(0),
                                window_pages.page_rows(ps, c.head_dim),
                                window_pages.record_words(c.head_dim)), jnp.uint32)}
    for r in COMPRESSED_RATIOS:
        k = len(layout.sources[r])
        out[f"pool{r}"] = jnp.zeros((k, n * layout.pages_per_seq(r),
                                     pool_pages.page_rows(ps, c.head_dim),
                                     pool_pages.layout(c.head_dim).width),
                                    jnp.uint32) if k else None
        groups = index_pages.page_groups(ps, c.index_head_dim)
        out[f"keys{r}"] = jnp.zeros((k, n * layout.pages_per_seq(r), groups, index_pages.PACK,
                                     index_pages.LANES), jnp.uint8) if k else None
    if layout.block_keys:
        r = c.compress_ratios[layout.candidate_source]
        out["cand"] = jnp.zeros((1, n * layout.pages_per_seq(r) * index_blocks.page_rows(ps),
                                 index_blocks.LANES), jnp.uint32)
    return V41Caches(**out)


def init_v41_states(layout: V41StepLayout, num_slots: int) -> tuple:
    """One fresh ratio-2 compressor state per ratio-2 KV source (``num_slots`` slots each)."""
    return tuple(init_compressor_state(num_slots, layout.config.head_dim, 2)
                 for _ in layout.sources[2])


def v41_meta(layout: V41StepLayout, kv_lens, q_lens, *, num_active: int | None = None,
             page_order=None) -> V41Meta:
    """The metadata of a step where sequence ``i`` holds ``kv_lens[i]`` tokens, the last
    ``q_lens[i]`` of them this step's rows (concatenated in sequence order), over caches of
    ``init_v41_caches(layout, S)``: sequence ``i`` owns pages ``i * pages_per_seq ..`` of each
    family (``page_order``, a permutation of each family's pages applied to its table, moves
    them), state slot ``i``. ``num_active`` (default ``S``) sets ``distribution``."""
    kv_lens, q_lens = np.asarray(kv_lens, np.int32), np.asarray(q_lens, np.int32)
    s = int(kv_lens.shape[0])
    active = s if num_active is None else int(num_active)
    decode = int(np.all(q_lens[:active] == 1)) * active
    out = dict(kv_lens=jnp.asarray(kv_lens),
               cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
               distribution=jnp.asarray([decode, active, active], jnp.int32),
               state_slots=jnp.arange(s, dtype=jnp.int32))
    for name, r in (("window", 0), ("r1", 1), ("r2", 2)):
        per = layout.pages_per_seq(r)
        table = np.arange(s * per, dtype=np.int32)
        if page_order is not None:
            table = np.asarray(page_order(table), np.int32)
        out[f"{name}_page_indices"] = jnp.asarray(table)
        out[f"{name}_cu_lens"] = jnp.arange(s + 1, dtype=jnp.int32) * per * layout.page_size
    return V41Meta(**out)
