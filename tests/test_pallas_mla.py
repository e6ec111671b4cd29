"""Pallas sparse MLA kernels (token- and page-sparse) in strict interpret mode (race detection,
NaN-filled uninitialised memory, out-of-bounds reads raising), against the jnp references and
the float64 oracle, on randomized ragged batches whose unowned cache slots are NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import page_sparse_mla, sparse_mla
from pallas_kernels.mla import blocks as mla_blocks
from reference import attend, batch, packed_cache
from reference.page_sparse_mla import page_sparse_mla_ref
from reference.sparse_mla import sparse_mla_ref
from tests import batches
from tests.oracle import mla_oracle

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

SCALE = 0.125
TOL = {"f32": 1e-5, "bf16": 2e-2}
BIG = np.iinfo(np.int32).max


def junk_token_topk(rng, b, k: int, *, dup: bool = True) -> np.ndarray:
    """Per row: valid offsets (some duplicated), then -1, >= kv_len, huge and negative junk,
    shuffled so junk sits between valid entries."""
    t = b.q.shape[0]
    cap = b.pages_per_seq * b.page_size
    rows = np.full((t, k), -1, np.int32)
    seq_of = np.searchsorted(b.cu_q_lens[1:], np.arange(t), side="right")
    for r in range(t):
        kv = int(b.seq_lens[min(seq_of[r], len(b.seq_lens) - 1)])
        n = rng.integers(0, min(kv, k - 4) + 1)
        valid = rng.choice(max(kv, 1), size=n, replace=False) if kv else np.zeros(0, int)
        if dup and n > 1:
            valid[-1] = valid[0]  # a duplicate counts twice
        junk = [-1, kv + rng.integers(0, cap), BIG, -BIG - 1, -7]
        row = np.concatenate([valid, rng.choice(junk, size=k - n)])
        rows[r] = rng.permutation(row)
    return rows


def junk_page_topk(rng, b, k_pages: int) -> np.ndarray:
    t = b.q.shape[0]
    pps = b.pages_per_seq
    pool = np.concatenate([np.arange(pps), [-1, pps, pps + 3, BIG, -BIG - 1]])
    return rng.choice(pool, size=(t, k_pages)).astype(np.int32)


def as_dtype(b, dtype):
    q = jnp.asarray(b.q, dtype)
    cache = jnp.asarray(b.cache, dtype)
    return q, cache


def check_against_oracle(out, lse, q, cache, b, sel, *, v_dim, page, tol):
    """out/lse vs the float64 oracle on the (possibly bf16-rounded) inputs."""
    ref_out, ref_lse = mla_oracle(np.asarray(q, np.float32), np.asarray(cache, np.float32),
                                  b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens,
                                  b.distribution, sm_scale=SCALE, v_dim=v_dim,
                                  pages_per_seq=b.pages_per_seq, page=page)
    out = np.asarray(out, np.float64)
    scale = max(np.abs(ref_out).max(), 1.0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol * scale)
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)


def run_token(b, sel, *, dtype, fmt, v_dim, block=8, heads_ok=True):
    q, cache = as_dtype(b, dtype)
    plain = cache
    if fmt == "packed":
        cache = packed_cache.pack_cache(cache)
    meta = (b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=v_dim, return_lse=True)
    out, lse = sparse_mla(q, cache, *meta, **kw, tokens_per_block=block, interpret=True)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:2], v_dim)
    ref_out, ref_lse = sparse_mla_ref(q, plain, *meta, **kw)
    tol = TOL["f32" if dtype == jnp.float32 else "bf16"]
    scale = max(float(jnp.abs(ref_out.astype(jnp.float32)).max()), 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=tol, atol=tol * scale)
    check_against_oracle(out, lse, q, plain, b, sel, v_dim=v_dim, page=False, tol=tol)
    return out, lse


def run_page(b, sel, *, dtype, fmt, v_dim, block=2):
    q, cache = as_dtype(b, dtype)
    plain = cache
    if fmt == "packed":
        cache = packed_cache.pack_cache(cache)
    meta = (b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=v_dim, return_lse=True)
    out, lse = page_sparse_mla(q, cache, *meta, **kw, pages_per_block=block, interpret=True)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:2], v_dim)
    ref_out, _ = page_sparse_mla_ref(q, plain, *meta, **kw)
    tol = TOL["f32" if dtype == jnp.float32 else "bf16"]
    scale = max(float(jnp.abs(ref_out.astype(jnp.float32)).max()), 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=tol, atol=tol * scale)
    check_against_oracle(out, lse, q, plain, b, sel, v_dim=v_dim, page=True, tol=tol)
    return out, lse


# (dtype, cache format, dim, v_dim): f32 rows; the packed bf16 cache at D=128 (one half used)
# and D=256 (both halves: the split at packed_words(D) = 128); the plain bf16 slow path.
FORMATS = [(jnp.float32, "f32", 128, 96), (jnp.bfloat16, "packed", 256, 192),
           (jnp.bfloat16, "packed", 128, 64), (jnp.bfloat16, "bf16", 256, 160)]


# Every scenario in f32; the bf16 formats on the multi-token ones (decode-only batches are in
# the mixed one), to keep the strict interpreter's time in CI small.
SCENARIO_CASES = ([(n, 0) for n in sorted(batches.SCENARIOS)]
                  + [("prefill", 1), ("mixed_padding", 1), ("mtp", 1)])


@pytest.mark.parametrize("name,fmt_index", SCENARIO_CASES)
def test_token_sparse_matches_reference_and_oracle(name, fmt_index):
    dtype, fmt, dim, v_dim = FORMATS[fmt_index]
    b = batches.scenario(name, 11 + fmt_index, num_heads=4, dim=dim)
    sel = junk_token_topk(np.random.default_rng(fmt_index), b, 12)
    run_token(b, sel, dtype=dtype, fmt=fmt, v_dim=v_dim)


@pytest.mark.parametrize("name,fmt_index", [(n, 3 if i else 0) for n, i in SCENARIO_CASES])
def test_page_sparse_matches_reference_and_oracle(name, fmt_index):
    dtype, fmt, dim, v_dim = FORMATS[fmt_index]
    b = batches.scenario(name, 21 + fmt_index, num_heads=4, dim=dim)
    sel = junk_page_topk(np.random.default_rng(fmt_index), b, 4)
    run_page(b, sel, dtype=dtype, fmt=fmt, v_dim=v_dim)


@pytest.mark.parametrize("fmt_index", [2, 3])
def test_token_sparse_bf16_formats(fmt_index):
    dtype, fmt, dim, v_dim = FORMATS[fmt_index]
    b = batches.scenario("mixed_padding", 5, num_heads=8, dim=dim)
    run_token(b, junk_token_topk(np.random.default_rng(5), b, 16), dtype=dtype, fmt=fmt,
              v_dim=v_dim)


def test_page_sparse_packed_cache():
    dtype, fmt, dim, v_dim = FORMATS[1]
    b = batches.scenario("mtp", 6, num_heads=2, dim=dim)
    run_page(b, junk_page_topk(np.random.default_rng(6), b, 4), dtype=dtype, fmt=fmt,
             v_dim=v_dim, block=3)


@pytest.mark.parametrize("heads", [1, 16])
def test_heads_one_and_many(heads):
    b = batches.scenario("mtp", 7, num_heads=heads, dim=128)
    sel = junk_token_topk(np.random.default_rng(heads), b, 12)
    run_token(b, sel, dtype=jnp.float32, fmt="f32", v_dim=128, block=16)
    run_page(b, junk_page_topk(np.random.default_rng(heads), b, 3), dtype=jnp.float32,
             fmt="f32", v_dim=128, block=1)


def test_empty_rows_give_zeros_and_neg_inf_lse():
    b = batches.scenario("mixed_padding", 8, num_heads=4, dim=128)
    sel = junk_token_topk(np.random.default_rng(8), b, 16)
    sel[0] = -1  # a row of an active sequence with no valid entry
    sel[1] = BIG
    out, lse = run_token(b, sel, dtype=jnp.float32, fmt="f32", v_dim=64)
    pad = np.arange(int(b.cu_q_lens[-1]), b.q.shape[0])  # rows outside every sequence
    for r in [0, 1, *pad]:
        assert not np.asarray(out[r]).any()
        assert np.isneginf(np.asarray(lse[r])).all()


def test_duplicates_count_once_per_occurrence():
    b = batches.scenario("decode", 9, num_heads=2, dim=128)
    sel = np.full((b.q.shape[0], 8), -1, np.int32)
    sel[:, :3] = [[0, 0, 0]] * b.q.shape[0]  # token 0 three times
    sel[:, 3] = 0 if b.seq_lens.min() < 2 else 1
    run_token(b, sel, dtype=jnp.float32, fmt="f32", v_dim=128)


def test_selection_wider_than_block_and_not_a_multiple():
    """k = 37 over blocks of 8: four full blocks and a ragged fifth, on every row. The MTP
    scenario (9 rows, kv_lens 12/40/64, so rows hold up to 33 valid entries spread over all five
    blocks) carries the same crossing as the 53-row prefill batch did, at a sixth of the strict
    interpreter's grid steps."""
    b = batches.scenario("mtp", 10, num_heads=2, dim=128)
    rng = np.random.default_rng(10)
    sel = junk_token_topk(rng, b, 37, dup=False)
    run_token(b, sel, dtype=jnp.float32, fmt="f32", v_dim=128, block=8)


