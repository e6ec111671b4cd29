"""Which DMA and strided-VMEM forms Mosaic compiles for gathering cache rows, through libtpu's
AOT compile on CPU (no TPU): the forms a page-run gather could be written in.

Every form is a small Pallas kernel reading rows of a ``u32[P, ps, 128]`` cache in HBM
(``memory_space=pl.ANY``) at a scalar-prefetched (page, row) into a VMEM scratch:

1. ``row``: one DMA of one row at a dynamic (page, row).
2. ``run n``: one DMA of a static run of ``n`` rows (n = 2, 8, 64) at a dynamic row start
   inside a page (the run ends inside the page; the start is not a multiple of 8).
3. ``run dynamic length``: ``pl.ds(start, n)`` with a traced ``n``; the result says where it is
   refused (``trace`` / ``lower`` / ``compile``) and the first line of the message.
   ``run 8 / dynamic length to a dynamic vmem row``: forms 2 and 3 into VMEM at a dynamic row
   (runs packed one after another in one buffer).
   ``run dynamic length, TPU interpreter`` / ``, interpret=True``: the same kernel interpreted
   on the CPU (what interpret-mode tests would run; chip-independent), checked for its rows.
4. ``flat run n``: the cache reshaped to ``u32[P * ps, 128]`` outside the kernel, then one DMA
   of ``n`` rows at the dynamic flat row ``page * ps + row``; the result also says whether the
   compiled program holds a ``copy`` of the whole cache (the reshape not being a bitcast), at
   ``ps = 64`` and at a page size that is not whole (8, 128) tiles (``ODD_PAGE_SIZE``).
5. ``strided store/load <dtype>``: ``ref[pl.ds(j, n, stride=4)] = x`` into, and
   ``x = ref[pl.ds(j, n, stride=4)]`` out of, a VMEM ref of ``dtype`` (u32 / bf16 / f32), at a
   static ``j`` and at a dynamic ``j`` (the fp8 rope-quarter expansion needs one of them).
6. ``dma to strided vmem``: a DMA of ``n`` rows whose destination is
   ``buf.at[pl.ds(j, n, stride=4)]``.
7. ``wide ...``: DMAs of rows of ``WIDE_LANES`` (256) u32 words, a packed bf16 V4 row
   (``u32[P, ps, 256]``), from HBM into a VMEM scratch (the V4 page runs' packed / f32 form):
   ``wide row`` one row at a dynamic, unaligned HBM row into a dynamic, unaligned VMEM row;
   ``wide run 8 at a multiple of 8`` 8 rows at dynamic rows that are multiples of 8 (both
   sides: ``pl.multiple_of(r // 8 * 8, 8)``); ``wide run 8 at an unaligned row`` 8 rows at a
   dynamic row (``pl.multiple_of`` absent: not provably aligned); ``wide run 5`` 5 rows at
   aligned rows; ``wide run dynamic length`` a traced number of rows at aligned rows;
   ``wide run dynamic length, multiple of 8`` the same declared ``pl.multiple_of(n, 8)`` (the
   form of ``v4_attention.formats._run_copies``' tile-aligned DMAs).

A form is ``(True, "")`` when it compiles, else ``(False, "<stage>: <first line>")``.
``probe(chip)`` returns every compiled form for ``chip``, ``interpreter_facts()`` the interpreted
ones (``tests/test_dma_probe.py`` pins today's outcome); ``python -m scripts.probes.dma_probe
[--chips v5e,v6e,tpu7x]`` prints the table.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot, tpu
from reference.formats import model1

PAGES = 32
PAGE_SIZE = 64
LANES = tpu.LANES
ODD_PAGE_SIZE = 12  # a page size that is not whole (8, 128) tiles (form 4)
RUNS = (2, 8, 64)  # static run lengths of form 2 (and 4)
STRIDE = model1.ROPE_TOKENS_PER_ROW  # the fp8 rope-quarter expansion: tokens per rope row
STRIDED_ROWS = 8  # rows written / read by one strided access (form 5, 6)
WIDE_LANES = 2 * LANES  # form 7: a packed bf16 V4 row, 256 u32 words
WIDE_TILE = 8  # form 7: the sublane tile of a 32-bit VMEM buffer
DTYPES = {"u32": jnp.uint32, "bf16": jnp.bfloat16, "f32": jnp.float32}


def _first_line(e: BaseException) -> str:
    msg = str(e)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    keys = ("Mosaic", "Not implemented", "not supported", "must", "Unsupported", "Error")
    line = next((ln for ln in lines if any(k in ln for k in keys)), lines[0] if lines else "")
    return f"{type(e).__name__}: {line}"[:200] if type(e).__name__ not in line else line[:200]


def _stage_compile(fn, specs, chip: str):
    """Trace, lower and compile ``fn(*specs)`` for ``chip`` as ``aot.aot_compile`` does, but
    name the stage that refused: ``(compiled, "")`` or ``(None, "<stage>: <message>")``."""
    dev = aot.topology_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
    stage = "trace"
    try:
        with aot.compiling_on(dev):
            traced = jax.jit(fn).trace(*placed)
            stage = "lower"
            lowered = traced.lower()
            stage = "compile"
            return lowered.compile(), ""
    except Exception as e:  # Mosaic / Pallas raise several types
        return None, f"{stage}: {_first_line(e)}"


def _gather(kernel, cache_shape, buf_rows: int, *, flat: bool = False, interpret=False):
    """``(fn, specs)``: ``pallas_call`` of ``kernel(tbl_smem, cache_hbm, out, buf, sem)`` with
    ``tbl`` i32[4] = (page, row, length, j); ``flat`` reshapes the cache to ``[P * ps, lanes]``
    before the call (outside the kernel); ``lanes``: the cache's last dim (128 or 256)."""
    lanes = cache_shape[-1]
    def f(tbl, cache):
        if flat:
            cache = cache.reshape(-1, cache.shape[-1])
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((8, lanes), lambda i, *_: (0, 0)),
                scratch_shapes=[pltpu.VMEM((buf_rows, lanes), jnp.uint32),
                                pltpu.SemaphoreType.DMA((1,))]),
            out_shape=jax.ShapeDtypeStruct((8, lanes), jnp.uint32),
            interpret=interpret)(tbl, cache)
    return f, [jax.ShapeDtypeStruct((4,), jnp.int32),
               jax.ShapeDtypeStruct(cache_shape, jnp.uint32)]


