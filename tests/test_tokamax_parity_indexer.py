"""``dsa_jax.engines.tokamax.indexer`` against tokamax 0.0.17 itself (issue 29): on the same
random inputs, ``lightning_indexer(causal_rule="tpu_inference")`` equals
``tokamax.ops.lightning_indexer(implementation="xla")`` exactly (indices and score bits) on
decode rows, a prefill chunk and a mixed batch, in both cache layouts; the official rule
differs from tokamax's exactly on the early prefill rows it should; ``top_k`` equals
``tokamax.ops.top_k(implementation="xla")``; ``encode_index_records`` writes the bytes
tokamax's ``dsv4_compressor`` writes in indexer mode, and reads back as tokamax's reader does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tokamax = pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 (CI's 3.12 leg)")
pytestmark = pytest.mark.kernel_gate

from dsa_jax.engines.tokamax import indexer as tk  # noqa: E402
from reference.formats import tokamax_index as ti  # noqa: E402

D, H, PS, PPS, PAGES = 128, 4, 8, 3, 20  # ps entries per page; capacity 24 entries

BATCHES = {  # name: (q_lens, seq_lens, distribution, pad_rows, pad_seqs, ratio)
    "decode": ([1, 1, 1, 1], [37, 9, 96, 4], [4, 4, 4], 2, 1, 4),
    "prefill_chunk": ([16], [30], [0, 1, 1], 0, 0, 4),
    "mixed": ([1, 1, 12, 5], [37, 9, 12, 60], [2, 3, 4], 3, 1, 4),
    "tokens": ([1, 6], [20, 11], [1, 1, 2], 1, 0, 1),
}


def their_inputs(rng, name, layout, q_dtype=jnp.float32):
    """tokamax's positional arguments for batch ``name``: a fixed-stride table over a shuffled
    cache of random records (every page holds valid records: tokamax clips and reads what we
    skip, so only the selection may differ where nothing is visible)."""
    q_lens, seq_lens, dist, pad_rows, pad_seqs, _ = BATCHES[name]
    m = len(q_lens) + pad_seqs
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))])
    sl = np.concatenate([seq_lens, np.full(pad_seqs, 5)])
    x = rng.standard_normal((PAGES * PS, D)) * np.exp(rng.uniform(-3, 3, (PAGES * PS, 1)))
    cache = ti.write_index_records(jnp.zeros(ti.cache_shape(PAGES, PS, layout), jnp.uint8),
                                   np.arange(PAGES * PS, dtype=np.int32),
                                   ti.encode_index_records(x.astype(np.float32)),
                                   kv_layout=layout)
    t = sum(q_lens) + pad_rows
    q = jnp.asarray(rng.standard_normal((t, H, D)), q_dtype)
    w = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    table = rng.permutation(PAGES)[:m * PPS]
    return (q, w, cache, jnp.asarray(sl, jnp.int32), jnp.asarray(table, jnp.int32),
            jnp.asarray(cu, jnp.int32), jnp.asarray(dist, jnp.int32))


CASES = [  # (batch, layout, k); k = 32 > capacity: the -1 / -inf padding
    ("decode", ti.HEAD_ALONG_SUBLANE, 5), ("decode", ti.SEQ_ALONG_LANE, 32),
    ("prefill_chunk", ti.SEQ_ALONG_LANE, 5), ("mixed", ti.HEAD_ALONG_SUBLANE, 32),
    ("mixed", ti.SEQ_ALONG_LANE, 5), ("tokens", ti.HEAD_ALONG_SUBLANE, 5)]


@pytest.mark.parametrize(("name", "layout", "k"), CASES)
def test_lightning_indexer_equals_tokamax(name, layout, k):
    rng = np.random.default_rng()
    q_dtype = jnp.float8_e4m3fn if name == "mixed" else jnp.float32  # tokamax's arg_specs
    args = their_inputs(rng, name, layout, q_dtype)
    kw = dict(k=k, compression_ratio=BATCHES[name][-1], kv_layout=layout, return_scores=True)
    ours = tk.lightning_indexer(*args, causal_rule="tpu_inference", **kw)
    theirs = tokamax.ops.lightning_indexer(*args, implementation="xla", **kw)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])
    assert (np.asarray(ours[0]) == -1).any() and (np.asarray(ours[0]) >= 0).any()


def test_the_official_rule_differs_from_tokamax_on_early_prefill_rows():
    """seq_len = q_len = 12 at r = 4 (docs section 2.4): rows p = 0, 1, 2 see nothing
    officially and entry 0 in tokamax; rows with p % 4 == 3 agree."""
    rng = np.random.default_rng()
    q, w, cache, _, table, _, _ = their_inputs(rng, "prefill_chunk", ti.HEAD_ALONG_SUBLANE)
    args = (q[:12], w[:12], cache, jnp.asarray([12], jnp.int32), table[:PPS],
            jnp.asarray([0, 12], jnp.int32), jnp.asarray([0, 1, 1], jnp.int32))
    official = np.asarray(tk.lightning_indexer(*args, k=4, compression_ratio=4))
    theirs = np.asarray(tokamax.ops.lightning_indexer(*args, k=4, compression_ratio=4,
                                                      implementation="xla"))
    np.testing.assert_array_equal(official[0], [-1] * 4)
    np.testing.assert_array_equal(theirs[0], [0, -1, -1, -1])
    differ = [p for p in range(12) if not np.array_equal(official[p], theirs[p])]
    assert differ == [p for p in range(12) if p % 4 != 3]


@pytest.mark.parametrize("as_bits", [False, True])
def test_top_k_equals_tokamax(as_bits):
    rng = np.random.default_rng()
    s = rng.standard_normal((7, 40)).astype(np.float32)
    s[1, ::3] = -np.inf
    s[2, 5] = np.nan
    s[3, :10] = np.float32(0.25)  # ties: the lower column first
    lens = jnp.asarray([40, 40, 17, 40, 0, 3, 41], jnp.int32)
    x = jnp.asarray(s.view(np.int32) if as_bits else s)
    for k, row_lengths in ((8, lens), (40, None)):
        ours = tk.top_k(x, k, row_lengths, return_scores=True)
        theirs = tokamax.ops.top_k(x, k, row_lengths, return_scores=True, implementation="xla")
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_array_equal(ours[1], theirs[1])


def _state_cache(state: np.ndarray) -> jax.Array:
    """f32 states ``[P, tokens, 512]`` as tokamax's indexer cache hosts them: state value
    ``l`` of a 1024-byte slab row is bytes ``(0..3, l)`` (``docs/engines/tokamax.md`` 5)."""
    p, n, _ = state.shape
    b = state.reshape(p, n, 2, 256).view(np.uint8).reshape(p, n, 2, 256, 4)
    return jnp.asarray(np.ascontiguousarray(b.transpose(0, 1, 2, 4, 3)).reshape(p, 2 * n, 4, 256))


@pytest.mark.parametrize("quant_block", [128, 32])
def test_encode_index_records_writes_the_compressors_bytes(quant_block):
    """tokamax's ``dsv4_compressor`` (indexer mode, ``"xla"``) pools two boundary tokens'
    windows into records at slots 64 and 70; ``encode_index_records`` of the pooled keys (its
    ``compress_norm_rope``) gives the same 256 bytes, and tokamax's reader decodes them as
    ``dequantize_index_cache`` does."""
    from tokamax._src.ops.dsv4_compressor import reference as comp_ref
    from tokamax._src.ops.lightning_indexer import reference as li_ref

    rng = np.random.default_rng()
    pages, per_page, ratio = 4, 4, 4  # 4 states (8 slab rows, 32 record slots) per page
    state = np.zeros((pages, per_page, 4 * D), np.float32)
    state[:2] = rng.standard_normal((2, per_page, 4 * D))  # positions 0..7 in pages 0, 1
    cache = _state_cache(state)
    pos, table, req = (jnp.asarray(v, jnp.int32) for v in ([3, 7], [0, 1], [0, 0]))
    slots = np.array([64, 70], np.int32)
    rms_w = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
    ang = rng.uniform(0, 6, (16, 32))
    cos_sin = jnp.asarray(np.concatenate([np.cos(ang), np.sin(ang)], 1), jnp.float32)
    new, _ = tokamax.ops.dsv4_compressor(
        cache, pos, table, req, jnp.asarray(slots), rms_w, cos_sin_cache=cos_sin,
        block_table_stride=2, state_block_size=per_page, compress_ratio=ratio, overlap=True,
        quant_block=quant_block, implementation="xla")
    windows = comp_ref.gather_state_windows(jnp.asarray(state), pos, table, 2, req, per_page,
                                            D, ratio, True)
    pooled = jax.jit(comp_ref.compress_norm_rope, static_argnums=(6, 7))(
        *windows, rms_w, cos_sin, (pos // ratio) * ratio, 1e-6, 64)
    np.testing.assert_array_equal(ti.gather_index_records(new, slots),
                                  ti.encode_index_records(pooled, quant_block=quant_block))
    keys, scales = li_ref._dequantize_cache_kv(new, D, "head_along_sublane")
    keys = np.asarray(keys, np.float32).reshape(-1, D)[slots]
    theirs = keys * np.asarray(scales, np.float32).reshape(-1)[slots, None]
    ours = ti.dequantize_index_cache(new, quant_block=128)  # the reader's one scale
    np.testing.assert_array_equal(np.asarray(ours).reshape(-1, D)[slots], theirs)
