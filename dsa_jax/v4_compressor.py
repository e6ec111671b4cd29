"""The DeepSeek-V4 compressor as a public op (``dsa_jax.v4_compress_step``): one step of the
learned gated pooling of ``ratio`` tokens into a compressed entry, over a ragged batch, with the
per-sequence state ring carried across steps.

``compress_step`` takes ``reference.v4_compressor.compress_step``'s arguments (the math, the
state contract and the masking rules are in that module's docstring) plus ``backend=``
(``"reference"``, ``"pallas"`` or ``None``: ``dsa_jax.backend``) and the knobs of the Pallas
entry ``pallas_kernels.v4_compressor.compress_step`` (``interpret=``, ``vmem_limit_bytes=``;
ignored by the reference). It returns the same ``(CompressedEntries, CompressorState)`` on
either backend: the state bit for bit, the pooled rows to f32 rounding (the same tree of the
same ops). ``reference.v4_compressor.write_entries`` stores the entries in a paged cache; the
V4 step (``dsa_jax.v4_step``) runs this op for every compressed layer.
"""

from __future__ import annotations

from dsa_jax import backend as _backend
from reference import v4_compressor as vc


def compress_step(kv, score, ape, norm_weight, cos, sin, state: vc.CompressorState, state_slots,
                  kv_lens, cu_q_lens, distribution, *, ratio: int, eps: float = vc.NORM_EPS,
                  backend: str | None = None, interpret=None,
                  vmem_limit_bytes: int | None = None, precision: str = "f32",
                  implementation=None,
                  rope_rows=None) -> tuple[vc.CompressedEntries, vc.CompressorState]:
    """One step of the V4 compressor: ``(CompressedEntries, CompressorState)``.

    Args as ``reference.v4_compressor.compress_step`` (``kv`` / ``score f32|bf16[T, coff * d]``,
    ``ape f32[ratio, coff * d]``, ``norm_weight f32[d]``, the RoPE tables ``cos`` / ``sin``,
    the state pool, ``state_slots i32[S]``, the ragged metadata; ``ratio`` 4 or 128, ``eps``,
    ``precision`` ``"f32"`` or ``"bf16"``: the official regime's rounding of the finished
    entries, ``reference.v4_compressor.finish_entries``), plus:

    - ``backend``: ``"reference"``, ``"pallas"`` or ``None`` (``dsa_jax.backend``); an unknown
      name is a ``ValueError`` naming it;
    - ``interpret``: the Pallas entry's (False compiles with Mosaic, True runs the strict
      interpreter, or a ``pltpu.InterpretParams``); ``None`` leaves the default, which off TPU
      is the interpreter;
    - ``vmem_limit_bytes``: the Pallas entry's scoped-VMEM override (``None``: its default);
    - ``implementation``: ``"xla"`` (the jnp reference), ``"pallas"``, an ordered list or
      ``None`` (``dsa_jax.backend``; ``backend=`` is the older spelling);
    - ``rope_rows``: ``f32[P, 128]``, the tables in the Pallas kernel's row layout
      (``pallas_kernels.v4_compressor.rope_rows(cos, sin)``, a model constant: build it once),
      so the kernel reads one 512-B row per entry instead of two 16-KB table tiles; ``None``:
      the tiles. The reference ignores it.

    Jit the caller with ``state`` donated to update the pool in place. Bad shapes, dtypes or a
    ratio other than 4 / 128 raise ``ValueError`` naming the numbers (on either backend).
    """
    knobs = {k: v for k, v in (("interpret", interpret), ("vmem_limit_bytes", vmem_limit_bytes),
                               ("rope_rows", rope_rows)) if v is not None}

    def call(fn, extra):
        return fn(kv, score, ape, norm_weight, cos, sin, state, state_slots, kv_lens, cu_q_lens,
                  distribution, ratio=ratio, eps=eps, precision=precision, **extra)

    return _backend.run("v4_compressor", implementation, backend, knobs, call)
