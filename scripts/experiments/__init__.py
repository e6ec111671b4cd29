"""Experiments: the witness and real-attention experiments (with their notebooks) and the fp8
accuracy study; ``byte_lm`` is the real-attention experiment's small byte-level LM."""
