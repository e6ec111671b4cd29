"""tokamax's 256-byte index records as a cache format of the Pallas indexer (issue 29).

Format ``RECORD_FORMAT`` (``"tokamax_head_along_sublane"``): the bytes
``reference.formats.tokamax_index`` defines for ``"head_along_sublane"``, ``u8[P, ps // 4, 4,
256]`` (stacked: ``u8[L, P, ps // 4, 4, 256]``); entry ``t`` of a page is the record at
``[t // 4, t % 4, :]``: bytes ``[0, 128)`` its e4m3 key, byte 128 its ue8m0 scale
``2**(byte - 127)`` (0xFF NaN, 0 the subnormal ``2**-127``), the rest unread.

The kernel reads the cache as stored (``RecordCache`` wraps the array so the shared glue sees
the logical ``(P, ps, 128)``): one DMA per page of ``ps * 256`` bytes, ``u8[ps // 4, 4, 256]``
in VMEM, the XLA array's own tiling (``T(4,128)(4,1)``: no relayout, no copy in the compiled
HLO; ``tests/test_tokamax_pallas_indexer.py`` checks it for v6e and tpu7x). Each stage then
decodes its pages in VMEM (``decode_stage``): the codes upcast exactly to the compute dtype, the
scale bytes turned into f32 by integer arithmetic on their bits (exact, no fp8/e8m0 convert) and
moved onto lanes by one ``[P*ps, 128]`` f32 transpose. The score is tokamax's, in its order:
``(sum_h w * relu(q . code)) * scale`` (f32 accumulation; the kernel's order already).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from reference.formats import tokamax_index as ti
from reference.quant import fp8

RECORD_FORMAT = "tokamax_" + ti.HEAD_ALONG_SUBLANE
_F32_MANTISSA = 23
_SUBNORMAL_2_POW_M127 = 1 << (_F32_MANTISSA - 1)  # f32 bits of 2**-127 (ue8m0 byte 0)
_F32_QNAN = 0x7FC00000  # ue8m0 byte 0xFF is NaN
_E8M0_NAN = 0xFF


@dataclass(frozen=True)
class RecordCache:
    """tokamax index records ``u8[..., P, ps // 4, 4, 256]`` (module docstring) seen by the
    indexer glue as keys of logical shape ``(..., P, ps, 128)``. A pytree."""

    records: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(..., num_pages, page_size, 128)`` of the keys it holds."""
        *lead, rows, pack, _ = np.shape(self.records)
        return (*lead, rows * pack, ti.HEAD_DIM)

    @property
    def page_size(self) -> int:
        """Entries per page."""
        return self.shape[-2]


jax.tree_util.register_dataclass(RecordCache, data_fields=["records"], meta_fields=[])


def wrap(cache) -> RecordCache:
    """A one-layer ``u8[P, ps // 4, 4, 256]`` record cache as a ``RecordCache`` (checked by
    ``reference.formats.tokamax_index.check_index_cache``: ValueError/TypeError naming it)."""
    ti.check_index_cache("cache_kv", cache, ti.HEAD_ALONG_SUBLANE)
    return RecordCache(jnp.asarray(cache))


def scale_bits(b: jax.Array) -> jax.Array:
    """``i32`` ue8m0 bytes -> the ``i32`` bits of the f32 ``2**(b - 127)`` (exact: byte 0 is the
    subnormal ``2**-127``, byte 0xFF NaN)."""
    bits = jnp.where(b == _E8M0_NAN, _F32_QNAN, b << _F32_MANTISSA)
    return jnp.where(b == 0, _SUBNORMAL_2_POW_M127, bits)


def decode_stage(keys: jax.Array, compute_dtype) -> tuple[jax.Array, jax.Array]:
    """In-kernel decode of a stage's pages ``u8[P, ps // 4, 4, 256]`` -> ``(codes
    compute_dtype[P * ps, 128], scale row f32[1, P * ps])`` (entry order along both)."""
    pages, rows, pack, width = keys.shape
    b = jnp.concatenate([keys[p].reshape(rows * pack, width) for p in range(pages)], axis=0)
    codes = pltpu.bitcast(b[:, :ti.HEAD_DIM], fp8.FP8_DTYPE)
    sc = b[:, ti.HEAD_DIM:].astype(jnp.int32)  # [P*ps, 128]: lane 0 is the scale byte
    scale = jax.lax.bitcast_convert_type(scale_bits(sc), jnp.float32)
    return codes.astype(compute_dtype), scale.T[0:1, :]
