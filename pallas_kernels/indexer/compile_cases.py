"""AOT compile-gate cases of the indexer entries (``pallas_kernels.aot``): the DeepSeek-V3.2
indexer shapes (H=64, D=128, pages of 64, k=2048 tokens or 32 pages), decode, long decode,
prefill and a mixed batch, with the traffic model of the blocks each chip picks; and the
DeepSeek-V4 compressed-key indexer (``compression_ratio=4``: H=64, D=128, pages of 64 entries,
k=512 Flash / 1024 Pro entries; ``V4_SHAPES``), also with DeepSeek-V4's FP4 index simulation
(``index_quant="fp4_sim"``: the Hadamard rotation and FP4 rounding of each key tile in the
kernel; ``V4_FP4_SHAPES``), and with DeepSeek-V4's official bf16 scoring (``precision="bf16"``:
the dots, products and head sums rounded to bf16 in the kernel; ``V4_BF16_SHAPES``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import aot
from pallas_kernels.indexer import fp8_pages_topk, v41_pages, v41_scores
from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.kernel import compute_dtypes
from pallas_kernels.indexer.page import streamindex_page_topk
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES
from pallas_kernels.indexer.token import streamindex_topk
from pallas_kernels.indexer.traffic import traffic
from reference.formats import fp8_cache, fp8_index_pages
from reference.quant import fp8
from reference.v41 import index_pages as v41_index_pages
from reference.v41.config import v41_flash

# name -> (q_lens, kv_lens, one_token_per_seq); DeepSeek-V3.2 indexer: H=64, D=128, page 64.
GATE_SHAPES = {
    "decode 64x4096": ([1] * 64, [4096] * 64, True),
    "decode 8x131072": ([1] * 8, [131072] * 8, True),
    "prefill 2048@32768": ([2048], [32768], False),
    # the common serving batch: decode rows beside a chunked prefill (general path)
    "mixed 60x1@4096 + 512@32768": ([1] * 60 + [512], [4096] * 60 + [32768], False),
}
GATE_HEADS, GATE_DIM, GATE_PAGE, GATE_K = 64, 128, 64, 2048

# DeepSeek-V4's indexer: ratio-4 compressed keys, same heads and dim; pages of 64 entries
# (256 tokens). name -> (q_lens, kv_lens in tokens, one_token_per_seq, k).
V4_RATIO = 4
V4_SHAPES = {
    "V4-Flash decode 64x8192 (2048 entries) k=512": ([1] * 64, [8192] * 64, True, 512),
    "V4-Pro decode 64x8192 (2048 entries) k=1024": ([1] * 64, [8192] * 64, True, 1024),
    "V4-Flash mixed 60x1@8192 + 512@32768 k=512": ([1] * 60 + [512], [8192] * 60 + [32768],
                                                   False, 512),
    "V4-Pro prefill 2048@131072 (32768 entries) k=1024": ([2048], [131072], False, 1024),
}

# index_quant="fp4_sim" (bf16 keys as stored, q simulated in the glue). The in-kernel rotation
# and rounding depend only on the stage's key tile (``P * page`` x 128), so the quick gate holds
# the Flash decode on the token entry (16-page stages) and the mixed batch at Pro's budget on the
# page entry (the general path's smaller stages and its row ladder); the rest when not quick.
# V4-Pro has Flash's indexer dims (64 heads x 128, ratio 4); only the budget differs.
# name -> (q_lens, kv_lens in tokens, one_token_per_seq, k entries, page_mode, quick)
_MIXED = V4_SHAPES["V4-Flash mixed 60x1@8192 + 512@32768 k=512"][:2]
V4_FP4_SHAPES = {
    "V4-Flash decode 64x8192 (2048 entries) k=512 fp4_sim":
        (*V4_SHAPES["V4-Flash decode 64x8192 (2048 entries) k=512"], False, True),
    "V4-Pro mixed 60x1@8192 + 512@32768 k=1024 pages fp4_sim": (*_MIXED, False, 1024, True, True),
    "V4-Pro decode 64x8192 (2048 entries) k=1024 fp4_sim":
        (*V4_SHAPES["V4-Pro decode 64x8192 (2048 entries) k=1024"], False, False),
    "V4-Flash mixed 60x1@8192 + 512@32768 k=512 fp4_sim": (*_MIXED, False, 512, False, False),
    "V4-Flash decode 64x8192 (2048 entries) k=512 f32 keys fp4_sim":  # the HIGHEST rotation
        (*V4_SHAPES["V4-Flash decode 64x8192 (2048 entries) k=512"], False, False),
}

# precision="bf16" (bf16 q and keys, the official rounding in the stage's epilogue): the Flash
# decode on each entry (the page entry's epilogue takes its page maxima of the rounded scores),
# in the quick gate. The rounding is per score, independent of the blocks, so one shape per
# entry shows Mosaic lowers it. name -> (as V4_FP4_SHAPES).
V4_BF16_SHAPES = {
    "V4-Flash decode 64x8192 (2048 entries) k=512 bf16 scores":
        (*V4_SHAPES["V4-Flash decode 64x8192 (2048 entries) k=512"], False, True),
    "V4-Flash decode 64x8192 (2048 entries) k=512 pages bf16 scores":
        (*V4_SHAPES["V4-Flash decode 64x8192 (2048 entries) k=512"], True, True),
}


def gate_specs(q_lens, kv_lens, *, key_dtype=jnp.bfloat16, heads=GATE_HEADS, dim=GATE_DIM,
               page_size=GATE_PAGE, q_dtype=jnp.bfloat16,
               compression_ratio: int = 1) -> tuple[list, int]:
    """Argument specs of a batch (each sequence's capacity = its kv_len); ``pages_per_seq``.
    ``key_dtype`` float8_e4m3fn: the cache is an ``Fp8IndexCache`` of specs.
    ``compression_ratio``: ``kv_lens`` in tokens, pages of ``page_size`` entries."""
    t, s = sum(q_lens), len(q_lens)
    pps = -(-max(kv // compression_ratio for kv in kv_lens) // page_size)
    i32 = jnp.int32
    cache = jax.ShapeDtypeStruct((s * pps, page_size, dim), key_dtype)
    if jnp.dtype(key_dtype) == fp8.FP8_DTYPE:
        cache = fp8_cache.Fp8IndexCache(cache, jax.ShapeDtypeStruct(
            (s * pps, fp8_cache.scale_lanes(page_size)), jnp.float32))
    specs = [jax.ShapeDtypeStruct((t, heads, dim), q_dtype),
             jax.ShapeDtypeStruct((t, heads), jnp.float32), cache,
             jax.ShapeDtypeStruct((s,), i32), jax.ShapeDtypeStruct((s * pps,), i32),
             jax.ShapeDtypeStruct((s + 1,), i32), jax.ShapeDtypeStruct((s + 1,), i32),
             jax.ShapeDtypeStruct((3,), i32)]
    return specs, pps


def gate_cases(kernel: str, entry, k_name: str, *, page_mode: bool,
               quick: bool) -> list[aot.CompileCase]:
    """Compile cases of ``entry`` at the gate shapes with bf16 keys, then with the fp8 index
    cache (bf16 q; an fp8 q at the 64 x 4096 decode: tpu7x's fp8 MXU path; the prefill shape
    only when not quick), plus an f32-key decode when not quick."""
    shapes = dict(GATE_SHAPES)
    shapes.update({f"{name} fp8 keys": v for name, v in GATE_SHAPES.items()
                   if not (quick and name.startswith("prefill"))})  # quick: decode and mixed
    shapes["decode 64x4096 fp8 keys fp8 q"] = GATE_SHAPES["decode 64x4096"]
    if not quick:
        shapes["decode 64x4096 f32 keys"] = GATE_SHAPES["decode 64x4096"]
    cases = []
    for name, (q_lens, kv_lens, otp) in shapes.items():
        key_dtype = (jnp.float32 if "f32" in name else fp8.FP8_DTYPE if "fp8 keys" in name
                     else jnp.bfloat16)
        q_dtype = fp8.FP8_DTYPE if "fp8 q" in name else jnp.bfloat16
        specs, pps = gate_specs(q_lens, kv_lens, key_dtype=key_dtype, q_dtype=q_dtype)
        k = GATE_K if not page_mode else min(GATE_K // GATE_PAGE, pps)

        def fn_for_chip(chip, pps=pps, otp=otp, k=k):
            return functools.partial(entry, **{k_name: k}, pages_per_seq=pps,
                                     one_token_per_seq=otp, chip=chip)

        def model(chip, q_lens=q_lens, kv_lens=kv_lens, otp=otp, pps=pps, key_dtype=key_dtype,
                  specs=specs):
            compute, _, lanes = compute_dtypes(specs[0], specs[2], chip)
            return traffic(q_lens, kv_lens, heads=GATE_HEADS, dim=GATE_DIM, page_size=GATE_PAGE,
                           pages_per_seq=pps, key_itemsize=jnp.dtype(key_dtype).itemsize,
                           q_itemsize=compute.itemsize, scale_lanes=lanes,
                           blocks=resolve_blocks(None, block_rows=None, block_pages=None,
                                                 chip=chip, one_token_per_seq=otp,
                                                 pages_per_seq=pps, page_size=GATE_PAGE,
                                                 page_mode=page_mode, mosaic=True),
                           page_mode=page_mode, one_token_per_seq=otp)

        tags = ("decode",) if otp else ("mixed",) if name.startswith("mixed") else ("prefill",)
        cases.append(aot.CompileCase(kernel, name, fn_for_chip, specs, model, tags))
    return cases


def token_cases(quick: bool) -> list[aot.CompileCase]:
    """``streamindex_topk`` at the gate shapes, k=2048."""
    return gate_cases("streamindex_topk", streamindex_topk, "k", page_mode=False, quick=quick)


def page_cases(quick: bool) -> list[aot.CompileCase]:
    """``streamindex_page_topk`` at the gate shapes, ``k_pages = 2048 / 64 = 32``."""
    return gate_cases("streamindex_page_topk", streamindex_page_topk, "k_pages",
                      page_mode=True, quick=quick)


def v4_cases(quick: bool) -> list[aot.CompileCase]:
    """``streamindex_topk(compression_ratio=4)`` at ``V4_SHAPES`` with bf16 keys, plus the fp8
    index cache at the Flash decode (quick: the long prefill is left out), plus
    ``index_quant="fp4_sim"`` at ``V4_FP4_SHAPES`` (page entry: ``k_pages = k / 64``), plus
    ``precision="bf16"`` at ``V4_BF16_SHAPES``."""
    shapes = {name: (*v, None, False, "f32") for name, v in V4_SHAPES.items()
              if not (quick and name.startswith("V4-Pro prefill"))}
    flash = next(iter(V4_SHAPES))
    shapes[flash + " fp8 keys"] = (*V4_SHAPES[flash], None, False, "f32")
    shapes.update({name: (*v[:4], "fp4_sim", v[4], "f32") for name, v in V4_FP4_SHAPES.items()
                   if v[5] or not quick})
    shapes.update({name: (*v[:4], None, v[4], "bf16") for name, v in V4_BF16_SHAPES.items()
                   if v[5] or not quick})
    cases = []
    for name, (q_lens, kv_lens, otp, k, quant, page_mode, precision) in shapes.items():
        key_dtype = (fp8.FP8_DTYPE if "fp8 keys" in name else jnp.float32 if "f32 keys" in name
                     else jnp.bfloat16)
        specs, pps = gate_specs(q_lens, kv_lens, key_dtype=key_dtype, compression_ratio=V4_RATIO)
        entry, k_kw = ((streamindex_page_topk, {"k_pages": k // GATE_PAGE}) if page_mode
                       else (streamindex_topk, {"k": k}))

        def fn_for_chip(chip, pps=pps, otp=otp, entry=entry, k_kw=k_kw, quant=quant,
                        precision=precision):
            # precision only when not the default: the f32 cases' calls stay as they were
            extra = {} if precision == "f32" else {"precision": precision}
            return functools.partial(entry, **k_kw, pages_per_seq=pps, one_token_per_seq=otp,
                                     compression_ratio=V4_RATIO, index_quant=quant, chip=chip,
                                     **extra)

        def model(chip, q_lens=q_lens, kv_lens=kv_lens, otp=otp, pps=pps, key_dtype=key_dtype,
                  specs=specs, quant=quant, page_mode=page_mode, precision=precision):
            compute, _, lanes = compute_dtypes(specs[0], specs[2], chip, quant, precision)
            blocks = resolve_blocks(None, block_rows=None, block_pages=None, chip=chip,
                                    one_token_per_seq=otp, pages_per_seq=pps,
                                    page_size=GATE_PAGE, page_mode=page_mode, mosaic=True)
            return traffic(q_lens, kv_lens, heads=GATE_HEADS, dim=GATE_DIM, page_size=GATE_PAGE,
                           pages_per_seq=pps, key_itemsize=jnp.dtype(key_dtype).itemsize,
                           q_itemsize=compute.itemsize, scale_lanes=lanes, blocks=blocks,
                           page_mode=page_mode, one_token_per_seq=otp,
                           compression_ratio=V4_RATIO, index_quant=quant)

        tags = ("decode",) if otp else ("mixed",) if "mixed" in name else ("prefill",)
        tags += ("v4",) + (("fp4_sim",) if quant else ()) + (("bf16",) if precision == "bf16"
                                                             else ())
        kernel = "streamindex_page_topk r=4" if page_mode else "streamindex_topk r=4"
        cases.append(aot.CompileCase(kernel, name, fn_for_chip, specs, model, tags))
    return cases


# DeepSeek-V4.1's long rows (issue 31, Deliver 6): at ratio 1 a context of N tokens is an
# N-entry indexer row. V4.1's indexer dims (``reference.v41.v41_flash``: 32 heads x 128,
# top-512), pages of ``GATE_PAGE`` entries. Keys as this package stores them: bf16, the fp8
# index pages ``u8[P, G, 4, 128]``, or V4.1's own fp4 index pages (``v41_pages``; pages of at
# least ``V41_FP4_MIN_PAGE``, where they hold the format's 68 B an entry).
# Two shapes record refusals (``scripts/cost/v41_long_rows.py``): 32 x 1M at pages of 64 (the
# page table i32[32 * 16384], 2 MiB, is scalar-prefetched into 1 MiB of SMEM; pages of
# ``V41_WIDE_PAGE`` compile) and a 1M prefill at the table's block rows (the kernel's row
# buffer f32[2, 16, 1M] is 128 MiB of VMEM; 4 block rows compile).
# name -> (q_lens, kv_lens in tokens, one_token_per_seq, page_size, quick, block_rows)
V41_WIDE_PAGE = 4 * GATE_PAGE
V41_LONG_SHAPES = {
    "V4.1 decode 4x131072": ([1] * 4, [131072] * 4, True, GATE_PAGE, False, None),
    "V4.1 decode 32x131072": ([1] * 32, [131072] * 32, True, GATE_PAGE, False, None),
    "V4.1 decode 4x1048576": ([1] * 4, [1048576] * 4, True, GATE_PAGE, True, None),
    "V4.1 decode 32x1048576": ([1] * 32, [1048576] * 32, True, GATE_PAGE, False, None),
    "V4.1 decode 32x1048576 pages of 256":
        ([1] * 32, [1048576] * 32, True, V41_WIDE_PAGE, False, None),
    "V4.1 prefill 1024@131072": ([1024], [131072], False, GATE_PAGE, False, None),
    "V4.1 prefill 64@1048576": ([64], [1048576], False, GATE_PAGE, False, None),
    "V4.1 prefill 64@1048576 block_rows=4": ([64], [1048576], False, GATE_PAGE, False, 4),
}
V41_KEY_FORMATS = ("bf16", "fp8 pages", "fp4 pages")
V41_SELECTIONS = ("consumer", "source")  # a candidate consumer's top-k, the candidate source's
V41_FP4_MIN_PAGE = v41_index_pages.LANES  # fp4 pages below 128 entries pad their lanes


def v41_long_case(name: str, key_format: str = "bf16", *, exact: bool = False,
                  score_chunk_bytes: int | None = None, shape: tuple | None = None,
                  selection: str | None = None) -> aot.CompileCase:
    """One V4.1 long-row case: ``streamindex_topk`` (bf16 keys),
    ``streamindex_topk_fp8_pages`` (``key_format="fp8 pages"``) or ``v41_scores.index_topk_v41``
    (``"fp4 pages"``, V4.1's own format, pages of at least ``V41_FP4_MIN_PAGE``) at
    ``V41_LONG_SHAPES[name]``
    (or ``shape``: ``(q_lens, kv_lens, one_token_per_seq, page_size[, quick, block_rows])``),
    ratio 1, V4.1's indexer dims; ``exact``: ``lax.top_k`` (the official ``torch.topk``'s
    exact set) instead of the default approximate top-k; ``score_chunk_bytes``: the entry's
    knob (``None``: its default ``SCORE_CHUNK_BYTES``); ``selection`` (fp4 pages only, exact,
    ``V41_SELECTIONS``): ``"consumer"``, a candidate consumer's top-k (``index_topk_v41`` given
    ``candidates i32[T, candidate_topk_blocks]`` of ``candidate_block_size`` entries, the last
    spec; the model reads every page: an upper bound, the pages read depend on the ids), or
    ``"source"``, the candidate source's (``index_select_v41``: its top-k and its blocks)."""
    if key_format not in V41_KEY_FORMATS:
        raise ValueError(f"key_format must be one of {V41_KEY_FORMATS}, got {key_format!r}")
    if selection is not None and (selection not in V41_SELECTIONS or key_format != "fp4 pages"):
        raise ValueError(f"selection must be one of {V41_SELECTIONS} with key_format='fp4 "
                         f"pages', got {selection!r} with {key_format!r}")
    cfg = v41_flash()
    heads, dim, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    q_lens, kv_lens, otp, page, *rest = shape if shape is not None else V41_LONG_SHAPES[name]
    block_rows = rest[1] if len(rest) > 1 else None
    fp4 = key_format == "fp4 pages"
    page = max(page, V41_FP4_MIN_PAGE) if fp4 else page
    specs, pps = gate_specs(q_lens, kv_lens, heads=heads, dim=dim, page_size=page)
    pages = key_format == "fp8 pages"
    if pages:
        specs[2] = jax.ShapeDtypeStruct(
            (specs[2].shape[0], fp8_index_pages.page_groups(page), fp8_index_pages.PACK,
             fp8_index_pages.LANES), jnp.uint8)
    entry = fp8_pages_topk.streamindex_topk_fp8_pages if pages else streamindex_topk
    knobs = {} if score_chunk_bytes is None else {"score_chunk_bytes": score_chunk_bytes}
    if fp4:
        specs[2] = jax.ShapeDtypeStruct(
            (specs[2].shape[0], *v41_pages.page_shape(page, dim)), jnp.uint8)
        entry = v41_scores.index_topk_v41
        knobs.update(page_size=page, dim=dim)
    if selection == "consumer":
        specs.append(jax.ShapeDtypeStruct((specs[0].shape[0], cfg.candidate_topk_blocks),
                                          jnp.int32))
        entry = functools.partial(_last_as_candidates, entry)
    if selection == "source":
        entry = _candidate_source
        knobs["num_blocks"] = cfg.candidate_topk_blocks
    if selection is not None:
        knobs["candidate_block"] = cfg.candidate_block_size
    if block_rows is not None:
        knobs["block_rows"] = block_rows
    chunk = SCORE_CHUNK_BYTES if score_chunk_bytes is None else score_chunk_bytes

    def fn_for_chip(chip):
        return functools.partial(entry, k=k, pages_per_seq=pps, one_token_per_seq=otp,
                                 exact=exact, chip=chip, **knobs)

    def model(chip):
        blocks = resolve_blocks(None, block_rows=block_rows, block_pages=None, chip=chip,
                                one_token_per_seq=otp, pages_per_seq=pps, page_size=page,
                                page_mode=False, mosaic=True)
        if pages:
            return fp8_pages_topk.traffic(q_lens, kv_lens, heads=heads, page_size=page,
                                          pages_per_seq=pps, q_itemsize=2, blocks=blocks,
                                          one_token_per_seq=otp, chunk_bytes=chunk)
        if fp4:
            return v41_scores.traffic(q_lens, kv_lens, heads=heads, dim=dim, page_size=page,
                                      pages_per_seq=pps, q_itemsize=2, blocks=blocks,
                                      one_token_per_seq=otp, chunk_bytes=chunk)
        return traffic(q_lens, kv_lens, heads=heads, dim=dim, page_size=page,
                       pages_per_seq=pps, key_itemsize=2, q_itemsize=2, blocks=blocks,
                       page_mode=False, one_token_per_seq=otp, chunk_bytes=chunk)

    tags = ("v41", "long", "decode" if otp else "prefill") + (("exact",) if exact else ())
    label = (f"{name} {key_format} keys k={k}" + (" exact" if exact else "")
             + {None: "", "consumer": f" among {cfg.candidate_topk_blocks} blocks",
                "source": f" + {cfg.candidate_topk_blocks} candidate blocks"}[selection])
    return aot.CompileCase("streamindex_topk V4.1 r=1", label, fn_for_chip, specs, model, tags)


