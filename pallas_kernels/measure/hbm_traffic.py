"""HBM bytes each Pallas kernel moves, COUNTED IN THE PALLAS TPU INTERPRETER (a simulation),
against the kernel's traffic model and the minimum, at the same shapes and block sizes.

Counted: every block copy of the grid pipeline and every executed manual DMA between memory
spaces while the kernel runs in interpret mode (``pallas_kernels._interpret_counter``). Byte
counts are with the minor dim padded to 128 lanes (what TPU tiling moves for an array like the
indexer's ``f32[R*H, 1]`` weight column; equal to the logical bytes for every other copy here).
No TPU is used: this is what the simulated kernel copies, not a hardware measurement.

Model: ``case.model`` is the kernel family's own traffic function
(``pallas_kernels.indexer.traffic.traffic`` / ``pallas_kernels.mla.traffic.mla_traffic`` /
``pallas_kernels.v4_compressor.traffic.compressor_traffic``, the functions behind
``compile_cases``) called with this case's
shapes and blocks. It also prices XLA work outside the ``pallas_call`` (the indexer
page-score row map, the sparse MLA index preparation); those terms are split out as "XLA side"
(``*_xla_bytes`` below, one line per model term), because the interpreter counts only the
kernel's own copies; the MLA kernels' scalar prefetch (row info and page table into SMEM) is
set aside with it, as the interpreter does not count scalar prefetch either. Counted must equal
the model's kernel side exactly. An HBM -> HBM DMA (the V4 compressor's state call) counts its
bytes twice, read and written, as its model does.

DMA descriptors: counted, every block copy of the grid pipeline and every started manual DMA
(``TrafficCount.descriptors``); modelled, ``Traffic.dmas``. Counted must equal the model.

The report: ``python -m scripts.cost.hbm_traffic [--quick] [--out DIR]``
(``tests/test_hbm_traffic.py`` checks the quick cases).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from pallas_kernels import _interpret_counter as counter
from pallas_kernels import (
    aot,
    page_sparse_mla,
    streamindex_page_topk,
    streamindex_topk,
)
from pallas_kernels.indexer import blocks as iblocks
from pallas_kernels.indexer import scoring
from pallas_kernels.indexer import traffic as itraffic
from pallas_kernels.mla import blocks as mblocks
from pallas_kernels.mla import kernel as mkernel
from pallas_kernels.mla import traffic as mtraffic
from pallas_kernels.mla.traffic import PREP_BYTES_PER_PAGE
from reference.core.synthetic import make_ragged_batch
from reference.formats import fp8_cache, packed_cache
from reference.quant import fp8

LABEL = "counted in the Pallas TPU interpreter (simulation)"
# Plain interpreter: no race detection (the kernels' own tests run the strict one); the counts
# do not depend on it. "eager": every started DMA executes (and is counted) at its start.
INTERPRET = pltpu.InterpretParams(dma_execution_mode="eager")


@dataclass(frozen=True)
class Shape:
    """One batch: sequences ``(q_len, kv_len)``, heads, latent dim, pages."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    heads: int = 8
    dim: int = 128
    page_size: int = 16
    pages_per_seq: int = 8

    @property
    def decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @property
    def rows(self) -> int:
        return sum(self.q_lens)

    def batch(self, seed: int):
        return make_ragged_batch(np.random.default_rng(seed), q_lens=self.q_lens,
                                 kv_lens=self.kv_lens, page_size=self.page_size,
                                 pages_per_seq=self.pages_per_seq, num_heads=self.heads,
                                 dim=self.dim)


@dataclass(frozen=True)
class Case:
    """A kernel at one shape: ``run()`` executes it in interpret mode; the model and its XLA
    side (bytes the model prices outside the ``pallas_call``)."""

    kernel: str
    shape: str
    run: Callable[[], object]
    model: aot.Traffic
    xla_bytes: int
    blocks: str

    @property
    def model_kernel_bytes(self) -> int:
        return self.model.bytes_moved - self.xla_bytes


# ----------------------------------------------------------------------------- indexer


def indexer_xla_bytes(s: Shape, *, page_mode: bool) -> int:
    """The XLA term of ``indexer.traffic.traffic``: none. q and weights are read by the
    kernel's own q blocks (no per-item gather) and both modes DMA each item's score rows to
    their output rows (page mode maps no slot to a row in XLA)."""
    del s, page_mode
    return 0


