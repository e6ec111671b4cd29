"""The CPU stand-ins for the official DeepSeek-V4.1 GPU kernels
(``scripts/experiments/official_v41/kernels_cpu.py``, the harness that runs the released
``inference/model.py`` against the V4.1 statement) checked on their own, without the official
code: ``fp4_act_quant``'s two branches equal this package's stored formats bit for bit on bf16
inputs (the compressed kv: e4m3 scales per 16, ``reference.v41.formats.encode_compressed_kv``;
the index q / keys: ue8m0 per 32, ``encode_index_fp4``), the window's ``act_quant`` call equals
``encode_window_kv``, including all-zero blocks and magnitudes that saturate or underflow the
e4m3 scale. Needs torch (skipped without it, as in CI)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reference.v41 import formats  # noqa: E402
from scripts.experiments.official_v41 import kernels_cpu as kc  # noqa: E402


def _bf16_rows(rng, shape):
    """bf16 rows with per-row magnitudes from 2^-40 to 2^20 (the compressed kv's e4m3 scale
    then underflows to its floor or saturates at 448), a zero block and a zero row."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (2.0 ** rng.integers(-40, 20, (*shape[:-1], 1))).astype(np.float32)
    x[0, :32], x[1] = 0.0, 0.0
    t = torch.from_numpy(x).to(torch.bfloat16)
    return t, t.to(torch.float32).numpy()


@pytest.mark.parametrize("kind", ["compressed", "index", "window"])
def test_the_quantizer_stand_ins_are_the_stored_formats_bit_for_bit(kind):
    t, x = _bf16_rows(np.random.default_rng(), (256, 512 if kind != "index" else 128))
    if kind == "compressed":
        got = kc.fp4_act_quant(t.clone(), 16, True, scale_dtype=torch.float8_e4m3fn)
        want = formats.decode_compressed_kv(formats.encode_compressed_kv(x))
    elif kind == "index":
        got = kc.fp4_act_quant(t.clone(), 32, True)
        want = formats.decode_index_fp4(formats.encode_index_fp4(x))
    else:
        got = kc.act_quant(t.clone(), 32, "ue8m0", torch.float8_e8m0fnu, True)
        want = formats.decode_window_kv(formats.encode_window_kv(x))
    np.testing.assert_array_equal(got.to(torch.float32).numpy(), np.asarray(want))