def _candidate_source(*arrays, exact: bool, **knobs):
    """``v41_scores.index_select_v41(*arrays, **knobs)`` (exact whatever ``exact`` says)."""
    del exact
    return v41_scores.index_select_v41(*arrays, **knobs)


def _last_as_candidates(entry, *arrays, **knobs):
    """``entry(*arrays[:-1], candidates=arrays[-1], **knobs)``: a compile case's specs are
    positional."""
    return entry(*arrays[:-1], candidates=arrays[-1], **knobs)


def v41_long_cases(quick: bool) -> list[aot.CompileCase]:
    """``V41_LONG_SHAPES`` x ``V41_KEY_FORMATS`` (approximate top-k; quick: the 4 x 1M decode
    with bf16 keys alone)."""
    return [v41_long_case(name, fmt) for name, v in V41_LONG_SHAPES.items()
            for fmt in V41_KEY_FORMATS if not quick or (v[4] and fmt == "bf16")]


def compile_cases(quick: bool) -> list[aot.CompileCase]:
    """Every indexer compile case: token then page top-k, then the V4 compressed-key indexer
    (the V4.1 long rows, ``v41_long_cases``, are compiled by ``scripts/cost/v41_long_rows.py``
    and ``tests/test_v41_long_rows.py``, not here: 1M-entry rows)."""
    return token_cases(quick) + page_cases(quick) + v4_cases(quick)
