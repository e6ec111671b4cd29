"""V4.1's fp4 index keys on the TPU (issue 31, Deliver 3): the pages layout
(``reference.v41.index_pages``: entries along lanes, nibbles paired across the feature halves,
one ``u8[G, 4, 128]`` array per page) holds ``encode_index_fp4``'s codes and scale bytes exactly,
and the Pallas indexer reading it (``pallas_kernels.indexer.v41_pages`` / ``v41_scores``; strict
interpreter, 0xFF bytes (NaN scales) in every slot no row may read) returns the reference's
scores bit for bit (``decode_index_fp4`` then ``reference.indexer.scores.index_scores``, both
precisions); the decoded values meet a float64 NumPy oracle written from the format's
definition; the interpreter's bytes and DMA descriptors equal the traffic model's (one DMA per
page of ``512 * G`` bytes); it AOT-compiles at V4.1-Flash's indexer dims on every chip with the
cache read in place."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, chips
from pallas_kernels.indexer import v41_pages
from pallas_kernels.indexer.blocks import resolve_blocks
from pallas_kernels.indexer.v41_scores import (
    index_scores_v41,
    index_select_v41,
    index_topk_v41,
    traffic,
)
from pallas_kernels.measure import interpret_counter as counter
from reference.indexer.scores import index_scores
from reference.v41 import index_pages as ip
from reference.v41 import v41_flash
from reference.v41.formats import E2M1_GRID, decode_index_fp4, encode_index_fp4, index_fp4_bytes

FLASH = v41_flash()
D, H = FLASH.index_head_dim, 4
PS, PPS, NUM_PAGES = 16, 8, 40
POISON = 0xFF  # an unwritten byte: its scale byte decodes to NaN


# ------------------------------------------------------------------------------- the layout

def _oracle_decode(rows: np.ndarray) -> np.ndarray:
    """float64 values of official rows ``u8[N, 17 D / 32]`` from the format's definition: byte
    ``i`` holds feature ``2i`` (low nibble) and ``2i + 1``; nibble ``s << 3 | c`` is ``(-1)^s
    E2M1_GRID[c]``; scale byte ``b`` of block ``j`` (32 features) is ``2^(b - 127)``, 0xFF NaN."""
    n, width = rows.shape
    d = width * 32 // 17
    out = np.zeros((n, d))
    for r in range(n):
        for f in range(d):
            nib = (int(rows[r, f // 2]) >> (4 * (f % 2))) & 0xF
            b = int(rows[r, d // 2 + f // 32])
            scale = np.nan if b == 0xFF else 2.0 ** (b - 127)
            out[r, f] = (-1) ** (nib >> 3) * E2M1_GRID[nib & 7] * scale
    return out


@pytest.mark.parametrize("ps,dim", [(128, 128), (256, 128), (16, 128), (4, 32)])
def test_pages_hold_the_format_bit_for_bit(ps, dim):
    """``to_pages`` / ``from_pages`` and ``write_entries`` / ``read_entries`` are bit moves of
    ``encode_index_fp4``'s rows (block magnitudes from 2^-30 to 2^30, NaN blocks); the bytes per
    entry are 68 at multiples of 128 (``D = 128``)."""
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, ps, dim)) * 2.0 ** rng.integers(-30, 30, (2, 3, ps, 1))
    x[0, 1, 2, :7] = np.nan
    rows = encode_index_fp4(jnp.asarray(x, jnp.float32))
    pages = ip.to_pages(rows)
    assert pages.shape == (2, 3, ip.page_groups(ps, dim), 4, 128)
    np.testing.assert_array_equal(ip.from_pages(pages, ps, dim), rows)
    lay, pid, off = np.meshgrid(np.arange(2), np.arange(3), np.arange(ps), indexing="ij")
    empty = jnp.full(pages.shape, POISON, jnp.uint8)
    written = ip.write_entries(empty, lay, pid, off, rows, page_size=ps, dim=dim)
    got = np.asarray(written).reshape(2, 3, ip.blocks(ps), ip.groups(dim) * 4, 128)
    want = np.asarray(pages).reshape(got.shape)
    lanes = np.arange(128)[None] < ps  # only the lanes of entries are written
    np.testing.assert_array_equal(np.where(lanes, got[..., :, :], 0), np.where(lanes, want, 0))
    np.testing.assert_array_equal(
        ip.read_entries(written, lay, pid, off, page_size=ps, dim=dim), rows)
    out = ip.read_entries(written, 0, 3, 0, page_size=ps, dim=dim)  # page 3 of 3: zeros
    assert not np.asarray(out).any()
    if dim == 128 and ps % 128 == 0:
        assert ip.bytes_per_entry(ps, dim) == 68


def test_both_writers_store_the_same_bytes_and_drop_what_they_must():
    """``write_entries``' two forms (``_write_blocks``: ``new - old`` added into the entry's whole
    block; ``_write_lanes``: the entry's lane column) over a poisoned stack: entries sharing
    blocks and pages, page ids ``-1`` and ``P`` and a layer past the stack dropped (never
    wrapped), every other byte untouched; a call with fewer entries than pages takes the
    blocks form, and both give what ``read_entries`` reads back bit for bit."""
    rng = np.random.default_rng()
    ps, dim, num_pages = 256, 128, 5
    slots = rng.choice(2 * num_pages * ps, 40, replace=False)
    lay, pid, off = slots // (num_pages * ps), slots // ps % num_pages, slots % ps
    pid[:3], lay[3] = [-1, num_pages, -7], 2  # dropped
    x = rng.standard_normal((40, dim)) * 2.0 ** rng.integers(-20, 20, (40, 1))
    rows = encode_index_fp4(jnp.asarray(x, jnp.float32))
    start = jnp.asarray(rng.integers(0, 256, (2, num_pages, ip.page_groups(ps, dim), 4, 128)),
                        jnp.uint8)
    args = (jnp.asarray(lay), jnp.asarray(pid), jnp.asarray(off), ip._padded(rows, dim))
    keep = (pid >= 0) & (pid < num_pages) & (lay < 2)
    ok_pid = np.where(keep, pid, num_pages)
    got = [np.asarray(f(start, args[0], jnp.asarray(ok_pid), args[2], args[3], ps, dim))
           for f in (ip._write_blocks, ip._write_lanes)]
    np.testing.assert_array_equal(got[0], got[1])
    public = ip.write_entries(start, lay, pid, off, rows, page_size=ps, dim=dim)
    np.testing.assert_array_equal(np.asarray(public), got[0])
    np.testing.assert_array_equal(
        ip.read_entries(public, lay[keep], pid[keep], off[keep], page_size=ps, dim=dim),
        rows[keep])
    touched = np.zeros(start.shape[:2] + (ip.blocks(ps), 128), bool)
    touched[lay[keep], pid[keep], off[keep] // 128, off[keep] % 128] = True
    view = (2, num_pages, ip.blocks(ps), ip.groups(dim) * 4, 128)
    same = ~touched[:, :, :, None, :]
    np.testing.assert_array_equal(np.where(same, np.asarray(public).reshape(view), 0),
                                  np.where(same, np.asarray(start).reshape(view), 0))


def test_a_decode_write_into_a_long_stack_copies_nothing():
    """AOT compile (libtpu on CPU, the default chip): 16 decode entries written into a stack of
    V4.1-Flash's index keys at 1M entries (8192 pages of 128) donated: no copy of the stack
    (the lane-column scatter made XLA relayout it in and out, 4 copies) and no temporaries."""
    from pallas_kernels.measure import xla_cost

    num_pages, t = 8192, 16
    f = jax.ShapeDtypeStruct
    specs = [f((1, num_pages, ip.page_groups(128, D), 4, 128), jnp.uint8), f((t,), jnp.int32),
             f((t,), jnp.int32), f((t, index_fp4_bytes(D)), jnp.uint8)]
    out = xla_cost.compile_program(
        lambda p, i, o, r: ip.write_entries(p, 0, i, o, r, page_size=128, dim=D), specs,
        chips.DEFAULT, donate_argnums=(0,), case="V4.1 index key write")
    copies = [ln for ln in out.as_text().splitlines() if " copy(" in ln and "u8[1," in ln]
    assert not copies, copies
    assert out.memory_analysis().temp_size_in_bytes < 1 << 20


def test_nibbles_pair_across_halves():
    """Hand case: feature ``f``'s code sits in byte ``f % 64`` of the entry's lane, the low
    nibble for ``f < 64``; the scale bytes follow in group 16."""
    x = np.zeros((1, 1, 128), np.float32)
    x[0, 0, 3], x[0, 0, 64 + 5] = 6.0, -1.0  # block 0: scale 2^0 (amax 6); block 2: 2^-2
    rows = encode_index_fp4(jnp.asarray(x))
    lane = np.asarray(ip.to_pages(rows[None]))[0, 0].reshape(17 * 4, 128)[:, 0]
    assert lane[3] == 0x7 and lane[5] == 0xE << 4  # 6.0: code 7; -1.0 = -4 x 2^-2: 8 | 6
    assert lane[64] == 127 and lane[66] == 127 - 2  # ue8m0: 2^0 and 2^-2 (amax 1 / 6 -> 1/4)


def test_decoded_values_meet_the_float64_oracle():
    rng = np.random.default_rng()
    x = rng.standard_normal((64, D)) * 2.0 ** rng.integers(-20, 20, (64, 1))
    rows = np.array(encode_index_fp4(jnp.asarray(x, jnp.float32)))
    rows[5, 64 + 2] = 0xFF  # a NaN scale: its block only
    got = np.asarray(decode_index_fp4(rows), np.float64)
    np.testing.assert_array_equal(got, _oracle_decode(rows))
    assert np.isnan(got[5, 64:96]).all() and not np.isnan(np.delete(got, 5, 0)).any()


def test_refusals_name_the_numbers():
    with pytest.raises(ValueError, match=r"divide 128 or be a multiple of it.*page_size=48"):
        ip.check_geometry(48, 128)
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        ip.check_geometry(128, 48)
    good = jnp.zeros((3, 17, 4, 128), jnp.uint8)
    with pytest.raises(TypeError, match="uint8.*int8"):
        ip.as_index_fp4_pages(good.astype(jnp.int8), 128, 128)
    with pytest.raises(ValueError, match=r"\(G, 4, 128\) = \(34, 4, 128\).*page_size=256"):
        ip.as_index_fp4_pages(good, 256, 128)
    assert ip.as_index_fp4_pages(good, 128, 128).shape == (3, 128, 128)


# ------------------------------------------------------------------------------- the kernel

def make_case(rng, *, q_lens, seq_lens, ratio=1, stack=True):
    """Scores arguments over pages of ``PS`` entries: every slot no row may read holds 0xFF
    bytes (its scale NaN), a padding sequence and a padding row (NaN q) at the end; the pages
    in layer 1 of a stack whose layer 0 is all 0xFF. Returns ``(q, w, pages, meta, keys)``,
    ``keys f32[S, PPS * PS, D]`` each sequence's decoded entries (NaN past its length)."""
    table = np.full((len(q_lens) + 1) * PPS, 10 ** 6, np.int32)
    perm = rng.permutation(NUM_PAGES)
    rows = np.full((NUM_PAGES, PS, D * 17 // 32), POISON, np.uint8)
    p_next = 0
    for s, n_tok in enumerate(seq_lens):
        n_ent = n_tok // ratio
        n_pages = -(-n_ent // PS)
        table[s * PPS:s * PPS + n_pages] = perm[p_next:p_next + n_pages]
        p_next += n_pages
        x = rng.standard_normal((n_ent, D)) * np.exp(rng.uniform(-3, 3, (n_ent, 1)))
        enc = np.asarray(encode_index_fp4(jnp.asarray(x, jnp.float32)))
        for j in range(n_ent):
            rows[table[s * PPS + j // PS], j % PS] = enc[j]
    pages = ip.to_pages(jnp.asarray(rows))
    if stack:
        pages = jnp.stack([jnp.full_like(pages, POISON), pages])
    keys = np.stack([np.asarray(decode_index_fp4(rows[np.clip(table[s * PPS:(s + 1) * PPS],
                                                              0, NUM_PAGES - 1)]))
                     .reshape(PPS * PS, D) for s in range(len(q_lens))])
    t = sum(q_lens) + 1
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    sl = np.concatenate([seq_lens, [5]]).astype(np.int32)
    iq = rng.standard_normal((t, H, D)).astype(np.float32)
    q = np.array(decode_index_fp4(encode_index_fp4(jnp.asarray(iq))))  # V4.1's fp4 query
    q[-1] = np.nan
    w = rng.standard_normal((t, H)).astype(np.float32)
    dist = np.array([0, 0, len(q_lens)], np.int32)
    cu_kv = np.arange(len(q_lens) + 2, dtype=np.int32) * PPS * PS
    meta = tuple(jnp.asarray(a) for a in (sl, table, cu, cu_kv, dist))
    return jnp.asarray(q), jnp.asarray(w), pages, meta, keys


def _reference(q, w, keys, q_lens, seq_lens, ratio, precision):
    """``index_scores`` of each row against its sequence's decoded entries, masked to the
    visible ones (``j < (p + 1) // r``, ``p`` the row's position) with ``-inf``."""
    out = np.full((q.shape[0], PPS * PS), -np.inf, np.float32)
    row = 0
    for s, (n, kl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        s_all = np.asarray(index_scores(q[row:row + n], w[row:row + n], jnp.asarray(keys[s]),
                                        precision))
        for i in range(n):
            vis = (kl - n + i + 1) // ratio
            out[row + i, :vis] = s_all[i, :vis]
        row += n
    return out


@pytest.mark.parametrize("precision,ratio", [("bf16", 1), ("f32", 2)])
def test_scores_equal_the_reference(precision, ratio):
    """Prefill rows (9 and 6: row blocks of 4 and 1), a decode row and the padding row, read
    from layer 1 of a stack: the reference's f32 scores bit for bit, ``-inf`` off the visible
    entries, none NaN (every 0xFF slot unread)."""
    q_lens, seq_lens = [9, 1, 6], [40 * ratio, 93 * ratio + 1, 22 * ratio]
    q, w, pages, meta, keys = make_case(np.random.default_rng(), q_lens=q_lens,
                                        seq_lens=seq_lens, ratio=ratio)
    got = np.asarray(index_scores_v41(
        q, w, pages, *meta, pages_per_seq=PPS, page_size=PS, dim=D, compression_ratio=ratio,
        precision=precision, layer=1, block_rows=4, block_pages=2, interpret=True))
    want = _reference(q, w, keys, q_lens, seq_lens, ratio, precision)
    np.testing.assert_array_equal(got[:-1].view(np.uint32), want[:-1].view(np.uint32))
    assert not np.isnan(got).any() and np.isfinite(got[:-1]).sum() > 300
    assert (got[-1] == -np.inf).all()
    if precision == "bf16":  # bf16-valued scores
        np.testing.assert_array_equal(got, got.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_topk_selects_the_highest_scores():
    """``index_topk_v41`` (exact, chunks of 4 rows: the selection runs chunk by chunk) over the
    reference's scores: each row keeps ``min(k, visible)`` distinct visible entries, every one
    scoring at least as high as every visible entry it leaves out; ``-1`` after them and on the
    padding row."""
    ratio, q_lens, seq_lens, k = 2, [5, 1, 3], [60, 201, 9], 12
    q, w, pages, meta, keys = make_case(np.random.default_rng(), q_lens=q_lens,
                                        seq_lens=seq_lens, ratio=ratio)
    got = np.asarray(index_topk_v41(
        q, w, pages, *meta, k=k, pages_per_seq=PPS, page_size=PS, dim=D, exact=True,
        compression_ratio=ratio, layer=1, block_rows=1, score_chunk_bytes=4 * PPS * PS * 4,
        interpret=True))
    scores = _reference(q, w, keys, q_lens, seq_lens, ratio, "bf16")
    assert (got[-1] == -1).all()
    for t in range(len(got) - 1):
        visible = np.isfinite(scores[t])
        n = min(k, int(visible.sum()))
        kept = got[t, :n]
        assert (got[t, n:] == -1).all() and len(set(kept)) == n and visible[kept].all(), t
        left = visible.copy()
        left[kept] = False
        if left.any():
            assert scores[t, kept].min() >= scores[t, left].max(), t


def test_bytes_and_dmas_equal_the_model():
    """Decode (ratio 2, one row per sequence) under the interpreter's counter: the counted bytes
    (lane padded) and descriptors equal ``v41_scores.traffic``: one DMA of ``512 * G`` bytes per
    fetched page, one per score row, the q block and weight column."""
    ratio, q_lens, seq_lens = 2, [1, 1, 1], [200, 17, 250]
    q, w, pages, meta, _ = make_case(np.random.default_rng(), q_lens=q_lens, seq_lens=seq_lens,
                                     ratio=ratio)
    blocks = resolve_blocks(None, block_rows=1, block_pages=2, chip=None,
                            one_token_per_seq=True, pages_per_seq=PPS)
    with counter.count_hbm_traffic() as mine:
        got = index_scores_v41(q, w, pages, *meta, pages_per_seq=PPS, page_size=PS, dim=D,
                               compression_ratio=ratio, layer=1, one_token_per_seq=True,
                               block_rows=1, block_pages=2,
                               interpret=pltpu.InterpretParams(dma_execution_mode="eager"))
    assert np.isfinite(np.asarray(got)[:-1]).any(axis=1).all()
    model = traffic(q_lens, seq_lens, heads=H, dim=D, page_size=PS, pages_per_seq=PPS,
                    q_itemsize=2, blocks=blocks, one_token_per_seq=True,
                    compression_ratio=ratio)
    assert mine.dmas_unexecuted == 0
    assert mine.bytes(lane_padded=True) == model.bytes_moved
    assert mine.descriptors == model.dmas
    pages_read = sum(-(-(kl // ratio) // PS) for kl in seq_lens)
    page_dmas = mine.count("hbm", "vmem", kind="dma")
    assert page_dmas == pages_read
    assert model.bytes_min == 3 * H * (D * 2 + 4) + sum(kl // ratio for kl in seq_lens) * 68 \
        + 3 * PPS * PS * 4  # q and weights, 68 B an entry, the score rows, of the 3 rows


def _candidates(rng, q_lens, seq_lens, ratio, block, per_row=3):
    """Random candidate blocks ``i32[T, per_row + 2]`` per row (its visible blocks, a ``-1``
    slot, and one id past the capacity: both select nothing) and, per sequence, the set of
    sequence-local pages holding an entry of some row's blocks (the definition, in NumPy)."""
    rows, read, cap_blocks = [], [], -(-PPS * PS // block)
    for n, kl in zip(q_lens, seq_lens, strict=True):
        pages = set()
        for i in range(n):
            vis = (kl - n + i + 1) // ratio
            ids = rng.choice(max(1, -(-vis // block)), per_row)
            rows.append([*ids, -1, cap_blocks + 3])
            for c in ids:
                pages |= set(range(c * block // PS, (c * block + block - 1) // PS + 1))
        read.append(pages)
    rows.append([0] * per_row + [-1, -1])  # the padding row (outside every sequence)
    return np.asarray(rows, np.int32), read


def _poison_unread(pages, meta, read):
    """Layer 1's pages that no sequence's candidates touch (``read``) overwritten with 0xFF."""
    table = np.asarray(meta[1])
    unread = [table[s * PPS + p] for s, pages_s in enumerate(read) for p in range(PPS)
              if p not in pages_s and 0 <= table[s * PPS + p] < NUM_PAGES]
    assert unread, "the case must leave pages unread"
    return pages.at[1, np.asarray(unread)].set(POISON)


@pytest.mark.parametrize("block", [4, 24])
def test_candidate_scores_read_only_candidate_pages(block):
    """``candidates=``: a consumer's scores (prefill rows of 5 and 3, a decode row; blocks of 4,
    and of 24 entries that straddle pages of 16). Every page holding no row's candidate is
    overwritten with 0xFF (NaN scales: whatever such a page holds cannot matter); each row's
    scores equal the reference's bit for bit on its own candidates' visible entries and are
    ``-inf`` elsewhere, none NaN (that those pages are not fetched: the next test)."""
    rng = np.random.default_rng()
    ratio, q_lens, seq_lens = 2, [5, 1, 3], [200, 251, 90]
    q, w, pages, meta, keys = make_case(rng, q_lens=q_lens, seq_lens=seq_lens, ratio=ratio)
    cands, read = _candidates(rng, q_lens, seq_lens, ratio, block)
    pages = _poison_unread(pages, meta, read)
    got = np.asarray(index_scores_v41(
        q, w, pages, *meta, pages_per_seq=PPS, page_size=PS, dim=D, compression_ratio=ratio,
        layer=1, block_rows=4, block_pages=2, candidates=jnp.asarray(cands),
        candidate_block=block, interpret=True))
    want = _reference(q, w, keys, q_lens, seq_lens, ratio, "bf16")
    mine = np.zeros_like(want, bool)
    for t, ids in enumerate(cands[:-1]):
        for c in ids[(ids >= 0) & (ids * block < PPS * PS)]:
            mine[t, c * block:(c + 1) * block] = True
    want = np.where(mine, want, -np.inf)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.isnan(got).any() and np.isfinite(got).sum() > 20


@pytest.mark.parametrize("block", [4, 32])
def test_topk_among_candidates(block):
    """``index_topk_v41(candidates=)`` in chunks of 4 rows (each chunk takes its own rows'
    candidates), pages no candidate touches poisoned: each row's top-``k`` among its own
    candidate entries in the declared order (the definition's oracle, ``test_v41_candidates``)
    over the reference's scores; ``-1`` tail and on the padding row. Blocks of 4: 5 ids x 4 <
    128 entries, only the candidate entries ranked; of 32: 160 >= 128, the whole row masked."""
    from tests.test_v41_candidates import oracle_topk

    rng = np.random.default_rng()
    ratio, q_lens, seq_lens, k = 2, [5, 1, 3], [200, 251, 90], 12
    q, w, pages, meta, keys = make_case(rng, q_lens=q_lens, seq_lens=seq_lens, ratio=ratio)
    cands, read = _candidates(rng, q_lens, seq_lens, ratio, block)
    got = np.asarray(index_topk_v41(
        q, w, _poison_unread(pages, meta, read), *meta, k=k, pages_per_seq=PPS, page_size=PS,
        dim=D, compression_ratio=ratio, layer=1, block_rows=1,
        score_chunk_bytes=4 * PPS * PS * 4, candidates=jnp.asarray(cands),
        candidate_block=block, interpret=True))
    scores = _reference(q, w, keys, q_lens, seq_lens, ratio, "bf16")
    want = oracle_topk(scores, [PPS * PS] * len(scores), cands, k, block)
    np.testing.assert_array_equal(got, want)
    assert (got[-1] == -1).all() and (got[:-1, 0] >= 0).all()


def test_the_candidate_sources_selection_in_chunks():
    """``index_select_v41(num_blocks=)`` (the candidate source: its own top-k unrestricted and
    its rows' candidate blocks) in chunks of 4 rows over the reference's scores, against the
    definition's oracles (``test_v41_candidates``), per-row sets in a prefill; then a consumer
    given those blocks (pages no candidate touches poisoned) equals ``index_topk_v41``'s."""
    from tests.test_v41_candidates import oracle_blocks, oracle_topk

    rng = np.random.default_rng()
    ratio, q_lens, seq_lens, k, nb, block = 1, [5, 1, 3], [100, 126, 45], 7, 3, 4
    q, w, pages, meta, keys = make_case(rng, q_lens=q_lens, seq_lens=seq_lens, ratio=ratio)
    kw = dict(k=k, pages_per_seq=PPS, page_size=PS, dim=D, compression_ratio=ratio, layer=1,
              block_rows=1, score_chunk_bytes=4 * PPS * PS * 4, candidate_block=block,
              interpret=True)
    top, blocks = (np.asarray(a) for a in index_select_v41(q, w, pages, *meta, num_blocks=nb,
                                                           **kw))
    scores = _reference(q, w, keys, q_lens, seq_lens, ratio, "bf16")
    lens = [(kl - n + i + 1) // ratio for n, kl in zip(q_lens, seq_lens, strict=True)
            for i in range(n)] + [0]
    np.testing.assert_array_equal(top, oracle_topk(scores, lens, None, k, block))
    np.testing.assert_array_equal(blocks, oracle_blocks(scores, lens, nb, block))
    assert len({tuple(r) for r in blocks[:5]}) > 1  # the prefill's rows differ
    read = [set() for _ in q_lens]
    seq_of = [s for s, n in enumerate(q_lens) for _ in range(n)]
    for t, s in enumerate(seq_of):
        read[s] |= {int(c) * block // PS for c in blocks[t] if c >= 0}
    got, none = index_select_v41(q, w, _poison_unread(pages, meta, read), *meta,
                                 candidates=jnp.asarray(blocks), **kw)
    assert none is None
    np.testing.assert_array_equal(np.asarray(got), oracle_topk(scores, lens, blocks, k, block))
    with pytest.raises(ValueError, match="both candidates= and num_blocks="):
        index_select_v41(q, w, pages, *meta, candidates=jnp.asarray(blocks), num_blocks=nb, **kw)


@pytest.mark.parametrize("block", [8, 24])
def test_candidate_reads_equal_the_model(block):
    """Decode rows with candidates under the interpreter's counter: one DMA per candidate page
    (the NumPy set of pages holding a row's block; blocks of 24 straddle pages of 16), bytes
    and descriptors equal ``v41_scores.traffic(read_pages=...)``, fewer than without."""
    rng = np.random.default_rng()
    ratio, q_lens, seq_lens = 2, [1, 1, 1], [230, 17, 250]
    q, w, pages, meta, _ = make_case(rng, q_lens=q_lens, seq_lens=seq_lens, ratio=ratio)
    cands, read = _candidates(rng, q_lens, seq_lens, ratio, block, per_row=2)
    blocks = resolve_blocks(None, block_rows=1, block_pages=2, chip=None,
                            one_token_per_seq=True, pages_per_seq=PPS)
    with counter.count_hbm_traffic() as mine:
        index_scores_v41(q, w, pages, *meta, pages_per_seq=PPS, page_size=PS, dim=D,
                         compression_ratio=ratio, layer=1, one_token_per_seq=True, block_rows=1,
                         block_pages=2, candidates=jnp.asarray(cands), candidate_block=block,
                         interpret=pltpu.InterpretParams(dma_execution_mode="eager"))
    kw = dict(heads=H, dim=D, page_size=PS, pages_per_seq=PPS, q_itemsize=2, blocks=blocks,
              one_token_per_seq=True, compression_ratio=ratio)
    model = traffic(q_lens, seq_lens, **kw, read_pages=read)
    assert mine.dmas_unexecuted == 0
    fetched = [{p for p in ps if p * PS < kl // ratio} for kl, ps in zip(seq_lens, read,
                                                                          strict=True)]
    assert mine.count("hbm", "vmem", kind="dma") == sum(map(len, fetched))  # written pages
    assert mine.bytes(lane_padded=True) == model.bytes_moved
    assert mine.descriptors == model.dmas
    assert model.bytes_moved < traffic(q_lens, seq_lens, **kw).bytes_moved
    on_read = sum(min(PS, kl // ratio - p * PS) for kl, ps in zip(seq_lens, fetched,
                                                                  strict=True) for p in ps)
    assert model.bytes_min == 3 * H * (D * 2 + 4) + on_read * 68 + 3 * PPS * PS * 4


def test_entry_refusals_name_the_numbers():
    q, w, pages, meta, _ = make_case(np.random.default_rng(), q_lens=[1], seq_lens=[8])
    kw = dict(pages_per_seq=PPS, page_size=PS, dim=D, interpret=True)
    with pytest.raises(ValueError, match=r"layer=2 is outside \[0, 2\)"):
        index_scores_v41(q, w, pages, *meta, **kw, layer=2)
    with pytest.raises(ValueError, match=r"\(G, 4, 128\) = \(34, 4, 128\).*page_size=256"):
        index_scores_v41(q, w, pages, *meta, **{**kw, "page_size": 256}, layer=1)
    with pytest.raises(ValueError, match="precision"):
        index_scores_v41(q, w, pages, *meta, **kw, layer=1, precision="fp8")
    cands = jnp.zeros((q.shape[0], 4), jnp.int32)
    with pytest.raises(TypeError, match="candidate_block must be a static Python int"):
        index_scores_v41(q, w, pages, *meta, **kw, layer=1, candidates=cands)
    with pytest.raises(TypeError, match="^index_topk_v41 .*candidate_block must be a static"):
        index_topk_v41(q, w, pages, *meta, **kw, k=4, layer=1, candidates=cands)
    with pytest.raises(ValueError, match="^index_select_v41: num_blocks must be positive, got "
                                         "num_blocks=0"):
        index_select_v41(q, w, pages, *meta, **kw, k=4, layer=1, num_blocks=0, candidate_block=8)
    with pytest.raises(ValueError,
                       match=r"candidates.shape\[0\] must equal q.shape\[0\] \(rows\) = 2, got 3"):
        index_scores_v41(q, w, pages, *meta, **kw, layer=1, candidates=jnp.zeros((3, 4), int),
                         candidate_block=8)


# ------------------------------------------------------------------------------- AOT gate

GATE_ROWS, GATE_ENTRIES, GATE_PAGE = 64, 8192, 128


def _gate_specs():
    pps = GATE_ENTRIES // GATE_PAGE
    i32 = jnp.int32
    return [jax.ShapeDtypeStruct((GATE_ROWS, FLASH.index_n_heads, D), jnp.float32),
            jax.ShapeDtypeStruct((GATE_ROWS, FLASH.index_n_heads), jnp.float32),
            jax.ShapeDtypeStruct((2, GATE_ROWS * pps, *v41_pages.page_shape(GATE_PAGE, D)),
                                 jnp.uint8),
            jax.ShapeDtypeStruct((GATE_ROWS,), i32), jax.ShapeDtypeStruct((GATE_ROWS * pps,), i32),
            jax.ShapeDtypeStruct((GATE_ROWS + 1,), i32),
            jax.ShapeDtypeStruct((GATE_ROWS + 1,), i32), jax.ShapeDtypeStruct((3,), i32)]


@pytest.mark.kernel_gate
@pytest.mark.parametrize("chip", chips.NAMES)
def test_compiles_on_every_chip_without_a_cache_copy(chip):
    """V4.1-Flash's indexer (32 heads x 128) at a ratio-1 decode of 64 rows x 8192 entries in
    pages of 128, a stack of 2 read at layer 1: compiles, the stack read in place (no op of the
    stack's size in the HLO but its parameter), the kernel's declared bytes equal the model's."""
    specs = _gate_specs()

    def fn(q, w, pages, *meta):
        return index_scores_v41(q, w, pages, *meta, pages_per_seq=GATE_ENTRIES // GATE_PAGE,
                                page_size=GATE_PAGE, dim=D, one_token_per_seq=True, layer=1,
                                chip=chip)

    text = aot.aot_compile(fn, specs, chip, "V4.1 index pages decode").as_text()
    dims = ",".join(str(d) for d in specs[2].shape)
    stack_sized = re.compile(r"=\s*\(?u8\[" + dims + r"\]")
    producers = [ln for ln in text.splitlines() if stack_sized.search(ln)
                 and not re.search(r"\b(parameter|bitcast)\(", ln)]
    assert not producers, producers[:3]
    assert "tpu_custom_call" in text