def test_bad_page_ids_and_slots_are_skipped_inside_the_kernel():
    """Page ids < 0 or >= num_pages, and a sequence whose page slots lie past the table: the
    kernel's walk (which reads the page table in SMEM) skips exactly what the reference does,
    with valid entries before, between and after the skipped ones in one block."""
    import dataclasses

    # mixed_padding's sequences with the last one 3 rows long, not 17 (12 rows, not 26): the
    # same page table crossings (table entries 1 and 4 inside sequence 0's five pages, sequence
    # 3's slots off the table, padding rows, inactive slots) at half the interpreter's steps.
    b = batches.scenario("mixed_padding_short", 13, num_heads=4, dim=128)
    table = np.array(b.page_indices)
    table[1], table[4] = -3, b.cache.shape[0] + 5
    cu_kv = np.array(b.cu_kv_lens)
    cu_kv[3] = table.shape[0] * b.page_size  # every page slot of sequence 3 is off the table
    b = dataclasses.replace(b, page_indices=table, cu_kv_lens=cu_kv)
    rng = np.random.default_rng(13)
    run_token(b, junk_token_topk(rng, b, 24), dtype=jnp.float32, fmt="f32", v_dim=128, block=8)
    run_page(b, junk_page_topk(rng, b, 5), dtype=jnp.float32, fmt="f32", v_dim=128, block=2)


