"""``dsa_jax.v4_step`` against the dense statement of the official layer
(``reference.deepseek_v4.attention_layer``), per sequence: the step's inputs are projected with
the statement's own pieces (``tests/v4_step_model.py``), its output finished with the
statement's inverse RoPE and output projection, and compared with the statement's output."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh

from dsa_jax.v4_step import V4Caches, V4ModelLayout, v4_step
from pallas_kernels import chips, tpu
from reference import deepseek_v4 as dv4
from reference.statements.deepseek_v4_layer import rope_tables
from tests import v4_bf16_oracle as oracle
from tests import v4_step_model as vm
from tests.isolated import run_isolated

RATIOS = (0, 4, 128)
MAX_SEQ = 400


INTERPRET = {"interpret": True}  # the strict Pallas interpreter (pallas_kernels.tpu)
# The same strict interpreter (NaN-filled uninitialised memory, out-of-bounds reads raising)
# without race detection: the lock-step run's decodes (race detection costs ~40% of a Pallas
# decode step in the interpreter: 0.76 s vs 1.25 s a step, measured alone); its prefill runs
# with it, and so does every other Pallas test here (a decode step of the same kernels:
# ``test_step_pallas_strict_interpreter_few_steps``).
INTERPRET_NO_RACES = {"interpret": pltpu.InterpretParams(
    **dict(tpu.STRICT_INTERPRET, detect_races=False))}


def _model(qat, seed=0, window_size=128):
    cfgs = vm.configs(RATIOS, window_size=window_size)
    params = [dv4.init_params(c, seed=seed + i) for i, c in enumerate(cfgs)]
    return cfgs, params


def _schedule(prefill, decodes):
    """Steps as per-sequence new-token counts: one prefill, then one-token decodes."""
    return [list(prefill)] + [[1] * len(prefill)] * decodes


def _drive(schedule, *, qat, backend="reference", kernel_options=None, seed=0, model=None,
           compare=True, pallas_from=0, backends=None, window_size=128, window_page_size=16,
           max_seq=MAX_SEQ, precision="f32", step_precision=None, oracle_check=False):
    """Run the paged step and the statement over ``schedule``; compare every step's output,
    per sequence and layer, with the statement's.

    ``backends``: ``[(backend, kernel_options), ...]`` driven in lockstep, each on its own
    paged caches, against ONE statement run (the statement's per-step cost paid once;
    ``kernel_options`` may be a function of the step number giving the options); default
    ``[(backend, kernel_options)]``, the backend taking over from step ``pallas_from`` (the
    steps before run the reference). ``window_size`` overrides the window (statement configs
    and layout alike). ``precision``: the regime of the projections, the step, the statement
    and the output side alike (``_assert_step_close`` gives the tolerance of each). Returns
    the paged model and the last step's result of the first backend. ``step_precision``
    overrides the step's own regime (default ``precision``). ``oracle_check``: at the end,
    every backend's and the statement's outputs of every step, per sequence and layer, against
    the float64 oracle of the bf16 regime (``_assert_meet_the_oracle``)."""
    cfgs, params = model or _model(qat, seed, window_size)
    backends = backends or [(backend, kernel_options)]
    num_seqs = len(schedule[0])
    total = np.sum(schedule, axis=0)
    rng = np.random.default_rng(seed + 100)
    xs = [jnp.asarray(rng.standard_normal((int(n), cfgs[0].dim), dtype=np.float32))
          for n in total]
    pms = [vm.PagedModel(RATIOS, num_seqs, max_seq, window_size=window_size,
                         window_page_size=window_page_size) for _ in backends]
    sp = vm.step_params(cfgs, params, max_seq)
    sink = jnp.stack([p["attn_sink"] for p in params])
    states = {(li, i): dv4.init_state(c, 1, max_seq) for li, c in enumerate(cfgs)
              for i in range(num_seqs)}
    done = np.zeros(num_seqs, int)
    carry = [(pm.caches, pm.states) for pm in pms]
    results = [None] * len(backends)
    # outputs and CSA picks per source (each backend, then the statement) and sequence
    outs = [[[[] for _ in cfgs] for _ in range(num_seqs)] for _ in range(len(backends) + 1)]
    picks = [[[] for _ in range(num_seqs)] for _ in range(len(backends) + 1)]
    for n_step, q_lens in enumerate(schedule):
        seq_pos = [np.arange(d, d + q, dtype=np.int32) for d, q in zip(done, q_lens, strict=True)]
        pos = np.concatenate(seq_pos)
        # Projected one sequence at a time, as the statement projects it (with QAT, a batch
        # of other rows can move a value across an fp8 rounding boundary).
        per_seq = [[vm.project(params[li], xs[i][done[i]:done[i] + q],
                               jnp.asarray(seq_pos[i]), c, max_seq, qat, precision)
                    for li, c in enumerate(cfgs)] for i, q in enumerate(q_lens)]
        per_layer = [{k: jnp.concatenate([p[li][k] for p in per_seq]) for k in per_seq[0][li]}
                     for li in range(len(cfgs))]
        meta = pms[0].meta(done + q_lens, q_lens, decode=max(q_lens) == 1)
        inputs = vm.step_inputs(cfgs, per_layer, sink)
        for b, (name, opts) in enumerate(backends):
            res = v4_step(inputs, sp, *carry[b], meta, layout=pms[b].layout, qat=qat,
                          backend=name if n_step >= pallas_from else "reference",
                          kernel_options=opts(n_step) if callable(opts) else opts,
                          precision=step_precision or precision)
            carry[b], results[b] = (res.caches, res.states), res
        row = 0
        for i, q in enumerate(q_lens if compare else []):
            for li, c in enumerate(cfgs):
                start = int(done[i]) if n_step == 0 else jnp.int32(done[i])
                want, states[li, i], sel = dv4.attention_layer(
                    params[li], xs[i][None, done[i]:done[i] + q], start, states[li, i], c,
                    qat=qat, precision=precision, return_selection=True)
                outs[-1][i][li].append(np.asarray(want[0], np.float32))
                if sel is not None:
                    picks[-1][i].append(np.asarray(sel.topk[0]))
                for b, ((name, _), res) in enumerate(zip(backends, results, strict=True)):
                    if sel is not None:
                        topk = res.topk[pms[0].layout.slot(li), row:row + q]
                        _assert_same_picks(topk, sel, f"{name}: step {n_step} seq {i} layer {li}")
                        picks[b][i].append(np.asarray(topk))
                    got = vm.finish(params[li], res.out[li, row:row + q].astype(jnp.float32),
                                    jnp.asarray(pos[row:row + q]), c, max_seq, precision)
                    outs[b][i][li].append(np.asarray(got))
                    _assert_step_close(got, want[0], precision,
                                       f"{name}: step {n_step} seq {i} layer {li} "
                                       f"(ratio {c.compress_ratio})")
            row += q
        done = done + q_lens
    if oracle_check:
        _assert_meet_the_oracle([n for n, _ in backends] + ["statement"], outs, picks, xs,
                                cfgs, params, max_seq, qat)
    return pms[0], results[0]


# The step and the statement against the float64 oracle of the bf16 regime over a whole run (the
# oracle takes each sequence whole), in bf16 ulps of each row's largest output. Measured on the
# lock-step run (at 260 decodes: 280 and 263 tokens, every layer type): the statement and the
# Pallas step at most 1.62 ulps, mean <= 0.010, <= 0.17% of the elements a whole ulp off; the
# reference step at most 1.5 ulps, mean <= 0.154 and <= 2.1% (its attention merges the window
# and compressed parts by LSE, P rounded against each part's max: ``_assert_step_close``'s
# note).
ORACLE_OUT_ULPS, ORACLE_OUT_MEAN_ULPS, ORACLE_OUT_FLIP_FRACTION = 3.0, 0.3, 0.05
# CSA rows whose picks score as the oracle's top-k: issue 27's bar for the official code against
# itself (430 of 440 decode rows). A row can miss when an fp4 index-key code sits one step from
# the oracle's (the regime's flips, ``tests/test_v4_bf16_regime.py``), moving a small score by
# several of the row's ulps. Measured (the lock-step run): 280 / 280 and 262 / 263 rows, the
# same rows for the statement and both backends.
ORACLE_PICK_FRACTION = 430 / 440


def _assert_meet_the_oracle(names, outs, picks, xs, cfgs, params, max_seq, qat):
    """Each source's (``names``: the backends, then the statement) outputs of every step,
    per sequence and layer, against ``tests/v4_bf16_oracle.py`` on the whole sequence: CSA picks
    scoring as the oracle's own top-k (``oracle.picks_score_as_the_oracle``) on at least
    ``ORACLE_PICK_FRACTION`` of the rows, then the outputs against the oracle fed the source's
    own picks, in bf16 ulps of each row's largest output (``ORACLE_OUT_*``)."""
    for i, x in enumerate(xs):
        x = np.asarray(x, np.float64)
        for li, c in enumerate(cfgs):
            p = {k: np.asarray(v) for k, v in params[li].items()}
            cos, sin = (np.asarray(t, np.float64) for t in rope_tables(c, max_seq))
            base, fed = oracle.layer(p, x, c, cos, sin, qat=qat), {}
            for s, name in enumerate(names):
                got, msg = np.concatenate(outs[s][i][li]), f"{name}: seq {i} layer {li}"
                want = base
                if c.compress_ratio == 4:
                    topk = np.concatenate(picks[s][i])
                    ok = oracle.picks_score_as_the_oracle(topk, base["scores"], base["picks"],
                                                          c.index_topk)[0].sum()
                    print(f"oracle {msg}: picks score as the oracle's top-k on {ok} of "
                          f"{len(x)} rows")
                    assert ok >= ORACLE_PICK_FRACTION * len(x), (msg, ok, len(x))
                    key = tuple(tuple(sorted(r[r >= 0])) for r in topk)
                    if key not in fed:  # the sources' picks are mostly the same sets
                        same = key == tuple(tuple(sorted(r)) for r in base["picks"])
                        fed[key] = base if same else oracle.layer(
                            p, x, c, cos, sin, qat=qat, picks=[list(r) for r in key])
                    want = fed[key]
                worst, mean, flips = oracle.out_error(got, want["out"])
                print(f"oracle {msg}: max {worst:.2f} mean {mean:.3f} ulp, {flips:.4f} >= 1")
                assert (worst <= ORACLE_OUT_ULPS and mean <= ORACLE_OUT_MEAN_ULPS
                        and flips <= ORACLE_OUT_FLIP_FRACTION), (msg, worst, mean, flips)


