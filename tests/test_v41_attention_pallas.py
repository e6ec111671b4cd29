"""The Pallas V4.1 attention over the window and pool pages (``pallas_kernels.v41_attention``,
issue 31 Deliver 3, the attention part), strict interpreter: each row's window tokens (fp8 /
ue8m0-32 records) and listed pool entries (fp4 / e4m3-16) read in place from layer 1 of stacks
whose every unwritten byte is 0xFF (NaN scales: a read of a slot no row may read poisons the
output), pages permuted, released window pages (-1), unlisted entries (-1), a row outside
every sequence; against ``deepseek_v41_layer.attend`` over the format's decode of the official
bytes (``decode_window_kv`` / ``decode_compressed_kv``), within the V4.1 step's tolerance.
The interpreter's bytes and descriptors equal ``entry.traffic``; the kernel AOT-compiles at
V4.1-Flash's dims on every chip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsa_jax.v41_cli import OUT_MEAN_ULPS, OUT_ULPS
from pallas_kernels import aot, chips, tpu
from pallas_kernels.measure import interpret_counter as counter
from pallas_kernels.v41_attention import decode
from pallas_kernels.v41_attention.entry import traffic, v41_attention, window_segments
from pallas_kernels.v41_attention.kernel import AttnConfig
from reference.quant.bf16 import rounding
from reference.statements import deepseek_v41_layer as L
from reference.v41 import pool_pages as pp
from reference.v41 import window_pages as wp
from reference.v41.formats import (
    decode_compressed_kv,
    decode_window_kv,
    encode_compressed_kv,
    encode_window_kv,
)
from tests.v4_bf16_oracle import out_error

pytestmark = pytest.mark.kernel_gate  # the three gates: also run on the newest jax (README)
POISON = 0xFFFFFFFF
NUM_PAGES = 24


def _pages(rng, rows_fn, n_tok, ps, dim, layout_rows, write):
    """Stack ``u32[2, NUM_PAGES, R, W]`` of 0xFF with ``n_tok`` official rows per sequence
    written at layer 1 on permuted pages; returns ``(pages, table [S, pps], rows per seq)``."""
    pages = jnp.full((2, NUM_PAGES, layout_rows, dim // 4), POISON, jnp.uint32)
    perm = rng.permutation(NUM_PAGES)
    table, all_rows, nxt = [], [], 0
    for n in n_tok:
        npg = -(-n // ps)
        ids = perm[nxt:nxt + npg]
        nxt += npg
        x = rng.standard_normal((n, dim)) * 2.0 ** rng.integers(-6, 6, (n, 1))
        rows = rows_fn(jnp.asarray(x, jnp.float32))
        t = np.arange(n)
        pages = write(pages, 1, jnp.asarray(ids[t // ps]), jnp.asarray(t % ps), rows,
                      page_size=ps, dim=dim)
        table.append(ids)
        all_rows.append(np.asarray(rows))
    return pages, table, all_rows


def make_case(rng, *, dim, heads, ps, window, topk, positions, pool_len, runs=False):
    """Two sequences; ``positions [(seq, p)]`` rows (seq -1: outside every sequence); each
    row lists 1..topk entries drawn at random, or (``runs``) a run of ``topk`` consecutive
    entries in a shuffled order (entries sharing record and scale rows)."""
    n_tok = [max(p for s, p in positions if s == i) + 1 for i in range(2)]
    win, wtab, wrows = _pages(rng, encode_window_kv, n_tok, ps, dim,
                              wp.page_rows(ps, dim), wp.write_tokens)
    pool, ptab, prows = _pages(rng, encode_compressed_kv, [pool_len] * 2, ps, dim,
                               pp.page_rows(ps, dim), pp.write_entries)
    t = len(positions)
    pos = np.array([p if s >= 0 else -1 for s, p in positions], np.int32)
    base = np.asarray(window_segments(jnp.asarray(pos), window_size=window, page_size=ps,
                                      dim=dim))
    wpage = np.full(base.shape, -1, np.int32)
    lists = np.full((t, topk), -1, np.int32)
    for r, (s, p) in enumerate(positions):
        if s < 0:
            continue
        for j, b in enumerate(base[r]):
            if b <= p and b // ps < len(wtab[s]):
                wpage[r, j] = wtab[s][b // ps]
        # the window page wholly behind the window: released
        first = max(p - window + 1, 0)
        wpage[r][(base[r] + AttnConfig(1, dim, window, ps, 0, "bf16").seg) <= first] = -1
        n = topk if runs else rng.integers(1, topk + 1)
        start = rng.integers(0, pool_len - n + 1)
        lists[r, :n] = (rng.permutation(np.arange(start, start + n)) if runs
                        else rng.choice(pool_len, n, replace=False))
    ppage = np.where(lists >= 0, np.asarray([ptab[max(s, 0)] for s, _ in positions])[
        np.arange(t)[:, None], np.maximum(lists, 0) // ps], -1).astype(np.int32)
    poff = np.where(lists >= 0, lists % ps, 0).astype(np.int32)
    q = rng.standard_normal((t, heads, dim)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    sink = rng.standard_normal(heads).astype(np.float32)
    args = (jnp.asarray(q), jnp.asarray(sink), win, jnp.asarray(wpage), jnp.asarray(base),
            jnp.asarray(pos))
    kw = dict(window_size=window, page_size=ps, window_layer=1, pool_pages_=pool,
              pool_page=jnp.asarray(ppage), pool_offset=jnp.asarray(poff), pool_layer=1)
    return args, kw, (wrows, prows, lists)


@pytest.mark.parametrize("dim,ps", [(512, 128), (64, 16)])
def test_decode_is_the_format_bit_for_bit(dim, ps):
    """``decode.window_values`` / ``pool_values`` in a kernel (strict interpreter) equal
    ``decode_window_kv`` / ``decode_compressed_kv`` of the official bytes, in the lane order,
    bit for bit: every token of a page (each scale slot, each record half), block magnitudes
    2^-20..2^20, NaN blocks."""
    rng = np.random.default_rng()
    x = rng.standard_normal((ps, dim)) * 2.0 ** rng.integers(-20, 20, (ps, 1))
    x[3, 40:45] = np.nan
    t = np.arange(ps)
    for encode, decode_ref, to_pages, lay, fn in (
            (encode_window_kv, decode_window_kv, wp.to_pages, wp.layout(dim), "window"),
            (encode_compressed_kv, decode_compressed_kv, pp.to_pages, pp.layout(dim), "pool")):
        rows = encode(jnp.asarray(x, jnp.float32))
        page = to_pages(rows[None])[0]
        rec = page[t // lay.per_row]
        scales = page[lay.record_rows(ps) + t // lay.per_scale_row]
        half = jnp.asarray((t % lay.per_row)[:, None], jnp.int32)
        slot = jnp.asarray((t % lay.per_scale_row)[:, None], jnp.int32)

        def kernel(r, h, sc, sl, o, fn=fn):
            if fn == "window":
                o[...] = decode.window_values(r[...], sc[...], sl[...], dim)
            else:
                o[...] = decode.pool_values(r[...], h[...], sc[...], sl[...], dim)

        got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((ps, dim), jnp.float32),
                             interpret=tpu.interpret_params(True))(rec, half, scales, slot)
        want = pp.to_lane_order(decode_ref(rows))
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                      np.asarray(want).view(np.uint32), err_msg=fn)


def _reference(q, sink, positions, window, truth, precision):
    """``L.attend`` per row over the decoded window tokens ``max(0, p - window + 1) .. p`` and
    listed entries; a row outside every sequence: zeros."""
    wrows, prows, lists = truth
    out = np.zeros(q.shape, np.float32)
    for r, (s, p) in enumerate(positions):
        if s < 0:
            continue
        toks = np.arange(max(p - window + 1, 0), p + 1)
        keys = [np.asarray(decode_window_kv(jnp.asarray(wrows[s][toks])))]
        ent = lists[r][lists[r] >= 0]
        if len(ent):
            keys.append(np.asarray(decode_compressed_kv(jnp.asarray(prows[s][ent]))))
        kv = jnp.asarray(np.concatenate(keys))[None]
        ok = jnp.ones((1, 1, kv.shape[1]), bool)
        o = L.attend(jnp.asarray(q[r])[None, None], kv, ok, jnp.asarray(sink),
                     q.shape[-1] ** -0.5, rounding(precision))
        out[r] = np.asarray(o[0, 0])
    return out


CASES = {  # V4.1-Flash's D, window and pages of 16 (segments of 16); the tiny config's dims
    "flash_dims": dict(dim=512, heads=4, ps=16, window=40, topk=8, pool_len=60,
                       positions=[(0, 50), (1, 3), (0, 17), (-1, 0), (1, 39)]),
    "tiny_dims": dict(dim=64, heads=2, ps=4, window=8, topk=4, pool_len=20,
                      positions=[(0, 9), (1, 0), (-1, 0), (1, 14)]),
    # runs of up to 24 consecutive entries across pages of 16: shared record and scale rows
    "flash_runs": dict(dim=512, heads=4, ps=16, window=40, topk=24, pool_len=60, runs=True,
                       positions=[(0, 50), (1, 3), (0, 17), (-1, 0), (1, 39)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_attention_equals_the_reference(name, precision):
    """Every row within the step's tolerance of the reference (bf16 ulps of its largest
    output); the row outside every sequence zeros; no NaN (no 0xFF slot read)."""
    case = CASES[name]
    args, kw, truth = make_case(np.random.default_rng(), **case)
    got = np.asarray(v41_attention(*args, **kw, precision=precision, interpret=True))
    want = _reference(np.asarray(args[0]), np.asarray(args[1]), case["positions"],
                      case["window"], truth, precision)
    assert not np.isnan(got).any()
    for r, (s, _) in enumerate(case["positions"]):
        if s < 0:
            np.testing.assert_array_equal(got[r], 0.0)
            continue
        top, mean, _ = out_error(got[r], want[r])
        assert top <= OUT_ULPS and mean <= OUT_MEAN_ULPS, (r, top, mean)


@pytest.mark.parametrize("name", ["flash_dims", "flash_runs"])
def test_bytes_and_dmas_equal_the_model(name):
    """The interpreter's counted bytes (lane padded) and descriptors equal ``entry.traffic``:
    a meta DMA a row, two DMAs a window segment with a page, one a distinct record row and one
    a distinct scale row of the listed entries with a page, q and the output blocks. Runs of
    consecutive entries share rows: fewer than two DMAs an entry."""
    case = CASES[name]
    args, kw, _ = make_case(np.random.default_rng(), **case)
    with counter.count_hbm_traffic() as mine:
        jax.block_until_ready(v41_attention(
            *args, **kw, interpret=pltpu.InterpretParams(dma_execution_mode="eager")))
    shape = dict(heads=case["heads"], dim=case["dim"], window_size=case["window"],
                 page_size=case["ps"])
    model = traffic(args[3], args[4], args[5], kw["pool_page"], **shape,
                    pool_offset=kw["pool_offset"])
    assert mine.dmas_unexecuted == 0
    assert mine.bytes(lane_padded=True) == model.bytes_moved
    assert mine.descriptors == model.dmas
    assert model.ratio > 1
    unshared = traffic(args[3], args[4], args[5], kw["pool_page"], **shape)
    if case.get("runs"):  # each run's pairs share a record row, its sixteens a scale row
        assert model.dmas < unshared.dmas - int((np.asarray(kw["pool_page"]) >= 0).sum())
    assert model.dmas <= unshared.dmas


def test_a_flash_row_fetches_a_shared_pool_row_once():
    """The model at V4.1-Flash (``scripts.cost.v41_attention_traffic``, which the
    interpreter's counts equal above): the newest 512 entries (a run: pairs share record rows,
    sixteens scale rows) move within 5% of the minimum in under a third of the unshared
    descriptors; random entries never more than unshared."""
    from scripts.cost import v41_attention_traffic as at

    rng = np.random.default_rng()
    run = at.per_row(at.ENTRIES["ratio 1"], "newest", 2, rng)
    assert run["bytes"] < 1.05 * run["minimum"] < run["bytes_unshared"]
    assert run["dmas"] < run["dmas_unshared"] / 3
    rand = at.per_row(at.ENTRIES["ratio 2"], "random", 2, rng)
    assert rand["bytes"] <= rand["bytes_unshared"] and rand["dmas"] <= rand["dmas_unshared"]


def test_the_next_rows_reads_start_before_this_row_is_written():
    """Cross-row overlap, in the interpreter's order of copies: row ``t + 1``'s meta is loaded
    (and its reads started) before row ``t``'s output block goes back to HBM, every row but
    the last; each row's meta once."""
    case = CASES["flash_dims"]
    args, kw, _ = make_case(np.random.default_rng(), **case)
    with counter.count_hbm_traffic() as mine:
        jax.block_until_ready(v41_attention(
            *args, **kw, interpret=pltpu.InterpretParams(dma_execution_mode="eager")))
    order = [(c.kind, c.src, c.dst) for c in mine.copies]
    metas = [i for i, c in enumerate(order) if c == ("dma", "hbm", "smem")]
    outs = [i for i, c in enumerate(order) if c[0] == "block" and c[2] == "hbm"]
    t = len(case["positions"])
    assert len(metas) == len(outs) == t
    assert all(metas[r + 1] < outs[r] for r in range(t - 1)), (metas, outs)