def _sum_rows(out_ref, buf):
    out_ref[...] = buf[0:8] + buf[buf.shape[0] - 8:]  # (Mosaic has no u32 reductions)


def _run_kernel(tbl, cache, out_ref, buf, sem, *, n, dynamic_len=False, flat=0, dst_row=False):
    page, row = tbl[0], tbl[1]
    size = tbl[2] if dynamic_len else n
    src = (cache.at[pl.ds(page * flat + row, size)] if flat
           else cache.at[page, pl.ds(row, size)])
    copy = pltpu.make_async_copy(src, buf.at[pl.ds(tbl[3] if dst_row else 0, size)], sem.at[0])
    copy.start()
    copy.wait()
    _sum_rows(out_ref, buf)


def _buf_rows(n: int) -> int:
    return max(8, -(-n // 8) * 8)


def run_dma(chip: str, n: int, *, dynamic_len: bool = False,
            dst_row: bool = False) -> tuple[bool, str]:
    """Forms 1-3: one DMA of ``n`` rows at a dynamic (page, row) of ``u32[P, ps, 128]`` into
    VMEM rows ``[0, n)`` (``dst_row``: at a dynamic VMEM row, into a buffer of ``2 n`` rows)."""
    kernel = functools.partial(_run_kernel, n=n, dynamic_len=dynamic_len, dst_row=dst_row)
    rows = _buf_rows(2 * n if dst_row else n)
    compiled, err = _stage_compile(*_gather(kernel, (PAGES, PAGE_SIZE, LANES), rows), chip)
    return compiled is not None, err


def dynamic_length_interprets(tpu_interpreter: bool = True) -> tuple[bool, str]:
    """Form 3 interpreted on the CPU (no chip), by the Pallas TPU interpreter
    (``pltpu.InterpretParams()``) or by ``interpret=True``: does the kernel trace and run (rows
    5:8 of page 2), and copy the right rows?"""
    kernel = functools.partial(_run_kernel, n=8, dynamic_len=True)
    f, _ = _gather(kernel, (4, 16, LANES), 8,
                   interpret=pltpu.InterpretParams() if tpu_interpreter else True)
    cache = jnp.arange(4 * 16 * LANES, dtype=jnp.uint32).reshape(4, 16, LANES)
    try:
        out = jax.jit(f)(jnp.asarray([2, 5, 3, 0], jnp.int32), cache)
    except Exception as e:  # the interpreter's discharge rules raise several types
        return False, f"trace: {_first_line(e)}"
    return bool((out[:3] == 2 * cache[2, 5:8]).all()), ""


def _copies_cache(compiled, page_size: int) -> bool:
    """Does the compiled program copy (or transpose) an operand the size of the whole cache?"""
    txt = compiled.as_text()
    shapes = (f"u32[{PAGES},{page_size},{LANES}]", f"u32[{PAGES * page_size},{LANES}]")
    return any(re.search(re.escape(s) + r"\{[^}]*\} (copy|transpose)\(", txt) for s in shapes)


def flat_run_dma(chip: str, n: int, page_size: int = PAGE_SIZE) -> tuple[bool, bool | str]:
    """Form 4 on ``u32[P, page_size, 128]``: ``(compiles, the program copies the whole cache)``
    or ``(False, message)``."""
    kernel = functools.partial(_run_kernel, n=n, flat=page_size)
    compiled, err = _stage_compile(
        *_gather(kernel, (PAGES, page_size, LANES), _buf_rows(n), flat=True), chip)
    return (True, _copies_cache(compiled, page_size)) if compiled is not None else (False, err)


def _strided_kernel(tbl, x_ref, o_ref, buf, *, store: bool, dynamic: bool):
    j = tbl[3] if dynamic else 1
    rows = pl.ds(j, STRIDED_ROWS, stride=STRIDE)
    if store:
        buf[...] = jnp.zeros(buf.shape, buf.dtype)
        buf[rows] = x_ref[...]
        o_ref[...] = buf[0:STRIDED_ROWS * STRIDE // 2] + buf[STRIDED_ROWS * STRIDE // 2:]
    else:
        buf[...] = jnp.concatenate([x_ref[...]] * STRIDE, axis=0)
        o_ref[...] = buf[rows]


def strided_vmem(chip: str, dtype: str, *, store: bool, dynamic: bool) -> tuple[bool, str]:
    """Form 5: a strided sublane store into (or load out of) a VMEM ref of ``dtype``."""
    dt = DTYPES[dtype]
    buf_rows = STRIDED_ROWS * STRIDE
    out_rows = buf_rows // 2 if store else STRIDED_ROWS

    def f(tbl, x):
        return pl.pallas_call(
            functools.partial(_strided_kernel, store=store, dynamic=dynamic),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,),
                in_specs=[pl.BlockSpec((STRIDED_ROWS, LANES), lambda i, *_: (0, 0))],
                out_specs=pl.BlockSpec((out_rows, LANES), lambda i, *_: (0, 0)),
                scratch_shapes=[pltpu.VMEM((buf_rows, LANES), dt)]),
            out_shape=jax.ShapeDtypeStruct((out_rows, LANES), dt))(tbl, x)

    specs = [jax.ShapeDtypeStruct((4,), jnp.int32),
             jax.ShapeDtypeStruct((STRIDED_ROWS, LANES), dt)]
    compiled, err = _stage_compile(f, specs, chip)
    return compiled is not None, err


def _dma_strided_dst_kernel(tbl, cache, out_ref, buf, sem):
    copy = pltpu.make_async_copy(cache.at[tbl[0], pl.ds(tbl[1], STRIDED_ROWS)],
                                 buf.at[pl.ds(1, STRIDED_ROWS, stride=STRIDE)], sem.at[0])
    copy.start()
    copy.wait()
    _sum_rows(out_ref, buf)


def dma_to_strided_vmem(chip: str) -> tuple[bool, str]:
    """Form 6: one DMA of ``STRIDED_ROWS`` rows into every ``STRIDE``-th row of a VMEM buffer."""
    compiled, err = _stage_compile(
        *_gather(_dma_strided_dst_kernel, (PAGES, PAGE_SIZE, LANES), STRIDED_ROWS * STRIDE),
        chip)
    return compiled is not None, err


def _wide_kernel(tbl, cache, out_ref, buf, sem, *, n, aligned, dynamic_len, multiple):
    tile = WIDE_TILE
    row, dst = tbl[1], tbl[3]
    if aligned:
        row, dst = pl.multiple_of(row // tile * tile, tile), pl.multiple_of(dst // tile * tile,
                                                                            tile)
    size = n
    if dynamic_len:
        size = pl.multiple_of(tbl[2] // tile * tile, tile) if multiple else tbl[2]
    copy = pltpu.make_async_copy(cache.at[tbl[0], pl.ds(row, size)], buf.at[pl.ds(dst, size)],
                                 sem.at[0])
    copy.start()
    copy.wait()
    _sum_rows(out_ref, buf)


def wide_dma(chip: str, n: int, *, aligned: bool, dynamic_len: bool = False,
             multiple: bool = False) -> tuple[bool, str]:
    """Form 7: one DMA of ``n`` rows of ``u32[P, ps, 256]`` at a dynamic (page, row) into a
    dynamic row of a ``[4 * 8, 256]`` VMEM buffer; ``aligned``: both rows
    ``pl.multiple_of(r // 8 * 8, 8)``; ``dynamic_len``: a traced number of rows, as given
    or (``multiple``) ``pl.multiple_of(n // 8 * 8, 8)``."""
    kernel = functools.partial(_wide_kernel, n=n, aligned=aligned, dynamic_len=dynamic_len,
                               multiple=multiple)
    compiled, err = _stage_compile(
        *_gather(kernel, (PAGES, PAGE_SIZE, WIDE_LANES), 4 * WIDE_TILE), chip)
    return compiled is not None, err


def probe_wide(chip: str) -> dict:
    """Form 7 for ``chip``: ``{form: result}``."""
    return {"wide row": wide_dma(chip, 1, aligned=False),
            "wide run 8 at a multiple of 8": wide_dma(chip, 8, aligned=True),
            "wide run 8 at an unaligned row": wide_dma(chip, 8, aligned=False),
            "wide run 5": wide_dma(chip, 5, aligned=True),
            "wide run dynamic length": wide_dma(chip, 8, aligned=True, dynamic_len=True),
            "wide run dynamic length, multiple of 8": wide_dma(chip, 8, aligned=True,
                                                               dynamic_len=True, multiple=True)}


def probe_strided(chip: str) -> dict:
    """Form 5 for ``chip``: ``{"strided <store|load> <dtype> <static|dynamic> j": result}``."""
    return {f"strided {op} {dtype} {'dynamic' if dyn else 'static'} j":
            strided_vmem(chip, dtype, store=op == "store", dynamic=dyn)
            for op in ("store", "load") for dtype in DTYPES for dyn in (False, True)}


def probe(chip: str) -> dict:
    """Every form of the module docstring for ``chip``: ``{form: (ok, detail)}``."""
    got: dict = {"row": run_dma(chip, 1)}
    for n in RUNS:
        got[f"run {n}"] = run_dma(chip, n)
    got["run dynamic length"] = run_dma(chip, 8, dynamic_len=True)
    got["run 8 to a dynamic vmem row"] = run_dma(chip, 8, dst_row=True)
    got["run dynamic length to a dynamic vmem row"] = run_dma(chip, 8, dynamic_len=True,
                                                              dst_row=True)
    for n in (1, 8):
        got[f"flat run {n}"] = flat_run_dma(chip, n)
    got[f"flat run 1, ps={ODD_PAGE_SIZE}"] = flat_run_dma(chip, 1, ODD_PAGE_SIZE)
    got.update(probe_strided(chip))
    got["dma to strided vmem"] = dma_to_strided_vmem(chip)
    got.update(probe_wide(chip))
    return got


def interpreter_facts() -> dict:
    """Form 3 interpreted on the CPU (chip-independent): ``{form: (ok, detail)}``."""
    return {"run dynamic length, TPU interpreter": dynamic_length_interprets(),
            "run dynamic length, interpret=True": dynamic_length_interprets(False)}
