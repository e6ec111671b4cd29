"""Moved to reference/mla/attend.py; kept so old imports work.

Unlike the other shims this old path is the new module itself (``sys.modules`` aliasing), not a
copy of its names: tests/test_reference_mla.py monkeypatches ``attend.GATHER_BLOCK_BYTES``
through it, and the chunked gather reads that global from ``reference.mla.attend``, so a copy
would leave the patch without effect."""

import sys

from reference.mla import attend as _attend

sys.modules[__name__] = _attend
