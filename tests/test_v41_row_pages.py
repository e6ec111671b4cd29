"""V4.1's window and pool caches on the TPU (issue 31, Deliver 3; ``reference.v41.row_pages``):
the window pages (``window_pages``: a record row of whole lanes per token in MODEL1's
byte-plane order, 32 tokens' ue8m0 scale words a scale row) and the pool pages (``pool_pages``:
two entries' nibbles a record row, sixteen entries' e4m3 scale words a scale row) hold
``encode_window_kv``'s / ``encode_compressed_kv``'s bytes exactly, written and read per entry
(several layers in one scatter, out-of-range pages dropped / read as zeros); 544 B a token (528
at pages of 256: rows padded to a multiple of 8) and 288 B an entry at V4.1's ``D = 512`` (pages
of 128)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from reference.v41 import pool_pages as pp
from reference.v41 import window_pages as wp
from reference.v41.formats import encode_compressed_kv, encode_window_kv


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
    for page in (3, -1):  # page 3 of 3 and page -1: dropped (never wrapped to the last page)
        dropped = wp.write_tokens(written, 0, page, 0, rows[0, 0, 1], page_size=ps, dim=dim)
        np.testing.assert_array_equal(dropped, written)
    if dim == 512 and ps % 256 == 0:  # 256 records + 8 scale rows: a multiple of 8 (TILE_ROWS)
        assert wp.bytes_per_token(ps, dim) == 528
    if dim == 512 and ps == 128:  # 132 rows padded to 136
        assert wp.bytes_per_token(ps, dim) == 544


def test_record_planes_and_scale_words():
    """Hand case: feature ``f`` of token 5 sits at position ``P = 64 (f % 8) + f // 8`` of the
    lane order, byte ``P // 128`` of record word ``P % 128`` (row 5); its 16 scale bytes are
    words 20..23 of row ``ps`` (32 tokens a scale row)."""
    x = np.zeros((1, 128, 512), np.float32)
    x[0, 5, 130] = 448.0  # block 4 (features 128..159): scale 2^0, code 0x7E
    x[0, 5, 3] = -2.0 ** -8  # block 0: amax 2^-8 -> scale 2^-16 (2^-8 / 448 -> 2^-16)
    pages = np.asarray(wp.to_pages(encode_window_kv(jnp.asarray(x))))[0]
    assert pages[5, 16] >> 8 & 0xFF == 0x7E  # feature 130: P = 128 + 16, plane 1 of word 16
    assert pages[5, 64] >> 8 & 0xFF == 0x80 | 0x78  # feature 3: P = 192; -256 x 2^-16
    assert (pp.lane_order(512)[[144, 192]] == [130, 3]).all()
    f = np.arange(512.0)
    np.testing.assert_array_equal(np.asarray(pp.to_lane_order(jnp.asarray(f))),
                                  pp.lane_order(512))
    np.testing.assert_array_equal(np.asarray(pp.from_lane_order(pp.to_lane_order(f))), f)
    assert pages[128, 20] & 0xFF == 127 - 16 and pages[128, 21] & 0xFF == 127  # blocks 0, 4


@pytest.mark.parametrize("ps,dim", [(128, 512), (20, 512), (4, 64), (32, 64)])
def test_pool_pages_hold_the_format_bit_for_bit(ps, dim):
    """Also at a page size that is no multiple of 2 or 16 (20: a half-used scale row)."""
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, ps, dim)) * 2.0 ** rng.integers(-8, 8, (2, 3, ps, 1))
    x[0, 2, 3, 17:20] = np.nan
    rows = encode_compressed_kv(jnp.asarray(x, jnp.float32))
    pages = pp.to_pages(rows)
    assert pages.shape == (2, 3, pp.page_rows(ps, dim), dim // 4)
    np.testing.assert_array_equal(pp.from_pages(pages, ps, dim), rows)
    lay, pid, off = np.meshgrid(np.arange(2), np.arange(3), np.arange(ps), indexing="ij")
    written = pp.write_entries(jnp.zeros_like(pages), lay, pid, off, rows, page_size=ps,
                               dim=dim)
    np.testing.assert_array_equal(written, pages)
    np.testing.assert_array_equal(
        pp.read_entries(written, lay, pid, off, page_size=ps, dim=dim), rows)
    assert not np.asarray(pp.read_entries(written, 1, 3, 0, page_size=ps, dim=dim)).any()
    for page in (3, -1):  # dropped, never wrapped to the last page
        dropped = pp.write_entries(written, 1, page, 0, rows[0, 0, 1], page_size=ps, dim=dim)
        np.testing.assert_array_equal(dropped, written)
    if dim == 512 and ps % 16 == 0:
        assert pp.bytes_per_entry(ps, dim) == 288


def test_pool_record_and_scale_slots():
    """Hand case: entry 3's nibble bytes are words 64..127 of record row 1 (two entries a row),
    its 32 e4m3 scale bytes words 24..31 of the first scale row (``ps / 2 = 64``)."""
    x = np.zeros((1, 128, 512), np.float32)
    x[0, 3, 0], x[0, 3, 1] = 6.0, -3.0  # block 0: scale e4m3(1) = 0x38; codes 7 and 8 | 5
    pages = np.asarray(pp.to_pages(encode_compressed_kv(jnp.asarray(x))))[0]
    assert pages[1, 64] & 0xFF == 0x7 | (0xD << 4)  # features 0 (low nibble) and 1 (high)
    assert pages[64, 24] & 0xFF == 0x38
    assert not pages[1, :64].any()  # entry 2: all zero codes

