"""Helpers of ``scripts/real_attention_experiment.py`` (issue 12): data, a byte-level causal LM,
a distilled lightning indexer, selections and metrics. Not installed and not part of the kernel
packages: the script puts the repository root on ``sys.path``."""
