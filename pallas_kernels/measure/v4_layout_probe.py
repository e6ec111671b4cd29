"""The measurements behind ``reference.v4_cache``'s TPU layout, through libtpu's AOT compile on
CPU (no TPU): which single-token gathers Mosaic compiles, and what XLA's TPU layout makes a
cache array occupy in HBM.

Each gather probe is a Pallas kernel that DMAs the rows of a few tokens, one DMA per token at a
dynamic (scalar-prefetched) page and row, from a ``u32[P, ps, W]`` cache in HBM into VMEM:

- ``row W``: a whole row of ``u32[P, ps, W]`` (W = 32, 128, 146, 160, 256);
- ``quarter static``: a quarter of a 128-word row at a static lane offset (``32 q``, chosen by
  ``pl.when`` per token), into lanes ``[0, 32)`` or into the same lanes ``[32 q, 32 q + 32)``;
- ``quarter dynamic``: the same at a dynamic lane offset;
- ``split``: ``reference.v4_cache``'s own gather: per token its nope row of ``u32[P, ps, 128]``
  and the row of ``u32[P, ceil(ps / 4), 128]`` holding its rope quarter (two DMAs), the quarter
  then selected by lanes in VMEM and decoded.

``row`` and ``split`` also say whether XLA put a relayout ``copy`` of the whole cache in front of
the kernel (it does when the argument's default layout is not row-major).

``physical_bytes`` is XLA's own size of an argument: ``memory_analysis().argument_size_in_bytes``
of a program taking only that array, with the layout XLA assigns to it (``layout``).

``probe(chip)`` returns the facts as a dict (``tests/test_v4_layout_probe.py``); the command
line ``python -m scripts.probes.v4_layout_probe [--chips v5e,v6e,tpu7x]`` prints them.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot

PAGES = 256
PAGE_SIZE = 64
TOKENS = 8  # tokens gathered per probe kernel (one DMA each)


def _first_error_line(e: Exception) -> str:
    msg = str(e)
    line = next((ln for ln in msg.splitlines() if "Mosaic" in ln or "Not implemented" in ln
                 or "must" in ln), msg.splitlines()[0] if msg else "")
    return line.strip()[:200]


def _compiles(fn, specs, chip: str) -> tuple[bool, str]:
    try:
        aot.aot_compile(fn, specs, chip)
        return True, ""
    except aot.CompileError as e:
        return False, _first_error_line(e)


def _gather_call(kernel, cache_spec, buf_words: int):
    """``pallas_call`` of ``kernel(tbl_smem, cache_hbm, out, buf, sems)``; ``tbl`` i32[2 *
    TOKENS] holds (page, row) per token."""
    def f(tbl, cache):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((TOKENS, 1), lambda i, *_: (0, 0)),
                scratch_shapes=[pltpu.VMEM((TOKENS, buf_words), jnp.uint32),
                                pltpu.SemaphoreType.DMA((TOKENS,))]),
            out_shape=jax.ShapeDtypeStruct((TOKENS, 1), jnp.float32))(tbl, cache)
    specs = [jax.ShapeDtypeStruct((2 * TOKENS,), jnp.int32), cache_spec]
    return f, specs


def _finish(out_ref, buf):
    out_ref[...] = jnp.sum((buf[...] & 0xFF).astype(jnp.float32), axis=1, keepdims=True)


def _row_kernel(tbl, cache, out_ref, buf, sems):
    copies = [pltpu.make_async_copy(cache.at[tbl[2 * i], pl.ds(tbl[2 * i + 1], 1)],
                                    buf.at[pl.ds(i, 1)], sems.at[i]) for i in range(TOKENS)]
    for c in copies:
        c.start()
    for c in copies:
        c.wait()
    _finish(out_ref, buf)


def _relayout(compiled, shape) -> bool:
    """Does the compiled program copy an argument of ``shape`` into another layout?"""
    pat = re.escape("u32[" + ",".join(map(str, shape)) + "]") + r"\{[^}]*\} copy\("
    return re.search(pat, compiled.as_text()) is not None


def row_gather(chip: str, words: int) -> tuple[bool, bool | str]:
    """One DMA per token of a whole row of ``u32[P, ps, words]``: ``(compiles, relayout copy of
    the whole cache in the program)``, or ``(False, Mosaic's message)``."""
    shape = (PAGES, PAGE_SIZE, words)
    f, specs = _gather_call(_row_kernel, jax.ShapeDtypeStruct(shape, jnp.uint32), words)
    try:
        return True, _relayout(aot.aot_compile(f, specs, chip), shape)
    except aot.CompileError as e:
        return False, _first_error_line(e)


def _split_kernel(tbl, nope, rope, out_ref, nbuf, rbuf, sems):
    """``reference.v4_cache``'s gather: token i = (page, row) -> its nope row and the rope row
    it shares with 3 tokens (two whole-row DMAs), then its rope quarter picked by lanes."""
    copies = []
    for i in range(TOKENS):
        page, row = tbl[2 * i], tbl[2 * i + 1]
        copies += [pltpu.make_async_copy(nope.at[page, pl.ds(row, 1)], nbuf.at[pl.ds(i, 1)],
                                         sems.at[2 * i]),
                   pltpu.make_async_copy(rope.at[page, pl.ds(row // 4, 1)],
                                         rbuf.at[pl.ds(i, 1)], sems.at[2 * i + 1])]
    for c in copies:
        c.start()
    for c in copies:
        c.wait()
    quarter = jnp.concatenate([jnp.full((1, 1), tbl[2 * i + 1] % 4, jnp.int32)
                               for i in range(TOKENS)], axis=0)  # [TOKENS, 1]
    r = rbuf[...]
    words = r[:, 0:32]
    for q in range(1, 4):
        words = jnp.where(quarter == q, r[:, 32 * q:32 * q + 32], words)
    lo = pltpu.bitcast(words << 16, jnp.float32)
    hi = pltpu.bitcast(words & jnp.uint32(0xFFFF0000), jnp.float32)
    codes = (nbuf[...] & 0xFF).astype(jnp.float32)
    out_ref[...] = (jnp.sum(codes, axis=1, keepdims=True) + jnp.sum(lo + hi, axis=1,
                                                                     keepdims=True))


def split_gather(chip: str, page_size: int = PAGE_SIZE):
    """The V4 cache's gather (``_split_kernel``) from ``nope u32[P, ps, 128]`` and ``rope
    u32[P, ceil(ps / 4), 128]``: ``(compiles, relayout copy, argument bytes per token)``, or
    ``(False, Mosaic's message, None)``."""
    nope_shape = (PAGES, page_size, 128)
    rope_shape = (PAGES, -(-page_size // 4), 128)

    def f(tbl, nope, rope):
        return pl.pallas_call(
            _split_kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
                out_specs=pl.BlockSpec((TOKENS, 1), lambda i, *_: (0, 0)),
                scratch_shapes=[pltpu.VMEM((TOKENS, 128), jnp.uint32),
                                pltpu.VMEM((TOKENS, 128), jnp.uint32),
                                pltpu.SemaphoreType.DMA((2 * TOKENS,))]),
            out_shape=jax.ShapeDtypeStruct((TOKENS, 1), jnp.float32))(tbl, nope, rope)

    specs = [jax.ShapeDtypeStruct((2 * TOKENS,), jnp.int32),
             jax.ShapeDtypeStruct(nope_shape, jnp.uint32),
             jax.ShapeDtypeStruct(rope_shape, jnp.uint32)]
    try:
        compiled = aot.aot_compile(f, specs, chip)
    except aot.CompileError as e:
        return False, _first_error_line(e), None
    size = compiled.memory_analysis().argument_size_in_bytes - 4 * 128  # the table: one tile
    copies = _relayout(compiled, nope_shape) or _relayout(compiled, rope_shape)
    return True, copies, size / (PAGES * page_size)


def _quarter_kernel(tbl, cache, out_ref, buf, sems, *, same_lanes: bool, dynamic: bool):
    """Token i's 32 words are quarter ``row % 4`` of row ``row // 4`` of a ``u32[P, ps/4,
    128]`` cache."""
    def copy(i, q):
        dst = pl.ds(q * 32, 32) if same_lanes else pl.ds(0, 32)
        return pltpu.make_async_copy(
            cache.at[tbl[2 * i], pl.ds(tbl[2 * i + 1] // 4, 1), pl.ds(q * 32, 32)],
            buf.at[pl.ds(i, 1), dst], sems.at[i])

    for i in range(TOKENS):
        q = tbl[2 * i + 1] % 4
        if dynamic:
            copy(i, pl.multiple_of(q, 1)).start()
            continue
        for qq in range(4):
            @pl.when(q == qq)
            def _(i=i, qq=qq):
                copy(i, qq).start()
    for i in range(TOKENS):
        copy(i, 0).wait()  # same byte count whatever the quarter
    _finish(out_ref, buf)


def quarter_gather(chip: str, *, same_lanes: bool, dynamic: bool) -> tuple[bool, str]:
    """One DMA per token of 32 of the 128 lanes of a shared row."""
    spec = jax.ShapeDtypeStruct((PAGES, PAGE_SIZE // 4, 128), jnp.uint32)
    kernel = functools.partial(_quarter_kernel, same_lanes=same_lanes, dynamic=dynamic)
    return _compiles(*_gather_call(kernel, spec, 128 if same_lanes else 32), chip)


def physical(chip: str, shape, dtype=jnp.uint32) -> tuple[int, str]:
    """``(argument bytes, layout)`` XLA's TPU compile gives an argument of ``shape``."""
    spec = jax.ShapeDtypeStruct(shape, dtype)
    compiled = aot.aot_compile(lambda x: jnp.sum(x[..., :1]), [spec], chip)
    name = jnp.dtype(dtype).name.replace("uint", "u")
    pat = re.escape(name + "[" + ",".join(map(str, shape)) + "]") + r"\{[^}]*\}"
    found = re.findall(pat, compiled.as_text())
    return int(compiled.memory_analysis().argument_size_in_bytes), found[0] if found else "?"


def probe(chip: str, quick: bool = False) -> dict:
    """The facts of the module docstring for ``chip`` (``quick``: the ones the layout rests
    on, for the test)."""
    got: dict = {}
    for words in (128, 160, 256) if quick else (32, 128, 146, 160, 256):
        got[f"row {words}"] = row_gather(chip, words)
        size, layout = physical(chip, (PAGES, PAGE_SIZE, words))
        got[f"bytes/token {words}"] = size / (PAGES * PAGE_SIZE)
        got[f"layout {words}"] = layout
    got["quarter static, same lanes"] = quarter_gather(chip, same_lanes=True, dynamic=False)
    got[f"split ps={PAGE_SIZE}"] = split_gather(chip)
    if not quick:
        got["split ps=16"] = split_gather(chip, 16)
        got["split ps=6"] = split_gather(chip, 6)
        got["quarter static, to lanes 0:32"] = quarter_gather(chip, same_lanes=False,
                                                              dynamic=False)
        got["quarter dynamic, same lanes"] = quarter_gather(chip, same_lanes=True, dynamic=True)
    return got
