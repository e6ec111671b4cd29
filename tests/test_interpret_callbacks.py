"""``tests/interpret_callbacks.py`` (the suite's NumPy hand-over of the strict interpreter's
callbacks) is installed, and the interpreter under it is as strict and as exact as under jax's
own path: a race is reported, uninitialised memory reads NaN, an out-of-bounds DMA read raises,
and a kernel of the package gives the same bits both ways."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu
from tests import interpret_callbacks

pytestmark = pytest.mark.kernel_gate  # also on the newest jax, whose interpreter it feeds

STRICT = pltpu.InterpretParams(**tpu.STRICT_INTERPRET)
X = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)


def _call(kernel, scratch, *, prefetch=None):
    """``kernel`` over ``X`` (in HBM) into an ``f32[8, 128]`` block, in the strict
    interpreter; ``prefetch``: an ``i32[1]`` scalar-prefetch operand first."""
    specs = [pl.BlockSpec(memory_space=pl.ANY)]
    out = jax.ShapeDtypeStruct(X.shape, X.dtype)
    if prefetch is None:
        return pl.pallas_call(kernel, out_shape=out, in_specs=specs, scratch_shapes=scratch,
                              interpret=STRICT)(X)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(1,), in_specs=specs,
        out_specs=pl.BlockSpec(X.shape, lambda i, s: (0, 0)), scratch_shapes=scratch)
    return pl.pallas_call(kernel, out_shape=out, grid_spec=grid,
                          interpret=STRICT)(jnp.asarray([prefetch], jnp.int32), X)


def _dma(x_hbm, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...] * 2.0


def _racy(x_hbm, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm, buf, sem)
    copy.start()
    o_ref[...] = buf[...]  # read before the wait: races the DMA's write
    copy.wait()


def _uninitialised(x_hbm, o_ref, buf):
    del x_hbm
    o_ref[...] = buf[...]


def _dynamic_window(start_ref, x_hbm, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm.at[pl.ds(start_ref[0], 8)], buf, sem)
    copy.start()
    copy.wait()
    o_ref[...] = buf[...]


DMA_SCRATCH = [pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA]


def test_the_suite_runs_the_numpy_hand_over():
    assert interpret_callbacks.installed(), (
        "tests/interpret_callbacks.py did not install: jax's io_callback_impl has another "
        "signature than the one it was written for; the suite runs jax's slower path")


@pytest.mark.parametrize("path", ["numpy", "jax"])
def test_the_interpreter_stays_strict(path, capfd):
    """Both paths: the race is reported, NaN fills uninitialised VMEM, a DMA read past the end
    of its buffer (a runtime start, so only the interpreter can see it) raises naming it, and
    an in-bounds one reads the values."""
    import contextlib

    with interpret_callbacks.jax_path() if path == "jax" else contextlib.nullcontext():
        pltpu.reset_tpu_interpret_mode_state()
        try:  # jax 0.10 prints the race; jax 0.12 raises it from the callback
            jax.block_until_ready(_call(_racy, DMA_SCRATCH))
            reported = capfd.readouterr().out
        except Exception as e:  # noqa: BLE001 - the interpreter's error, whatever its type
            reported = str(e)
        assert "RACE DETECTED" in reported
        pltpu.reset_tpu_interpret_mode_state()
        assert np.isnan(np.asarray(_call(_uninitialised, DMA_SCRATCH[:1]))).all()
        np.testing.assert_array_equal(np.asarray(_call(_dynamic_window, DMA_SCRATCH,
                                                       prefetch=0)), np.asarray(X))
        with pytest.raises(Exception, match="Out-of-bounds read"):
            jax.block_until_ready(_call(_dynamic_window, DMA_SCRATCH, prefetch=4))
        pltpu.reset_tpu_interpret_mode_state()


def test_a_package_kernel_gives_the_same_bits_both_ways():
    """The Pallas token top-k (DMAs, semaphores, several row blocks) on a mixed ragged batch,
    and a DMA-then-compute kernel: the same bits under the NumPy hand-over as under jax's
    path."""
    from pallas_kernels.indexer import streamindex_topk
    from tests.test_pallas_indexer import PAGES_PER_SEQ, _mixed

    b = _mixed(1)
    kw = dict(k=20, pages_per_seq=PAGES_PER_SEQ, exact=True, block_rows=16, block_pages=2,
              interpret=STRICT)
    got = [np.asarray(streamindex_topk(*b.args(), **kw)), np.asarray(_call(_dma, DMA_SCRATCH))]
    with interpret_callbacks.jax_path():
        want = [np.asarray(streamindex_topk(*b.args(), **kw)),
                np.asarray(_call(_dma, DMA_SCRATCH))]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got[1], 2.0 * np.asarray(X))
