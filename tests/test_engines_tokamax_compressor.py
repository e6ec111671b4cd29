"""``dsa_jax.engines.tokamax.compressor`` (issue 29, the compressor side): tokamax's
``proj_and_save_state`` and ``dsv4_compressor`` on this package's math, without tokamax.

In all three modes (CSA, CSA indexer, HCA), with every state no stored entry reads set to NaN:
the stored states decode (NumPy, from the slab / word bytes) to ``hidden @ wkv_wgate + ape``;
each stored entry (``paged_state.paged_entries``) meets the float64 compressor oracle
(``tests/v4_compressor_oracle.py``) on the decoded states; the cache after
``dsv4_compressor`` is the cache before with exactly the stored tokens' records replaced by the
record encoders' bytes of those entries (slot ``-1``, non-boundary tokens and the states write
nothing). Refusals name the argument; ``implementation`` follows tokamax's dispatch rules.
The byte comparison against tokamax itself is ``tests/test_tokamax_parity_compressor.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import pytest
from v4_compressor_oracle import compress_sequence

from dsa_jax.engines.tokamax import compressor as tc
from reference.formats import tokamax_index, tokamax_v4
from reference.v4_compressor import paged_state

HIDDEN = 32
# mode: head_dim, ratio, overlap, state_block_size, seq lens, this step's positions per request
# (request 1's first position has slot -1: a boundary token not stored)
MODES = {
    "csa": (512, 4, True, 4, (10, 16), (range(10), (11, 15))),
    "indexer": (128, 4, True, 4, (10, 16), (range(10), (11, 15))),
    "hca": (512, 128, False, 32, (200, 256), ((0, 126, 127, 199), (127, 255))),
}
HCA_RECORDS = (2, 16)  # HCA cache pages x rows (8 two-row records a page)


@dataclass
class Case:
    """One mode's inputs (tokamax's argument names) and the facts the checks need."""

    mode: str
    proj: tuple  # proj_and_save_state's positional args, cache last
    kwargs: dict  # dsv4_compressor's keyword args (state_cache / rope_cache included)
    args: tuple  # dsv4_compressor's positional args, cache first
    ratio: int
    stored: np.ndarray  # bool[N]: the tokens whose record is written
    seq_lens: tuple
    table: np.ndarray  # i32[R, stride]


def _nan_bytes(shape, dtype):
    return np.full(shape, 0xFF if dtype == np.uint8 else -1, dtype)  # f32 NaN in every word


def make_case(mode: str, seed: int = 0) -> Case:
    """Random inputs for ``mode`` (see ``MODES``): state pages per request in a random order,
    unused table entries on an all-NaN page, record slots in a page of random bytes after the
    state pages (the state shares the CSA / indexer cache; HCA has a ``state_cache``)."""
    d, r, overlap, sbs, seq_lens, steps = MODES[mode]
    rng = np.random.default_rng(seed)
    coff = 1 + overlap
    width = coff * d
    lanes = 2 * tc.LANES if mode == "indexer" else tc.LANES
    rpt = 2 * width // lanes
    stride = max(-(-n // sbs) for n in seq_lens)
    num_state = sum(-(-n // sbs) for n in seq_lens) + 1  # + the NaN page, last
    pages = rng.permutation(num_state - 1)
    table = np.full((len(seq_lens), stride), num_state - 1, np.int32)
    at = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // sbs)
        table[i, :nb] = pages[at:at + nb]
        at += nb
    positions = np.concatenate([np.asarray(s, np.int32) for s in steps])
    reqs = np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(steps)])
    stored = (positions + 1) % r == 0
    stored[len(steps[0])] = False  # request 1's first token: slot -1
    # the states some stored entry reads; every other state stays NaN
    reach = [np.zeros(n, bool) for n in seq_lens]
    for p, i in zip(positions[stored], reqs[stored], strict=True):
        reach[i][max(p - coff * r + 1, 0):p + 1] = True
    srows = sbs * rpt
    state_shape = (num_state, srows) + ((lanes,) if mode == "csa" else (4, lanes))
    kind = np.int32 if mode == "csa" else np.uint8
    rec_shape = (HCA_RECORDS if mode == "hca" else (1, srows)) + state_shape[2:]
    records = rng.integers(0, 256, (int(np.prod(rec_shape)) * kind().itemsize,), np.uint8)
    records = records.view(kind).reshape(rec_shape)
    state = _nan_bytes(state_shape, kind)
    proj_slots = np.concatenate([
        np.where(reach[i], (table[i, np.arange(n) // sbs] * sbs + np.arange(n) % sbs) * rpt, -1)
        for i, n in enumerate(seq_lens)]).astype(np.int32)
    per_rec = 2 if mode == "hca" else 1
    if mode == "hca":
        cache, state_cache = records, state
        rec_base = 0
    else:
        cache, state_cache = np.concatenate([state, records]), None
        rec_base = num_state * srows * (4 if mode == "indexer" else 1)
    slots = rec_base + per_rec * rng.permutation(len(positions)).astype(np.int32)
    slots[len(steps[0])] = -1
    kwargs = dict(block_table_stride=stride, state_block_size=sbs, compress_ratio=r,
                  overlap=overlap, state_cache=state_cache, rope_cache=None,
                  quant_block=64 if mode != "indexer" else 128)
    if mode == "csa":
        words = rng.integers(-2**31, 2**31, (cache.shape[0], cache.shape[1] // 4, tc.LANES))
        kwargs["rope_cache"] = words.astype(np.int32)
    num_pos = max(seq_lens)
    kwargs["cos_sin_cache"] = rng.uniform(-1, 1, (num_pos, tc.ROPE_DIM)).astype(np.float32)
    rms = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    n_all = sum(seq_lens)
    proj = (rng.standard_normal((n_all, HIDDEN)).astype(np.float32),
            (rng.standard_normal((HIDDEN, 2 * width)) / np.sqrt(HIDDEN)).astype(np.float32),
            rng.standard_normal((r, width)).astype(np.float32),
            np.concatenate([np.arange(n, dtype=np.int32) for n in seq_lens]), proj_slots,
            cache if state_cache is None else state_cache)
    args = (cache, positions, table.reshape(-1), reqs, slots, rms)
    return Case(mode, proj, kwargs, args, r, stored, seq_lens, table)


def saved(case: Case):
    """``proj_and_save_state`` applied: ``(args, kwargs)`` of the ``dsv4_compressor`` call."""
    state = tc.proj_and_save_state(*case.proj, compress_ratio=case.ratio)
    if case.kwargs["state_cache"] is not None:
        return case.args, {**case.kwargs, "state_cache": state}
    return (state, *case.args[1:]), case.kwargs


def decoded_states(cache, table, seq_lens, sbs, dim):
    """NumPy: each request's stored states ``f32[n, dim]`` from the cache bytes."""
    c = np.asarray(cache)
    f = c.view("<f4") if c.dtype == np.int32 else np.ascontiguousarray(
        c.transpose(0, 1, 3, 2)).view("<f4").reshape(c.shape[0], c.shape[1], -1)
    per_page = f.reshape(c.shape[0], -1)
    return [np.stack([per_page[table[i, q // sbs], (q % sbs) * dim:(q % sbs + 1) * dim]
                      for q in range(n)]) for i, n in enumerate(seq_lens)]


@pytest.fixture(scope="module", params=sorted(MODES))
def case(request):
    return make_case(request.param)


def test_proj_and_save_state_stores_the_projected_state(case):
    d, r, overlap, sbs, seq_lens, _ = MODES[case.mode]
    hidden, w, ape, pos, slots, cache = case.proj
    out = tc.proj_and_save_state(*case.proj, compress_ratio=r)
    assert out.shape == cache.shape and out.dtype == cache.dtype
    dim = paged_state.state_dim(d, overlap)
    got = np.concatenate(decoded_states(out, case.table, seq_lens, sbs, dim))
    width = dim // 2
    want = np.float64(hidden) @ np.float64(w)
    want[:, width:] += ape[pos % r]
    ok = slots >= 0
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)
    assert np.isnan(got[~ok]).all()  # slot -1: nothing written
    # only the stored tokens' rows changed
    changed = np.any(np.asarray(out).reshape(out.shape[0], out.shape[1], -1)
                     != cache.reshape(cache.shape[0], cache.shape[1], -1), axis=-1)
    assert changed.sum() == ok.sum() * dim * 4 // (cache[0, 0].size * cache.itemsize)


def test_entries_meet_the_float64_oracle(case):
    d, r, overlap, sbs, seq_lens, _ = MODES[case.mode]
    args, kw = saved(case)
    cache, pos, table, reqs, slots, rms = args
    state = cache if kw["state_cache"] is None else kw["state_cache"]
    store = jnp.asarray(case.stored)
    got = np.asarray(paged_state.paged_entries(
        state, jnp.asarray(pos), jnp.asarray(table), jnp.asarray(reqs), store, jnp.asarray(rms),
        jnp.asarray(kw["cos_sin_cache"]), block_table_stride=kw["block_table_stride"],
        state_block_size=sbs, ratio=r, overlap=overlap, eps=1e-6))
    states = decoded_states(state, case.table, seq_lens, sbs, paged_state.state_dim(d, overlap))
    cs = kw["cos_sin_cache"]
    width = states[0].shape[1] // 2
    oracle = [compress_sequence(s[:, :width], s[:, width:], np.zeros((r, width)), rms,
                                cs[:, :tc.ROPE_DIM // 2], cs[:, tc.ROPE_DIM // 2:], ratio=r)
              for s in states]
    for t in np.flatnonzero(case.stored):
        np.testing.assert_allclose(got[t], oracle[reqs[t]][pos[t] // r], rtol=1e-5, atol=1e-5)
    assert np.isfinite(got[case.stored]).all() and not got[~case.stored].any()


def _records(mode, rows):
    """The record bytes of entries ``rows`` as the cache stores them (the encoders)."""
    if mode == "csa":
        return tokamax_v4.encode_csa_records(rows)
    if mode == "indexer":
        return tokamax_index.encode_index_records(rows, quant_block=128)
    return tokamax_v4.words_to_slabs(tokamax_v4.encode_plane_rows(rows))


def test_dsv4_compressor_writes_exactly_the_stored_records(case):
    d, r, overlap, sbs, _, _ = MODES[case.mode]
    args, kw = saved(case)
    cache, pos, table, reqs, slots, rms = args
    new, new_rope = tc.dsv4_compressor(*args, **kw)
    assert new.shape == cache.shape and new.dtype == cache.dtype
    assert (new_rope is None) == (case.mode != "csa")
    state = cache if kw["state_cache"] is None else kw["state_cache"]
    rows = paged_state.paged_entries(
        state, jnp.asarray(pos), jnp.asarray(table), jnp.asarray(reqs),
        jnp.asarray(case.stored), jnp.asarray(rms), jnp.asarray(kw["cos_sin_cache"]),
        block_table_stride=kw["block_table_stride"], state_block_size=sbs, ratio=r,
        overlap=overlap, eps=1e-6)
    want = np.array(cache)
    t = np.flatnonzero(case.stored)
    recs = _records(case.mode, rows)
    if case.mode == "csa":
        want.reshape(-1, tc.LANES)[slots[t]] = np.asarray(recs[0])[t]
        want_rope = np.array(kw["rope_cache"])
        want_rope.reshape(-1, 32)[slots[t]] = np.asarray(recs[1])[t]
        np.testing.assert_array_equal(np.asarray(new_rope), want_rope)
    elif case.mode == "indexer":
        want.reshape(-1, want.shape[-1])[slots[t]] = np.asarray(recs)[t]
    else:
        flat = want.reshape(-1, 4, tc.LANES)
        flat[slots[t]], flat[slots[t] + 1] = np.asarray(recs)[t, 0], np.asarray(recs)[t, 1]
    np.testing.assert_array_equal(np.asarray(new), want)  # states and other slots unchanged


def test_hca_record_at_the_last_row_keeps_its_first_half():
    """tokamax's reference stores rows ``s, s + 1`` of a record at slot ``s`` and drops a row
    past the cache: a record at the last row writes that row only."""
    c = make_case("hca")
    args, kw = saved(c)
    t = int(np.flatnonzero(c.stored)[0])
    slots = np.array(args[4])
    last = c.args[0].shape[0] * c.args[0].shape[1] - 1
    slots[t] = last
    new = np.asarray(tc.dsv4_compressor(*args[:4], slots, args[5], **kw)[0])
    full = np.asarray(tc.dsv4_compressor(*args, **kw)[0]).reshape(-1, 4, tc.LANES)
    flat = new.reshape(-1, 4, tc.LANES)
    np.testing.assert_array_equal(flat[last], full[args[4][t]])
    others = np.setdiff1d(np.arange(flat.shape[0]), [last, args[4][t], args[4][t] + 1])
    np.testing.assert_array_equal(flat[others], full[others])


def test_implementation_names():
    c = make_case("indexer")
    args, kw = saved(c)
    want = tc.dsv4_compressor(*args, **kw)[0]
    got = tc.dsv4_compressor(*args, **kw, implementation=["mosaic_tpu", "xla"])[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(NotImplementedError, match="own per-sequence state ring"):
        tc.dsv4_compressor(*args, **kw, implementation="mosaic_tpu")
    with pytest.raises(ExceptionGroup):
        tc.dsv4_compressor(*args, **kw, implementation=("pallas", "mosaic_tpu"))
    with pytest.raises(ValueError, match="unknown implementation 'triton'"):
        tc.dsv4_compressor(*args, **kw, implementation="triton")
    with pytest.raises(NotImplementedError, match="no Pallas kernel"):
        tc.proj_and_save_state(*c.proj, compress_ratio=4, implementation="pallas")


@pytest.mark.parametrize("change, match", [
    (dict(compress_ratio=0), "compress_ratio must be positive"),
    (dict(block_table_stride=3), "len\\(block_table\\) = 8 must be a multiple of "
                                 "block_table_stride = 3"),
    (dict(state_block_size=5), "state_block_size 5 exceeds the 4 token states"),
    (dict(overlap=False), "the CSA indexer \\(head_dim=128\\) requires overlap=True"),
    (dict(quant_block=48), "quant_block must divide the key width 128"),
    (dict(cos_sin_cache=np.zeros((16, 32), np.float32)), "cos_sin_cache must be f32\\[max_pos, "
                                                          "64\\], got float32\\(16, 32\\)"),
    (dict(positions=np.zeros(12, np.int64)), "positions must be int32"),
    (dict(kv_slot_mapping=np.zeros(5, np.int32)), "kv_slot_mapping must have shape \\(12,\\)"),
    (dict(rms_weight=np.ones(256, np.float32)), "head_dim 256; served: 128 \\(CSA indexer\\)"),
    (dict(cache=np.zeros((4, 8, 4, 128), np.uint8)), "indexer cache must be uint8 \\(num_pages, "
                                                     "rows, 4, 256\\)"),
    (dict(state_cache=np.zeros((4, 8, 4, 256), np.int8)), "state_cache must be uint8"),
])
def test_dsv4_compressor_refusals_name_the_argument(change, match):
    c = make_case("indexer")
    names = ("cache", "positions", "block_table", "token_to_req_indices", "kv_slot_mapping",
             "rms_weight")
    call = {**dict(zip(names, c.args, strict=True)), **c.kwargs, **change}
    with pytest.raises((ValueError, TypeError), match=match):
        tc.dsv4_compressor(**call)


def test_csa_and_hca_refusals():
    c = make_case("csa")
    with pytest.raises(ValueError, match="needs rope_cache"):
        tc.dsv4_compressor(*c.args, **{**c.kwargs, "rope_cache": None})
    with pytest.raises(ValueError, match="quant_block must be 64 for CSA"):
        tc.dsv4_compressor(*c.args, **{**c.kwargs, "quant_block": 128})
    bad = np.zeros((c.args[0].shape[0], 3, tc.LANES), np.int32)
    with pytest.raises(ValueError, match="rope_cache must be int32 \\(num_pages, rows // 4"):
        tc.dsv4_compressor(*c.args, **{**c.kwargs, "rope_cache": bad})
    h = make_case("hca")
    with pytest.raises(ValueError, match="HCA cache must be uint8"):
        tc.dsv4_compressor(np.zeros((2, 16, tc.LANES), np.int32), *h.args[1:], **h.kwargs)
    small = np.zeros((2, 12, 4, tc.LANES), np.uint8)
    with pytest.raises(ValueError, match="state_cache page_size 12 must be a multiple of the 8"):
        tc.dsv4_compressor(*h.args, **{**h.kwargs, "state_cache": small})


@pytest.mark.parametrize("index, change, match", [
    (0, np.zeros((4, 3, 2)), "hidden_states must have rank 2"),
    (1, np.zeros((32, 1023), np.float32), "wkv_wgate must be \\(hidden, 2 \\* state_width\\)"),
    (2, np.zeros((3, 256), np.float32), "ape must have shape \\(compress_ratio, state_width\\) "
                                        "= \\(4, 256\\), got \\(3, 256\\)"),
    (2, np.zeros((4, 256), np.int32), "ape must be a floating array"),
    (4, np.zeros(3, np.int32), "slot_mapping must have shape"),
    (5, np.zeros((2, 8, 4, 200), np.uint8), "cache has 200 lanes"),
    (5, np.zeros((2, 7, 4, 256), np.uint8), "page_size 7 must be a multiple of the 2 rows"),
    (5, np.zeros((2, 8, 256), np.float32), "cache must be uint8"),
])
def test_proj_and_save_state_refusals_name_the_argument(index, change, match):
    args = list(make_case("indexer").proj)
    args[index] = change
    with pytest.raises((ValueError, TypeError), match=match):
        tc.proj_and_save_state(*args, compress_ratio=4)
