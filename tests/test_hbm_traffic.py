"""HBM traffic counted in the Pallas TPU interpreter (a simulation) against each kernel's traffic
model, at one small decode shape per kernel (``scripts/cost/hbm_traffic.py``'s quick cases).

Pinned: counted bytes (HBM<->VMEM lane-padded, HBM->SMEM logical) EQUAL the model's kernel
side exactly, counted DMA descriptors (pipeline block copies + started manual DMAs) EQUAL the
model's ``dmas``, and each input is fetched the number of times the design says (every needed
key page once per decode row, every selected row/page once): a change that re-fetches a block
or a page fails here. The V4 compressor's decode step and the V4 two-pass path are counted
the same way. A pinned mixed batch (decode rows beside a prefill chunk, general path) shows the
decode sequences taking 1-row items. Also: the counter's own self test, and the loud failure
when a hooked JAX internal is missing."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]

from pallas_kernels import _interpret_counter as counter  # noqa: E402
from pallas_kernels.measure import hbm_traffic as ht  # noqa: E402
from scripts.cost import hbm_traffic as hbm_traffic_script  # noqa: E402

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

KERNELS = ("streamindex_topk", "streamindex_page_topk", "sparse_mla", "page_sparse_mla")


@pytest.fixture(scope="module")
def counted():
    """kernel -> (case, TrafficCount) for the pinned decode shapes (each run once)."""
    return {c.kernel: (c, ht.count(c)) for c in ht.decode_cases()}


@pytest.fixture(scope="module")
def counted_compressor():
    """(case, TrafficCount) of the V4 compressor's decode step (run once)."""
    case = ht.compressor_case()
    return case, ht.count(case)


