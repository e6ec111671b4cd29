"""PagedLayout: only constructible valid, refusals name the numbers; aligned_page_size."""

from __future__ import annotations

import dataclasses

import pytest

from dsa_jax import LayoutError, PagedLayout, aligned_page_size


def test_a_page_size_that_does_not_divide_the_window_is_refused_naming_all_three_numbers():
    with pytest.raises(LayoutError, match=r"page_size=48 does not divide sliding_window=128 "
                                          r"\(128 % 48 = 32\)") as e:
        PagedLayout(page_size=48, pages_per_seq=4, sliding_window=128)
    assert "aligned_page_size(48, 128) = 32" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_page_larger_than_the_window_is_refused_unless_it_is_the_window():
    with pytest.raises(LayoutError, match="256 % 256|does not divide sliding_window=128"):
        PagedLayout(page_size=256, pages_per_seq=1, sliding_window=128)
    assert PagedLayout(page_size=128, pages_per_seq=1, sliding_window=128).pages_per_window == 1


def test_a_zero_window_is_not_the_same_as_no_window():
    with pytest.raises(LayoutError, match="a model without SWA has no window: pass None"):
        PagedLayout(page_size=16, pages_per_seq=4, sliding_window=0)
    assert PagedLayout(page_size=16, pages_per_seq=4, sliding_window=None).pages_per_window is None


@pytest.mark.parametrize("page_size", [0, -8])
def test_a_non_positive_page_size_is_refused_with_or_without_a_window(page_size):
    for window in (None, 128):
        with pytest.raises(LayoutError, match=f"page_size must be positive.*{page_size}"):
            PagedLayout(page_size=page_size, pages_per_seq=4, sliding_window=window)


def test_other_refusals_name_the_field():
    with pytest.raises(LayoutError, match="pages_per_seq=0"):
        PagedLayout(page_size=16, pages_per_seq=0)
    with pytest.raises(LayoutError, match="sliding_window=-64"):
        PagedLayout(page_size=16, pages_per_seq=4, sliding_window=-64)
    with pytest.raises(LayoutError, match="page_size must be a Python int"):
        PagedLayout(page_size=16.0, pages_per_seq=4)
    with pytest.raises(LayoutError, match="index_dim=0"):
        PagedLayout(page_size=16, pages_per_seq=4, index_dim=0)


def test_the_layout_is_frozen_and_hashable_so_it_can_be_a_jit_static():
    layout = PagedLayout(page_size=64, pages_per_seq=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.page_size = 48  # type: ignore[misc]
    assert hash(layout) == hash(PagedLayout(page_size=64, pages_per_seq=16))


def test_derived_capacities_and_dims_deepseek_v32():
    layout = PagedLayout(page_size=64, pages_per_seq=128, sliding_window=4096)
    assert layout.capacity_tokens == 128 * 64 == 8192
    assert layout.pages_per_window == 64
    assert layout.pages_for(1) == 1 and layout.pages_for(64) == 1 and layout.pages_for(65) == 2
    assert layout.pages_for(0) == 0
    assert (layout.index_dim, layout.qk_dim, layout.padded_dim, layout.v_dim) == (128, 576, 640,
                                                                                   512)
    assert layout.latent_cache_shape(10) == (10, 64, 640)
    assert layout.index_cache_shape(10) == (10, 64, 128)
    assert PagedLayout(page_size=8, pages_per_seq=1, latent_dim=128, rope_dim=0).padded_dim == 128
    assert PagedLayout(page_size=8, pages_per_seq=1, latent_dim=120, rope_dim=9).padded_dim == 256


def test_check_cache_names_the_disagreeing_dim():
    layout = PagedLayout(page_size=8, pages_per_seq=4, latent_dim=100, rope_dim=28)
    layout.check_cache("c", _Shape((5, 8, 128)), "latent")
    with pytest.raises(ValueError, match=r"c.shape\[-2\] \(page_size\) = 16 != layout.page_size "
                                         r"= 8"):
        layout.check_cache("c", _Shape((5, 16, 128)), "latent")
    with pytest.raises(ValueError, match=r"shape\[-1\] = 64 != layout.index_dim = 128"):
        layout.check_cache("c", _Shape((5, 8, 64)), "index")


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def test_the_aligned_size_rounds_down_never_up():
    assert aligned_page_size(256, 128) == 128
    assert aligned_page_size(100, 512) == 64
    assert aligned_page_size(64, 512) == 64
    assert aligned_page_size(100, 4099) == 1  # a prime window leaves only 1 below itself


def test_no_window_leaves_the_desired_size_alone_and_never_returns_zero():
    assert aligned_page_size(48, None) == 48
    assert aligned_page_size(0, None) == 1
    assert aligned_page_size(0, 128) == 1
    with pytest.raises(LayoutError, match="window=0"):
        aligned_page_size(16, 0)


def test_the_aligned_size_is_always_a_size_the_layout_accepts():
    for window in (1, 2, 3, 128, 512, 1024, 4096, 4099):
        for desired in (1, 7, 16, 31, 32, 100, 128, 256, 5000):
            size = aligned_page_size(desired, window)
            assert 0 < size <= desired, (desired, window, size)
            PagedLayout(page_size=size, pages_per_seq=1, sliding_window=window)
