"""AOT compile-gate cases of the sparse MLA entries (``pallas_kernels.aot``) at DeepSeek-V3.2
absorbed-MLA shapes, with the traffic model of the blocks each chip picks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import aot
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import kernel
from pallas_kernels.mla.page import page_sparse_mla
from pallas_kernels.mla.token import sparse_mla
from pallas_kernels.mla.traffic import PREP_BYTES_PER_ENTRY, mla_traffic
from reference.formats import fp8_cache, packed_cache


def _specs(*shapes_dtypes):
    return [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]


def batch_specs(*, rows, heads, dim, seqs, context, page_size, selected, cache_dtype,
                fp8: bool = False):
    """Specs of (q, cache, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens, distribution)
    for ``seqs`` sequences of ``context`` tokens (pages of ``page_size``) and ``rows`` queries;
    ``fp8``: the cache is an ``Fp8LatentCache`` (``cache_dtype`` unused)."""
    pages = seqs * (context // page_size)
    words = packed_cache.packed_words(dim) if cache_dtype == jnp.uint32 else dim
    specs = _specs(((rows, heads, dim), jnp.bfloat16), ((pages, page_size, words), cache_dtype),
                   ((seqs,), jnp.int32), ((rows, selected), jnp.int32), ((pages,), jnp.int32),
                   ((seqs + 1,), jnp.int32), ((seqs + 1,), jnp.int32), ((3,), jnp.int32))
    if fp8:
        specs[1] = fp8_cache.Fp8LatentCache(jax.ShapeDtypeStruct(
            (pages, page_size, fp8_cache.LATENT_WORDS), jnp.uint32))
    return specs


# DeepSeek-V3.2 absorbed MLA: 576 latent+rope padded to 640, v_dim 512, pages of 64 tokens.
MLA_DIM, MLA_V_DIM, MLA_PAGE, MLA_SCALE = 640, 512, 64, 0.1352
FP8_DIM = 576  # the fp8 latent cache's cases pass the logical query width (read as given)
# (name, rows, seqs, context, heads): 64 decode rows x 8192; a 1024-token prefill at 32768; a
# mixed serving batch (60 decode rows beside a 512-row prefill chunk: 61 sequences of 8192).
COMPILE_SHAPES = (("decode64x8192_h128", 64, 64, 8192, 128),
                  ("decode64x8192_h16", 64, 64, 8192, 16),
                  ("prefill1024@32768_h128", 1024, 1, 32768, 128),
                  ("mixed60x1+512@8192_h128", 572, 61, 8192, 128))


K_TOKENS = 2048  # DeepSeek-V3.2's token budget
K_PAGES = K_TOKENS // MLA_PAGE  # 32 pages of 64 tokens: the same selected tokens per row


def token_cases(quick: bool = True) -> list[aot.CompileCase]:
    """``sparse_mla`` compile cases: packed bf16 cache at k=2048 for every shape;
    ``quick=False`` adds the f32 cache and the plain-bf16 (pack per call) slow path at the H=16
    decode shape."""
    extra = [] if quick else [("f32", jnp.float32), ("bf16", jnp.bfloat16)]
    return _cases("token", [("packed", jnp.uint32), ("fp8", jnp.uint32)], extra)


def page_cases(quick: bool = True) -> list[aot.CompileCase]:
    """``page_sparse_mla`` compile cases: 32 pages of 64 per row from a plain bf16 cache
    (pages are whole tiles) at every ``COMPILE_SHAPES`` shape; ``quick=False`` adds the packed
    and f32 caches at the H=16 decode shape."""
    extra = [] if quick else [("packed", jnp.uint32), ("f32", jnp.float32)]
    return _cases("page", [("bf16", jnp.bfloat16), ("fp8", jnp.uint32)], extra)


def _cases(mode: str, main, extra) -> list[aot.CompileCase]:
    """``main`` formats at every shape, ``extra`` formats at the H=16 decode shape only."""
    cases = []
    for name, rows, seqs, context, heads in COMPILE_SHAPES:
        for fmt, dt in main + (extra if heads == 16 else []):
            sel = f"k{K_TOKENS}" if mode == "token" else f"p{K_PAGES}x{MLA_PAGE}"
            cases.append(mla_case(mode, f"{name}_{sel}_{fmt}", rows, seqs, context, heads,
                                  fmt, dt))
    return cases


def mla_case(mode: str, label: str, rows: int, seqs: int, context: int, heads: int, fmt: str,
             dt) -> aot.CompileCase:
    """One compile case of ``sparse_mla`` (``mode="token"``, k = ``K_TOKENS``) or
    ``page_sparse_mla`` (``"page"``, ``K_PAGES`` pages): ``seqs`` sequences of ``context``
    tokens, ``rows`` query rows, ``heads`` heads, cache format ``fmt`` stored as ``dt``."""
    token = mode == "token"
    entries = K_TOKENS if token else K_PAGES
    fp8 = fmt == "fp8"  # q of the logical 576, read by the kernel as given
    specs = batch_specs(rows=rows, heads=heads, dim=FP8_DIM if fp8 else MLA_DIM, seqs=seqs,
                        context=context, page_size=MLA_PAGE, selected=entries, cache_dtype=dt,
                        fp8=fp8)
    kfmt = "packed" if fmt == "bf16" and token else fmt  # the token entry packs bf16 per call
    kdim = FP8_DIM if fp8 else MLA_DIM  # the kernel's query width

    def shape_for(chip):
        units = (mla_blocks.token_block(entries, chip) if token
                 else mla_blocks.page_block(entries, MLA_PAGE, chip))
        return units, kernel.block_shape(mode, heads=heads, dim=kdim, v_dim=MLA_V_DIM,
                                         page_size=MLA_PAGE, units=units, meta_len=entries,
                                         q_dtype=jnp.bfloat16, fmt=kfmt)

    def fn_for_chip(chip):
        units = shape_for(chip)[0]
        knob = {"tokens_per_block": units} if token else {"pages_per_block": units}
        return functools.partial(sparse_mla if token else page_sparse_mla, sm_scale=MLA_SCALE,
                                 pages_per_seq=context // MLA_PAGE, v_dim=MLA_V_DIM, **knob)

    def traffic(chip):
        prep = rows * entries * PREP_BYTES_PER_ENTRY
        t = mla_traffic(rows=rows, heads=heads, dim=kdim, v_dim=MLA_V_DIM,
                        selected_rows=entries * (1 if token else MLA_PAGE), fmt=kfmt,
                        q_itemsize=2, meta_words=entries, prep_bytes=prep,
                        table_words=seqs * context // MLA_PAGE, shape=shape_for(chip)[1])
        if token and fmt == "bf16":  # slow path: pack the whole cache (read bf16, write words)
            pages = seqs * context // MLA_PAGE
            extra = pages * MLA_PAGE * (2 * MLA_DIM + 4 * packed_cache.packed_words(MLA_DIM))
            t = aot.Traffic(t.bytes_moved + extra, t.bytes_min, t.flops, t.vmem_bytes,
                            t.dmas)
        return t

    tag = next((t for t in ("decode", "mixed") if label.startswith(t)), "prefill")
    return aot.CompileCase("sparse_mla" if token else "page_sparse_mla", label, fn_for_chip,
                           specs, traffic, tags=(tag,))


def compile_cases(quick: bool = True) -> list[aot.CompileCase]:
    """Every sparse MLA compile case: token then page."""
    return token_cases(quick) + page_cases(quick)
