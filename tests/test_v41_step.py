"""The paged DeepSeek-V4.1 step (``dsa_jax.v41_step``, issue 31 deliverable 5) against the dense
statement (``reference.statements.deepseek_v41.attention_stack``), in lock-step.

Two sequences in one ragged batch (and a padded third slot, inactive, plus rows outside every
sequence, all NaN) on the tiny config with every mode (SWA, FULL at ratio 2 and 1, REUSE,
REINDEX, the candidate source and its consumer): one sequence prefills 23 tokens at once (it ends
on an odd position: a ratio-2 token parks in the state), the other in chunks of 7 and 13 (the
second chunk starts on an odd position: it takes its partner from the state), then 260 decodes
each, crossing every pair, window (8), candidate-block (4 entries) and page (4) boundary many
times. The statement runs each sequence alone with the same chunks. Unwritten cache bytes are
0xFF (an fp8 / fp4 row whose scale byte is 0xFF decodes to NaN) and the compressor states start
NaN, so a read of any slot that must not be read poisons the output; pages are permuted, and
window pages behind every row's window are released from the table (id -1) at each step."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from dsa_jax.v41_cli import OUT_MEAN_ULPS, OUT_ULPS
from dsa_jax.v41_step import (
    V41StepLayout,
    init_v41_caches,
    init_v41_states,
    v41_meta,
    v41_step,
)
from pallas_kernels import tpu
from reference.statements import deepseek_v41 as s41
from reference.v4_compressor.ref import CompressorState
from reference.v41 import index_fp4_bytes, v41_tiny
from tests.v4_bf16_oracle import out_error

C = v41_tiny()
step_mod = importlib.import_module("dsa_jax.v41_step")  # dsa_jax.v41_step is the function
PAGE = 4
DECODES = 260
MAX_SEQ = 288  # 23 + 1 + 260 = 284 tokens at most, even (ratio-2 pairs), 72 pages of 4
LAYOUT = V41StepLayout(C, PAGE, MAX_SEQ)
# The Pallas lock-step's pages: the interpreted index-scores kernel costs per page DMA (measured:
# ~1.3 s a call at pages of 4, ~0.24 s at 16); 29 tokens still cross a page of 16.
PALLAS_PAGE = 16
CHUNKS = ((23,), (7, 13))  # per sequence, then DECODES one-token steps each
OUTSIDE = 2  # rows after the last sequence's: outside every sequence (NaN inputs); the chunk
# steps pad to one row count (more outside rows), so the step compiles once for both
# The step's attention sums over each row's window and chosen entries only, the statement's over
# every token and entry under a mask: the same rounding points, f32 sums in other orders, so a
# bf16 probability or output can flip by one ulp, carried through wo_a / wo_b (two more bf16
# roundings). The tolerance (OUT_ULPS max, OUT_MEAN_ULPS mean) is the CLI's statement check's,
# declared there; measured on the 262-step run: max 2.00 ulps, largest step mean 0.047.


def _poisoned(layout, num_seqs):
    """Caches of 0xFF bytes (every scale byte NaN) and NaN compressor states."""
    caches = jax.tree.map(lambda x: jnp.full_like(x, jnp.iinfo(x.dtype).max),
                          init_v41_caches(layout, num_seqs))
    states = tuple(CompressorState(jnp.full_like(s.kv, jnp.nan), jnp.full_like(s.score, jnp.nan))
                   for s in init_v41_states(layout, num_seqs))
    return caches, states


def _page_order(table):
    """A fixed permutation of every family's pages (sequences' pages interleaved)."""
    return np.random.default_rng(len(table)).permutation(table)


def _schedule(decodes: int):
    """``[(q_lens, starts)]``: the chunks of both sequences side by side, then ``decodes``
    one-token steps; and each sequence's final length."""
    steps, starts = [], [0, 0]
    n = max(len(c) for c in CHUNKS)
    for i in range(n):
        q = [c[i] if i < len(c) else 1 for c in CHUNKS]
        steps.append((q, list(starts)))
        starts = [s + x for s, x in zip(starts, q, strict=True)]
    for _ in range(decodes):
        steps.append(([1, 1], list(starts)))
        starts = [s + 1 for s in starts]
    return steps, starts


