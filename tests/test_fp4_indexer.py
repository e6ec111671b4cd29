"""``index_quant="fp4_sim"`` (DeepSeek-V4's FP4 index simulation, issue 21) on the reference page
top-k, the Pallas token / page top-k and ``dsa_jax``'s ``indexer_topk`` / ``page_topk``.

The in-kernel rounding (``pallas_kernels.indexer.fp4``, run inside a ``pallas_call`` in the
strict interpreter) is compared bit for bit with ``reference.deepseek_v4.fp4_act_quant_sim`` on
blocks built to hit its edges; the entries against the reference (equal index lists: the
interpreter's rotation sums as the reference's does on this CPU) and against the float64 oracle
of the simulated scores (``tests/oracle.py`` on q and keys rotated in f32, then FP4-rounded by
``test_fp4_sim.oracle_fp4``, the rule in Python: every selected entry scores at least as high as
every unselected candidate). Batches leave NaN in every unowned slot
(``tests/test_compressed_indexer.py``). Also: ``dsa_jax`` on both backends, the refusals, the
compile-gate cases and the traffic model's bytes (those of plain keys)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batches import scenario
from jax.experimental import pallas as pl
from oracle import check_token_topk, check_topk_rows, page_candidates, token_candidates
from test_compressed_indexer import STRICT, compressed_batch
from test_fp4_sim import _inputs, oracle_fp4

import dsa_jax
from pallas_kernels import aot, chips, streamindex_page_topk, streamindex_scores, streamindex_topk
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.indexer import fp4
from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.kernel import compute_dtypes
from pallas_kernels.indexer.traffic import traffic
from reference import (
    deepseek_v4,
    fp8_cache,
    index_scores,
    streamindex_page_topk_ref,
    streamindex_topk_ref,
)

pytestmark = pytest.mark.kernel_gate  # the kernel's rounding: also run on the newest jax

FP4 = {"index_quant": "fp4_sim"}


def _in_kernel(fn, x: np.ndarray, *extra) -> np.ndarray:
    """``fn(x, *extra)`` inside a one-block ``pallas_call`` in the strict interpreter."""
    def kernel(*refs):
        *ins, out = refs
        out[...] = fn(*(r[...] for r in ins))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                         interpret=STRICT)(jnp.asarray(x), *extra)
    return np.asarray(out)


def _edge_blocks() -> np.ndarray:
    """Blocks of 32 at the rule's edges: amax one ulp either side of ``6 * 2**k`` (the scale
    changes there), every e2m1 tie and midpoint at several scales, zeros of both signs, blocks
    whose amax is at or under the floor ``6 * 2**-126`` (f32 subnormals), one tiny value among
    large ones (it rounds to +-0), and the largest scale ``2**125``."""
    rng = np.random.default_rng(5)
    out = []
    for k in (-100, -7, 0, 3, 60):
        for f in (1 - 2**-24, 1.0, 1 + 2**-23):
            blk = rng.uniform(-1, 1, 32) * 6.0 * 2.0**k
            blk[rng.integers(32)] = np.float32(6.0 * 2.0**k * f)
            out.append(blk)
    grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 6.0, 2.25, 4.5])
    for k in (-30, -1, 0, 9):
        blk = np.concatenate([grid, -grid, [-0.0, 0.0, 6.0, -6.0, 1e-3, -1e-3]]) * 2.0**k
        out.append(blk)
    out += [np.zeros(32), -np.zeros(32), np.full(32, 6.0 * 2**-126),
            rng.uniform(-1, 1, 32) * 2**-130, rng.uniform(-1, 1, 32) * 2**-149 * 7]
    tiny = rng.uniform(-1, 1, 32) * 1e3
    tiny[3], tiny[4] = 1e-30, -1e-30
    out.append(tiny)
    big = rng.uniform(-1, 1, 32) * 2e38
    big[0] = 1.5 * 2.0**127  # s = 2**125, the largest amax whose e2m1 values stay finite
    out.append(big)
    return np.stack(out).astype(np.float32)


def test_in_kernel_fp4_round_is_bit_exact_with_fp4_act_quant_sim():
    x = _inputs()
    x = x[~np.isnan(x).any(axis=1)]  # NaN: each platform's max decides its block (docstring)
    edges = _edge_blocks()
    blocks = np.concatenate([x.reshape(-1, 32), edges])
    blocks = np.concatenate([blocks, np.ones((-len(blocks) % 4, 32), np.float32)])
    x = blocks.reshape(-1, 128)
    rng = np.random.default_rng(8)
    x = np.concatenate([x, (rng.standard_normal((32, 128)) * 10.0 ** rng.uniform(
        -8, 8, (32, 1))).astype(np.float32)])
    x = np.concatenate([x, np.zeros((-len(x) % 8, 128), np.float32)])
    got = _in_kernel(fp4.fp4_round, x)
    want = np.asarray(deepseek_v4.fp4_act_quant_sim(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(want.view(np.uint32), oracle_fp4(x).view(np.uint32))
    nan = x[:8].copy()
    nan[2, 5] = np.nan
    assert np.isnan(_in_kernel(fp4.fp4_round, nan)[2, 5])  # a NaN element stays NaN


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_in_kernel_rotation_and_rounding_is_the_reference_map(dtype):
    h = np.asarray(fp4.hadamard(128, jnp.float32))
    np.testing.assert_array_equal(h, deepseek_v4._hadamard_matrix(128))
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((64, 128)) * 3, dtype)
    got = _in_kernel(lambda k, hm: fp4.rotate_and_round(k, hm), x, fp4.hadamard(128, dtype))
    want = np.asarray(index_scores.fp4_sim(x))
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.asarray(jnp.asarray(got, jnp.bfloat16), np.float32), got)


def _sim(a):
    """The simulated values as the oracle reads them (rotation, then the rule in Python)."""
    return oracle_fp4(np.asarray(deepseek_v4.hadamard_rotate(jnp.asarray(a, jnp.float32))))


def _ratio_one(seed):
    return scenario("mixed_padding", seed, num_heads=4, dim=128), 1, False


def _bf16(seed):
    """``decode_r4`` with q and keys stored in bf16 (the kernel's one-pass rotation)."""
    b, ratio, otp = compressed_batch("decode_r4", seed)
    return dataclasses.replace(b, q=jnp.asarray(b.q, jnp.bfloat16),
                               cache=jnp.asarray(b.cache, jnp.bfloat16)), ratio, otp


BATCHES = {"decode_r4_bf16": _bf16,
           "prefill_r4": lambda s: compressed_batch("prefill_r4", s),
           "mixed_r1": _ratio_one}


def _call(entry, b, ratio, otp, **kw):
    extra = {} if entry in (streamindex_topk_ref, streamindex_page_topk_ref) else dict(
        block_rows=None if otp else 4, block_pages=2, interpret=STRICT)
    return np.asarray(entry(*b.args(), pages_per_seq=b.pages_per_seq, one_token_per_seq=otp,
                            exact=True, compression_ratio=ratio, **FP4, **kw, **extra))


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_pallas_token_topk_with_fp4_sim_equals_reference_and_oracle(name):
    b, ratio, otp = BATCHES[name](12)
    got = _call(streamindex_topk, b, ratio, otp, k=6)
    check_token_topk(got, b, 6, compression_ratio=ratio, rtol=1e-5, q=_sim(b.q),
                     cache=_sim(b.cache))
    np.testing.assert_array_equal(got, _call(streamindex_topk_ref, b, ratio, otp, k=6))


@pytest.mark.parametrize("name", ["prefill_r4", "mixed_r1"])
def test_page_topk_with_fp4_sim_max_pools_the_simulated_scores(name):
    b, ratio, otp = BATCHES[name](13)
    sim = dataclasses.replace(b, q=_sim(b.q), cache=_sim(b.cache))
    cands = page_candidates(token_candidates(*sim.args(), b.pages_per_seq, ratio), b.page_size)
    ref = _call(streamindex_page_topk_ref, b, ratio, otp, k_pages=3)
    check_topk_rows(ref, cands, 3, rtol=1e-5, what="page row")
    np.testing.assert_array_equal(_call(streamindex_page_topk, b, ratio, otp, k_pages=3), ref)


def test_fp4_sim_scores_of_the_kernel_are_the_simulated_definition():
    b, ratio, _ = compressed_batch("mixed_r4", 14)
    got = np.asarray(streamindex_scores(*b.args(), pages_per_seq=b.pages_per_seq,
                                        compression_ratio=ratio, block_rows=4, block_pages=2,
                                        interpret=STRICT, **FP4))
    sim = dataclasses.replace(b, q=_sim(b.q), cache=_sim(b.cache))
    cands = token_candidates(*sim.args(), b.pages_per_seq, ratio)
    for r, cand in enumerate(cands):
        row = got[r]
        keep = sorted(cand or {})
        assert np.all(np.isneginf(np.delete(row, keep)))
        np.testing.assert_allclose(row[keep], [cand[j] for j in keep], rtol=1e-5, atol=1e-4)


def test_a_stacked_cache_layer_with_fp4_sim_is_read_in_place():
    b, ratio, otp = compressed_batch("prefill_r4", 15)
    rng = np.random.default_rng(15)
    stack = np.stack([b.cache + i * rng.normal(size=b.cache.shape).astype(np.float32)
                      for i in range(3)])
    one = dataclasses.replace(b, cache=stack[2])
    want = _call(streamindex_topk_ref, one, ratio, otp, k=6)
    stacked = dataclasses.replace(b, cache=jnp.asarray(stack))
    got = _call(streamindex_topk, stacked, ratio, otp, k=6, layer=jnp.int32(2))
    np.testing.assert_array_equal(got, want)  # the reference's stacked read: test_stacked.py


@pytest.mark.parametrize("op,kw", [(dsa_jax.indexer_topk, {"k": 6}),
                                   (dsa_jax.page_topk, {"k_pages": 3})])
def test_dsa_jax_passes_index_quant_to_both_backends(op, kw):
    b, ratio, otp = compressed_batch("prefill_r4", 16)
    runs = {backend: np.asarray(op(*b.args(), **kw, pages_per_seq=b.pages_per_seq, exact=True,
                                   compression_ratio=ratio, **FP4, backend=backend,
                                   validate=True, kernel_options=opts))
            for backend, opts in (("reference", None),
                                  ("pallas", {"interpret": True, "block_rows": 4}))}
    np.testing.assert_array_equal(runs["pallas"], runs["reference"])
    # the keyword reached the op: the selection is the simulated scores' (the plain scores'
    # selection differs on this batch, test_fp4_sim.py)
    sim = dataclasses.replace(b, q=_sim(b.q), cache=_sim(b.cache))
    cands = token_candidates(*sim.args(), b.pages_per_seq, ratio)
    if "k" in kw:
        check_topk_rows(runs["reference"], cands, 6, rtol=1e-5)
    else:
        check_topk_rows(runs["reference"], page_candidates(cands, b.page_size), 3, rtol=1e-5)


@pytest.mark.parametrize("fn", [streamindex_topk_ref, streamindex_page_topk_ref, streamindex_topk,
                                streamindex_page_topk, streamindex_scores, dsa_jax.indexer_topk,
                                dsa_jax.page_topk])
def test_bad_index_quant_is_refused_by_name_everywhere(fn):
    b, ratio, _ = compressed_batch("decode_r4")
    kw = ({} if fn is streamindex_scores else {"k_pages": 2} if "page" in fn.__name__
          else {"k": 2})
    call = lambda bb, **q: fn(*bb.args(), **kw, pages_per_seq=bb.pages_per_seq,  # noqa: E731
                              compression_ratio=ratio, **q)
    with pytest.raises(ValueError, match=r"index_quant must be one of \(None, 'fp4_sim'\), "
                                         r"got 'fp8'"):
        call(b, index_quant="fp8")
    narrow = dataclasses.replace(b, q=b.q[..., :64], cache=b.cache[..., :64])
    with pytest.raises(ValueError, match=r"index_quant='fp4_sim' rotates the 128 index dims; "
                                         r"q.shape\[2\] \(D\) = 64"):
        call(narrow, **FP4)
    wide, _, _ = compressed_batch("decode_r4", page_size=32)  # fp8 pages: whole (32, 128) tiles
    fp8 = dataclasses.replace(wide, cache=fp8_cache.quantize_index_cache(wide.cache))
    with pytest.raises(ValueError, match=r"index_quant='fp4_sim' .* an fp8 index cache"):
        call(fp8, **FP4)


def test_the_gate_compiles_the_fp4_path_at_v4_flash_and_pro_dims():
    # the cases test_compile_indexer.py::test_compiles_for_tpu compiles for v5e, v6e, tpu7x
    cases = [c for c in icases.compile_cases(quick=True) if "fp4_sim" in c.tags]
    assert {c.shape.split()[0] for c in cases} == {"V4-Flash", "V4-Pro"}
    assert {c.kernel for c in cases} == {"streamindex_topk r=4", "streamindex_page_topk r=4"}
    for case in cases:
        kw = case.fn_for_chip(chips.DEFAULT).keywords
        assert kw["index_quant"] == "fp4_sim" and kw["compression_ratio"] == 4
        budget = kw["k"] if "k" in kw else kw["k_pages"] * icases.GATE_PAGE
        assert budget == (512 if "Flash" in case.shape else 1024)
        assert case.specs[0].shape[1:] == (64, 128)  # 64 index heads x 128
        assert case.specs[2].shape[1:] == (64, 128) and case.specs[2].dtype == jnp.bfloat16


@pytest.mark.parametrize("page_mode", [False, True])
@pytest.mark.parametrize("chip", sorted(aot.CHIPS))
def test_the_fp4_path_moves_the_bytes_of_plain_keys(chip, page_mode):
    # the traffic model's statement: the cache is read as stored (the rotation and rounding run
    # on the tile in VMEM, q is simulated in the glue), so the HBM bytes are the plain keys';
    # the MXU adds the rotation, 2 * 128 * 128 flops per key fetched
    for name in ("V4-Flash decode 64x8192 (2048 entries) k=512",
                 "V4-Flash mixed 60x1@8192 + 512@32768 k=512"):
        q_lens, kv_lens, otp, _ = icases.V4_SHAPES[name]
        specs, pps = icases.gate_specs(q_lens, kv_lens, compression_ratio=icases.V4_RATIO)
        compute, _, _ = compute_dtypes(specs[0], specs[2], chip, "fp4_sim")
        assert compute == jnp.bfloat16  # as the bf16 q of the plain gate case
        blocks = resolve_blocks(None, block_rows=None, block_pages=None, chip=chip,
                                one_token_per_seq=otp, pages_per_seq=pps,
                                page_size=icases.GATE_PAGE, page_mode=page_mode, mosaic=True)
        args = dict(heads=64, dim=128, page_size=icases.GATE_PAGE, pages_per_seq=pps,
                    key_itemsize=2, q_itemsize=2, blocks=blocks, page_mode=page_mode,
                    one_token_per_seq=otp, compression_ratio=icases.V4_RATIO)
        plain = traffic(q_lens, kv_lens, **args)
        sim = traffic(q_lens, kv_lens, **args, index_quant="fp4_sim")
        assert (sim.bytes_moved, sim.bytes_min) == (plain.bytes_moved, plain.bytes_min)
        assert sim.flops > plain.flops
        if otp:  # decode: one row per item, so the plain flops count the keys fetched
            assert sim.flops - plain.flops == 2 * 128 * 128 * plain.flops // (2 * 64 * 128)
        assert plain.vmem_bytes < sim.vmem_bytes < aot.chip_info(chip).vmem_capacity_bytes // 2


def test_counted_fp4_bytes_are_the_models_which_are_the_plain_keys():
    # the interpreter's count of the fp4 path at scripts/cost/hbm_traffic.py's decode shape equals
    # the model's kernel side, and that model's bytes are the plain path's (rotation in VMEM)
    from pallas_kernels.measure import hbm_traffic as ht

    knobs = dict(page_mode=False, block_rows=1, block_pages=2)
    case = ht.indexer_case(ht.DECODE, **knobs, index_quant="fp4_sim")
    n = ht.count(case)
    assert n.bytes(lane_padded=True) == case.model_kernel_bytes
    assert n.descriptors == case.model.dmas  # the DMA descriptors too
    plain = ht.indexer_case(ht.DECODE, **knobs)
    assert case.model_kernel_bytes == plain.model_kernel_bytes
    assert case.model.bytes_moved == plain.model.bytes_moved
    assert case.model.dmas == plain.model.dmas
