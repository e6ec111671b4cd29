"""Helpers of ``scripts/experiments/real_attention_experiment.py`` (issue 12): data, a
byte-level causal LM, a distilled lightning indexer, selections and metrics. Not installed and
not part of the kernel packages: import it as ``scripts.experiments.byte_lm`` from the
repository root."""