# The step against the statement in the bf16 regime: the same rounding points, but the reference
# attention merges its window and compressed parts by LSE (P rounded against each part's max, the
# statement's against the row's; the Pallas kernel's against its running max, as the official
# kernel's) and the f32 sums run in other orders, so a bf16 rounding can flip by one ulp; the
# outputs (bf16) are compared in bf16 ulps of each row's largest output.
# Measured (prefill 20 + 3, 40 decodes, window 8, QAT): the reference step up to 1 ulp and a row
# mean up to 0.24, the Pallas step up to 0.5 ulp and 0.12; the f32 step against the bf16
# statement is refused (``test_the_f32_step_is_not_the_bf16_regime``).
BF16_OUT_ULPS, BF16_OUT_MEAN_ULPS = 2.0, 0.5


def _assert_step_close(got, want, precision, msg):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if precision == "f32":
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4, err_msg=msg)
        return
    ulp = 2.0 ** (np.floor(np.log2(np.abs(want).max(axis=-1, keepdims=True))) - 7)
    err = np.abs(got - want) / ulp
    assert err.max() <= BF16_OUT_ULPS and err.mean() <= BF16_OUT_MEAN_ULPS, (
        msg, err.max(), err.mean())


def _assert_same_picks(topk, sel, msg):
    """The step's CSA selection ``topk i32[q, k]`` is the statement's (``IndexSelection``: the
    official form, visible entries best first, ``-1`` after), compared by the statement's own
    scores (ties at a bf16 score are common; either backend breaks them by the lower entry,
    as the statement's ``lax.top_k``, but an f32 sum in another order can move a score across
    a rounding boundary): the same number of picks per row, and each row's picked scores,
    sorted, equal to the statement's within one bf16 ulp of the row's best."""
    topk, want = np.asarray(topk), np.asarray(sel.topk[0])
    scores = np.asarray(sel.scores[0], np.float64)
    assert topk.shape[1] >= want.shape[1], (msg, topk.shape, want.shape)
    np.testing.assert_array_equal((topk >= 0).sum(1), (want >= 0).sum(1), err_msg=msg)
    for r in range(topk.shape[0]):
        got_s = np.sort(scores[r, topk[r][topk[r] >= 0]])
        want_s = np.sort(scores[r, want[r][want[r] >= 0]])
        tol = 2.0 ** -7 * (np.abs(want_s).max() if want_s.size else 0.0)
        np.testing.assert_allclose(got_s, want_s, rtol=0, atol=tol, err_msg=msg)


