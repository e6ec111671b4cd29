"""The measurements behind the fp8 cache layouts of ``reference.fp8_cache``, through libtpu's AOT
compile on CPU (no TPU): what XLA's TPU layout assignment and Mosaic accept.

1. XLA's default TPU layout of a jit argument:
   - ``f32[8192, 64]`` (one page's 64 scales per row) comes out transposed, ``{0,1:...}``, so a
     Pallas kernel operand in the row-major layout would cost a transpose copy per call;
   - ``f32[8192, 128]`` stays row-major;
   - ``f8e4m3fn[8192, 64, 128]`` gets tiles of (32, 128), so a page of 64 rows is whole tiles.
2. Mosaic refuses a DMA of part of a 32-bit row at a dynamic lane offset (64 or 32 of 128 lanes):
   the fp8 latent token cannot be 164 words (FlashMLA's 656 bytes) split into a 128-word row plus
   part of a shared row. A whole 128-lane row DMA compiles.
3. Mosaic compiles an e4m3 page upcast to bf16 and an e4m3 x e4m3 dot (f32 accumulation) on
   v5e, v6e and tpu7x.

``probe(chip)`` returns these facts as a dict (``tests/test_fp8_layout_probe.py``); the command
line ``python -m scripts.probes.fp8_layout_probe [--chips v5e,v6e,tpu7x]`` prints them.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import aot

PAGES = 8192


def _layout(chip: str, shape, dtype) -> str:
    """The layout XLA gives a jit argument of ``shape`` / ``dtype`` that feeds a reduction."""
    spec = jax.ShapeDtypeStruct(shape, dtype)
    txt = aot.aot_compile(lambda x: jnp.sum(x.astype(jnp.float32), axis=0), [spec],
                          chip).as_text()
    name = f"{jnp.dtype(dtype).name.replace('float8_e4m3fn', 'f8e4m3fn').replace('float32', 'f32')}"
    pat = re.escape(name + "[" + ",".join(map(str, shape)) + "]") + r"\{[^}]*\}"
    found = re.findall(pat, txt)
    return found[0] if found else "?"


def _lane_dma_kernel(tbl, src_hbm, out_ref, buf, sem, *, lanes):
    per_row = 128 // lanes
    t = tbl[0]
    off = pl.multiple_of((t % per_row) * lanes, lanes)
    copy = pltpu.make_async_copy(src_hbm.at[pl.ds(t // per_row, 1), pl.ds(off, lanes)],
                                 buf.at[pl.ds(0, 1)], sem.at[0])
    copy.start()
    copy.wait()
    out_ref[...] = jnp.sum(buf[...].astype(jnp.float32), axis=1, keepdims=True)


def _lane_dma_compiles(chip: str, lanes: int) -> tuple[bool, str]:
    """Does a DMA of ``lanes`` of a 128-lane u32 row at a dynamic lane offset compile?"""
    def f(tbl, src):
        return pl.pallas_call(
            functools.partial(_lane_dma_kernel, lanes=lanes),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=pl.BlockSpec((8, 1), lambda i, *_: (0, 0)),
                scratch_shapes=[pltpu.VMEM((8, lanes), jnp.uint32),
                                pltpu.SemaphoreType.DMA((1,))]),
            out_shape=jax.ShapeDtypeStruct((8, 1), jnp.float32))(tbl, src)

    specs = [jax.ShapeDtypeStruct((8,), jnp.int32),
             jax.ShapeDtypeStruct((PAGES * lanes // 128, 128), jnp.uint32)]
    try:
        aot.aot_compile(f, specs, chip)
        return True, ""
    except aot.CompileError as e:
        msg = str(e)
        first = next((ln for ln in msg.splitlines() if "Mosaic" in ln or "Not implemented" in ln),
                     msg.splitlines()[0])
        return False, first.strip()[:160]


def _fp8_kernel(q_ref, k_ref, o_ref, *, fp8_dot):
    k = k_ref[...]
    q = q_ref[...]
    if not fp8_dot:
        q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    o_ref[...] = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)


def _fp8_compiles(chip: str, fp8_dot: bool) -> bool:
    def f(q, k):
        return pl.pallas_call(
            functools.partial(_fp8_kernel, fp8_dot=fp8_dot), grid=(1,),
            in_specs=[pl.BlockSpec((16, 128), lambda i: (0, 0)),
                      pl.BlockSpec((64, 128), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((16, 64), lambda i: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32))(q, k)

    f8 = jnp.float8_e4m3fn
    specs = [jax.ShapeDtypeStruct((16, 128), f8 if fp8_dot else jnp.bfloat16),
             jax.ShapeDtypeStruct((64, 128), f8)]
    try:
        aot.aot_compile(f, specs, chip)
        return True
    except aot.CompileError:
        return False


def probe(chip: str) -> dict:
    """The facts above for ``chip``."""
    return {
        "layout f32[8192,64]": _layout(chip, (PAGES, 64), jnp.float32),
        "layout f32[8192,128]": _layout(chip, (PAGES, 128), jnp.float32),
        "layout f8e4m3fn[8192,64,128]": _layout(chip, (PAGES, 64, 128), jnp.float8_e4m3fn),
        "dma 64 of 128 lanes at a dynamic offset": _lane_dma_compiles(chip, 64),
        "dma 32 of 128 lanes at a dynamic offset": _lane_dma_compiles(chip, 32),
        "dma a whole 128-lane row": _lane_dma_compiles(chip, 128),
        "e4m3 page upcast to bf16 + bf16 dot": _fp8_compiles(chip, False),
        "e4m3 x e4m3 dot": _fp8_compiles(chip, True),
    }
