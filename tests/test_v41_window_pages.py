"""V4.1's window kv on the TPU (issue 31, Deliver 3): the window pages
(``reference.v41.window_pages``: a record row of whole lanes per token in MODEL1's byte-plane
order, the ue8m0 scale words after the records, tokens along lanes) hold
``encode_window_kv``'s codes and scale bytes exactly, written and read per token (several layers
in one scatter, out-of-range pages dropped / read as zeros); 528 B a token at V4.1's ``D = 512``
and pages of 128."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from reference.v41 import window_pages as wp
from reference.v41.formats import encode_window_kv


@pytest.mark.parametrize("ps,dim", [(128, 512), (256, 512), (64, 512), (4, 64), (32, 64)])
def test_pages_hold_the_format_bit_for_bit(ps, dim):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, ps, dim)) * 2.0 ** rng.integers(-30, 30, (2, 3, ps, 1))
    x[1, 0, 1, 40:45] = np.nan  # a NaN block: its scale byte 0xFF
    rows = encode_window_kv(jnp.asarray(x, jnp.float32))
    pages = wp.to_pages(rows)
    assert pages.shape == (2, 3, wp.page_rows(ps, dim), dim // 4)
    np.testing.assert_array_equal(wp.from_pages(pages, ps, dim), rows)
    lay, pid, off = np.meshgrid(np.arange(2), np.arange(3), np.arange(ps), indexing="ij")
    written = wp.write_tokens(jnp.zeros_like(pages), lay, pid, off, rows, page_size=ps,
                              dim=dim)
    np.testing.assert_array_equal(written, pages)
    np.testing.assert_array_equal(
        wp.read_tokens(written, lay, pid, off, page_size=ps, dim=dim), rows)
    assert not np.asarray(wp.read_tokens(written, 0, 3, 0, page_size=ps, dim=dim)).any()
    dropped = wp.write_tokens(written, 0, 3, 0, rows[0, 0, 0], page_size=ps, dim=dim)
    np.testing.assert_array_equal(dropped, written)  # page 3 of 3: dropped
    if dim == 512 and ps % 128 == 0:
        assert wp.bytes_per_token(ps, dim) == 528


def test_record_planes_and_scale_words():
    """Hand case: feature ``f`` of token 5 is byte ``f // 128`` of record word ``f % 128`` (row
    5); its 16 scale bytes are words 20..23 of row ``ps`` (32 tokens a scale row)."""
    x = np.zeros((1, 128, 512), np.float32)
    x[0, 5, 130] = 448.0  # block 4 (features 128..159): scale 2^0, code 0x7E
    x[0, 5, 3] = -2.0 ** -8  # block 0: amax 2^-8 -> scale 2^-16 (2^-8 / 448 -> 2^-16)
    pages = np.asarray(wp.to_pages(encode_window_kv(jnp.asarray(x))))[0]
    assert pages[5, 2] >> 8 & 0xFF == 0x7E  # feature 130 = 128 + 2: plane 1 of word 2
    assert pages[5, 3] & 0xFF == 0x80 | 0x78  # -256 x 2^-16: sign | e4m3 256 (0x78)
    assert pages[128, 20] & 0xFF == 127 - 16 and pages[128, 21] & 0xFF == 127  # blocks 0, 4