@pytest.mark.slow
def test_step_equals_statement_long_decode():
    """Prefill (133 and 118 tokens) then 140 decodes (to 273 and 258 tokens): both sequences
    cross ratio-128 groups (entry 0 completes at position 127 in the first's prefill and at
    the second's 10th decode; entry 1 at position 255 in both sequences' decodes, at different
    steps), many ratio-4 groups (the second's prefill leaves 2 tokens of a group pending) and
    the 128-token window (the first's prefill is longer than it, the second crosses it while
    decoding); every layer type, each step against the statement (reference backend, qat off;
    was 7 tokens and 256 decodes: the same crossings at ~half the steps). Run in a process
    of its own (``tests/isolated.py``): a worker crashed in XLA:CPU's compile here once, after
    an hour of other tests (issue 26)."""
    run_isolated(reference_long_decode)


def reference_long_decode() -> None:
    """The body of ``test_step_equals_statement_long_decode`` (a child process runs it)."""
    _drive(_schedule([133, 118], 140), qat=False, backend="reference")


# The window of the lockstep run and its page size (the interpreter's cost grows with the
# window: one DMA per window token per row and layer; 16 in pages of 8 cost ~1.3x per step).
LOCKSTEP_WINDOW, LOCKSTEP_WINDOW_PAGE = 8, 4
# Decodes after the prefill: the >= 256 issue 27 asks; both sequences pass position 255 (HCA
# entry 1: 20 + 256 = 276 and 3 + 256 = 259 tokens).
LOCKSTEP_DECODES = 256


