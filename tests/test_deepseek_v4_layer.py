"""The statement of the official DeepSeek-V4 attention layer (``reference.deepseek_v4``): a float64
NumPy oracle of the layer written from ``shared/SPEC.md`` (one loop per query, as the official
prefill reads), prefill vs prefill + decodes across the window (128) and group (4, 128)
boundaries for every layer type, causality, the sink rule, the QAT switch, the QAT quantizers
bit for bit against NumPy oracles of the rules, and the refusals.

Tolerances: the statement is f32 and XLA's CPU dot rounds differently for different row
counts, so prefill vs decode (and f32 vs the f64 oracle) agree to f32 rounding (``ATOL`` on
outputs of size ~0.3). The CSA indexer's top-k can then flip where two entries' scores tie to
f32 rounding (SPEC.md: compare selections by score): such rows must be near-ties, rare, and are
left out of the output comparison."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import v4_compressor_oracle as oracle

from reference import deepseek_v4 as dv

B = 2
N = 260  # crosses the window (128), ratio-128 groups (127, 255) and many ratio-4 groups
CUT = 130  # prefill CUT tokens, then N - CUT one-token decodes
MAX_SEQ = 264
ATOL = 2e-5
TIE_TOL = 1e-4  # index scores closer than this to the cut-off count as ties
# The statement in the f32 regime (the default, bf16: tests/test_v4_bf16_regime.py)
_layer = functools.partial(dv.attention_layer, precision="f32")


@functools.cache
def _params(config):
    return dv.init_params(config, seed=7)


def _x(config, n=N, seed=1, b=B):
    return np.random.default_rng(seed).standard_normal((b, n, config.dim), dtype=np.float32)


@functools.cache
def _one_prefill(config, qat=False, n=N, max_seq=MAX_SEQ):
    state = dv.init_state(config, B, max_seq)
    return _layer(_params(config), _x(config, n), 0, state, config, qat=qat,
                              return_selection=True)


def _prefill_then_decode(config, cut, qat=False, n=N, max_seq=MAX_SEQ):
    x = _x(config, n)
    state = dv.init_state(config, B, max_seq)
    out, state, sel = _layer(_params(config), x[:, :cut], 0, state, config,
                                         qat=qat, return_selection=True)
    outs, sels = [out], [sel]
    for t in range(cut, n):
        out, state, sel = _layer(_params(config), x[:, t:t + 1], jnp.int32(t),
                                             state, config, qat=qat, return_selection=True)
        outs.append(out)
        sels.append(sel)
    sel = None if sels[0] is None else dv.IndexSelection(
        *(np.concatenate([np.asarray(getattr(s, f)) for s in sels], axis=1)
          for f in ("topk", "scores")))
    return np.concatenate([np.asarray(o) for o in outs], axis=1), state, sel


def _tie_rows(topk_a, topk_b, scores):
    """``bool[B, S]``: rows whose selected sets differ; asserts each difference is a near-tie
    at the cut-off of ``scores`` (one run's index scores)."""
    differ = np.zeros(topk_a.shape[:2], bool)
    for b, s in np.ndindex(*topk_a.shape[:2]):
        a = set(topk_a[b, s][topk_a[b, s] >= 0])
        c = set(topk_b[b, s][topk_b[b, s] >= 0])
        if a == c:
            continue
        differ[b, s] = True
        kth = np.sort(scores[b, s][list(a)])[0]
        for j in a ^ c:
            assert abs(scores[b, s, j] - kth) <= TIE_TOL, (b, s, j, scores[b, s, j], kth)
    return differ


# ---------------------------------------------------------------------------------------------
# A float64 oracle of the layer (no QAT), written from SPEC.md.

def _rot(x, pos, inv, sign=1.0):
    """Interleaved-pair RoPE of the last ``2 len(inv)`` dims of ``x [..., d]`` at ``pos``."""
    rd = 2 * len(inv)
    ang = sign * pos * inv
    head, tail = x[..., :-rd], x[..., -rd:].copy()
    a, b = tail[..., 0::2].copy(), tail[..., 1::2].copy()
    tail[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    tail[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return np.concatenate([head, tail], axis=-1)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _oracle_row(p, x, c):
    """One batch row ``x [S, dim]`` of the layer: ``(out [S, dim], chosen sets, index scores)``."""
    r, rd, eps, n = c.compress_ratio, c.rope_head_dim, c.norm_eps, x.shape[0]
    if r:
        inv = oracle.inv_freq(rd, c.compress_rope_theta, c.rope_factor, c.original_seq_len,
                              c.beta_fast, c.beta_slow)
    else:
        inv = oracle.inv_freq(rd, c.rope_theta, 1.0, 0, 0, 0)
    pos = np.arange(n)[:, None]
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    qr = _rms(x @ p["wq_a.weight"].T, p["q_norm.weight"], eps)
    q = (qr @ p["wq_b.weight"].T).reshape(n, c.n_heads, c.head_dim)
    q = _rot(_rms(q, 1.0, eps), pos[:, :, None], inv)
    kv = _rot(_rms(x @ p["wkv.weight"].T, p["kv_norm.weight"], eps), pos, inv)

    def entries(prefix, ratio):
        return oracle.compress_sequence(x @ p[f"{prefix}.wkv.weight"].T,
                                        x @ p[f"{prefix}.wgate.weight"].T, p[f"{prefix}.ape"],
                                        p[f"{prefix}.norm.weight"], cos, sin, ratio=ratio,
                                        eps=eps)
    comp = entries("compressor", r) if r else np.zeros((0, c.head_dim))
    scores = None
    if r == 4:
        keys = entries("indexer.compressor", 4)
        qi = _rot((qr @ p["indexer.wq_b.weight"].T).reshape(n, c.index_n_heads, -1),
                  pos[:, :, None], inv)
        w = x @ p["indexer.weights_proj.weight"].T * c.index_head_dim ** -0.5 \
            * c.index_n_heads ** -0.5
        scores = np.einsum("sh,shj->sj", w, np.maximum(np.einsum("shd,jd->shj", qi, keys), 0))
    out, chosen = [], []
    for t in range(n):
        n_vis = (t + 1) // r if r else 0
        if r == 4:
            order = sorted(range(n_vis), key=lambda j: (-scores[t, j], j))
            pick = order[:c.index_topk]
        else:
            pick = list(range(n_vis))
        chosen.append(set(pick))
        keys_t = np.concatenate([kv[max(0, t - c.window_size + 1):t + 1], comp[pick]])
        logits = np.einsum("hd,nd->hn", q[t], keys_t) * c.head_dim ** -0.5
        m = logits.max(axis=-1, keepdims=True)
        e = np.exp(logits - m)
        o = e @ keys_t / (e.sum(-1, keepdims=True) + np.exp(p["attn_sink"][:, None] - m))
        o = _rot(o, t, inv, -1.0).reshape(c.o_groups, -1)
        wo_a = p["wo_a.weight"].reshape(c.o_groups, c.o_lora_rank, -1)
        out.append(np.einsum("gd,grd->gr", o, wo_a).reshape(-1) @ p["wo_b.weight"].T)
    return np.array(out), chosen, scores


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_matches_the_f64_oracle(ratio):
    config = dv.tiny_config(ratio)
    out, _, sel = _one_prefill(config)
    p = {k: np.asarray(v, np.float64) for k, v in _params(config).items()}
    x = _x(config).astype(np.float64)
    for b in range(B):
        want, chosen, _ = _oracle_row(p, x[b], config)
        rows = np.ones(N, bool)
        if ratio == 4:
            got = np.asarray(sel.topk[b])
            ref = np.full_like(got, -1)
            for t, c in enumerate(chosen):
                ref[t, :len(c)] = sorted(c)
            rows = ~_tie_rows(got[None], ref[None], np.asarray(sel.scores[b])[None])[0]
            assert rows.mean() > 0.95
        np.testing.assert_allclose(np.asarray(out[b])[rows], want[rows], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Chunk / decode consistency, causality.

@pytest.mark.parametrize("ratio, qat", [(0, False), (4, False), (128, False), (0, True)])
def test_prefill_then_decodes_equals_one_prefill(ratio, qat):
    """260 tokens in one prefill vs 130 then 130 one-token decodes: the window ring wraps, the
    second ratio-128 entry and ratio-4 entries complete during decode. With QAT a quantizer
    could round the other way on an f32 rounding difference; none does here (measured: the
    outputs agree to 4e-7 with QAT on every layer type, and no CSA selection flips)."""
    config = dv.tiny_config(ratio)
    out, state, sel = _one_prefill(config, qat=qat)
    got, state2, sel2 = _prefill_then_decode(config, CUT, qat=qat)
    rows = np.ones((B, N), bool)
    if ratio == 4:
        rows = ~_tie_rows(np.asarray(sel.topk), sel2.topk, np.asarray(sel.scores))
        assert rows.mean() > 0.95
        np.testing.assert_allclose(sel2.scores, sel.scores, atol=TIE_TOL, rtol=0)
    np.testing.assert_allclose(got[rows], np.asarray(out)[rows], atol=ATOL, rtol=0)
    for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_future_tokens_do_not_change_earlier_outputs(ratio):
    config = dv.tiny_config(ratio)
    out, _, _ = _one_prefill(config)
    x = np.array(_x(config))
    x[:, 200:] = _x(config, seed=5)[:, 200:]
    out2, _ = _layer(_params(config), x, 0, dv.init_state(config, B, MAX_SEQ),
                                 config)
    np.testing.assert_array_equal(np.asarray(out2)[:, :200], np.asarray(out)[:, :200])
    assert not np.allclose(np.asarray(out2)[:, 200:], np.asarray(out)[:, 200:])


def test_real_head_dim_512_matches_the_oracle_and_qat_moves_it():
    """V4's real head (448 nope + 64 rope: fp8 QAT in 7 blocks of 64) and a 128-dim indexer
    (Hadamard + fp4 in 4 blocks of 32), the rest tiny; window 16 so it slides within 40
    tokens. QAT on a CSA layer may change the indexer's choice, hence no upper bound."""
    config = dv.tiny_config(4, dim=32, n_heads=2, o_groups=1, q_lora_rank=16, head_dim=512,
                            o_lora_rank=8, index_n_heads=2, window_size=16, index_topk=4)
    out, _, sel = _one_prefill(config, n=40, max_seq=48)
    p = {k: np.asarray(v, np.float64) for k, v in _params(config).items()}
    for b in range(B):
        want, chosen, _ = _oracle_row(p, _x(config, 40)[b].astype(np.float64), config)
        got = np.asarray(sel.topk[b])
        ref = np.full_like(got, -1)
        for t, c in enumerate(chosen):
            ref[t, :len(c)] = sorted(c)
        rows = ~_tie_rows(got[None], ref[None], np.asarray(sel.scores[b])[None])[0]
        np.testing.assert_allclose(np.asarray(out[b])[rows], want[rows], atol=ATOL, rtol=0)
    q_out, _, _ = _one_prefill(config, qat=True, n=40, max_seq=48)
    assert np.isfinite(np.asarray(q_out)).all()
    assert np.abs(np.asarray(q_out) - np.asarray(out)).max() > 1e-3


# ---------------------------------------------------------------------------------------------
# The sink and the QAT switch.

def test_the_sink_scales_each_token_by_the_rule():
    """One head, one group: the layer is linear in the attention output ``o``, and the sink
    scales ``o`` by ``f = 1 / (1 + exp(sink - lse))``. So ``out(sink) = f * out(-inf)``, and
    for two sinks ``(1 / f1 - 1) / (1 / f2 - 1) = exp(sink1 - sink2)`` whatever ``lse`` is."""
    config = dv.tiny_config(0, n_heads=1, o_groups=1)
    params = dict(_params(config))
    x = _x(config, n=12)
    state = dv.init_state(config, B, 16)

    def run(sink):
        params["attn_sink"] = jnp.full((1,), sink, jnp.float32)
        return np.asarray(_layer(params, x, 0, state, config)[0], np.float64)

    free, s1, s2 = run(-jnp.inf), run(0.5), run(2.0)
    fs = []
    for s in (s1, s2):  # one factor per token (least squares), in (0, 1), nothing left over
        f = (s * free).sum(-1, keepdims=True) / (free * free).sum(-1, keepdims=True)
        np.testing.assert_allclose(s, f * free, atol=1e-6 * np.abs(free).max())
        assert ((f > 0) & (f < 1)).all()
        fs.append(f[..., 0])
    ratio = (1 / fs[0] - 1) / (1 / fs[1] - 1)
    np.testing.assert_allclose(ratio, np.exp(0.5 - 2.0), rtol=1e-3)
    assert np.abs(run(40.0)).max() < 1e-9 * np.abs(free).max() + 1e-12  # sink dominates


@pytest.mark.parametrize("ratio", [0, 128])  # CSA: test_real_head_dim_512_...
def test_qat_on_differs_and_off_is_the_default(ratio):
    config = dv.tiny_config(ratio)
    out, _, _ = _one_prefill(config)
    state = dv.init_state(config, B, MAX_SEQ)
    off, _ = _layer(_params(config), _x(config), 0, state, config, qat=False)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(out))
    on, _, _ = _one_prefill(config, qat=True)
    diff = np.abs(np.asarray(on) - np.asarray(out))
    assert 1e-3 < diff.max() < 0.2, diff.max()


# ---------------------------------------------------------------------------------------------
# The QAT quantizers, bit for bit against NumPy oracles of SPEC.md's rules.

def _grid_round(y, values, codes):
    """Round ``y`` to the nearest of ``values`` (sorted, >= 0; odd ``codes`` = odd mantissa),
    ties to the even code, keeping the sign. Brute force over the grid, float64."""
    a = np.abs(y.astype(np.float64))[..., None]
    dist = np.abs(a - values)
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    pick = np.where(tied.sum(-1) > 1, np.argmax(tied & (codes % 2 == 0), axis=-1),
                    np.argmax(tied, axis=-1))
    return np.sign(y) * values[pick]


def _e4m3_grid():
    codes = np.arange(0x7F)  # 0x7F is NaN
    e, m = codes >> 3, codes & 7
    values = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return values, codes


E2M1 = (np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]), np.arange(8))


def _pow2_ceil_bits(s):
    """SPEC.md: ``ceil(log2(s))`` from the f32 bits (exponent + 1 if any mantissa bit)."""
    bits = np.asarray(s, np.float32).view(np.uint32)
    e = (bits >> 23).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.ldexp(np.float32(1), e).astype(np.float32)


def _quant_oracle(x, block, floor, qmax, grid):
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), np.float32(floor))
    s = _pow2_ceil_bits(amax / np.float32(qmax))  # an f32 division, as SPEC.md writes it
    y = np.clip(blocks / s, -qmax, qmax)
    return (_grid_round(y, *grid) * s).astype(np.float32).reshape(x.shape)