def _step_inputs(xs_seq, q_lens, starts, layout=LAYOUT, rows=0):
    """The step's ``xs [L, T, dim]``: both sequences' rows, then NaN rows (``OUTSIDE`` at
    least, to ``rows``); meta for 3 sequence slots, the third inactive (pages of
    ``layout.page_size``)."""
    parts = [x[:, s:s + q] for x, q, s in zip(xs_seq, q_lens, starts, strict=True)]
    outside = max(OUTSIDE, rows - sum(q_lens))
    c = layout.config
    pad = np.full((len(c.compress_ratios), outside, c.dim), np.nan, np.float32)
    kv = [s + q for s, q in zip(starts, q_lens, strict=True)]
    meta = v41_meta(layout, [*kv, 5], [*q_lens, 0], num_active=2, page_order=_page_order)
    # window pages behind every row's window released (id -1): never read, never written
    table = np.asarray(meta.window_page_indices).copy()
    per, page = layout.pages_per_seq(0), layout.page_size
    for i, s in enumerate(starts):
        behind = (s - c.window_size + 1) // page  # pages wholly before the first row's window
        table[i * per:i * per + max(behind, 0)] = -1
    return np.concatenate([*parts, pad], axis=1), meta._replace(window_page_indices=table)


def _lockstep(decodes: int, layout=LAYOUT, **step_kwargs) -> None:
    """The step (``v41_step(..., layout=layout, **step_kwargs)``) against the statement over
    ``_schedule``'s chunks and ``decodes`` decodes (module docstring). Every step: each
    sequence's outputs on every layer equal the statement's within ``OUT_ULPS`` (max) and
    ``OUT_MEAN_ULPS`` (mean) bf16 ulps of each row's largest output, its top-k on every FULL
    and REINDEX layer and its candidate blocks identical; rows outside every sequence zeros."""
    c = layout.config
    params = s41.init_params(c, seed=3)
    rng = np.random.default_rng(7)
    steps, total = _schedule(decodes)
    xs_seq = [rng.standard_normal((len(c.compress_ratios), n, c.dim), dtype=np.float32)
              for n in total]
    caches, states = _poisoned(layout, 3)
    ref_states = [s41.init_state(c, 1, MAX_SEQ) for _ in CHUNKS]
    worst = worst_mean = 0.0
    n_chunks = max(len(c) for c in CHUNKS)
    chunk_rows = max(sum(q) for q, _ in steps[:n_chunks]) + OUTSIDE
    for n_step, (q_lens, starts) in enumerate(steps):
        rows = chunk_rows if n_step < n_chunks else 0
        xs, meta = _step_inputs(xs_seq, q_lens, starts, layout, rows)
        res = v41_step(params, xs, caches, states, meta, layout=layout, **step_kwargs)
        caches, states = res.caches, res.states
        out = np.asarray(res.out, np.float32)
        np.testing.assert_array_equal(out[:, sum(q_lens):], 0.0)
        off = 0
        for i, (q, s) in enumerate(zip(q_lens, starts, strict=True)):
            want, ref_states[i], sel = s41.attention_stack(
                params, xs_seq[i][:, None, s:s + q], s, ref_states[i], c, return_selection=True)
            msg = f"step {n_step} seq {i}"
            top, mean, _ = out_error(out[:, off:off + q], np.asarray(want[:, 0], np.float32))
            worst, worst_mean = max(worst, top), max(worst_mean, mean)
            assert top <= OUT_ULPS and mean <= OUT_MEAN_ULPS, (msg, top, mean)
            for j, layer in enumerate(layout.index_layers):
                np.testing.assert_array_equal(
                    np.sort(np.asarray(res.topk[j, off:off + q]), -1),
                    np.sort(np.asarray(sel.topk[layer][0]), -1), err_msg=f"{msg} layer {layer}")
            np.testing.assert_array_equal(np.asarray(res.candidates[off:off + q]),
                                          np.asarray(sel.candidates[0]), err_msg=msg)
            off += q
    assert total == [24 + decodes, 20 + decodes]
    print(f"lock-step: {len(steps)} steps, max {worst:.2f} bf16 ulps, step mean {worst_mean:.3f}")


