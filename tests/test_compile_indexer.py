"""Compile gate of the Pallas indexer kernels: AOT Mosaic compiles (non-interpret) of both entries
for v5e, v6e and tpu7x at the DeepSeek-V3.2 indexer shapes (H=64, D=128, page 64, k=2048) and at
DeepSeek-V4's compressed-key indexer (``compression_ratio=4``, pages of 64 entries, k=512 Flash /
1024 Pro; ``compile_cases.V4_SHAPES``), on a CPU-only machine (libtpu topologies). A failure
names the chip, the shape and Mosaic's message. Also: the traffic model's decode shapes move
<= 1.15x the minimum HBM bytes.

Compile time is XLA's TPU top-k in the selection stage (k = 2048 over thousands of columns:
15-40 s a program on this machine), not Mosaic. A kernel variant of a shape (fp8 keys, an fp8
q, ``fp4_sim``, bf16 scores) has the selection stage of its base case (same entry, shape and k:
the stage sees f32 scores of the same shape), so the variant compiles its entry's scoring
program (``streamindex_scores``: the glue before the kernel, the kernel, its score layout) on
every chip, and the base case compiles the whole entry, selection included, on every chip. A
variant without a base case (the V4 page entry's fp4_sim mixed batch and bf16 decode) compiles
whole."""

from __future__ import annotations

import functools

import pytest

from pallas_kernels import aot, chips, streamindex_topk
from pallas_kernels.indexer import blocks as iblocks
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.indexer.page import streamindex_page_topk
from pallas_kernels.indexer.token import streamindex_scores
from pallas_kernels.measure import xla_cost
from tests import glue_gates
from tests.chip_turns import on_every_chip

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

CASES = icases.compile_cases(quick=True)
VARIANTS = (" fp8 keys", " fp8 q", " fp4_sim", " bf16 scores")  # kernel-side variants of a shape


def _base_shape(shape: str) -> str:
    for suffix in VARIANTS:
        shape = shape.replace(suffix, "")
    return shape


_WHOLE = {(c.kernel, c.shape) for c in CASES if _base_shape(c.shape) == c.shape}


def _scores_only(case) -> bool:
    """A kernel variant whose base case (same entry and shape, so the same selection stage)
    compiles the whole entry."""
    return case.shape != _base_shape(case.shape) and (case.kernel,
                                                      _base_shape(case.shape)) in _WHOLE


def compile_gate(case, chip, fn=None):
    """The whole entry, or (``_scores_only``) its scoring program: the same knobs and blocks,
    without the selection stage its base case compiles."""
    fn = fn or case.fn_for_chip(chip)
    if not _scores_only(case):
        return aot.aot_compile(fn, case.specs, chip, f"{case.kernel} {case.shape}")
    kw = {k: v for k, v in fn.keywords.items() if k not in ("k", "k_pages")}
    scores = functools.partial(streamindex_scores, page_mode=fn.func is streamindex_page_topk,
                               **kw)
    return aot.aot_compile(scores, case.specs, chip, f"{case.kernel} {case.shape} (scores)")


def test_every_variant_without_a_base_case_compiles_whole():
    scored = [c for c in CASES if _scores_only(c)]
    assert len(scored) >= 10 and all(c.shape != _base_shape(c.shape) for c in scored)
    whole_variants = {c.shape for c in CASES if c.shape != _base_shape(c.shape)} - {
        c.shape for c in scored}
    assert whole_variants == {"V4-Pro mixed 60x1@8192 + 512@32768 k=1024 pages fp4_sim",
                              "V4-Flash decode 64x8192 (2048 entries) k=512 pages bf16 scores"}
    assert {c.kernel for c in CASES if not _scores_only(c)} == {c.kernel for c in CASES}


@pytest.mark.parametrize("case,chip", on_every_chip(CASES, lambda c: f"{c.kernel}[{c.shape}]"))
def test_compiles_for_tpu(case, chip):
    try:
        compiled = compile_gate(case, chip)
    except aot.CompileError as e:  # chip, shape and Mosaic's message, whole
        pytest.fail(str(e), pytrace=False)
    if case.kernel == "streamindex_topk r=4" and case.shape == glue_gates.INDEXER_FLASH:
        glue_gates.assert_glue("indexer", chip, xla_cost.analyze(compiled))  # issue 30


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
@pytest.mark.parametrize("case", [c for c in CASES if "decode" in c.tags],
                         ids=lambda c: f"{c.kernel}[{c.shape}]")
def test_decode_moves_at_most_115_percent_of_the_minimum_bytes(case, chip):
    t = case.traffic(chip)
    assert t.ratio <= 1.15, (f"{case.kernel} {case.shape} on {chip}: moves {t.bytes_moved} B, "
                             f"minimum {t.bytes_min} B, ratio {t.ratio:.3f}")
    assert t.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes // 2


