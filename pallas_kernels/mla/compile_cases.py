"""AOT compile-gate cases of the sparse MLA entries (``pallas_kernels.aot``) at DeepSeek-V3.2
absorbed-MLA shapes, with the traffic model of the blocks each chip picks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import aot, tpu
from pallas_kernels.mla import blocks as mla_blocks
from pallas_kernels.mla import kernel
from pallas_kernels.mla.page import page_sparse_mla
from pallas_kernels.mla.token import sparse_mla
from pallas_kernels.mla.traffic import PREP_BYTES_PER_ENTRY, PREP_BYTES_PER_PAGE, mla_traffic
from reference import packed_cache


def _specs(*shapes_dtypes):
    return [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]


def batch_specs(*, rows, heads, dim, seqs, context, page_size, selected, cache_dtype):
    """Specs of (q, cache, kv_lens, selected, page_indices, cu_q_lens, cu_kv_lens, distribution)
    for ``seqs`` sequences of ``context`` tokens (pages of ``page_size``) and ``rows`` queries."""
    pages = seqs * (context // page_size)
    words = packed_cache.packed_words(dim) if cache_dtype == jnp.uint32 else dim
    return _specs(((rows, heads, dim), jnp.bfloat16), ((pages, page_size, words), cache_dtype),
                  ((seqs,), jnp.int32), ((rows, selected), jnp.int32), ((pages,), jnp.int32),
                  ((seqs + 1,), jnp.int32), ((seqs + 1,), jnp.int32), ((3,), jnp.int32))


# DeepSeek-V3.2 absorbed MLA: 576 latent+rope padded to 640, v_dim 512, pages of 64 tokens.
MLA_DIM, MLA_V_DIM, MLA_PAGE, MLA_SCALE = 640, 512, 64, 0.1352
# (name, rows, seqs, context, heads): 64 decode rows x 8192; a 1024-token prefill at 32768.
COMPILE_SHAPES = (("decode64x8192_h128", 64, 64, 8192, 128),
                  ("decode64x8192_h16", 64, 64, 8192, 16),
                  ("prefill1024@32768_h128", 1024, 1, 32768, 128))


def token_cases(quick: bool = True) -> list[aot.CompileCase]:
    """``sparse_mla`` compile cases: packed bf16 cache at k=2048 for every shape;
    ``quick=False`` adds the f32 cache and the plain-bf16 (pack per call) slow path at the H=16
    decode shape."""
    k = 2048
    fmts = [("packed", jnp.uint32)] + ([] if quick else [("f32", jnp.float32),
                                                         ("bf16", jnp.bfloat16)])
    cases = []
    for name, rows, seqs, context, heads in COMPILE_SHAPES:
        for fmt, dt in fmts:
            if fmt != "packed" and heads != 16:
                continue
            cases.append(_token_case(f"{name}_k{k}_{fmt}", rows, seqs, context, heads, k, fmt,
                                     dt))
    return cases


def _token_case(label, rows, seqs, context, heads, k, fmt, dt) -> aot.CompileCase:
    specs = batch_specs(rows=rows, heads=heads, dim=MLA_DIM, seqs=seqs, context=context,
                        page_size=MLA_PAGE, selected=k, cache_dtype=dt)
    kfmt = "packed" if fmt == "bf16" else fmt

    def shape_for(chip):
        units = mla_blocks.token_block(k, chip)
        return units, kernel.block_shape("token", heads=heads, dim=MLA_DIM, v_dim=MLA_V_DIM,
                                  page_size=MLA_PAGE, units=units, meta_len=k,
                                  q_dtype=jnp.bfloat16, fmt=kfmt)

    def fn_for_chip(chip):
        units, shape = shape_for(chip)
        return functools.partial(
            sparse_mla, sm_scale=MLA_SCALE, pages_per_seq=context // MLA_PAGE,
            v_dim=MLA_V_DIM, tokens_per_block=units,
            vmem_limit_bytes=tpu.vmem_limit(mla_blocks.vmem_bytes(shape), chip))

    def traffic(chip):
        t = mla_traffic(rows=rows, heads=heads, dim=MLA_DIM, v_dim=MLA_V_DIM,
                        selected_rows=k, fmt=kfmt, q_itemsize=2, meta_words=k,
                        prep_bytes=rows * k * PREP_BYTES_PER_ENTRY,
                        table_words=seqs * context // MLA_PAGE, shape=shape_for(chip)[1])
        if fmt == "bf16":  # slow path: pack the whole cache (read bf16, write words) per call
            pages = seqs * context // MLA_PAGE
            extra = pages * MLA_PAGE * (2 * MLA_DIM + 4 * packed_cache.packed_words(MLA_DIM))
            t = aot.Traffic(t.bytes_moved + extra, t.bytes_min, t.flops, t.vmem_bytes)
        return t

    return aot.CompileCase("sparse_mla", label, fn_for_chip, specs, traffic,
                           tags=("decode",) if label.startswith("decode") else ("prefill",))
K_PAGES = 32  # 32 pages of 64 tokens = 2048 selected tokens, as the token kernel's k


def page_cases(quick: bool = True) -> list[aot.CompileCase]:
    """``page_sparse_mla`` compile cases: 32 pages of 64 per row from a plain bf16 cache
    (pages are whole tiles) at every ``COMPILE_SHAPES`` shape; ``quick=False`` adds the packed
    and f32 caches at the H=16 decode shape."""
    fmts = [("bf16", jnp.bfloat16)] + ([] if quick else [("packed", jnp.uint32),
                                                         ("f32", jnp.float32)])
    cases = []
    for name, rows, seqs, context, heads in COMPILE_SHAPES:
        for fmt, dt in fmts:
            if fmt != "bf16" and heads != 16:
                continue
            cases.append(_page_case(f"{name}_p{K_PAGES}x{MLA_PAGE}_{fmt}", rows, seqs,
                                    context, heads, fmt, dt))
    return cases


def _page_case(label, rows, seqs, context, heads, fmt, dt) -> aot.CompileCase:
    ps = MLA_PAGE
    specs = batch_specs(rows=rows, heads=heads, dim=MLA_DIM, seqs=seqs,
                             context=context, page_size=ps, selected=K_PAGES, cache_dtype=dt)

    def shape_for(chip):
        units = mla_blocks.page_block(K_PAGES, ps, chip)
        return units, kernel.block_shape("page", heads=heads, dim=MLA_DIM,
                                       v_dim=MLA_V_DIM, page_size=ps, units=units,
                                       meta_len=K_PAGES, q_dtype=jnp.bfloat16, fmt=fmt)

    def fn_for_chip(chip):
        units, shape = shape_for(chip)
        return functools.partial(
            page_sparse_mla, sm_scale=MLA_SCALE, pages_per_seq=context // ps,
            v_dim=MLA_V_DIM, pages_per_block=units,
            vmem_limit_bytes=tpu.vmem_limit(mla_blocks.vmem_bytes(shape), chip))

    def traffic(chip):
        return mla_traffic(rows=rows, heads=heads, dim=MLA_DIM, v_dim=MLA_V_DIM,
                                selected_rows=K_PAGES * ps, fmt=fmt, q_itemsize=2,
                                meta_words=K_PAGES,
                                prep_bytes=rows * K_PAGES * PREP_BYTES_PER_PAGE,
                                table_words=seqs * context // ps, shape=shape_for(chip)[1])

    return aot.CompileCase("page_sparse_mla", label, fn_for_chip, specs, traffic,
                           tags=("decode",) if label.startswith("decode") else ("prefill",))


def compile_cases(quick: bool = True) -> list[aot.CompileCase]:
    """Every sparse MLA compile case: token then page."""
    return token_cases(quick) + page_cases(quick)