def test_refusals_name_the_argument():
    args, kw, _ = make_case(np.random.default_rng(), **CASES["tiny_dims"])
    with pytest.raises(ValueError, match=r"window_page must be \[T, S\] = \[4, 3\]"):
        v41_attention(args[0], args[1], args[2], args[3][:, :2], *args[4:], **kw)
    with pytest.raises(ValueError, match=r"window_pages must be u32\[L, P, 8, 16\]"):
        v41_attention(args[0], args[1], args[2][:, :, :4], *args[3:], **kw)
    with pytest.raises(ValueError, match="precision"):
        v41_attention(*args, **kw, precision="fp8")
    with pytest.raises(ValueError, match=r"pool_layer=2 is outside \[0, 2\)"):
        v41_attention(*args, **{**kw, "pool_layer": 2})


def test_bad_runtime_values_read_nothing():
    """A traced layer outside its stack, page ids outside ``[0, P)`` and offsets outside the
    page are never read (the strict interpreter raises on an out-of-bounds read): the window
    only, or nothing (zeros)."""
    case = CASES["tiny_dims"]
    args, kw, truth = make_case(np.random.default_rng(), **case)
    only_window = _reference(np.asarray(args[0]), np.asarray(args[1]), case["positions"],
                             case["window"], (*truth[:2], np.full_like(truth[2], -1)), "bf16")
    bad = {**kw, "pool_page": jnp.where(kw["pool_page"] >= 0, NUM_PAGES + 3, -1)}
    bad_off = {**kw, "pool_offset": kw["pool_offset"] + case["ps"]}
    rows = [r for r, (s, _) in enumerate(case["positions"]) if s >= 0]
    for change in (bad, bad_off):
        got = np.asarray(v41_attention(*args, **change, interpret=True))
        assert max(out_error(got[r], only_window[r])[0] for r in rows) <= OUT_ULPS
    got = jax.jit(lambda layer: v41_attention(*args, **{**kw, "window_layer": layer,
                                                         "pool_layer": layer},
                                              interpret=True))(jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(got), 0.0)