@pytest.mark.slow
def test_both_backends_equal_statement_long_decode():
    """Issue 21's long run in the official regime (issue 27: ``precision="bf16"``, QAT on),
    both backends in lockstep against ONE statement run: a prefill of 20 and 3 tokens then
    ``LOCKSTEP_DECODES`` decodes (to 276 and 259 tokens), every step of both the reference and
    the Pallas backend (the strict interpreter, prefill included) against the statement in the
    same regime, per sequence and layer (``_assert_step_close``); at the end every step's
    output of the statement and of both backends against the float64 oracle of the regime
    (``tests/v4_bf16_oracle.py``, issue 27 deliverable 5: ``_assert_meet_the_oracle``). Both
    sequences complete
    ratio-128 entries 0 and 1 (positions 127 and 255) and every ratio-4 group on the way, at
    different steps. The window is 8 tokens (statement and layout; pages of 4), so it is
    crossed from the prefill on (sequence 0's prefill is longer than it) and a window spans
    page boundaries: the interpreter's cost grows with the window (128: about 5x per step),
    the 128-token window is covered by ``test_step_equals_statement_long_decode`` (f32, QAT
    off) and the Pallas decode after a ratio-4 group by
    ``test_step_pallas_strict_interpreter_few_steps``. The f32 regime's lockstep (QAT off, 130
    decodes) is gone to keep the suite in its budget: its crossings are this run's code, its
    arithmetic the f32 tests' (issue 26). The Pallas prefill runs the strict interpreter with
    race detection, its decodes without (``INTERPRET_NO_RACES``: a decode step's race check
    is ``test_step_pallas_strict_interpreter_few_steps``'s). Run in a process of its own
    (``tests/isolated.py``)."""
    run_isolated(lockstep_long_decode)


