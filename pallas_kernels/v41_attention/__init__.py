"""DeepSeek-V4.1 attention over its own cache pages (issue 31): ``v41_attention`` (the entry),
``window_segments`` (where a row's window segments start) and ``traffic`` (the model);
``kernel`` the Pallas kernel, ``decode`` the in-VMEM decode of the page rows."""

from pallas_kernels.v41_attention.entry import traffic, v41_attention, window_segments

__all__ = ["traffic", "v41_attention", "window_segments"]