@pytest.mark.slow  # started first (tests/conftest.py): no long tail
def test_the_step_meets_the_statement_in_lockstep():
    """The jnp step over 260 decodes (284 and 280 tokens)."""
    _lockstep(DECODES)


# V4.1-Flash's index geometry on the tiny config (index heads of 128, candidate blocks of 8; top-8
# among 2 blocks: 2 * 8 - 7 >= 8): the layout keeps the candidate source's keys in the block
# layout too (``V41StepLayout.block_keys``), and the Pallas consumer reads only its candidate
# blocks (``V41Caches.cand``).
C_BLOCKS = dataclasses.replace(C, index_head_dim=128, candidate_block_size=8, index_topk=8)
NO_RACES = pltpu.InterpretParams(**dict(tpu.STRICT_INTERPRET, detect_races=False))


@pytest.mark.slow  # started first (tests/conftest.py): no long tail
def test_the_pallas_step_meets_the_statement_in_lockstep():
    """``implementation="pallas"`` on ``C_BLOCKS`` (the ratio-2 compressor, the index scores over
    the index pages, the consumer's top-k from the candidate-block kernel over the block layout
    the step writes, poisoned at first: every block row a reused page's until its block's first
    entry resets it, and the attention over the window and pool pages on their kernels; the
    other selections jnp) over the chunks and 10 decodes (to 34 and 30 tokens: ratio-2 pairs
    completed from the state, window, candidate-block and page boundaries; the consumer's 2
    blocks of 8 among up to 5, the restriction binding), at pages of ``PALLAS_PAGE`` (each step
    shape's interpreted compile is most of it; a decode ~1.2 s). The strict interpreter without
    its race detection (NaN-filled memory, out-of-bounds reads raise): each kernel's races, its
    cross-row overlap included, are checked in its own multi-row tests
    (``test_v41_compressor_pallas``, ``test_v41_index_pages``, ``test_v41_candidate_blocks``,
    ``test_v41_attention_pallas``); here they cost a fifth of the run (measured: 137 s against
    111 s in one process). The tiny config's own Pallas consumer (index heads of 32, blocks of
    4: no block layout) reads whole pages holding candidates: ``index_topk_v41(candidates=)``,
    checked against the reference in ``tests/test_v41_index_pages.py``; its routing below."""
    layout = V41StepLayout(C_BLOCKS, PALLAS_PAGE, MAX_SEQ)
    assert layout.block_keys and layout.candidate_source == 3
    _lockstep(10, layout, implementation="pallas", kernel_options={"interpret": NO_RACES})


