"""Old path of ``pallas_kernels.measure.interpret_counter`` (the Pallas interpreter's HBM byte /
DMA counter). This module IS that module (``sys.modules`` points the old name at it), so every
name, underscore ones included, and ``monkeypatch.setattr`` on a module global
(``INTERNALS_MODULE``) behave as before. New code imports ``pallas_kernels.measure``."""

import sys

from pallas_kernels.measure import interpret_counter

sys.modules[__name__] = interpret_counter
