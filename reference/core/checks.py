"""Static (trace-time) argument checks shared by every op.

Shapes, dtypes and static arguments are known when a function is traced, so mistakes there
raise ``TypeError``/``ValueError`` naming the argument and the numbers. Runtime values that jit
cannot refuse (ids out of range, lengths past capacity) are masked by each op's documented rule
instead; ``dsa_jax`` offers an opt-in checkify validation that reports them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rank(name: str, x, expected: int) -> None:
    """Refuse ``x`` unless it has ``expected`` dimensions."""
    if np.ndim(x) != expected:
        raise ValueError(f"{name} must have rank {expected}, got rank {np.ndim(x)} "
                         f"(shape {tuple(np.shape(x))})")


def integer(name: str, x) -> None:
    """Refuse a non-integer array."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {jnp.result_type(x)}")


# Floating dtypes every op and kernel computes with (products accumulate in f32).
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def floating(name: str, x) -> None:
    """Refuse a non-floating array (TypeError) and a floating dtype no kernel supports, such as
    f16 or fp8 (ValueError naming the dtype and the supported list)."""
    dt = jnp.dtype(jnp.result_type(x))
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating array (float32 or bfloat16), got dtype {dt}")
    if dt not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {dt}, which no kernel supports; supported: "
                         f"{', '.join(str(d) for d in FLOAT_DTYPES)}")


def positive_int(name: str, value, where: str = "") -> int:
    """Refuse a static argument that is not a Python int >= 1; return it. ``where``: the
    call it was given to, prefixed to the message (``"Batch.from_packed: page_size ..."``)."""
    at = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{at}{name} must be a static Python int, got {type(value).__name__} "
                        f"{value!r}")
    if value <= 0:
        raise ValueError(f"{at}{name} must be positive, got {name}={value}")
    return int(value)


def nonneg_int(name: str, value) -> int:
    """Refuse a static argument that is not a Python int >= 0; return it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__} "
                        f"{value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value}")
    return int(value)


def dim(name: str, x, axis: int, expected: int, why: str) -> None:
    """Refuse ``x`` unless ``x.shape[axis] == expected``; ``why`` names where expected came from."""
    got = np.shape(x)[axis]
    if got != expected:
        raise ValueError(f"{name}.shape[{axis}] must equal {why} = {expected}, got {got} "
                         f"(shape {tuple(np.shape(x))})")


def ragged_metadata(seq_lens, page_indices, cu_q_lens, cu_kv_lens, distribution,
                    *, seq_lens_name: str = "seq_lens", page_indices_name: str = "page_indices",
                    cu_kv_lens_name: str = "cu_kv_lens") -> int:
    """Check the ragged paged batch metadata; return the static sequence count S. The
    ``*_name`` arguments: the caller's names of those arrays (V4's ``window.cu_lens``...)."""
    for name, x, r in ((seq_lens_name, seq_lens, 1), (page_indices_name, page_indices, 1),
                       ("cu_q_lens", cu_q_lens, 1), (cu_kv_lens_name, cu_kv_lens, 1),
                       ("distribution", distribution, 1)):
        rank(name, x, r)
        integer(name, x)
    num_seqs = np.shape(seq_lens)[0]
    dim("cu_q_lens", cu_q_lens, 0, num_seqs + 1, f"len({seq_lens_name}) + 1")
    dim(cu_kv_lens_name, cu_kv_lens, 0, num_seqs + 1, f"len({seq_lens_name}) + 1")
    dim("distribution", distribution, 0, 3, "3 (decode_end, prefill_end, num_seqs)")
    return num_seqs


def paged_cache(name: str, cache, feature_dim: int | None = None, why: str = "") -> None:
    """Check a paged cache ``[num_pages, page_size, D]``."""
    rank(name, cache, 3)
    floating(name, cache)
    if feature_dim is not None:
        dim(name, cache, 2, feature_dim, why)