def test_a_consumer_reads_candidate_blocks_only_where_the_layout_keeps_them(monkeypatch):
    """The Pallas step's consumer routing, traced only (no compile): on the tiny config (no block
    layout: ``cand`` None) its consumer runs ``index_select_v41(candidates=)`` over the pages;
    on ``C_BLOCKS`` the candidate-block kernel over ``cand``; every other index source the page
    kernel, without candidates."""
    import pallas_kernels.indexer.v41_candidates as vc
    import pallas_kernels.indexer.v41_scores as vs

    calls = []

    def spy(name, fn):
        def call(*args, **kw):  # the page kernel takes candidates=; the block kernel always
            calls.append((name, name == "blocks" or kw.get("candidates") is not None))
            return fn(*args, **kw)
        return call

    def trace(config, layout):
        params = s41.init_params(config, seed=0)
        xs = np.zeros((len(config.compress_ratios), 3, config.dim), np.float32)
        jax.eval_shape(lambda: step_mod.v41_step_body(
            params, xs, init_v41_caches(layout, 1), init_v41_states(layout, 1),
            v41_meta(layout, [3], [3]), layout=layout, precision="bf16",
            implementation="pallas"))

    monkeypatch.setattr(vs, "index_select_v41", spy("pages", vs.index_select_v41))
    monkeypatch.setattr(vc, "candidate_topk_v41", spy("blocks", vc.candidate_topk_v41))
    for config, want in ((C, ("pages", True)), (C_BLOCKS, ("blocks", True))):
        layout = V41StepLayout(config, PALLAS_PAGE, MAX_SEQ)
        assert (init_v41_caches(layout, 1).cand is None) == (config is C)
        calls.clear()
        trace(config, layout)
        assert calls == [("pages", False), ("pages", False), want], calls


def _one_step(**change):
    params = s41.init_params(C, seed=0)
    xs = np.zeros((len(C.compress_ratios), 3, C.dim), np.float32)
    args = dict(params=params, xs=xs, caches=init_v41_caches(LAYOUT, 1),
                states=init_v41_states(LAYOUT, 1), meta=v41_meta(LAYOUT, [3], [3]))
    args.update(change)
    return v41_step(args.pop("params"), args.pop("xs"), args.pop("caches"), args.pop("states"),
                    args.pop("meta"), layout=LAYOUT, **args)


def test_an_empty_batch_is_a_step_that_does_nothing():
    res = _one_step(xs=np.zeros((len(C.compress_ratios), 0, C.dim), np.float32))
    assert res.out.shape == (len(C.compress_ratios), 0, C.dim)
    assert res.topk.shape == (len(LAYOUT.index_layers), 0, C.index_topk)
    assert res.candidates.shape == (0, C.candidate_topk_blocks)


@pytest.mark.parametrize("change, error, words", [
    (dict(xs=np.zeros((9, 3, 31), np.float32)), ValueError, ["xs", "31", "32"]),
    (dict(xs=np.zeros((8, 3, 32), np.float32)), ValueError, ["xs", "8", "9"]),
    (dict(states=()), ValueError, ["states", "1"]),
    (dict(implementation="xla", kernel_options={"interpret": True}), ValueError,
     ["kernel_options", "pallas"]),
    (dict(implementation="pallas", kernel_options={"blocks": 8}), ValueError,
     ["kernel_options", "blocks", "interpret"]),
    (dict(implementation="cuda"), ValueError, ["implementation", "cuda"]),
    (dict(precision="fp8"), ValueError, ["precision", "fp8"]),
    (dict(params=[]), ValueError, ["params", "9"]),
])
def test_bad_arguments_are_refused_by_name(change, error, words):
    with pytest.raises(error) as e:
        _one_step(**change)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_caches_of_the_wrong_shape_or_dtype_are_refused():
    good = init_v41_caches(LAYOUT, 1)
    width = good.window.shape[-1]  # window pages: record_words(64) = 16 lanes
    with pytest.raises(ValueError, match=rf"caches.window.*{width}\].*{width - 1}\)"):
        _one_step(caches=good._replace(window=good.window[..., :-1]))
    with pytest.raises(ValueError, match=r"caches.pool2.*uint32"):
        _one_step(caches=good._replace(pool2=good.pool2.astype(jnp.uint8)))
    with pytest.raises(ValueError, match=r"caches.keys1 must be given"):
        _one_step(caches=good._replace(keys1=None))
    with pytest.raises(ValueError, match=r"caches.keys2 must have shape \[1, P, 5, 4, 128\] "
                                         r"\(.*index pages\), got \(1, 36, 4, 128\)"):
        _one_step(caches=good._replace(keys2=good.keys2[:, :, 0]))
    with pytest.raises(ValueError, match=r"caches.keys2 must have dtype uint8"):
        _one_step(caches=good._replace(keys2=good.keys2.astype(jnp.int32)))