@pytest.mark.parametrize("with_pool", [True, False], ids=["window+pool", "window only"])
@pytest.mark.parametrize("chip", chips.NAMES)
def test_compiles_at_flash_dims(chip, with_pool):
    """AOT Mosaic compile (libtpu on CPU) at V4.1-Flash's attention: 64 heads x 512, window
    128, top-512 entries, pages of 128, a 16-row decode, stacks of 2 read at layer 1; and the
    window-only kernel of the SWA layers (no pool operands)."""
    t, h, d, ps, k = 16, 64, 512, 128, 512
    seg_n = AttnConfig(h, d, 128, ps, k, "bf16").segments
    f = jax.ShapeDtypeStruct
    args = (f((t, h, d), jnp.bfloat16), f((h,), jnp.float32),
            f((2, 64, wp.page_rows(ps, d), d // 4), jnp.uint32), f((t, seg_n), jnp.int32),
            f((t, seg_n), jnp.int32), f((t,), jnp.int32))
    pool = (f((2, 64, pp.page_rows(ps, d), d // 4), jnp.uint32), f((t, k), jnp.int32),
            f((t, k), jnp.int32))

    def call(q, sink, win, wpage, base, pos, *pool_args):
        kw = dict(zip(("pool_pages_", "pool_page", "pool_offset"), pool_args, strict=False))
        return v41_attention(q, sink, win, wpage, base, pos, window_size=128, page_size=ps,
                             window_layer=1, pool_layer=1, chip=chip, **kw)

    aot.aot_compile(call, [*args, *(pool if with_pool else ())], chip, "V4.1 attention pages")
