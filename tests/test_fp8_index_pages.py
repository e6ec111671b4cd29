"""The fp8 index pages (issue 30; ``reference.formats.fp8_index_pages``,
``pallas_kernels.indexer.fp8_pages``): the ``Fp8IndexCache``'s rule 1 codes and f32 scales in
one ``u8[P, G, 4, 128]`` array per page. The format holds exactly what
``fp8_cache.quantize_index_rows`` gives (random keys and hand cases at the rounding
boundaries, both ``scale_fmt``), the Pallas indexer reading it (strict interpreter, NaN bytes in
every slot no row may read) returns the ``Fp8IndexCache`` path's scores and top-k bit for bit,
its interpreter-counted bytes and DMAs equal the traffic model's (one DMA per page, half the
``Fp8IndexCache``'s), and it AOT-compiles for every chip at the V4-Flash decode shape with no
copy of the cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, chips
from pallas_kernels.indexer import fp8_pages, token
from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.fp8_pages_topk import (
    streamindex_scores_fp8_pages,
    streamindex_topk_fp8_pages,
    traffic,
)
from pallas_kernels.measure import interpret_counter as counter
from reference.formats import fp8_cache
from reference.formats import fp8_index_pages as fip
from reference.quant import fp8

D = fp8.INDEX_HEAD_DIM


def _bits(x, dtype=np.uint32):
    return np.asarray(x).view(dtype)


# ------------------------------------------------------------------------------- the format

def _boundary_keys(rng, ps):
    """Pages of keys whose rows sit on the rule's edges: amax exactly ``448 * 2**k`` and an ulp
    either side (the ue8m0 scale's ceiling), values halfway between e4m3 codes (RNE), the amax
    floor ``1e-4`` and below it, -0.0, subnormal e4m3 codes, bf16-exact randoms, NaN, +-inf."""
    rows = []
    for k in (-3, 0, 5):
        top = np.float32(448.0 * 2.0 ** k)
        for amax in (np.nextafter(top, 0, dtype=np.float32), top,
                     np.nextafter(top, np.inf, dtype=np.float32)):
            r = rng.standard_normal(D).astype(np.float32) * amax / 8
            r[3] = amax
            r[4] = np.float32(2.0 ** k) * np.float32(1.0 + 2.0 ** -4)  # halfway: e4m3 has 3 bits
            r[5] = np.float32(2.0 ** k) * np.float32(1.0 + 3 * 2.0 ** -4)
            rows.append(r)
    rows.append(np.full(D, 1e-4, np.float32))
    rows.append(np.full(D, 3e-5, np.float32) * np.sign(rng.standard_normal(D)))
    z = np.zeros(D, np.float32)
    z[::2] = -0.0
    rows.append(z)
    sub = rng.standard_normal(D).astype(np.float32)
    sub[0], sub[1] = 448.0, 2.0 ** -9  # e4m3 subnormal code at scale 1
    rows.append(sub)
    nan = rng.standard_normal(D).astype(np.float32)
    nan[7] = np.nan
    rows.append(nan)
    inf = rng.standard_normal(D).astype(np.float32)
    inf[9] = -np.inf
    rows.append(inf)
    keys = rng.standard_normal((2 * ps, D)).astype(np.float32) * np.exp(
        rng.uniform(-6, 6, (2 * ps, 1))).astype(np.float32)
    keys[:len(rows)] = np.stack(rows)
    return keys.reshape(2, ps, D)


@pytest.mark.parametrize("ps", [8, 160])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_pages_hold_the_rule_bit_for_bit(ps, scale_fmt):
    """The pages' codes and scales are ``quantize_index_rows``' bits; the dequantized keys are
    ``dequantize_index_cache``'s bits; the ``Fp8IndexCache`` bit moves are exact inverses."""
    rng = np.random.default_rng()
    keys = jnp.asarray(_boundary_keys(rng, ps))
    pages = fip.quantize_index_pages(keys, scale_fmt=scale_fmt)
    assert pages.shape == (2, fip.page_groups(ps), 4, 128) and pages.dtype == jnp.uint8
    k8, s = fip.split_index_pages(pages)
    want_k8, want_s = fp8_cache.quantize_index_rows(keys, scale_fmt=scale_fmt)
    np.testing.assert_array_equal(_bits(k8, np.uint8), _bits(want_k8, np.uint8))
    np.testing.assert_array_equal(_bits(s), _bits(want_s))
    deq = fip.dequantize_index_pages(pages)
    np.testing.assert_array_equal(_bits(deq), _bits(want_k8.astype(jnp.float32)
                                                    * want_s[..., None]))
    if ps % fp8_cache.INDEX_PAGE_MULTIPLE == 0:
        cache = fp8_cache.quantize_index_cache(keys, scale_fmt=scale_fmt)
        np.testing.assert_array_equal(np.asarray(fip.from_index_cache(cache)),
                                      np.asarray(pages))
        np.testing.assert_array_equal(_bits(deq), _bits(fp8_cache.dequantize_index_cache(cache)))
        back = fip.to_index_cache(pages)
        np.testing.assert_array_equal(_bits(back.scales), _bits(cache.scales))
        np.testing.assert_array_equal(_bits(back.keys, np.uint8), _bits(cache.keys, np.uint8))
    # the documented byte positions: token t's scale byte i at [ps // 4 + t // 128, i, t % 128]
    t = ps - 1
    got = np.asarray(pages)[1, ps // 4 + t // 128, :, t % 128]
    assert got.tobytes() == np.asarray(want_s)[1, t].astype("<f4").tobytes()
    assert np.asarray(pages)[1, t // 4, t % 4].tobytes() == _bits(want_k8, np.uint8)[1, t].tobytes()


def test_bit_moves_keep_nan_payloads():
    rng = np.random.default_rng()
    k8 = rng.integers(0, 256, (3, 32, D), dtype=np.uint8).view(fp8.FP8_DTYPE)
    s = rng.integers(0, 2 ** 32, (3, 32), dtype=np.uint32)
    s[0, :4] = [0x7FC00001, 0xFF800000, 0x80000000, 0x7F800000]  # NaN payload, -inf, -0, inf
    pages = fip.pages_from_parts(jnp.asarray(k8), jnp.asarray(s.view(np.float32)))
    k8b, sb = fip.split_index_pages(pages)
    np.testing.assert_array_equal(_bits(k8b, np.uint8), k8.view(np.uint8))
    np.testing.assert_array_equal(_bits(sb), s)


def test_writer_stores_the_rule_and_drops_outside():
    rng = np.random.default_rng()
    ps, pages_n = 64, 3
    keys = jnp.asarray(rng.standard_normal((pages_n, ps, D)), jnp.bfloat16)
    full = fip.quantize_index_pages(keys)
    page_id = np.repeat(np.arange(pages_n), ps)
    offset = np.tile(np.arange(ps), pages_n)
    order = rng.permutation(pages_n * ps)
    empty = jnp.zeros_like(full)
    got = fip.write_index_pages(empty, page_id[order], offset[order],
                                keys.reshape(-1, D)[order])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full))
    junk = jnp.ones((4, D), jnp.float32)
    same = fip.write_index_pages(got, [-1, pages_n, 0, 1], [0, 0, -1, ps], junk)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(got))
    stacked = jnp.stack([empty, empty])
    one = fip.write_index_pages(stacked, page_id, offset, keys.reshape(-1, D), layer=1)
    np.testing.assert_array_equal(np.asarray(one[1]), np.asarray(full))
    assert not np.asarray(one[0]).any()