def _score_inputs():
    """A 45-row prefill (23 + 20 rows, 2 outside) over index pages of random unit keys
    (``encode_index_fp4``) of both ratios, random index queries and weights: ``(meta, rows,
    iq, w, keys)``, ``keys(r)`` the ratio-``r`` stack's ``(PagedBytes, RaggedBatch)``."""
    from reference.core import batch
    from reference.v41 import index_pages
    from reference.v41.formats import encode_index_fp4
    from reference.v41.paged import ragged

    rng = np.random.default_rng(5)
    xs_seq = [np.zeros((len(C.compress_ratios), n, C.dim), np.float32) for n in (24, 21)]
    _, meta = _step_inputs(xs_seq, [23, 20], [0, 0])  # a prefill
    caches = init_v41_caches(LAYOUT, 3)

    def encoded(pages):  # every slot a random key of unit scale, stored as the step stores it
        lead = pages.shape[:2]
        keys = rng.standard_normal((*lead, PAGE, C.index_head_dim), dtype=np.float32)
        return index_pages.to_pages(encode_index_fp4(jnp.asarray(keys)))

    caches = caches._replace(keys1=encoded(caches.keys1), keys2=encoded(caches.keys2))
    rows_n = 23 + 20 + OUTSIDE
    rows = batch.row_facts(rows_n, meta.kv_lens, meta.cu_q_lens, meta.distribution)
    iq = jnp.asarray(rng.standard_normal((rows_n, C.index_n_heads, C.index_head_dim)),
                     jnp.float32)
    w = jnp.asarray(rng.standard_normal((rows_n, C.index_n_heads)), jnp.float32)

    def keys(r):
        kv, per = step_mod._paged(LAYOUT, caches, meta, f"keys{r}", r)
        return kv, ragged(kv, meta.kv_lens, meta.cu_q_lens, meta.distribution,
                          pages_per_seq=per, ratio=r)

    return meta, rows, iq, w, keys


def test_index_scores_in_blocks_equal_one_block(monkeypatch):
    """The jnp index scores in blocks of whole pages (``SCORE_BLOCK_BYTES`` cut so that a block
    of the 45-row prefill holds 21 entries, 5 pages of 4: 15 blocks of the ratio-1 keys' 72
    pages and 8 of the ratio-2 keys' 36, the last ragged) equal one block's bit for bit, over
    index pages of random keys read at each ratio's stack row 0 (its one KV source). The
    function the step calls (``_scores``), not the whole step: the blocks are all that the
    knob changes."""
    meta, rows, iq, w, keys = _score_inputs()

    def scores(r):
        kv, b = keys(r)
        return np.asarray(jax.jit(lambda: step_mod._scores(iq, w, kv, 0, b, rows, meta,
                                                           "bf16"))())

    want = [scores(r) for r in (1, 2)]
    per_entry = iq.shape[0] * (4 * C.index_head_dim + 4 * C.index_n_heads
                               + index_fp4_bytes(C.index_head_dim))
    monkeypatch.setattr(step_mod, "SCORE_BLOCK_BYTES", 21 * per_entry)
    assert step_mod.score_block(iq.shape[0], C.index_n_heads, C.index_head_dim,
                                MAX_SEQ) // PAGE == 5
    for r, one in zip((1, 2), want, strict=True):
        got = scores(r)
        np.testing.assert_array_equal(got, one)
        # the visible entries of 43 rows scored from the random keys, nothing NaN
        assert (got != 0).sum() > 300 and not np.isnan(got).any()