def indexer_case(s: Shape, *, page_mode: bool, block_pages: int, block_rows: int,
                 chunk_bytes: int = scoring.SCORE_CHUNK_BYTES, dtype=jnp.bfloat16,
                 seed: int = 0, index_quant: str | None = None) -> Case:
    b = s.batch(seed)
    blocks = iblocks.resolve_blocks(None, block_rows=block_rows, block_pages=block_pages,
                                chip=None, one_token_per_seq=s.decode,
                                pages_per_seq=s.pages_per_seq)
    fp8_keys = jnp.dtype(dtype) == fp8.FP8_DTYPE  # the fp8 index cache, bf16 q
    cache = (fp8_cache.quantize_index_cache(jnp.asarray(b.cache)) if fp8_keys
             else jnp.asarray(b.cache, dtype))
    q_dtype = jnp.bfloat16 if fp8_keys else dtype
    args = (jnp.asarray(b.q, q_dtype), jnp.asarray(b.weights, jnp.float32),
            cache) + tuple(jnp.asarray(x) for x in b.meta())
    knobs = dict(pages_per_seq=s.pages_per_seq, one_token_per_seq=s.decode,
                 block_rows=blocks.block_rows, block_pages=blocks.block_pages,
                 score_chunk_bytes=chunk_bytes, interpret=INTERPRET, index_quant=index_quant)
    if page_mode:
        k = min(4, s.pages_per_seq)
        run = lambda: streamindex_page_topk(*args, k_pages=k, **knobs)  # noqa: E731
    else:
        k = 16
        run = lambda: streamindex_topk(*args, k=k, **knobs)  # noqa: E731
    model = itraffic.traffic(list(s.q_lens), list(s.kv_lens), heads=s.heads, dim=s.dim,
                        page_size=s.page_size, pages_per_seq=s.pages_per_seq,
                        key_itemsize=jnp.dtype(dtype).itemsize,
                        q_itemsize=jnp.dtype(q_dtype).itemsize, blocks=blocks,
                        page_mode=page_mode, one_token_per_seq=s.decode,
                        chunk_bytes=chunk_bytes,
                        scale_lanes=fp8_cache.scale_lanes(s.page_size) if fp8_keys else 0,
                        index_quant=index_quant)
    xla = indexer_xla_bytes(s, page_mode=page_mode)
    chunked = "" if chunk_bytes == scoring.SCORE_CHUNK_BYTES else f" chunk={chunk_bytes}B"
    return Case("streamindex_page_topk" if page_mode else "streamindex_topk", s.name, run,
                model, xla, f"R={blocks.block_rows} P={blocks.block_pages}{chunked}"
                + (" fp8 keys" if fp8_keys else "") + (f" {index_quant}" if index_quant else ""))


# ----------------------------------------------------------------------------- sparse MLA


def _rows_seq(s: Shape):
    """Per query row: (sequence, absolute position)."""
    out = []
    for i, (ql, kl) in enumerate(zip(s.q_lens, s.kv_lens, strict=True)):
        out += [(i, kl - ql + j) for j in range(ql)]
    return out


def full_token_topk(s: Shape, k: int, rng) -> np.ndarray:
    """Per row ``k`` distinct causal tokens (every entry valid, so ``mla_traffic``'s
    "every row selects k rows" holds)."""
    sel = np.zeros((s.rows, k), np.int32)
    for r, (_, pos) in enumerate(_rows_seq(s)):
        if pos + 1 < k:
            raise ValueError(f"{s.name}: row {r} at position {pos} has fewer than k={k} tokens")
        sel[r] = rng.choice(pos + 1, size=k, replace=False)
    return sel


def full_page_topk(s: Shape, k_pages: int, rng) -> np.ndarray:
    """Per row ``k_pages`` distinct pages holding at least one causal token."""
    sel = np.zeros((s.rows, k_pages), np.int32)
    for r, (_, pos) in enumerate(_rows_seq(s)):
        n = pos // s.page_size + 1
        if n < k_pages:
            raise ValueError(f"{s.name}: row {r} has {n} causal pages < k_pages={k_pages}")
        sel[r] = rng.choice(n, size=k_pages, replace=False)
    return sel


