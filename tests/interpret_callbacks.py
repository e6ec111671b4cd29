"""The strict Pallas interpreter's host callbacks without jax's per-call ``device_put``.

Why: the TPU interpreter (``interpret=InterpretParams(...)``) runs every load, store, DMA and
semaphore of a kernel as an ``io_callback``; jax's ``io_callback_impl`` first copies every
argument of every call into a CPU ``jax.Array`` (``device_put``), and the interpreter's
callbacks then read them back as NumPy. Sampled (py-spy, a V4 Pallas decode step in the
interpreter, jax 0.10.2): that ``device_put`` was 755 of the 1408 samples inside
``io_callback_impl``, more than the interpreter's own work (653), and the callbacks were ~70%
of the step.

What changes: for callbacks of the Pallas TPU interpreter only (recognised by the module of the
function jax calls back), the arguments are handed over as NumPy copies (a copy: XLA's buffers
live only for the call) under the CPU default device, and the results converted exactly as jax
does (``np.asarray``). The interpreter's checks are its own and unchanged: uninitialised
memory, out-of-bounds reads, race detection (``tests/test_interpret_callbacks.py`` checks each
under both paths, and that a package kernel gives the same bits). Every other
callback keeps jax's path. If jax's ``io_callback_impl`` has another signature than the one this
was written against (jax 0.10 - 0.12), nothing is installed and the suite runs jax's path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np

INTERPRETER_MODULES = ("jax._src.pallas.mosaic.interpret.",)
_SIGNATURE = ["args", "result_avals", "callback", "sharding", "ordered"]


def _interpreter_function(callback) -> bool:
    """Whether ``callback`` (a jax ``_FlatCallback``) calls the Pallas TPU interpreter."""
    func = getattr(callback, "callback_func", None)
    while hasattr(func, "func"):  # functools.partial(get, source_info=...)
        func = func.func
    module = getattr(func, "__module__", "") or ""
    return module.startswith(INTERPRETER_MODULES)


@functools.cache
def _cpu_device():
    """The first CPU device, looked up once (every interpreter callback enters it)."""
    import jax

    return jax.local_devices(backend="cpu")[0]


def install() -> bool:
    """Install the NumPy hand-over for the interpreter's callbacks; returns whether it is
    installed (False: jax's ``io_callback_impl`` is not the one this was written for)."""
    import jax
    from jax._src import callback as jax_callback

    impl = jax_callback.io_callback_impl
    if getattr(impl, "numpy_interpreter_callbacks", False):
        return True
    if list(inspect.signature(impl).parameters) != _SIGNATURE:
        return False

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        if not _interpreter_function(callback):
            return impl(*args, result_avals=result_avals, callback=callback,
                        sharding=sharding, ordered=ordered)
        with jax.default_device(_cpu_device()):
            out = callback(*(np.array(a, copy=True) for a in args))
        return jax.tree.map(np.asarray, out)

    io_callback_impl.numpy_interpreter_callbacks = True
    io_callback_impl.jax_impl = impl
    jax_callback.io_callback_impl = io_callback_impl
    return True


def installed() -> bool:
    """Whether the NumPy hand-over is the one jax calls."""
    from jax._src import callback as jax_callback

    return getattr(jax_callback.io_callback_impl, "numpy_interpreter_callbacks", False)


@contextlib.contextmanager
def jax_path():
    """Inside: jax's own ``io_callback_impl`` (``device_put`` on every call), to compare
    against. A program compiled inside keeps calling back through whichever is installed when
    it runs: the callback looks the implementation up per call."""
    from jax._src import callback as jax_callback

    mine = jax_callback.io_callback_impl
    jax_callback.io_callback_impl = getattr(mine, "jax_impl", mine)
    try:
        yield
    finally:
        jax_callback.io_callback_impl = mine
