"""``reference.batch.RaggedBatch``: the one batch type, and the one token -> page slot -> page id
rule every op (reference, Pallas kernels, cache writer, validator) uses, checked against the
rule written out here in NumPy from SPEC.md (not from the implementation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chips, tpu
from reference import batch
from reference.synthetic import make_ragged_batch


def _numpy_rule(table, slot0, page, num_pages):
    """Page id of page ``page`` of a sequence whose slots start at ``slot0``, or None."""
    slot = slot0 + page
    if slot < 0 or slot >= len(table):
        return None
    pid = int(table[slot])
    return pid if 0 <= pid < num_pages else None


def _batch(seed=0, **kw):
    rng = np.random.default_rng(seed)
    b = make_ragged_batch(rng, q_lens=[1, 3, 2], kv_lens=[9, 20, 5], page_size=4,
                          pages_per_seq=6, num_heads=1, dim=8, pad_seqs=1, pad_rows=2, **kw)
    return b, batch.RaggedBatch.of(jnp.asarray(b.cache), *(jnp.asarray(x) for x in b.meta()),
                                   pages_per_seq=b.pages_per_seq)


def test_is_a_pytree_with_static_sizes():
    _, rb = _batch()
    leaves, tree = jax.tree.flatten(rb)
    assert len(leaves) == 5  # the five arrays; page_size, pages_per_seq, num_pages are static
    back = jax.tree.unflatten(tree, leaves)
    assert (back.page_size, back.pages_per_seq, back.num_pages) == (4, 6, rb.num_pages)
    assert rb.capacity_tokens == 24

    @jax.jit
    def used(b: batch.RaggedBatch):
        return b.seq_pages(1).page_ids

    np.testing.assert_array_equal(np.asarray(used(rb)), np.asarray(rb.seq_pages(1).page_ids))


@pytest.mark.parametrize("corrupt", ["none", "slot_past_table", "negative_id", "id_past_cache"])
def test_page_ids_follow_the_rule(corrupt):
    b, rb = _batch(seed=3)
    table = np.array(b.page_indices)
    if corrupt == "negative_id":
        table[1] = -5
    elif corrupt == "id_past_cache":
        table[2] = rb.num_pages + 7
    cu_kv = np.array(b.cu_kv_lens)
    if corrupt == "slot_past_table":
        cu_kv[2] = (len(table) - 1) * rb.page_size  # sequence 2's pages run off the table end
    rb = batch.RaggedBatch(rb.kv_lens, jnp.asarray(table), rb.cu_q_lens, jnp.asarray(cu_kv),
                           rb.distribution, page_size=rb.page_size,
                           pages_per_seq=rb.pages_per_seq, num_pages=rb.num_pages)
    seqs = jnp.arange(rb.num_seqs)[:, None]
    pages = jnp.arange(-1, rb.pages_per_seq + 2)[None, :]
    pid, ok = rb.page_ids(seqs, pages, jnp.ones(pages.shape, bool))
    for s in range(rb.num_seqs):
        for j, p in enumerate(np.asarray(pages)[0]):
            want = _numpy_rule(table, int(cu_kv[s]) // rb.page_size, int(p), rb.num_pages)
            assert bool(ok[s, j]) == (want is not None), (corrupt, s, p)
            if want is not None:
                assert int(pid[s, j]) == want


def test_token_slots_and_seq_pages_agree_with_the_synthetic_layout():
    b, rb = _batch(seed=5)
    for s, pages in enumerate(b.seq_pages):
        kv = int(b.seq_lens[s])
        pos = jnp.arange(rb.capacity_tokens)
        pid, off, ok = rb.token_slots(s, pos, pos < kv)
        for t in range(rb.capacity_tokens):
            assert bool(ok[t]) == (t < kv), (s, t)
            if t < kv:
                assert (int(pid[t]), int(off[t])) == (int(pages[t // 4]), t % 4)
        sp = rb.seq_pages(s)
        np.testing.assert_array_equal(np.asarray(sp.token_ok), np.arange(24) < kv)


def test_lookup_page_on_an_empty_table_finds_nothing():
    pid, ok = batch.lookup_page(jnp.zeros((0,), jnp.int32), jnp.arange(3), 5)
    assert not bool(jnp.any(ok)) and pid.shape == (3,)


def test_interpret_true_means_the_strict_interpreter_for_every_kernel():
    params = tpu.interpret_params(True)
    assert params.detect_races and params.uninitialized_memory == "nan"
    assert params.out_of_bounds_reads == "raise"
    with pytest.raises(TypeError, match="interpret"):
        tpu.interpret_params("yes")


def test_one_chip_answer_follows_the_default_device():
    from pallas_kernels import aot

    assert tpu.device_chip() is None  # CPU host
    with jax.default_device(aot.topology_device(chips.DEFAULT)):
        assert tpu.device_chip() == chips.DEFAULT