def mla_case(s: Shape, *, page_mode: bool, k: int, block: int, v_dim: int,
             seed: int = 0, fp8_latent: bool = False) -> Case:
    """Packed bf16 cache (token mode; the serving format) or plain bf16 pages (page mode); or
    the fp8 latent cache (``fp8_latent``, both modes; ``s.dim`` must be 576)."""
    b = s.batch(seed)
    rng = np.random.default_rng(seed + 1)
    q = jnp.asarray(b.q, jnp.bfloat16)
    plain = jnp.asarray(b.cache, jnp.bfloat16)  # NaN in every slot no row may read
    if fp8_latent:
        plain = fp8_cache.quantize_latent_cache(jnp.asarray(b.cache))
    meta_args = tuple(jnp.asarray(x) for x in b.meta())
    kv_lens, page_indices, cu_q, cu_kv, dist = meta_args
    kw = dict(sm_scale=0.125, pages_per_seq=s.pages_per_seq, v_dim=v_dim, interpret=INTERPRET)
    if page_mode:
        sel = jnp.asarray(full_page_topk(s, k, rng))
        units = mblocks.page_block(k, s.page_size, None, block)
        fmt, cache, selected, meta_words = "bf16", plain, k * s.page_size, k
        fmt = "fp8" if fp8_latent else fmt
        prep = s.rows * k * PREP_BYTES_PER_PAGE

        def run():
            return page_sparse_mla(q, cache, kv_lens, sel, page_indices, cu_q, cu_kv, dist,
                                   pages_per_block=units, **kw)
    else:
        sel = jnp.asarray(full_token_topk(s, k, rng))
        units = mblocks.token_block(k, None, block)
        fmt, cache, selected, meta_words = "packed", plain, k, k
        if fp8_latent:
            fmt = "fp8"
        else:
            cache = packed_cache.pack_cache(plain)
        prep = s.rows * k * mtraffic.PREP_BYTES_PER_ENTRY

        def run():
            return pallas_kernels.sparse_mla(q, cache, kv_lens, sel, page_indices, cu_q, cu_kv,
                                             dist, tokens_per_block=units, **kw)

    mode = "page" if page_mode else "token"
    kdim = s.dim  # the fp8 cache's query too: the kernel reads it as given
    shape = mkernel.block_shape(mode, heads=s.heads, dim=kdim, v_dim=v_dim,
                             page_size=s.page_size, units=units, meta_len=k,
                             q_dtype=jnp.bfloat16, fmt=fmt)
    model = mtraffic.mla_traffic(rows=s.rows, heads=s.heads, dim=kdim, v_dim=v_dim,
                             selected_rows=selected, fmt=fmt, q_itemsize=2,
                             meta_words=meta_words, prep_bytes=prep,
                             table_words=int(page_indices.shape[0]), shape=shape)
    name = "page_sparse_mla" if page_mode else "sparse_mla"
    what = f"k_pages={k} pages/block={units}" if page_mode else f"k={k} rows/block={units}"
    # The interpreter does not count scalar prefetch (row info + page table -> SMEM): priced by
    # the model, set aside here with the XLA side.
    prefetch = mtraffic.prefetch_bytes(rows=s.rows, table_words=int(page_indices.shape[0]))
    return Case(name, s.name, run, model, prep + prefetch, f"{what} {fmt}")


# ----------------------------------------------------------------------------- V4 compressor