def _same_bits(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.uint32),
                                  np.asarray(b, np.float32).view(np.uint32))


def _hand_blocks(block, qmax, grid_values):
    """Hand blocks ``f32[8, block]``: midpoints between codes at scale exactly 1 (amax = qmax),
    the same with amax one ulp above qmax (scale 2), a tiny block, zeros, a block under the fp8
    amax floor, and random blocks."""
    rng = np.random.default_rng(0)
    ties = (grid_values[:-1] + grid_values[1:]) / 2  # every midpoint between adjacent codes
    above = np.nextafter(np.float32(qmax), np.float32(np.inf))
    rows = [
        [*np.resize(ties, block - 1), qmax],  # row 0: ties from the bottom, scale 1
        [*-np.resize(ties[::-1], block - 1), qmax],  # row 1: negative ties from the top
        [*np.resize(ties, block - 1), above],  # row 2: scale 2
        np.resize(grid_values[1:], block) * 2.0 ** -30,  # row 3: tiny
        np.zeros(block),  # row 4: the amax floor
        np.resize([1e-5, -3e-6, 2e-5], block),  # row 5: under the fp8 floor 1e-4
        rng.standard_normal(block) * 3.0,
        rng.standard_normal(block) * 1e3,
    ]
    return np.array(rows, np.float32)