def _lockstep_options(n_step: int) -> dict:
    """The Pallas backend's options at step ``n_step`` of the lock-step run: races checked on
    the prefill (step 0), not on the decodes."""
    return INTERPRET if n_step == 0 else INTERPRET_NO_RACES


def lockstep_long_decode() -> None:
    """The body of ``test_both_backends_equal_statement_long_decode`` (a child process runs
    it)."""
    _drive(_schedule([20, 3], LOCKSTEP_DECODES), qat=True,
           backends=[("reference", None), ("pallas", _lockstep_options)],
           window_size=LOCKSTEP_WINDOW,
           window_page_size=LOCKSTEP_WINDOW_PAGE, max_seq=288, precision="bf16",
           oracle_check=True)


def test_step_equals_statement_across_the_second_hca_group_with_qat():
    """Prefill 250 and 3 tokens, then 8 decodes: the first sequence completes HCA entry 1 at
    position 255 and two ratio-4 groups, its window has long dropped the prefill's start;
    every layer type; QAT on (off: the long decode test and the others)."""
    _drive(_schedule([250, 3], 8), qat=True, backend="reference")


def test_the_f32_step_is_not_the_bf16_regime():
    """The tolerance of the bf16 comparison refuses the f32 step against the bf16 statement
    (the regime is the step's, not the projections')."""
    with pytest.raises(AssertionError):
        _drive(_schedule([37, 5], 2), qat=True, precision="bf16", step_precision="f32")


def test_step_pallas_strict_interpreter_few_steps():
    """The Pallas backend (strict interpreter off TPU: indexer and fused V4 kernel) on a
    decode step after a reference prefill of 131 and 6 tokens: it completes a ratio-4 group
    (entry 32) and its window drops token 3, every layer type; against the statement. (A
    Pallas prefill of 137 rows takes > 10 min in the interpreter on 2 cores.)"""
    _drive(_schedule([131, 6], 1), qat=False, backend="pallas", kernel_options=INTERPRET,
           pallas_from=1)


CHUNK_LENGTHS = ((257, 300), (129, 300), (1, 300))  # per sequence: crosses 255, 127, any
CHUNK_MAX_SEQ = 304
CHUNK_ROWS = 64  # rows of every split step (the rest: padding rows outside every sequence)


