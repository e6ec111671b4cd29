"""The V4 step's window rows written by the fused attention kernel (``dsa_jax.v4_step`` on the
Pallas backend, ``dsa_jax.v4_step_writes.attend_writing``; ``pallas_kernels.v4_attention.writes``)
against the XLA scatter it replaces (``write_windows`` before the attention), bit for bit: one
step's outputs and every window stack, packed bf16 words, f32 and fp8 MODEL1, in the strict
interpreter. The batch mixes decode rows, a 3-row chunk and an 8-row prefill from position 0
(fp8: rope rows shared by 3 and by 4 of the step's tokens), two padding rows outside every
sequence, and NaN in every window slot the step writes (the writes must replace them) and in
the fp8 rope quarters of tokens no row writes or reads."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from argparse import Namespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsa_jax import v4_cli
from dsa_jax.v4_step import v4_step_body
from pallas_kernels import chips, xla_cost
from pallas_kernels.measure import interpret_counter as counter
from pallas_kernels.v4_attention import compile_cases, writes
from pallas_kernels.v4_attention.state import v4_attention_state
from reference.formats import model1
from reference.v4_attention import PagedKV

pytestmark = pytest.mark.kernel_gate
step_mod = importlib.import_module("dsa_jax.v4_step")  # the package exports the function

Q_LENS, KV_LENS = [1, 3, 8], [40, 21, 8]


def _batch(fmt: str):
    """One synthetic step at tiny dims (``v4_cli.build``), window stacks in ``fmt``; NaN in
    each slot a row of the step writes (fp8: its nope record; and the rope quarters of the
    page positions past every sequence's length, never read)."""
    args = Namespace(quick=True, context=256, prefill=8, heads=2, topk=16, layers=2,
                     page_size=16)
    rng = np.random.default_rng(7)
    layout, inputs, params, caches, states, meta = v4_cli.build(
        rng, v4_cli.sizes(args), Q_LENS, KV_LENS)
    layout = dataclasses.replace(layout, window_cache_format=fmt, compressed_cache_format=fmt)
    lay = layout.layout_for(0)
    ps = layout.window_page_size
    table, cu = np.asarray(meta.window_page_indices), np.asarray(meta.window_cu_lens)
    fields = [f for f in caches._fields if f.endswith("_window") and getattr(caches, f) is not None]
    out = {}
    for f in fields:
        x = np.array(getattr(caches, f))
        for s, (ql, kv) in enumerate(zip(Q_LENS, KV_LENS, strict=True)):
            for p in range(kv - ql, kv):
                x[:, table[cu[s] // ps + p // ps], p % ps] = np.nan
        cache = lay.to_cache(x, "window")
        if fmt == "fp8":  # unread quarters of the last pages' rope rows: NaN bits
            rope = np.array(cache.rope)
            for s, kv in enumerate(KV_LENS):
                pid = table[cu[s] // ps + (kv - 1) // ps]
                quarter = rope[:, pid].view(np.uint32).reshape(rope.shape[0], -1, 4, 32)
                for p in range(kv, -(-kv // ps) * ps):
                    quarter[:, (p % ps) // 4, p % 4] = 0x7FC00000
            cache = model1.Fp8V4Cache(cache.nope, rope)
        out[f] = cache
    for r, f in ((4, "csa_compressed"), (128, "hca_compressed")):  # one format per kernel
        if getattr(caches, f) is not None:
            out[f] = layout.layout_for(r).to_cache(np.asarray(getattr(caches, f)), "compressed")
    return layout, inputs, params, caches._replace(**out), states, meta, fields


def _run(batch, fused: bool, monkeypatch):
    layout, inputs, params, caches, states, meta, _ = batch
    monkeypatch.setattr(step_mod, "fuses_writes", lambda *a: fused)
    fn = jax.jit(functools.partial(
        v4_step_body, layout=layout, sm_scale=None, qat=False, exact=True, backend="pallas",
        kernel_options=(("interpret", True),), precision="bf16"))
    return fn(inputs, params, caches, states, meta)


def _written(n, fmt: str, calls: int):
    """The interpreter's count ``n`` of the writes of ``calls`` writing attention calls, each
    writing this step's ``sum(Q_LENS)`` tokens: the model's bytes and descriptors per token
    (``writes.written_bytes`` / ``written_dmas``: an HBM -> HBM copy is read and written;
    fp8: the nope record, and the rope row of a leader only, the first of the step's tokens
    on that row; the model's worst case is every token a leader)."""
    copies = [c for c in n.select("hbm", "hbm", "dma") if "uint" in c.dtype or fmt == "plain"]
    tokens = calls * sum(Q_LENS)
    leaders = calls * sum(len({p // writes.QUARTERS for p in range(kv - ql, kv)})
                          for ql, kv in zip(Q_LENS, KV_LENS, strict=True))
    dmas = tokens * writes.written_dmas(fmt) - (tokens - leaders if fmt == "fp8" else 0)
    assert len(copies) == dmas, n.table()
    per_dma = writes.written_bytes(fmt) // 2 // writes.written_dmas(fmt)
    assert {c.nbytes for c in copies} == {per_dma}


@pytest.mark.parametrize("fmt", ["packed", "fp8"])
def test_fused_window_writes_equal_the_scatter_bit_for_bit(fmt, monkeypatch):
    """... and the interpreter counts the writes' bytes and descriptors of the model
    (``writes.written_bytes`` / ``written_dmas`` per token, ``_written``)."""
    batch = _batch(fmt)
    assert all(writes.writable(getattr(batch[3], f)) for f in batch[-1])
    with counter.count_hbm_traffic() as n:
        got = _run(batch, True, monkeypatch)
        jax.block_until_ready(got)
    _written(n, fmt, calls=len(batch[-1]) * 2)  # each window stack, at each of the 2 layers
    want = _run(batch, False, monkeypatch)
    np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))
    assert not np.isnan(np.asarray(got.out)[:, :sum(Q_LENS)]).any()
    for f in batch[-1]:
        for a, b in zip(jax.tree.leaves(getattr(got.caches, f)),
                        jax.tree.leaves(getattr(want.caches, f)), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.tobytes() == b.tobytes(), f  # bits, NaN payloads included


@pytest.mark.parametrize("fmt", ["packed", "f32", "fp8"])
def test_the_writing_kernel_compiles_in_place(fmt):
    """``v4_attention_state(new_kv=...)`` on a packed, f32 or fp8 MODEL1 window cache, donated,
    AOT for the default chip at a small decode shape: Mosaic takes the HBM -> HBM row DMAs
    (fp8: the nope record and the whole rope row), XLA neither copies a cache part nor
    scatters into one (the rows move by the kernel's DMAs only)."""
    q, window, kv, cu, d, _, _ = compile_cases.specs(rows=8, context=1024, heads=8, ratio=0,
                                                     k=None, fmt=fmt)

    leaves, tree = jax.tree.flatten(window.cache)  # the parts apart, to donate

    def fn(q, table, w_cu, kv, cu, d, new_kv, *parts):
        return v4_attention_state(
            q, PagedKV(jax.tree.unflatten(tree, parts), table, w_cu), kv, cu, d,
            sm_scale=compile_cases.SCALE, window_size=compile_cases.WINDOW, compress_ratio=0,
            window_pages_per_seq=1024 // compile_cases.PAGE, new_kv=new_kv)

    new_kv = jax.ShapeDtypeStruct((q.shape[0], 512), jnp.bfloat16)
    compiled = xla_cost.compile_program(
        fn, [q, *window[1:], kv, cu, d, new_kv, *leaves], chips.DEFAULT,
        donate_argnums=tuple(range(7, 7 + len(leaves))), case=f"v4_writes_{fmt}")
    cost = xla_cost.analyze(compiled)
    assert len(cost.kernels) == 1 and not cost.has_loop
    sizes = {int(np.prod(x.shape)) for x in leaves}
    big = xla_cost.parse_large_results(compiled.as_text(), 1 << 20)
    assert not [x for x in big if x.opcode.startswith(("copy", "scatter", "fusion"))
                and int(np.prod(xla_cost.dims(xla_cost.strip_layout(x.shape).lstrip("(")
                                               .split("]")[0] + "]"))) in sizes], big


def test_f32_rows_written_at_a_layer_of_a_stack_equal_the_scatter():
    """An f32 window stack ``[2, P, 16, 512]`` written at layer 1 by the kernel (strict
    interpreter; a decode row, a 3-row chunk, a padding row) equals the rows stored by the
    XLA scatter, layer 0 untouched, and the output equals the call on the scattered stack;
    the interpreter counts the model's writes (``writes.written_bytes`` / ``written_dmas``:
    one DMA and 4 KB per token, the padding row none)."""
    rng = np.random.default_rng(3)
    ps, pps, kv_lens, q_lens = 16, 4, [20, 5], [1, 3]
    table = rng.permutation(2 * pps + 1)[:2 * pps].astype(np.int32)
    cache = rng.standard_normal((2, 2 * pps + 1, ps, 512)).astype(np.float32)
    rows = rng.standard_normal((sum(q_lens) + 1, 512)).astype(np.float32)
    want = cache.copy()
    for s, (kv, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
        for j, p in enumerate(range(kv - ql, kv)):
            r = sum(q_lens[:s]) + j
            want[1, table[s * pps + p // ps], p % ps] = rows[r]
            cache[1, table[s * pps + p // ps], p % ps] = np.nan  # the write must replace it
    q = jnp.asarray(rng.standard_normal((len(rows), 4, 512)), jnp.float32)
    args = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray([0, 1, 4], jnp.int32),
            jnp.asarray([1, 2, 2], jnp.int32))
    kw = dict(sm_scale=0.05, window_size=16, compress_ratio=0, window_pages_per_seq=pps,
              layer=1, interpret=True, block=8)
    cu = jnp.asarray([0, pps * ps, 2 * pps * ps], jnp.int32)
    with counter.count_hbm_traffic() as n:
        out, got = v4_attention_state(q, PagedKV(jnp.asarray(cache), table, cu), *args,
                                      new_kv=jnp.asarray(rows), **kw)
        jax.block_until_ready(got)
    written = n.select("hbm", "hbm", "dma")  # one 2 KB row DMA per token: 4 KB moved
    assert len(written) == sum(q_lens) * writes.written_dmas("plain")
    assert {2 * c.nbytes for c in written} == {writes.written_bytes("plain")}
    ref = v4_attention_state(q, PagedKV(jnp.asarray(want), table, cu), *args, **kw)
    assert np.asarray(got).tobytes() == want.tobytes()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