def compressor_case(*, ratio: int = 4, d: int = 128, seqs: int = 4, seed: int = 0,
                    rope_rows: bool = False) -> Case:
    """A decode step of the Pallas V4 compressor (``v4_compressor.compress_step``): ``seqs``
    sequences of one token each, every one completing an entry (``traffic.decode_counts``: the
    step the static program must serve) and reading its ring slot; random rows and ring. At
    ``seqs = 4``, ratio 4: 5 output slots, one of them unused (a zero row). ``rope_rows``: the
    tables given in the kernel's row layout (``v4_compressor.rope_rows``)."""
    from pallas_kernels.v4_compressor import compress_step
    from pallas_kernels.v4_compressor import rope_rows as build_rows
    from pallas_kernels.v4_compressor import traffic as ctraffic
    from reference import v4_compressor as vc

    rng = np.random.default_rng(seed)
    width, rows = vc.compressor_coff(ratio) * d, vc.state_rows(ratio)
    kv_lens = [ratio * (i + 2) for i in range(seqs)]  # each token completes an entry
    f32 = functools.partial(rng.standard_normal, dtype=np.float32)
    cos, sin = vc.rope_tables(max(kv_lens))
    state = vc.CompressorState(jnp.asarray(f32((seqs, rows, width))),
                               jnp.asarray(f32((seqs, rows, width))))
    args = (jnp.asarray(f32((seqs, width))), jnp.asarray(f32((seqs, width))),
            jnp.asarray(f32((ratio, width))), jnp.ones((d,), jnp.float32), cos, sin, state,
            jnp.arange(seqs, dtype=jnp.int32), jnp.asarray(kv_lens, jnp.int32),
            jnp.arange(seqs + 1, dtype=jnp.int32), jnp.asarray([seqs] * 3, jnp.int32))
    # the RoPE table tiles the kernel loads: a completing entry whose position lies in the tile
    # the previous one loaded reuses it (every sequence completes entry kv_len // ratio - 1)
    tiles = [(n // ratio - 1) * ratio // ctraffic.TABLE_TILE for n in kv_lens]
    counts = dataclasses.replace(ctraffic.decode_counts(seqs, ratio),
                                 table_tiles=1 + int(np.count_nonzero(np.diff(tiles))))
    model = ctraffic.compressor_traffic(counts, ratio=ratio, d=d, row_table=rope_rows)
    table = build_rows(cos, sin) if rope_rows else None
    return Case("v4_compressor", f"decode {seqs} seqs, ratio {ratio} d{d}",
                lambda: compress_step(*args, ratio=ratio, interpret=INTERPRET, rope_rows=table),
                model, 0, f"R={rows} W={width}")


# ----------------------------------------------------------------------------- cases

# Decode: 4 sequences of ragged lengths (partial last pages, causal page counts 3..8).
DECODE = Shape("decode 4 seqs, kv 33..128, H8 D128 page16", (1, 1, 1, 1), (128, 70, 33, 100))
# MTP: 3 rows per sequence (several row blocks per sequence in the indexer at R=2).
MTP = Shape("mtp 2 seqs x 3 rows, kv 70/128, H8 D128 page16", (3, 3), (70, 128))
# Sparse MLA at D=256 (packed words W=128 = D/2: the packed row is exactly the bf16 row).
MLA_DECODE = Shape("decode 4 seqs, kv 33..128, H8 D256 page16", (1, 1, 1, 1),
                   (128, 70, 33, 100), dim=256)
MLA_MTP = Shape("mtp 2 seqs x 3 rows, kv 70/128, H8 D256 page16", (3, 3), (70, 128), dim=256)
# fp8 caches: the index cache needs pages of a multiple of 32; the latent cache holds 576.
FP8_DECODE = Shape("decode 4 seqs, kv 33..128, H8 D128 page32", (1, 1, 1, 1),
                   (128, 70, 33, 100), page_size=32, pages_per_seq=4)
FP8_MLA_DECODE = Shape("decode 4 seqs, kv 33..128, H8 D576 page16", (1, 1, 1, 1),
                       (128, 70, 33, 100), dim=576)
# Chunked prefill: 24 new rows at the end of a 96-token sequence, beside a decode row.
PREFILL = Shape("prefill 24 rows@96 + 1 decode, H8 D128 page16", (1, 24), (50, 96))
# Mixed serving batch through the general path: 3 decode rows beside a 9-row prefill chunk. At
# R=8 (ladder 1, 2, 8) the decode rows take 1-row items, the prefill one 8-row and one 1-row item.
MIXED = Shape("mixed 3 decode + 9 rows@80, H8 D128 page16", (1, 9, 1, 1), (40, 80, 17, 128))


def mixed_case(*, page_mode: bool) -> Case:
    """The pinned mixed batch (``MIXED``) through the general path at R=8, P=2."""
    return indexer_case(MIXED, page_mode=page_mode, block_rows=8, block_pages=2)


def decode_cases() -> list[Case]:
    """One small decode case per kernel (the shapes ``tests/test_hbm_traffic.py`` pins)."""
    return [indexer_case(DECODE, page_mode=False, block_rows=1, block_pages=2),
            indexer_case(DECODE, page_mode=True, block_rows=1, block_pages=2),
            mla_case(MLA_DECODE, page_mode=False, k=32, block=16, v_dim=256),
            mla_case(MLA_DECODE, page_mode=True, k=2, block=1, v_dim=256)]


def fp8_cases() -> list[Case]:
    """The four kernels reading the fp8 caches directly (decode)."""
    return [indexer_case(FP8_DECODE, page_mode=False, block_rows=1, block_pages=2,
                         dtype=fp8.FP8_DTYPE),
            indexer_case(FP8_DECODE, page_mode=True, block_rows=1, block_pages=2,
                         dtype=fp8.FP8_DTYPE),
            mla_case(FP8_MLA_DECODE, page_mode=False, k=32, block=16, v_dim=512,
                     fp8_latent=True),
            mla_case(FP8_MLA_DECODE, page_mode=True, k=2, block=1, v_dim=512, fp8_latent=True)]


def all_cases(quick: bool) -> list[Case]:
    cases = decode_cases() + fp8_cases() + [compressor_case()]
    if not quick:
        cases += [indexer_case(MTP, page_mode=False, block_rows=2, block_pages=2),
                  indexer_case(MTP, page_mode=True, block_rows=2, block_pages=2),
                  mla_case(MLA_MTP, page_mode=False, k=32, block=16, v_dim=256),
                  mla_case(MLA_MTP, page_mode=True, k=2, block=1, v_dim=256),
                  indexer_case(PREFILL, page_mode=False, block_rows=8, block_pages=4),
                  # two kernel calls of 16 rows (f32[16, 128] scores each)
                  indexer_case(PREFILL, page_mode=False, block_rows=8, block_pages=4,
                               chunk_bytes=16 * 128 * 4),
                  indexer_case(PREFILL, page_mode=True, block_rows=8, block_pages=4),
                  # R=4 > 3 rows per sequence: the static grid has an empty tail work item
                  indexer_case(MTP, page_mode=False, block_rows=4, block_pages=2),
                  mixed_case(page_mode=False), mixed_case(page_mode=True)]
    return cases


# ----------------------------------------------------------------------------- measure


def count(case: Case) -> counter.TrafficCount:
    """Run ``case`` in interpret mode under the counter."""
    with counter.count_hbm_traffic() as counted:
        jax.block_until_ready(case.run())
    if not counted.copies or counted.dmas_unexecuted:
        raise counter.CountError(f"{case.kernel} {case.shape}: {len(counted.copies)} copies "
                                 f"counted, {counted.dmas_unexecuted} DMAs never executed")
    return counted


def row(case: Case, counted: counter.TrafficCount, seconds: float) -> dict:
    h2v = counted.bytes("hbm", "vmem", lane_padded=True)
    v2h = counted.bytes("vmem", "hbm", lane_padded=True)
    h2s = counted.bytes("hbm", "smem", lane_padded=True)
    h2h = counted.bytes("hbm", "hbm", lane_padded=True)
    other = counted.bytes(lane_padded=True) - h2v - v2h - h2s - h2h
    total = h2v + v2h + h2s + 2 * h2h + other  # an HBM -> HBM copy reads and writes HBM
    m = case.model
    return {"kernel": case.kernel, "shape": case.shape, "blocks": case.blocks,
            "counted_hbm_to_vmem": h2v, "counted_vmem_to_hbm": v2h, "counted_hbm_to_smem": h2s,
            "counted_hbm_to_hbm": h2h, "counted_other": other, "counted_total": total,
            "counted_dmas": counted.descriptors, "model_dmas": m.dmas,
            "counted_logical_total": counted.bytes(),
            "model_bytes_moved": m.bytes_moved, "model_xla_side": case.xla_bytes,
            "model_kernel_side": case.model_kernel_bytes, "bytes_min": m.bytes_min,
            "counted_over_model_kernel": total / max(case.model_kernel_bytes, 1),
            "counted_over_min": total / max(m.bytes_min, 1),
            "copies": counted.table(), "seconds": round(seconds, 2)}