@st.composite
def _split(draw):
    """Sequence lengths and a split of their tokens into steps: each sequence cycles its own
    drawn pattern of new-token counts (1: a decode, 2..48: a chunk) from its drawn first step
    on; a step takes every due sequence whose piece still fits ``CHUNK_ROWS`` rows (the others
    wait) and orders them decodes first, rotated by the step number, so batch positions, page
    tables and phases mix."""
    lengths = [draw(st.integers(lo, hi)) for lo, hi in CHUNK_LENGTHS]
    pieces = []
    for n in lengths:
        pattern = draw(st.lists(st.one_of(st.just(1), st.integers(2, 48)), min_size=1,
                                max_size=12))
        cut, k = [], 0
        while sum(cut) < n:
            cut.append(min(pattern[k % len(pattern)], n - sum(cut)))
            k += 1
        pieces.append(cut)
    first = [draw(st.integers(0, 12)) for _ in lengths]
    skip = [draw(st.sampled_from([0, 2, 3, 5])) for _ in lengths]  # sit out every k-th (0: never)
    steps, nxt, t = [], [0] * len(lengths), 0
    while any(nxt[i] < len(pieces[i]) for i in range(len(lengths))):
        rows, step = 0, []
        for j in range(len(lengths)):
            i = (j + t) % len(lengths)
            if nxt[i] == len(pieces[i]) or t < first[i] or skip[i] and t % skip[i] == 0:
                continue
            q = pieces[i][nxt[i]]
            if rows + q <= CHUNK_ROWS:
                step.append((i, q))
                rows += q
                nxt[i] += 1
        if step:
            steps.append(sorted(step, key=lambda s: s[1] != 1))  # decodes first, stable
        t += 1
    return lengths, steps


@functools.cache
def _chunk_model():
    cfgs, params = _model(False)
    return cfgs, params, vm.step_params(cfgs, params, CHUNK_MAX_SEQ)


def _run_split(lengths, steps, proj, rows):
    """The reference step over ``steps`` (``[(seq, new tokens), ...]`` each) on fresh paged
    caches; every step padded to ``rows`` rows. Returns ``(result, outputs per sequence
    f32[L, n, H, 512])``."""
    cfgs, params, sp = _chunk_model()
    pm = vm.PagedModel(RATIOS, len(lengths), CHUNK_MAX_SEQ)
    caches, states, res = pm.caches, pm.states, None
    done = np.zeros(len(lengths), int)
    outs = [[] for _ in lengths]
    sink = jnp.stack([p["attn_sink"] for p in params])
    for step in steps:
        seqs = [i for i, _ in step]
        q_lens = [q for _, q in step]
        per_layer = []
        for li in range(len(cfgs)):
            d = {}
            for key in proj[0][li]:
                x = np.concatenate([proj[i][li][key][done[i]:done[i] + q] for i, q in step])
                pad = np.zeros((rows - len(x),) + x.shape[1:], x.dtype)
                d[key] = jnp.asarray(np.concatenate([x, pad]))
            per_layer.append(d)
        meta = pm.batch_meta(seqs, [done[i] + q for i, q in step], q_lens,
                             sum(q == 1 for q in q_lens) if len(steps) > 1 else 0)
        res = v4_step(vm.step_inputs(cfgs, per_layer, sink), sp, caches, states, meta,
                      layout=pm.layout, backend="reference", precision="f32")
        caches, states = res.caches, res.states
        out, row = np.asarray(res.out), 0
        for i, q in step:
            outs[i].append(out[:, row:row + q])
            row += q
            done[i] += q
    return res, [np.concatenate(o, axis=1) for o in outs]


@pytest.mark.slow
def test_step_is_chunk_invariant():
    """``chunk_invariance`` (below) in a process of its own whose XLA:CPU compiles optimise
    (``tests/isolated.py``, ``optimized=True``): its ~600 steps of 64 rows run the same few
    programs over and over, where the suite's quick compile (-O0) made them ~1.6x slower
    (alone: 39 s in the suite's flags, 24 s optimised, session 26)."""
    run_isolated(chunk_invariance, optimized=True)