@pytest.fixture(scope="module")
def counted_fp8():
    """kernel -> (case, TrafficCount) of the fp8-cache decode cases (each run once)."""
    return {c.kernel: (c, ht.count(c)) for c in ht.fp8_cases()}


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp8_counted_bytes_equal_the_models_kernel_side_and_meet_the_issue_bounds(
        counted_fp8, kernel):
    """Issue 10: indexer key bytes per key <= 1.10 x 132 B (GPU layout), sparse MLA bytes per
    gathered token <= 1024 B, both counted in the interpreter; and counted == model."""
    case, n = counted_fp8[kernel]
    assert n.dmas_unexecuted == 0
    assert n.bytes(lane_padded=True) == case.model_kernel_bytes, n.table()
    assert n.descriptors == case.model.dmas, n.table()
    gathers = n.select("hbm", "vmem", "dma")
    if kernel.startswith("streamindex"):
        s = ht.FP8_DECODE
        keys = sum(-(-kl // s.page_size) * s.page_size for kl in s.kv_lens)  # whole pages
        per_key = sum(c.nbytes for c in gathers) / keys
        assert per_key == 128 + 4 * 128 / s.page_size <= 1.10 * 132, per_key
    else:
        s = ht.FP8_MLA_DECODE
        tokens = s.rows * (32 if kernel == "sparse_mla" else 2 * s.page_size)
        assert sum(c.nbytes for c in gathers) / tokens == 1024


def _pages(s: ht.Shape) -> int:
    return sum(-(-kl // s.page_size) for kl in s.kv_lens)


@pytest.mark.parametrize("kernel", KERNELS)
def test_counted_decode_bytes_equal_the_models_kernel_side(counted, kernel):
    case, n = counted[kernel]
    assert n.dmas_unexecuted == 0
    total = n.bytes(lane_padded=True)
    assert total == case.model_kernel_bytes, (
        f"{kernel}: counted {total} B != model kernel side {case.model_kernel_bytes} B; "
        f"copies: {n.table()}")
    assert n.descriptors == case.model.dmas, (
        f"{kernel}: counted {n.descriptors} DMA descriptors != model {case.model.dmas}; "
        f"copies: {n.table()}")


def test_decode_descriptors_per_row_are_the_layouts():
    """Per decode row, from the layouts: the indexer one DMA per causal key page (two with the
    fp8 cache: keys and scale row), one score row out, the q and weight blocks in; sparse MLA
    one DMA per selected token row (page mode: per selected page), its entries row into SMEM,
    the q block in and the out block back. Checked on the models the counts equal."""
    s, m = ht.DECODE, ht.MLA_DECODE
    cases = {c.kernel: c for c in ht.decode_cases()}
    for kernel in ("streamindex_topk", "streamindex_page_topk"):
        assert cases[kernel].model.dmas == _pages(s) + s.rows * (1 + 2), kernel
    assert cases["sparse_mla"].model.dmas == m.rows * (32 + 1 + 2)
    assert cases["page_sparse_mla"].model.dmas == m.rows * (2 + 1 + 2)
    fp8 = {c.kernel: c for c in ht.fp8_cases()}
    assert fp8["streamindex_topk"].model.dmas == 2 * _pages(ht.FP8_DECODE) + 4 * 3


def test_compressor_decode_counted_bytes_and_descriptors_equal_the_model(counted_compressor):
    """The Pallas V4 compressor's decode step (4 sequences completing an entry, ratio 4, d 128;
    5 output slots): counted bytes (an HBM -> HBM row copy read and written) and descriptors
    equal ``compressor_traffic``'s; per completing sequence 7 descriptors (kv and score row,
    kv and gate ring slot, the state's kv copy, score row in, gate row out), one per output
    slot, plus the two ape blocks."""
    case, n = counted_compressor
    assert n.dmas_unexecuted == 0
    counted = n.bytes(lane_padded=True) + n.bytes("hbm", "hbm")
    assert counted == case.model.bytes_moved, n.table()
    assert n.descriptors == case.model.dmas == 7 * 4 + 5 + 2, n.table()
    assert n.count("hbm", "hbm", "dma") == 4  # one kv row per sequence into its ring


def test_decode_indexer_reads_each_needed_key_page_once_and_each_row_once(counted):
    s = ht.DECODE
    page_bytes = s.page_size * s.dim * 2
    for kernel in ("streamindex_topk", "streamindex_page_topk"):
        _, n = counted[kernel]
        keys = n.select("hbm", "vmem", "dma")
        assert len(keys) == _pages(s) and {c.nbytes for c in keys} == {page_bytes}, kernel
        q_blocks = [c for c in n.select("hbm", "vmem", "block") if c.shape[-1] == s.dim]
        assert len(q_blocks) == s.rows, kernel
    for kernel in ("streamindex_topk", "streamindex_page_topk"):  # score rows, one DMA each
        assert counted[kernel][1].count("vmem", "hbm", "dma") == s.rows, kernel


def test_decode_sparse_mla_gathers_each_selection_once(counted):
    s = ht.MLA_DECODE
    _, tok = counted["sparse_mla"]
    assert tok.count("hbm", "vmem", "dma") == s.rows * 32  # k=32 packed rows per query row
    assert tok.count("hbm", "smem", "dma") == s.rows  # one metadata row each
    _, page = counted["page_sparse_mla"]
    assert page.count("hbm", "vmem", "dma") == s.rows * 2  # k_pages=2 whole pages per row
    for n in (tok, page):
        assert n.count("hbm", "vmem", "block") == s.rows  # q
        assert n.count("vmem", "hbm", "block") == s.rows  # out


def test_v4_two_pass_descriptors_are_two_mla_calls_with_lse():
    """DeepSeek-V4's two-pass path (``fused=False``) at a tiny decode batch whose rows gather a
    full window (16) and all k = 8 selected entries: counted descriptors equal the two token
    MLA calls' ``mla_traffic`` dmas plus one LSE block per row per call (``v4_traffic``'s
    sum)."""
    import dataclasses

    import numpy as np
    from jax.experimental.pallas import tpu as pltpu
    from v4_batches import make_v4_batch

    from pallas_kernels.mla import traffic as mtraffic
    from pallas_kernels.v4_attention.entry import v4_attention

    b = make_v4_batch(11, q_lens=[1, 1], kv_lens=[80, 64], ratio=4, heads=2, window_size=16,
                      window_page_size=4, comp_page_size=4, k=8)
    b = dataclasses.replace(b, compressed_indices=np.array(
        [np.arange(8) + 3, np.arange(8)[::-1] + 1], np.int32))
    with counter.count_hbm_traffic() as n:
        jax.block_until_ready(v4_attention(
            b.q, *b.args()[1:], sm_scale=0.1, **b.kwargs(), fused=False,
            interpret=pltpu.InterpretParams(dma_execution_mode="eager")))
    rows = 2

    def dmas(m):  # one call of m entries per row (the block shape does not enter the count)
        shape = ht.mkernel.block_shape("token", heads=2, dim=512, v_dim=512, page_size=4,
                                       units=m, meta_len=m, q_dtype="float32", fmt="f32")
        return mtraffic.mla_traffic(rows=rows, heads=2, dim=512, v_dim=512, selected_rows=m,
                                    fmt="f32", q_itemsize=4, meta_words=m, prep_bytes=0,
                                    table_words=1, shape=shape).dmas

    model = sum(dmas(m) + rows for m in (16, 8))  # + one LSE block per row and call
    assert n.dmas_unexecuted == 0
    assert n.descriptors == model == 64, n.table()


@pytest.mark.parametrize("page_mode", [False, True])
def test_mixed_batch_decode_sequences_take_one_row_items(page_mode):
    # MIXED at R=8 (ladder 1, 2, 8): decode sequences kv 40/17/128 and the prefill's last row
    # (pos 79) are 1-row items, the prefill's rows at pos 71..78 one 8-row item; the 2-row level
    # has no item (one q block fetched at row 0, unused).
    s = ht.MIXED
    case = ht.mixed_case(page_mode=page_mode)
    n = ht.count(case)
    assert n.bytes(lane_padded=True) == case.model_kernel_bytes, n.table()
    assert n.descriptors == case.model.dmas, n.table()
    q_blocks = [c.shape[0] for c in n.select("hbm", "vmem", "block") if c.shape[-1] == s.dim]
    assert sorted(q_blocks) == [1, 1, 1, 1, 2, 8]
    pages = {"decode": 3 + 2 + 8, "prefill": 5 + 5}  # each item's causal pages, once
    keys = n.select("hbm", "vmem", "dma")
    assert len(keys) == sum(pages.values())
    # MXU work: decode rows at R=1 (not R=8): 2*H*D per key token per block row
    tokens = {1: (pages["decode"] + 5) * s.page_size, 8: 5 * s.page_size}
    assert case.model.flops == sum(2 * r * s.heads * s.dim * t for r, t in tokens.items())
    if not page_mode:
        assert n.count("vmem", "hbm", "dma") == s.rows  # one DMA per score row


def test_self_test_counts_block_copies_and_dmas_exactly():
    n = counter.self_test()
    assert n.bytes("hbm", "vmem") == 2 * 2 * 8 * 128 * 4  # 2 blocks + 2 DMAs
    assert n.bytes("vmem", "hbm") == 2 * 8 * 128 * 4


def test_hooks_are_removed_after_the_block():
    mod = counter.check_internals()
    before = (mod.get, mod.store, mod.DMA)
    with counter.count_hbm_traffic():
        assert (mod.get, mod.store, mod.DMA) != before
    assert (mod.get, mod.store, mod.DMA) == before


def _missing_method(mod, monkeypatch):
    monkeypatch.delattr(mod.DMA, "execute_read")
    return "DMA.execute_read"


def _renamed_keyword(mod, monkeypatch):
    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *,
            name=None):  # input_name renamed
        raise AssertionError("never called")

    def wrapper(*a, **k):
        return get(*a, **k)

    wrapper.__wrapped__ = get
    monkeypatch.setattr(mod, "get", wrapper)
    return "'input_name'"


def _missing_module(mod, monkeypatch):
    monkeypatch.setattr(counter, "INTERNALS_MODULE", "jax._src.pallas.mosaic.no_such_module")
    return "no_such_module"


@pytest.mark.parametrize("breakage", [_missing_method, _renamed_keyword, _missing_module])
def test_a_missing_hooked_internal_fails_loudly_naming_jax_version(monkeypatch, breakage):
    mod = counter.check_internals()
    symbol = breakage(mod, monkeypatch)
    with pytest.raises(counter.InternalsChanged, match=symbol) as err:
        with counter.count_hbm_traffic():
            pytest.fail("entered the counting block with broken internals")
    assert f"jax {jax.__version__}" in str(err.value)
    assert isinstance(err.value, RuntimeError)


def test_indexer_with_an_empty_tail_work_item_moves_only_modelled_bytes():
    case = ht.indexer_case(ht.MTP, page_mode=False, block_rows=4, block_pages=2)
    n = ht.count(case)
    assert n.bytes(lane_padded=True) == case.model_kernel_bytes
    assert n.descriptors == case.model.dmas


def test_script_quick_writes_labelled_tables(tmp_path, counted, counted_fp8,
                                            counted_compressor):
    """The report of ``--quick`` (the decode, fp8 and compressor cases: the fixtures' counts,
    not run again in the interpreter)."""
    done = {(c.kernel, c.shape): n for c, n in [*counted.values(), *counted_fp8.values(),
                                                counted_compressor]}
    assert len(done) == len(ht.all_cases(quick=True))
    assert hbm_traffic_script.main(["--quick", "--out", str(tmp_path)],
                                   count_case=lambda c: done[(c.kernel, c.shape)]) == 0
    md = (tmp_path / "hbm_traffic.md").read_text()
    assert ht.LABEL in md and "counted DMAs" in md
    data = (tmp_path / "hbm_traffic.json").read_text()
    assert ht.LABEL in data and '"rows"' in data