def test_refusals_name_the_numbers():
    with pytest.raises(ValueError, match="multiple of 4"):
        fip.quantize_index_pages(jnp.zeros((1, 6, D)))
    with pytest.raises(ValueError, match="34 groups"):
        fip.check_index_pages("pages", jnp.zeros((1, 34, 4, 128), jnp.uint8))
    with pytest.raises(TypeError, match="uint8"):
        fip.check_index_pages("pages", jnp.zeros((1, 17, 4, 128), jnp.int32))
    assert [fip.page_size_of(fip.page_groups(p)) for p in (4, 64, 128, 132, 512)] == [
        4, 64, 128, 132, 512]
    assert [fip.bytes_per_token(p) for p in (32, 64, 128, 256)] == [144, 136, 132, 132]
    for ps in (32, 64, 96, 128, 256):  # the same bytes as the Fp8IndexCache, at every page size
        assert fip.bytes_per_token(ps) == fp8_cache.index_bytes_per_token(ps)


# ------------------------------------------------------------------------------- the kernel

H, PS, PPS, NUM_PAGES = 2, 32, 4, 12  # capacity 128: whole lanes (the model's score rows)
NAN = 0xFF  # e4m3fn NaN code; 0xFFFFFFFF: an f32 NaN scale


def make_case(rng, *, q_lens, seq_lens, ratio=1, pad_row=True, scale_fmt="ue8m0"):
    """Indexer arguments with both caches (``Fp8IndexCache``, the same bytes as pages): every
    slot no row may read (unused pages, slots past a sequence's entries) holds NaN codes and a
    NaN scale; a padding sequence and (``pad_row``) a padding row (NaN q) at the end."""
    table = np.full((len(q_lens) + 1) * PPS, 10 ** 6, np.int32)
    perm = rng.permutation(NUM_PAGES)
    keys = rng.standard_normal((NUM_PAGES, PS, D)) * np.exp(rng.uniform(-3, 3, (NUM_PAGES, PS, 1)))
    cache = fp8_cache.quantize_index_cache(jnp.asarray(keys, jnp.float32), scale_fmt=scale_fmt)
    k8 = np.asarray(cache.keys).view(np.uint8).copy()
    sc = np.asarray(cache.scales).view(np.uint32).copy()
    used = np.zeros((NUM_PAGES, PS), bool)
    p_next = 0
    for s, n_tok in enumerate(seq_lens):
        n_ent = n_tok // ratio
        n_pages = -(-n_ent // PS)
        table[s * PPS:s * PPS + n_pages] = perm[p_next:p_next + n_pages]
        p_next += n_pages
        for j in range(n_ent):
            used[table[s * PPS + j // PS], j % PS] = True
    k8[~used] = NAN
    sc[:, :PS][~used] = 0xFFFFFFFF
    cache = fp8_cache.Fp8IndexCache(jnp.asarray(k8.view(fp8.FP8_DTYPE)),
                                    jnp.asarray(sc.view(np.float32)))
    t = sum(q_lens) + pad_row
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    sl = np.concatenate([seq_lens, [5]]).astype(np.int32)
    q = rng.standard_normal((t, H, D)).astype(np.float32)
    if pad_row:
        q[-1] = np.nan
    w = rng.standard_normal((t, H)).astype(np.float32)
    dist = np.array([0, 0, len(q_lens)], np.int32)
    cu_kv = np.arange(len(q_lens) + 2, dtype=np.int32) * PPS * PS  # slots start at s * PPS
    meta = tuple(jnp.asarray(x) for x in (sl, table, cu, cu_kv, dist))
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(w)), cache, fip.from_index_cache(cache), meta


def test_scores_equal_the_fp8_cache_path():
    """Prefill rows (9 and 6, row blocks of 4 and 1) and a decode row: the same f32 scores bit
    for bit, ``-inf`` where the fp8 cache path has it; none NaN (every NaN slot unread)."""
    qw, cache, pages, meta = make_case(np.random.default_rng(), q_lens=[9, 1, 6],
                                       seq_lens=[40, 93, 22])
    kw = dict(pages_per_seq=PPS, block_rows=4, block_pages=1, interpret=True)
    want = np.asarray(token.streamindex_scores(*qw, cache, *meta, **kw))
    got = np.asarray(streamindex_scores_fp8_pages(*qw, pages, *meta, **kw))
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.isnan(got).any() and np.isfinite(got[:-1]).sum() > 100


def test_topk_bytes_and_dmas_equal_the_model():
    """Compressed decode (ratio 4, one row per sequence) under the interpreter's counter, the
    pages read in place from layer 1 of a stack: the top-k is the fp8 cache path's; the counted
    bytes (lane padded) equal the model's, and the counted descriptors too: one DMA per fetched
    page, one per score row, the q and weight blocks (the fp8 cache: one more per page, its
    scale row)."""
    ratio, q_lens, seq_lens = 4, [1, 1, 1], [380, 17, 200]
    qw, cache, pages, meta = make_case(np.random.default_rng(), q_lens=q_lens,
                                       seq_lens=seq_lens, ratio=ratio,
                                       scale_fmt=None)  # f32 scales, not powers of two
    blocks = resolve_blocks(None, block_rows=1, block_pages=2, chip=None,
                            one_token_per_seq=True, pages_per_seq=PPS)
    run = dict(k=8, pages_per_seq=PPS, block_rows=blocks.block_rows,
               block_pages=blocks.block_pages, exact=True, compression_ratio=ratio,
               one_token_per_seq=True, interpret=pltpu.InterpretParams(dma_execution_mode="eager"))
    stack = jnp.stack([jnp.full_like(pages, NAN), pages])  # layer 0 all NaN: never read
    with counter.count_hbm_traffic() as mine:
        got = np.asarray(streamindex_topk_fp8_pages(*qw, stack, *meta, **run, layer=1))
    with counter.count_hbm_traffic() as theirs:
        want = np.asarray(token.streamindex_topk(*qw, cache, *meta, **run))
    np.testing.assert_array_equal(got, want)
    assert (got[:-1, 0] >= 0).all() and (got[-1] == -1).all()
    model = traffic(q_lens, seq_lens, heads=H, page_size=PS,  # the active sequences
                          pages_per_seq=PPS, q_itemsize=2, blocks=blocks,
                          one_token_per_seq=True, compression_ratio=ratio)
    assert mine.dmas_unexecuted == 0
    assert mine.bytes(lane_padded=True) == model.bytes_moved
    assert mine.descriptors == model.dmas
    assert theirs.bytes(lane_padded=True) == model.bytes_moved  # the same bytes
    page_dmas = mine.count("hbm", "vmem", kind="dma")
    assert theirs.count("hbm", "vmem", kind="dma") == 2 * page_dmas > 0
    assert theirs.descriptors == model.dmas + page_dmas


def test_entry_refusals_name_the_numbers():
    """Refused before any kernel runs: a layer outside the stack, pages that are not bytes, a
    page size the Fp8IndexCache checks refuse (not a multiple of 32)."""
    qw, _, pages, meta = make_case(np.random.default_rng(), q_lens=[1], seq_lens=[8])
    kw = dict(k=2, pages_per_seq=PPS, interpret=True)
    with pytest.raises(ValueError, match=r"layer=2 is outside \[0, 2\)"):
        streamindex_topk_fp8_pages(*qw, jnp.stack([pages, pages]), *meta, **kw, layer=2)
    with pytest.raises(TypeError, match="uint8"):
        streamindex_topk_fp8_pages(*qw, pages.astype(jnp.int8), *meta, **kw)
    small = fip.quantize_index_pages(jnp.zeros((NUM_PAGES, 16, D)))
    with pytest.raises(ValueError, match="multiple of 32"):
        streamindex_topk_fp8_pages(*qw, small, *meta, **kw)


# ------------------------------------------------------------------------------- AOT gate

GATE_ROWS, GATE_TOKENS, GATE_RATIO, GATE_K, GATE_HEADS, GATE_PAGE = 64, 8192, 4, 512, 64, 64


def _gate_fn(q, w, pages, seq_lens, table, cu_q, cu_kv, dist):
    pps = table.shape[0] // seq_lens.shape[0]
    return streamindex_topk_fp8_pages(q, w, pages, seq_lens, table, cu_q, cu_kv, dist,
                                      k=_gate_fn.k, pages_per_seq=pps, one_token_per_seq=True,
                                      compression_ratio=_gate_fn.ratio, chip=_gate_fn.chip)


def _gate_specs(tokens: int, ratio: int, q_dtype) -> list:
    pps = tokens // ratio // GATE_PAGE
    num_pages = GATE_ROWS * pps
    i32 = jnp.int32
    return [jax.ShapeDtypeStruct((GATE_ROWS, GATE_HEADS, D), q_dtype),
            jax.ShapeDtypeStruct((GATE_ROWS, GATE_HEADS), jnp.float32),
            jax.ShapeDtypeStruct((num_pages, *fp8_pages.page_shape(GATE_PAGE)), jnp.uint8),
            jax.ShapeDtypeStruct((GATE_ROWS,), i32),
            jax.ShapeDtypeStruct((GATE_ROWS * pps,), i32),
            jax.ShapeDtypeStruct((GATE_ROWS + 1,), i32),
            jax.ShapeDtypeStruct((GATE_ROWS + 1,), i32), jax.ShapeDtypeStruct((3,), i32)]


@pytest.mark.kernel_gate
def test_compiles_on_every_chip_without_a_cache_copy():
    """V4-Flash decode (64 rows x 8192 tokens, 2048 entries in pages of 64, k = 512): compiles
    for each chip, the cache read in place (no cache-sized op in the HLO but its parameter);
    and V3.2's decode (64 x 4096, k = 2048) with an fp8 q on the newest chip (its fp8 MXU)."""
    cases = [(chip, GATE_TOKENS, GATE_RATIO, GATE_K, jnp.bfloat16) for chip in chips.NAMES]
    cases.append((chips.NEWEST, 4096, 1, 2048, fp8.FP8_DTYPE))
    for chip, tokens, ratio, k, q_dtype in cases:
        specs = _gate_specs(tokens, ratio, q_dtype)
        dims = ",".join(str(d) for d in specs[2].shape)
        cache_sized = re.compile(r"=\s*\(?u8\[(1,)?" + dims + r"\]")
        _gate_fn.chip, _gate_fn.ratio, _gate_fn.k = chip, ratio, k
        text = aot.aot_compile(_gate_fn, specs, chip, "fp8 index pages decode").as_text()
        producers = [ln for ln in text.splitlines() if cache_sized.search(ln)
                     and not re.search(r"\b(parameter|bitcast)\(", ln)]
        assert not producers, (chip, producers[:3])
        assert "tpu_custom_call" in text and any(cache_sized.search(ln)
                                                 for ln in text.splitlines()), chip


# ------------------------------------------------------------------------------- the public ops

def test_public_ops_take_the_pages_on_both_implementations():
    """``dsa_jax.indexer_topk`` / ``page_topk`` take the pages (bare bytes, stacked at layer 1;
    and an ``IndexPages``): the jnp path and the Pallas path (strict interpreter: the token
    top-k reads the pages as stored) return the ``Fp8IndexCache`` call's results exactly; with
    ``validate=True`` too (jnp path); a layer outside the stack and a non-page byte array are
    refused naming the numbers."""
    import dsa_jax

    qw, cache, pages, meta = make_case(np.random.default_rng(), q_lens=[5, 1, 3],
                                       seq_lens=[40, 93, 22])
    stack = jnp.stack([jnp.full_like(pages, NAN), pages])  # layer 0 all NaN: never read
    kw = dict(k=8, pages_per_seq=PPS, exact=True)
    for impl in ("xla", "pallas"):
        want = np.asarray(dsa_jax.indexer_topk(*qw, cache, *meta, **kw, implementation=impl))
        got = dsa_jax.indexer_topk(*qw, stack, *meta, **kw, implementation=impl, layer=1)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert (want[:-1, 0] >= 0).all() and (want[-1] == -1).all()
        if impl == "xla":  # validate: the batch rules under checkify, the same call
            got = dsa_jax.indexer_topk(*qw, fip.IndexPages(pages), *meta, **kw,
                                       implementation=impl, validate=True)
            np.testing.assert_array_equal(np.asarray(got), want)
    # page top-k: the references read the pages as their Fp8IndexCache (the Pallas page entry
    # too, after the same bit move: not run again here)
    pkw = dict(k_pages=2, pages_per_seq=PPS, exact=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(dsa_jax.page_topk(*qw, pages, *meta, **pkw)),
                                  np.asarray(dsa_jax.page_topk(*qw, cache, *meta, **pkw)))
    with pytest.raises(ValueError, match=r"layer=2 is outside \[0, 2\)"):
        dsa_jax.indexer_topk(*qw, stack, *meta, **kw, layer=2)
    with pytest.raises(ValueError, match="lanes per group"):
        dsa_jax.indexer_topk(*qw, pages[..., :64], *meta, **kw)