# Three derandomized examples (was 4; issue 26's suite budget): all-decode splits (257 steps),
# a 30-token chunk then mostly decodes (278 steps) and chunk-heavy splits with late joins
# (63 steps); the fourth (10-token chunks and decodes, 310 steps) added no phase of its own.
@settings(max_examples=3, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(_split())
def chunk_invariance(split):
    """Chunk invariance of the paged step as a property (reference backend): three sequences
    (257-300, 129-300 and 1-300 tokens: ratio-128 entries 0 and 1, ratio-4 groups, the
    128-token window) split into steps of mixed phases (one-token decodes first, then chunks
    of 2-48 tokens, sequences joining late and sitting steps out, batch order rotating) leave
    the same window, compressed (``csa_compressed``, ``csa_index``, ``hca_compressed``) caches
    and compressor states, bit for bit, as one prefill of every token; every token's output
    follows the one prefill's (the outputs themselves are checked against the statement by
    the long tests). The step's inputs are projected once per sequence and sliced, so only
    the step's own arithmetic is under test."""
    lengths, steps = split
    cfgs, params, _ = _chunk_model()
    rng = np.random.default_rng(sum(lengths))
    pos = jnp.arange(CHUNK_MAX_SEQ)
    proj = []
    for n in lengths:
        x = np.zeros((CHUNK_MAX_SEQ, cfgs[0].dim), np.float32)
        x[:n] = rng.standard_normal((n, cfgs[0].dim), dtype=np.float32)
        proj.append([{k: np.asarray(v) for k, v in vm.project(
            params[li], jnp.asarray(x), pos, c, CHUNK_MAX_SEQ, False).items()}
            for li, c in enumerate(cfgs)])
    one, want = _run_split(lengths, [[(i, n) for i, n in enumerate(lengths)]], proj,
                           len(lengths) * CHUNK_MAX_SEQ)
    got_res, got = _run_split(lengths, steps, proj, CHUNK_ROWS)
    for name in V4Caches._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got_res.caches, name)),
                                      np.asarray(getattr(one.caches, name)), err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_res.states),
                            jax.tree.leaves(one.states), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"sequence {i}")


# ----------------------------------------------------------------------------- refusals


def _one_step_args():
    cfgs, params = _model(False)
    pm = vm.PagedModel(RATIOS, 2, MAX_SEQ)
    x = jnp.ones((3, cfgs[0].dim), jnp.float32)
    pos = jnp.asarray([0, 1, 0])
    per_layer = [vm.project(params[li], x, pos, c, MAX_SEQ, False) for li, c in enumerate(cfgs)]
    inputs = vm.step_inputs(cfgs, per_layer, None)
    return inputs, vm.step_params(cfgs, params, MAX_SEQ), pm, pm.meta([2, 1], [2, 1], False)


def test_refuses_bad_ratio():
    with pytest.raises(ValueError, match=r"compress_ratios\[1\]=8"):
        V4ModelLayout((0, 8), 16, 4)


def test_refuses_family_for_missing_type():
    with pytest.raises(ValueError, match="no layer has ratio 4"):
        V4ModelLayout((0, 128), 16, 4, csa_page_size=8, csa_pages_per_seq=2,
                      hca_page_size=4, hca_pages_per_seq=1)


@pytest.mark.parametrize("change, match", [
    (lambda a: a[0]._replace(window_kv=a[0].window_kv[:, :2]),
     r"inputs.window_kv must have shape \(3, 3, 512\)"),
    (lambda a: a[0]._replace(csa_kv=a[0].csa_kv[..., :512]),
     r"inputs.csa_kv must have shape \(1, 3, 1024\)"),
    (lambda a: a[0]._replace(hca_score=None), "inputs.hca_score is missing"),
])
def test_refuses_bad_inputs(change, match):
    args = _one_step_args()
    inputs, sp, pm, meta = args
    with pytest.raises(ValueError, match=match):
        v4_step(change(args), sp, pm.caches, pm.states, meta, layout=pm.layout,
                backend="reference")


