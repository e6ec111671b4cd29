"""The CPU stand-ins for the official DeepSeek-V4 GPU kernels
(``scripts/experiments/official_v4/kernels_cpu.py``, the harness that runs the released
``inference/model.py`` against this package: issue 27's evidence) checked on their own, without
the official code: the fp8 / fp4 QAT stand-ins equal ``reference.quant.qat``'s simulations bit
for bit on bf16 inputs, the Hadamard stand-in is the Sylvester rotation rounded once, and the
sparse attention stand-in meets a float64 softmax with the sink in the denominator (``-1`` slots
and unreferenced NaN rows ignored); ``cuda_ops`` selects ties as torch's CUDA top-k and rounds a
bf16 ``rsqrt`` once. Needs torch (skipped without it, as in CI)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference.quant import qat  # noqa: E402
from scripts.experiments.official_v4 import kernels_cpu as kc  # noqa: E402


def _bf16_rows(rng, shape):
    """bf16 values spanning magnitudes (block amaxes from 1e-6 to 1e3, some zero blocks), as a
    torch bf16 tensor and its exact f32 NumPy copy."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.uniform(-6, 3, (*shape[:-1], 1))).astype(np.float32)
    x[0, :64] = 0.0
    t = torch.from_numpy(x).to(torch.bfloat16)
    return t, t.to(torch.float32).numpy()


def test_act_quant_is_the_reference_fp8_sim_bit_for_bit():
    t, x = _bf16_rows(np.random.default_rng(1), (64, 448))
    got = kc.act_quant(t.clone(), 64, "ue8m0", torch.float8_e8m0fnu, True)
    want = np.asarray(qat.act_quant_sim(x, 64))
    np.testing.assert_array_equal(got.to(torch.float32).numpy(), want)
    codes, s = kc.act_quant(t, 64, "ue8m0")  # the non-inplace form: codes times scales
    back = codes.to(torch.float32).reshape(64, 7, 64) * s[..., None]
    np.testing.assert_array_equal(back.reshape(64, 448).numpy(), want)


def test_fp4_act_quant_is_the_reference_fp4_sim_bit_for_bit():
    t, x = _bf16_rows(np.random.default_rng(2), (64, 128))
    got = kc.fp4_act_quant(t.clone(), 32, True)
    np.testing.assert_array_equal(got.to(torch.float32).numpy(),
                                  np.asarray(qat.fp4_act_quant_sim(x, 32)))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 5.5, 0.26])
    np.testing.assert_array_equal(kc.fp4_round(ties).numpy(),
                                  [0, 1, 1, 2, 2, 4, 4, 0, -2, 6, 0.5])


def test_hadamard_is_the_rotation_rounded_once():
    t, x = _bf16_rows(np.random.default_rng(3), (16, 128))
    got = kc.hadamard_transform(t, scale=128 ** -0.5)
    assert got.dtype == torch.bfloat16
    h = np.asarray(qat._hadamard_matrix(128), np.float64)
    want = torch.from_numpy(x.astype(np.float64) @ h * 128 ** -0.5).to(torch.bfloat16)
    np.testing.assert_array_equal(got.to(torch.float32).numpy(),
                                  want.to(torch.float32).numpy())


def test_sparse_attn_meets_a_float64_softmax_with_the_sink():
    rng = np.random.default_rng(4)
    b, m, h, d, n, k = 1, 3, 2, 64, 150, 140  # 140 slots: three blocks of 64, the last partial
    q = torch.from_numpy(rng.standard_normal((b, m, h, d), dtype=np.float32) * 2).bfloat16()
    kv = torch.from_numpy(rng.standard_normal((b, n, d), dtype=np.float32)).bfloat16()
    sink = torch.from_numpy(rng.standard_normal(h).astype(np.float32))
    idx = np.full((b, m, k), -1, np.int32)
    for r in range(m):  # distinct rows 1..149 (row 0 never referenced), -1 scattered between
        pick = rng.choice(np.arange(1, n), size=100 + 10 * r, replace=False)
        slots = np.sort(rng.choice(k, size=pick.size, replace=False))
        idx[0, r, slots] = pick
    kv[0, 0] = float("nan")
    got = kc.sparse_attn(q, kv, sink, torch.from_numpy(idx), d ** -0.5).float().numpy()
    qd, kvd = q.double().numpy(), kv.double().numpy()
    for r in range(m):
        keys = kvd[0, idx[0, r][idx[0, r] >= 0]]
        s = qd[0, r] @ keys.T * d ** -0.5  # [h, j]
        mx = s.max(-1, keepdims=True)
        e = np.exp(s - mx)
        want = e @ keys / (e.sum(-1, keepdims=True) + np.exp(sink.double().numpy()[:, None] - mx))
        np.testing.assert_allclose(got[0, r], want, atol=2e-2 * np.abs(want).max())


def test_cuda_ops_topk_takes_the_lowest_indices_among_ties_rsqrt_rounds_once():
    x = torch.tensor([[1.0, 3, 3, 0, 3, -float("inf"), 3], [0, 0, 0, 0, 2, 0, 0]]).bfloat16()
    v = torch.tensor([0.890625, 1.0390625, 4.0]).bfloat16()  # 3 elements: torch's scalar path
    saved = torch.Tensor.topk, torch.rsqrt
    with kc.cuda_ops():
        values, idx = x.topk(3, dim=-1)
        r = torch.rsqrt(v)
    assert (torch.Tensor.topk, torch.rsqrt) == saved
    np.testing.assert_array_equal(idx.numpy(), [[1, 2, 4], [4, 0, 1]])
    np.testing.assert_array_equal(values.float().numpy(), [[3, 3, 3], [2, 0, 0]])
    want = torch.from_numpy(1 / np.sqrt(v.double().numpy())).bfloat16()  # one rounding
    np.testing.assert_array_equal(r.float().numpy(), want.float().numpy())
