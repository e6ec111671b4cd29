"""The ragged paged batch as one object: ``Batch``, built once per engine step and passed to
every op as ``batch=`` in place of its metadata arrays.

An engine builds one ``Batch`` per step and reuses it for every layer:

- ``Batch.from_packed(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, *,
  page_size, pages_per_seq)``: the packed page table (sglang-jax; the package's positional form,
  ``reference.core.batch``): sequence ``i``'s pages start at slot ``cu_kv_lens[i] // page_size``.
- ``Batch.from_fixed_stride(kv_lens, page_table, cu_q_lens, distribution, *, page_size)``: the
  fixed-stride table ``i32[S, pages_per_seq]`` (vLLM / tpu-inference, jax's
  ``ragged_paged_attention``): row ``i`` holds sequence ``i``'s pages. It is the packed form
  with ``page_indices = page_table.reshape(-1)`` and ``cu_kv_lens[i] = i * pages_per_seq *
  page_size``: a view of the table (no copy of a cache, and none of the table under jit).

Arrays (leaves of the pytree): ``kv_lens i32[S]`` (each sequence's KV length including this
step's rows), ``page_indices i32[N]``, ``cu_q_lens i32[S+1]``, ``cu_kv_lens i32[S+1]``,
``distribution i32[3] = (decode_end, prefill_end, num_seqs)``. Statics: ``page_size`` (keys per
page: tokens, or entries of DeepSeek-V4's compressed index keys) and ``pages_per_seq``. The
factories check shapes and dtypes (``ValueError`` / ``TypeError`` naming the argument and the
numbers); an op checks the batch against its cache (``page_size`` against the cache's dim -2).
Runtime values are masked by ``reference.core.batch``'s rules and reported by ``validate=True``
on the op. ``S = 0`` (no sequences) and ``T = 0`` (no rows) are valid batches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import checks as _checks

META_NAMES = ("kv_lens", "page_indices", "cu_q_lens", "cu_kv_lens", "distribution")


def _int_array(where: str, name: str, x, shape: tuple) -> jax.Array:
    """``x`` as i32 with ``shape`` (``None`` entries: any), else a named error."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
        if x.size == 0:
            dtype = np.dtype(np.int32)
            x = x.astype(np.int32)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: {name} must be an integer array (i32), got dtype {dtype}")
    got = tuple(np.shape(x))
    if len(got) != len(shape) or any(
            w is not None and g != w for g, w in zip(got, shape, strict=True)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{where}: {name} must have shape {want}, got {list(got)}")
    return jnp.asarray(x, jnp.int32)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A ragged paged batch (module docstring): five i32 arrays and two static sizes. Build it
    with ``from_packed`` or ``from_fixed_stride``; a pytree (jit / shard_map pass it whole)."""

    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    cu_kv_lens: jax.Array
    distribution: jax.Array
    page_size: int
    pages_per_seq: int

    @classmethod
    def from_packed(cls, kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution, *,
                    page_size: int, pages_per_seq: int) -> Batch:
        """The batch of a packed page table.

        Args:
          kv_lens: ``i32[S]`` KV length per sequence, in tokens.
          page_indices: ``i32[N]``, sequence ``i``'s pages from slot
            ``cu_kv_lens[i] // page_size``.
          cu_q_lens: ``i32[S+1]`` row offsets of each sequence's query rows.
          cu_kv_lens: ``i32[S+1]``, cumulative page-aligned capacities (keys).
          distribution: ``i32[3]`` ``(decode_end, prefill_end, num_seqs)``.
          page_size: keys per page (static). pages_per_seq: page-table stride (static).
        """
        where = "Batch.from_packed"
        kv = _int_array(where, "kv_lens", kv_lens, (None,))
        s = kv.shape[0]
        return cls(kv, _int_array(where, "page_indices", page_indices, (None,)),
                   _int_array(where, "cu_q_lens", cu_q_lens, (s + 1,)),
                   _int_array(where, "cu_kv_lens", cu_kv_lens, (s + 1,)),
                   _int_array(where, "distribution", distribution, (3,)),
                   page_size=_checks.positive_int("page_size", page_size, where),
                   pages_per_seq=_checks.positive_int("pages_per_seq", pages_per_seq, where))

    @classmethod
    def from_fixed_stride(cls, kv_lens, page_table, cu_q_lens, distribution, *,
                          page_size: int) -> Batch:
        """The batch of a fixed-stride page table ``i32[S, pages_per_seq]`` (row ``i``:
        sequence ``i``'s pages); ``kv_lens``, ``cu_q_lens``, ``distribution`` and
        ``page_size`` as ``from_packed``."""
        where = "Batch.from_fixed_stride"
        kv = _int_array(where, "kv_lens", kv_lens, (None,))
        s = kv.shape[0]
        table = _int_array(where, "page_table", page_table, (s, None))
        page_size = _checks.positive_int("page_size", page_size, where)
        pages_per_seq = _checks.positive_int("page_table.shape[1] (pages_per_seq)",
                                             int(table.shape[1]), where)
        stride = pages_per_seq * page_size
        cu_kv = jnp.arange(s + 1, dtype=jnp.int32) * stride
        return cls(kv, table.reshape(-1), _int_array(where, "cu_q_lens", cu_q_lens, (s + 1,)),
                   cu_kv, _int_array(where, "distribution", distribution, (3,)),
                   page_size=page_size, pages_per_seq=pages_per_seq)

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        """``(kv_lens, page_indices, cu_q_lens, cu_kv_lens, distribution)``: the ops'
        positional order."""
        return (self.kv_lens, self.page_indices, self.cu_q_lens, self.cu_kv_lens,
                self.distribution)

    @property
    def num_seqs(self) -> int:
        """``S``: sequence slots, active or not."""
        return int(self.kv_lens.shape[0])


jax.tree_util.register_dataclass(Batch, data_fields=list(META_NAMES),
                                 meta_fields=["page_size", "pages_per_seq"])


def op_batch(op: str, batch, positional: tuple, *, names: tuple[str, ...], cache,
             pages_per_seq, layout=None, tokens: bool = True) -> tuple[tuple, int]:
    """The metadata arrays and ``pages_per_seq`` of one call of ``op``: from ``batch`` or from
    the positional arrays (exactly one of them), with ``pages_per_seq`` from the keyword, the
    ``layout`` or the batch, all of which must agree. ``names``: the op's names of the five
    positional arrays (the indexer's ``seq_lens`` is the MLA's ``kv_lens``). ``tokens``: the
    cache's pages hold tokens (not DeepSeek-V4's compressed entries), so a ``layout``'s
    ``page_size`` must be the cache's too."""
    from_layout = None if layout is None else _layout_pages(op, layout)
    cache_page = int(tuple(getattr(cache, "shape", np.shape(cache)))[-2])
    if layout is not None and tokens and int(layout.page_size) != cache_page:
        raise ValueError(f"{op}: layout.page_size = {layout.page_size} but the cache holds "
                         f"{cache_page} tokens per page (its shape[-2])")
    if metadata_from(op, batch, positional, names) is not None:
        pages = _agree(op, [("pages_per_seq", pages_per_seq), ("layout.pages_per_seq",
                                                                  from_layout)])
        if pages is None:
            raise TypeError(f"{op}: pages_per_seq is required (or layout=PagedLayout(...), or "
                            f"batch=)")
        return tuple(positional), pages
    pages = _agree(op, [("batch.pages_per_seq", batch.pages_per_seq),
                        ("pages_per_seq", pages_per_seq), ("layout.pages_per_seq",
                                                           from_layout)])
    if cache_page != batch.page_size:
        raise ValueError(f"{op}: batch.page_size = {batch.page_size} but the cache holds "
                         f"{cache_page} keys per page (its shape[-2])")
    return batch.arrays, pages


def metadata_from(op: str, batch, positional: tuple, names: tuple[str, ...]):
    """Exactly one source of an op's batch metadata: ``positional`` (returned) when ``batch``
    is ``None``, else ``None`` (the caller reads the ``Batch``); a missing array, a ``batch``
    that is not a ``Batch`` or both given is a ``TypeError`` naming them."""
    if batch is None:
        missing = [n for n, x in zip(names, positional, strict=True) if x is None]
        if missing:
            raise TypeError(f"{op}: the batch metadata is missing ({', '.join(missing)}): pass "
                            f"batch=dsa_jax.Batch.from_packed(...) / from_fixed_stride(...) "
                            f"or all of {', '.join(names)} positionally")
        return tuple(positional)
    if not isinstance(batch, Batch):
        raise TypeError(f"{op}: batch must be a dsa_jax.Batch, got {type(batch).__name__}")
    given = [n for n, x in zip(names, positional, strict=True) if x is not None]
    if given:
        raise TypeError(f"{op}: pass the batch metadata either as batch= or positionally, not "
                        f"both (also given: {', '.join(given)})")
    return None


def _layout_pages(op: str, layout) -> int:
    pages = getattr(layout, "pages_per_seq", None)
    if pages is None:
        raise TypeError(f"{op}: layout must be a dsa_jax.PagedLayout, got "
                        f"{type(layout).__name__}")
    return int(pages)


def _agree(op: str, named: list[tuple[str, int | None]]) -> int | None:
    """The one value the given (non-None) entries share, else ``ValueError`` naming them."""
    given = [(n, int(v)) for n, v in named if v is not None]
    if len({v for _, v in given}) > 1:
        raise ValueError(f"{op}: " + " but ".join(f"{n} = {v}" for n, v in given))
    return given[0][1] if given else None