def test_the_jnp_step_in_row_chunks_equals_one_chunk(monkeypatch):
    """The jnp step with its selection and attention a few rows at a time equals the step in
    one chunk bit for bit (outputs, top-k, candidates, caches, states) on a prefill of both
    sequences (45 rows) over poisoned caches, and its compiled program holds neither the
    scores ``f32[T, E]`` nor the decoded reads ``f32[T, width, D]``. ``SELECT_CHUNK_BYTES``
    cut to 13 rows of the ratio-2 keys' 144 entries: 4 chunks of 12 rows at ratio 2, 8 of 6 at
    ratio 1; ``ATTEND_CHUNK_BYTES`` to 13 rows of 12 reads (window 8 + top-4): 4 chunks of 12
    on compressed layers, 3 of 15 on SWA ones; every last chunk of 12 or 6 clamped to overlap
    the one before."""
    params = s41.init_params(C, seed=4)
    xs_seq = [np.random.default_rng(4).standard_normal((len(C.compress_ratios), n, C.dim),
                                                        dtype=np.float32) for n in (24, 21)]
    xs, meta = _step_inputs(xs_seq, [23, 20], [0, 0])
    t = xs.shape[1]
    step = jax.jit(step_mod.v41_step_body, static_argnames=("layout", "precision"))

    def run():
        caches, states = _poisoned(LAYOUT, 3)
        args = ([dict(p) for p in params], jnp.asarray(xs), caches, states, meta)
        step.clear_cache()  # the knobs are read at trace time
        compiled = step.lower(*args, layout=LAYOUT, precision="bf16").compile()
        return jax.tree.map(np.asarray, compiled(*args)), compiled.as_text()

    want, whole = run()
    widths = (C.window_size, C.window_size + C.index_topk)
    entries = (MAX_SEQ // 2, MAX_SEQ)  # the ratio-2 and ratio-1 keys' capacities
    monkeypatch.setattr(step_mod, "SELECT_CHUNK_BYTES", 13 * 4 * entries[0])
    monkeypatch.setattr(step_mod, "ATTEND_CHUNK_BYTES", 13 * 4 * widths[1] * C.head_dim)
    assert [step_mod.select_rows(t, e) for e in entries] == [12, 6]
    assert [step_mod.attend_rows(t, w, C.head_dim) for w in widths] == [15, 12]
    got, chunked = run()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (got.topk >= 0).sum() > 200 and np.abs(got.out[:, :43]).min(axis=-1).all()
    whole_rows = [f"f32[{t},{e}]" for e in entries] + [
        f"f32[{t},{w},{C.head_dim}]" for w in widths]
    for name in whole_rows:  # the one-chunk program has each; the chunked one none of them
        assert name in whole, name
        assert name not in chunked, name
    assert f"f32[12,{entries[0]}]" in chunked and f"f32[6,{entries[1]}]" in chunked


def test_bf16_weights_are_read_as_given():
    """``params`` in bf16 (an engine's weights) give the step of the same values in f32, bit for
    bit: the step upcasts inside its jit (exact), it does not copy them to f32 first."""
    params = s41.init_params(C, seed=6)
    as_bf16 = [{k: jnp.asarray(v, jnp.bfloat16) for k, v in p.items()} for p in params]
    as_f32 = [{k: jnp.asarray(v, jnp.float32) for k, v in p.items()} for p in as_bf16]
    xs = np.random.default_rng(6).standard_normal((len(C.compress_ratios), 6, C.dim),
                                                  dtype=np.float32)
    outs = []
    for p in (as_bf16, as_f32):
        res = v41_step(p, xs, init_v41_caches(LAYOUT, 1), init_v41_states(LAYOUT, 1),
                       v41_meta(LAYOUT, [6], [6]), layout=LAYOUT)
        outs.append(jax.tree.map(np.asarray, (res.out, res.topk, res.caches)))
    for a, b in zip(*(jax.tree.leaves(o) for o in outs), strict=True):
        np.testing.assert_array_equal(a, b)