def test_no_tail_padding_last_page_of_table():
    """The last sequence's last page is the last entry of page_indices (no tail padding)."""
    b = batches.scenario("short_context", 12, num_heads=2, dim=128)
    assert b.page_indices.shape[0] == sum(-(-int(x) // b.page_size)
                                          for x in b.seq_lens[:b.distribution[2]])
    cap = b.pages_per_seq * b.page_size
    sel = np.tile(np.arange(-2, cap + 2, dtype=np.int32), (b.q.shape[0], 1))
    run_token(b, sel, dtype=jnp.float32, fmt="f32", v_dim=128, block=16)


def test_reference_gather_accepts_packed_cache():
    """``reference.attend.attend_selected`` on the packed cache == on the bf16 cache."""
    b = batches.scenario("mtp", 13, num_heads=2, dim=256)
    q, cache = as_dtype(b, jnp.bfloat16)
    sel = jnp.asarray(junk_token_topk(np.random.default_rng(13), b, 10))
    rb = batch.RaggedBatch.of(cache, *(jnp.asarray(x) for x in b.meta()),
                              pages_per_seq=b.pages_per_seq)
    slots, valid = attend.token_slots(sel, rb.rows(q.shape[0]), rb, causal=False)
    # jitted: one XLA:CPU compile per cache format instead of op-by-op dispatch
    attend_selected = jax.jit(attend.attend_selected, static_argnames=("sm_scale", "v_dim"))
    want = attend_selected(q, cache, slots, valid, sm_scale=SCALE, v_dim=200)
    got = attend_selected(q, packed_cache.pack_cache(cache), slots, valid, sm_scale=SCALE,
                          v_dim=200)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(g))


def test_pack_unpack_round_trip_and_halves():
    x = jax.random.normal(jax.random.key(0), (3, 5, 640)).astype(jnp.bfloat16)
    words = packed_cache.pack_cache(x)
    assert words.shape == (3, 5, 384) and words.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(packed_cache.unpack_cache(words, 640)),
                                  np.asarray(x))
    low, high = packed_cache.unpack_words(words)
    np.testing.assert_array_equal(np.asarray(low), np.asarray(x[..., :384], np.float32))
    np.testing.assert_array_equal(np.asarray(high[..., :256]),
                                  np.asarray(x[..., 384:], np.float32))
    assert not np.asarray(high[..., 256:]).any()


