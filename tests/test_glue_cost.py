"""The V4 compressor's in-kernel finish (issue 30 deliverable 4: norm and RoPE in the pool kernel,
the RoPE tables read through their transposed view) on a RoPE table whose length is not a
multiple of 128 (the padded table view), in the interpreter against the reference. The
glue gates themselves run inside the compile gates that compile those programs
(``tests/glue_gates.py``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import v4_compressor as pvc
from pallas_kernels.v4_compressor import compile_cases as ccases
from reference import v4_compressor as vc
from tests import glue_gates, test_compile_indexer, test_compile_v4

pytestmark = pytest.mark.kernel_gate


def test_the_glue_gates_run_inside_compile_gates_that_compile_their_programs():
    """The gated programs are cases of the compile gates that assert the glue bounds (so a
    renamed case cannot drop a gate silently): the V4-Flash decode indexer (every chip of
    ``test_compile_indexer.test_compiles_for_tpu``) and the ``csa_d512_decode64`` compressor
    (every chip of ``test_compile_v4``'s
    ``test_compressor_compiles_in_place_without_per_element_glue``)."""
    indexer = [c for c in test_compile_indexer.CASES if c.kernel == "streamindex_topk r=4"
               and c.shape == glue_gates.INDEXER_FLASH]
    assert len(indexer) == 1 and not test_compile_indexer._scores_only(indexer[0])
    compressor = [c for c, _ in test_compile_v4.COMPRESSOR_CASES
                  if c.shape == glue_gates.COMPRESSOR]
    assert len(compressor) == len(test_compile_v4.aot.CHIPS)
    assert glue_gates.COMPRESSOR in {c.shape for c in ccases.compile_cases()}


def test_compressor_finish_on_a_table_not_a_multiple_of_128():
    """Ratio 4, d 128, a 200-position table (the kernel reads a padded transposed view): the
    entries equal the reference's bit for bit (the same ops in the same order; XLA CPU), the
    unused slots zero."""
    rng = np.random.default_rng()
    ratio, d, n = 4, 128, 13
    cos, sin = vc.rope_tables(200)
    width = vc.compressor_coff(ratio) * d
    kv, score = (jnp.asarray(rng.standard_normal((n, width)), jnp.float32) for _ in range(2))
    ape = jnp.asarray(rng.standard_normal((ratio, width)), jnp.float32)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32)
    # a zero pool: entry 45 pools tokens 176..179 from the ring
    state = vc.CompressorState(*(jnp.zeros((2, vc.state_rows(ratio), width), jnp.float32)
                                 for _ in range(2)))
    # kv_len 193 (this step's tokens 180..192): entries 45..47 at positions 180..188, in the
    # table's last tile (positions 128..199, padded to 256)
    args = (kv, score, ape, weight, cos, sin, state, jnp.asarray([1], jnp.int32),
            jnp.asarray([180 + n], jnp.int32), jnp.asarray([0, n], jnp.int32),
            jnp.asarray([0, 1, 1], jnp.int32))
    got, _ = pvc.compress_step(*args, ratio=ratio, interpret=True)
    want, _ = vc.compress_step(*args, ratio=ratio)
    np.testing.assert_array_equal(np.asarray(got.seq), np.asarray(want.seq))
    np.testing.assert_array_equal(np.asarray(got.entry), np.asarray(want.entry))
    assert (np.asarray(got.entry) >= 0).sum() == 3
    np.testing.assert_array_equal(np.asarray(got.rows).view(np.uint32),
                                  np.asarray(want.rows).view(np.uint32))