@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_decode_dma_descriptors_per_row_are_one_per_key_page_plus_three(chip):
    """The model's DMA descriptors per decode row (``traffic``, equal to the interpreter's
    count in ``tests/test_hbm_traffic.py``), from the layout: one per causal key page (two with
    the fp8 index cache: the page's keys and its scale row), one score row out, the q block
    and the weight column in. V3.2 64 x 4096: 64 pages, 67 per row (fp8: 131); V4 8192
    tokens at ratio 4: 32 pages of 64 entries, 35 per row (fp8: 67)."""
    shapes = {name: v[:2] for name, v in [*icases.GATE_SHAPES.items(),
                                          *icases.V4_SHAPES.items()]}
    for case in [c for c in CASES if "decode" in c.tags]:
        rows = case.specs[0].shape[0]
        q_lens, kv_lens = shapes[_base_shape(case.shape).removesuffix(" pages")]
        ratio = icases.V4_RATIO if "v4" in case.tags else 1
        assert set(q_lens) == {1} and len(q_lens) == rows
        page_dmas = 2 if "fp8 keys" in case.shape else 1
        want = sum(-(-kv // ratio // icases.GATE_PAGE) * page_dmas + 1 + 2 for kv in kv_lens)
        assert 0 < case.traffic(chip).dmas == want, (case.shape, case.traffic(chip))


def test_the_gate_holds_v4_flash_and_pro_compressed_key_cases():
    v4 = [c for c in CASES if "v4" in c.tags]
    assert {c.shape.split()[0] for c in v4} == {"V4-Flash", "V4-Pro"}
    assert {"decode", "mixed"} <= {t for c in v4 for t in c.tags}
    flash = next(c for c in v4 if c.shape.startswith("V4-Flash decode"))
    assert flash.fn_for_chip(chips.DEFAULT).keywords["compression_ratio"] == icases.V4_RATIO == 4
    assert flash.fn_for_chip(chips.DEFAULT).keywords["k"] == 512
    assert flash.specs[2].shape == (64 * 32, 64, 128)  # 8192 tokens = 2048 entries = 32 pages


def test_compile_error_names_chip_shape_and_mosaic_message():
    # A deliberately untileable kernel: a 16-row DMA into an HBM slice at an offset Mosaic cannot
    # prove a multiple of 8 (the error the indexer's single-row output DMAs avoid).
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(off_ref, x_ref, o_hbm, sem):
        cp = pltpu.make_async_copy(x_ref, o_hbm.at[pl.ds(off_ref[0], 16)], sem.at[0])
        cp.start()
        cp.wait()

    def fn(off, x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 1024), jnp.float32),
                              grid_spec=pltpu.PrefetchScalarGridSpec(
                                  num_scalar_prefetch=1, grid=(1,),
                                  in_specs=[pl.BlockSpec((16, 1024), lambda i, *_: (0, 0))],
                                  out_specs=pl.BlockSpec(memory_space=pltpu.HBM),
                                  scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]))(off, x)

    specs = [jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16, 1024), jnp.float32)]
    with pytest.raises(aot.CompileError, match=rf"\[{chips.OLDEST}\] toy 64x1024: .*aligned"):
        aot.aot_compile(fn, specs, chips.OLDEST, "toy 64x1024")


def test_an_aot_compile_writes_nothing_to_the_persistent_cache():
    """``aot.compiling_on`` (every AOT compile's context) skips the persistent-cache write of
    the compile and leaves the cache on: a TPU executable written there cannot be loaded back
    by libtpu's compile-only client, so the second compile of a program warned "Error reading
    persistent compilation cache entry" and compiled again (the suite runs with a cache,
    ``tests/conftest.py``). An XLA:CPU compile first, as in a worker: the cache is in use."""
    import warnings

    import jax
    import jax.numpy as jnp
    from jax._src import config as jax_config

    jax.block_until_ready(jax.jit(lambda x: x + 1.0)(jnp.ones(3)))
    before = jax_config.persistent_cache_min_compile_time_secs.value
    with aot.compiling_on(aot.topology_device(chips.OLDEST)):
        assert jax_config.persistent_cache_min_compile_time_secs.value == aot.NO_CACHE_WRITE_SECS
    assert jax_config.persistent_cache_min_compile_time_secs.value == before
    assert jax.config.jax_enable_compilation_cache
    specs = [jax.ShapeDtypeStruct((8, 128), jnp.float32)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            aot.aot_compile(lambda x: jnp.tanh(x) * 5.0, specs, chips.OLDEST, "toy tanh")
    assert not [w for w in caught if "compilation cache" in str(w.message)], \
        [str(w.message)[:200] for w in caught]


# Small pages on a mixed batch (the CLI's `--quick --dsa-use-pallas` uses page 16): token-mode
# stages narrower than 128 lanes failed Mosaic on every chip (scripts/cost/compile_grid.py); the
# entry widens them (pallas_kernels.indexer.blocks.resolve_blocks), so every block choice compiles.
# Every choice has 512 score columns (64 pages of 8 ... 8 of 64) and k = 128, so one selection
# stage: the first choice compiles the whole entry on each chip, the others its scoring program
# (``streamindex_scores``: the same knobs, blocks and kernel, without the stage).
SMALL_PAGES = [(8, None), (16, None), (16, 2), (32, 1), (64, 1)]


@pytest.mark.parametrize("pages,chip", on_every_chip(SMALL_PAGES, lambda p: f"{p[0]}-{p[1]}"))
def test_token_topk_with_small_pages_compiles_on_a_mixed_batch(chip, pages):
    page_size, block_pages = pages
    q_lens, kv_lens = [1, 1, 1, 32], [300, 77, 512, 512]
    specs, pps = icases.gate_specs(q_lens, kv_lens, heads=8, page_size=page_size)
    assert pps * page_size == 512
    kw = dict(pages_per_seq=pps, block_pages=block_pages, chip=chip)
    whole = (page_size, block_pages) == SMALL_PAGES[0]
    fn = (functools.partial(streamindex_topk, k=128, **kw) if whole
          else functools.partial(streamindex_scores, **kw))
    try:
        aot.aot_compile(fn, specs, chip, f"page {page_size} block_pages {block_pages}")
    except aot.CompileError as e:
        pytest.fail(str(e), pytrace=False)
    widened = iblocks.resolve_blocks(None, block_rows=None, block_pages=block_pages, chip=chip,
                                     one_token_per_seq=False, pages_per_seq=pps,
                                     page_size=page_size, mosaic=True)
    assert widened.block_pages * page_size % 128 == 0