def test_act_quant_sim_matches_the_rule_bit_for_bit():
    values, codes = _e4m3_grid()
    x = _hand_blocks(64, 448.0, values)
    x = np.concatenate([x, x * np.float32(2.0 ** 7)]).reshape(4, 4 * 64)  # 4 blocks a row
    _same_bits(dv.act_quant_sim(jnp.asarray(x)),
               _quant_oracle(x, 64, 1e-4, 448.0, (values, codes)))
    # the floor is on the amax: a block of 1e-5 gets scale 2**ceil(log2(1e-4 / 448)) = 2**-22
    small = np.full((1, 64), 1e-5, np.float32)
    s = np.float32(2.0 ** -22)
    _same_bits(dv.act_quant_sim(jnp.asarray(small)),
               (_grid_round(small / s, values, codes) * s).astype(np.float32))
    grid = np.array([values, -values], np.float32).reshape(-1)  # the oracle's grid is e4m3's
    np.testing.assert_array_equal(grid.astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
                                  grid)


def test_fp4_act_quant_sim_matches_the_rule_bit_for_bit():
    x = _hand_blocks(32, 6.0, E2M1[0]).reshape(2, 4 * 32)
    got = np.asarray(dv.fp4_act_quant_sim(jnp.asarray(x)))
    _same_bits(got, _quant_oracle(x, 32, 6 * 2.0 ** -126, 6.0, E2M1))
    # midpoints at scale 1 round to the even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    # 2.5->2, 3.5->4, 5->4
    assert got[0, :7].tolist() == [0, 1, 1, 2, 2, 4, 4]
    # the oracle's rounding is ml_dtypes' (RNE) e2m1 on the clamped values
    y = np.random.default_rng(1).uniform(-7, 7, 4096).astype(np.float32).clip(-6, 6)
    np.testing.assert_array_equal(_grid_round(y, *E2M1),
                                  y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_the_scale_ceiling_of_the_reciprocal_product_equals_the_quotients():
    """The official kernels multiply amax by f32(1 / qmax); SPEC.md divides. Every f32 amax in
    the binade holding qmax gets the same power of two (the mantissa pattern, hence the
    rounding, repeats in every normal binade)."""
    for qmax, lo in ((448.0, 256.0), (6.0, 4.0)):
        amax = (np.float32(lo).view(np.uint32) + np.arange(1 << 23, dtype=np.uint32)).view(
            np.float32)
        prod = _pow2_ceil_bits(amax * np.float32(1.0 / qmax))
        quot = _pow2_ceil_bits(amax / np.float32(qmax))
        np.testing.assert_array_equal(prod, quot)


def test_hadamard_rotation_is_the_normalized_sylvester_matrix():
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2
    np.testing.assert_allclose(np.asarray(dv.hadamard_rotate(jnp.eye(4))), h4, atol=0)
    x = jax.random.normal(jax.random.key(0), (3, 128))
    np.testing.assert_allclose(np.asarray(dv.hadamard_rotate(dv.hadamard_rotate(x))),
                               np.asarray(x), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Config presets and refusals.

def test_presets_have_the_released_dims_and_layer_types():
    flash, pro = dv.flash_config(), dv.pro_config()
    fr, pr = flash.compress_ratios[:43], pro.compress_ratios[:61]
    assert (fr.count(4), fr.count(128), fr.count(0)) == (21, 20, 2)
    assert (pr.count(4), pr.count(128), pr.count(0)) == (30, 31, 0)
    assert dv.flash_config(0).compress_ratio == 0 and dv.pro_config(1).compress_ratio == 128
    shapes = dv.param_shapes(flash)  # the V4-Flash checkpoint's attention tensors
    assert shapes["wo_a.weight"] == (8192, 4096) and shapes["wo_b.weight"] == (4096, 8192)
    assert shapes["wq_b.weight"] == (32768, 1024) and shapes["wq_a.weight"] == (1024, 4096)
    assert shapes["compressor.ape"] == (4, 1024)
    assert shapes["indexer.compressor.ape"] == (4, 256)
    assert shapes["indexer.wq_b.weight"] == (8192, 1024)
    assert dv.param_shapes(dv.flash_config(3))["compressor.ape"] == (128, 512)
    assert dv.param_shapes(pro)["wo_a.weight"] == (16384, 4096)
    assert hash(flash) == hash(dv.flash_config()) and flash != pro


def test_config_from_the_released_config_json():
    """The V4-Pro ``inference/config.json`` fields this layer reads (values as released)."""
    args = {"dim": 7168, "n_heads": 128, "q_lora_rank": 1536, "head_dim": 512,
            "rope_head_dim": 64, "o_groups": 16, "o_lora_rank": 1024, "window_size": 128,
            "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32,
            "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 1024,
            "compress_rope_theta": 160000, "compress_ratios": list(dv.PRO_COMPRESS_RATIOS),
            "vocab_size": 129280, "n_routed_experts": 384}
    assert dv.config_from_model_args(args, 5) == dv.pro_config(5)
    with pytest.raises(ValueError, match="model args lack 'index_topk'"):
        dv.config_from_model_args({k: v for k, v in args.items() if k != "index_topk"}, 5)


@pytest.mark.parametrize("fields, match", [
    (dict(n_heads=6, o_groups=4), "n_heads=6 must be a multiple of o_groups=4"),
    (dict(head_dim=64, rope_head_dim=64), "head_dim=64 must exceed rope_head_dim=64"),
    (dict(compress_ratios=(8,)), "got 8 in"),
    (dict(layer_id=1), "layer_id=1 must index compress_ratios"),
    (dict(rope_head_dim=63), "rope_head_dim=63 must be even"),
    (dict(index_topk=0), "index_topk must be positive"),
])
def test_bad_configs_are_refused_naming_the_numbers(fields, match):
    with pytest.raises(ValueError, match=match):
        dv.tiny_config(4, **fields)


def test_bad_params_are_refused_naming_the_key():
    config = dv.tiny_config(4)
    params, x = dict(_params(config)), _x(config, n=4)
    state = dv.init_state(config, B, 16)
    missing = {k: v for k, v in params.items() if k != "indexer.compressor.ape"}
    with pytest.raises(ValueError, match="missing 'indexer.compressor.ape'"):
        _layer(missing, x, 0, state, config)
    bad = dict(params, **{"wo_a.weight": jnp.zeros((32, 128))})
    with pytest.raises(ValueError, match=r"params\['wo_a.weight'\] must have shape \(32, 256\), "
                                         r"got \(32, 128\)"):
        _layer(bad, x, 0, state, config)
    with pytest.raises(ValueError, match="unexpected key 'wq_a.scale'"):
        _layer(dict(params, **{"wq_a.scale": jnp.ones(1)}), x, 0, state, config)
    hca = dv.tiny_config(128)
    with pytest.raises(ValueError, match="unexpected key 'indexer.compressor.ape'"):
        _layer(params, x, 0, dv.init_state(hca, B, 16), hca)


def test_bad_inputs_and_states_are_refused_naming_the_numbers():
    config = dv.tiny_config(128)
    params, x = _params(config), _x(config, n=4)
    state = dv.init_state(config, B, 16)
    with pytest.raises(ValueError, match="start_pos=13 with S=4 tokens must fit max_seq_len=16"):
        _layer(params, x, 13, state, config)
    with pytest.raises(ValueError, match=r"x.shape\[2\] must equal config.dim = 64"):
        _layer(params, x[..., :32], 0, state, config)
    with pytest.raises(ValueError, match=r"state.window must have shape \(3, 128, 128\)"):
        _layer(params, _x(config, n=4, b=3), 0, state, config)
    with pytest.raises(ValueError, match=r"state.compressor must be absent \(None\)"):
        _layer(_params(dv.tiny_config(0)), x, 0, state, dv.tiny_config(0))
    csa = dv.tiny_config(4, index_head_dim=96)
    with pytest.raises(ValueError, match="index_head_dim=96 to be a power of two"):
        _layer(_params(csa), x, 0, dv.init_state(csa, B, 16), csa, qat=True)