# ----------------------------------------------------------------------------- bad arguments


def _small():
    b = batches.scenario("decode", 1, num_heads=2, dim=128)
    sel = np.zeros((b.q.shape[0], 4), np.int32)
    meta = (b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    return b, meta


@pytest.mark.parametrize("op", [sparse_mla, page_sparse_mla])
def test_refuses_latent_dim_not_multiple_of_128(op):
    b = batches.scenario("decode", 1, num_heads=2, dim=96)
    sel = np.zeros((b.q.shape[0], 4), np.int32)
    with pytest.raises(ValueError, match="multiple of 128.*96"):
        op(b.q, b.cache, b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens,
           b.distribution, sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=64)


@pytest.mark.parametrize("op", [sparse_mla, page_sparse_mla])
def test_refuses_packed_cache_of_wrong_width(op):
    b, meta = _small()
    bad = jnp.zeros((*b.cache.shape[:2], 64), jnp.uint32)  # packed_words(128) = 128
    with pytest.raises(ValueError, match="packed_words.*128.*got 64"):
        op(b.q, bad, *meta, sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=64)


@pytest.mark.parametrize("op", [sparse_mla, page_sparse_mla])
def test_refuses_reference_level_mistakes(op):
    b, meta = _small()
    with pytest.raises(ValueError, match="v_dim"):
        op(b.q, b.cache, *meta, sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=129)
    with pytest.raises(ValueError, match="sm_scale"):
        op(b.q, b.cache, *meta, sm_scale=-1.0, pages_per_seq=b.pages_per_seq, v_dim=64)


def test_refuses_bad_block_knobs_and_interpret():
    b, meta = _small()
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=64)
    with pytest.raises(ValueError, match="tokens_per_block.*12"):
        sparse_mla(b.q, b.cache, *meta, **kw, tokens_per_block=12)
    with pytest.raises(ValueError, match="pages_per_block=0"):
        page_sparse_mla(b.q, b.cache, *meta, **kw, pages_per_block=0)
    with pytest.raises(TypeError, match="interpret"):
        sparse_mla(b.q, b.cache, *meta, **kw, interpret="yes")


def test_vmem_estimate_fits_every_chip_at_the_compile_shapes():
    from pallas_kernels import aot, tpu
    from pallas_kernels.mla.kernel import block_shape
    for chip in aot.CHIPS:
        units = mla_blocks.token_block(2048, chip)
        s = block_shape("token", heads=128, dim=640, v_dim=512, page_size=64, units=units,
                        meta_len=2048, q_dtype=jnp.bfloat16, fmt="packed")
        cap = aot.chip_info(chip).vmem_capacity_bytes
        est = mla_blocks.vmem_bytes(s)
        assert 2 * est <= tpu.vmem_limit(est, chip) <= cap


def test_interpret_accepts_custom_params():
    b = batches.scenario("decode", 2, num_heads=2, dim=128)
    sel = junk_token_topk(np.random.default_rng(2), b, 8)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    meta = (b.seq_lens, sel, b.page_indices, b.cu_q_lens, b.cu_kv_lens, b.distribution)
    kw = dict(sm_scale=SCALE, pages_per_seq=b.pages_per_seq, v_dim=64)
    np.testing.assert_allclose(np.asarray(sparse_mla(b.q, b.cache, *meta, **kw,
                                                     interpret=params)),
                               np.asarray(sparse_mla_ref(b.q, b.cache, *meta, **kw)),
                               rtol=1e-5, atol=1e-5)


def test_a_plain_bf16_cache_warns_that_it_is_packed_on_every_call():
    import functools

    from pallas_kernels import PerformanceWarning

    S = jax.ShapeDtypeStruct
    args = [S((4, 8, 256), jnp.bfloat16), S((9, 16, 256), jnp.bfloat16), S((4,), jnp.int32),
            S((4, 32), jnp.int32), S((8,), jnp.int32), S((5,), jnp.int32), S((5,), jnp.int32),
            S((3,), jnp.int32)]
    fn = functools.partial(sparse_mla, sm_scale=0.1, pages_per_seq=2, v_dim=128)
    with pytest.warns(PerformanceWarning, match="store it packed"):
        jax.eval_shape(fn, *args)  # traced for TPU (interpret=False): warns, compiles nothing