def test_refuses_missing_param_and_bad_state():
    inputs, sp, pm, meta = _one_step_args()
    with pytest.raises(ValueError, match="params.csa_ape is missing"):
        v4_step(inputs, sp._replace(csa_ape=None), pm.caches, pm.states, meta,
                layout=pm.layout, backend="reference")
    bad = pm.states._replace(hca=pm.states.hca._replace(kv=pm.states.hca.kv[:, :64]))
    with pytest.raises(ValueError, match=r"states.hca.kv must have shape \(3, 128, 512\)"):
        v4_step(inputs, sp, pm.caches, bad, meta, layout=pm.layout, backend="reference")


def test_sharded_step_equals_the_single_device_step_per_local_batch():
    """``sharded_v4_step`` on a 2 x 2 (data x model) mesh equals ``v4_step`` on each local
    batch (heads split on the model axis, caches and states per data shard)."""
    from argparse import Namespace

    from dsa_jax import sharded_v4_step, v4_cli

    args = Namespace(quick=True, context=256, prefill=8, heads=2, topk=16, layers=4,
                     page_size=16)
    s = v4_cli.sizes(args)
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [1, 3, 8], [200, 131, 8]
    local = [v4_cli.build(rng, s, q_lens, kv_lens) for _ in range(2)]
    layout = local[0][0]
    stacked = [jax.tree.map(lambda *xs: np.stack(xs), *[b[j] for b in local])
               for j in range(1, 6)]
    stacked[1] = local[0][2]  # params replicated
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    got = sharded_v4_step(mesh, *stacked, layout=layout, backend="reference", precision="f32")
    for d, (_, inputs, _, caches, states, meta) in enumerate(local):
        want = v4_step(inputs, local[0][2], caches, states, meta, layout=layout,
                       backend="reference", precision="f32")
        np.testing.assert_allclose(np.asarray(got.out[d]), np.asarray(want.out), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.topk[d]), np.asarray(want.topk))
        np.testing.assert_array_equal(np.asarray(got.states.hca.kv[d]),
                                      np.asarray(want.states.hca.kv))


def test_fp8_caches_follow_the_plain_step():
    """Window and compressed caches in the fp8 MODEL1 format (``V4ModelLayout(...,
    window_cache_format="fp8", compressed_cache_format="fp8")``): the step writes quantized
    rows and entries and reads them back; its output follows the plain-cache step to fp8
    accuracy (the caches' history quantized from the same values)."""
    import dataclasses
    from argparse import Namespace

    from dsa_jax import v4_cli

    args = Namespace(quick=True, context=256, prefill=8, heads=2, topk=16, layers=4,
                     page_size=16)
    layout, inputs, params, caches, states, meta = v4_cli.build(
        np.random.default_rng(5), v4_cli.sizes(args), [1, 3, 8], [200, 131, 8])
    want = v4_step(inputs, params, caches, states, meta, layout=layout, backend="reference")
    fp8 = dataclasses.replace(layout, window_cache_format="fp8", compressed_cache_format="fp8")
    lay = fp8.layout_for(4)
    q = {f: (None if getattr(caches, f) is None else
             lay.to_cache(getattr(caches, f), "window")) for f in caches._fields
         if f != "csa_index"}
    got = v4_step(inputs, params, caches._replace(**q), states, meta, layout=fp8,
                  backend="reference")
    ref = np.asarray(want.out)
    err = np.linalg.norm(np.asarray(got.out) - ref) / np.linalg.norm(ref)
    assert err < 0.05, err
    assert not np.isnan(np.asarray(got.out)).any()


def test_v4_step_cost_script_quick(capsys):
    """``scripts/cost/v4_step_cost.py --quick`` compiles the step for v6e (the Pallas compressor):
    no narrow gathers."""
    from scripts.cost import v4_step_cost as mod

    mod.main(["--quick", "--compressors", "pallas"])
    text = capsys.readouterr().out
    assert f"{chips.DEFAULT} (pallas compressor): 4 layers, 8 decode rows x 2048 tokens" in text
    assert "narrow gathers/scatters (< 128 elements per index, > 1024 indices): []" in text
