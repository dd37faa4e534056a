"""Analyses of runs and checkpoints, and the names `--mode=analyze` knows them by."""

# The mechanistic ones read one traced pass (every layer's output and weights).
MECHANISTIC = ("logit_lens", "fixed_points", "attention", "activations")
ANALYSES = ("overthinking", "halting", *MECHANISTIC)
# A language model's, from one streamed pass over validation text (analyze_lm).
LM_ANALYSES = ("fixed_points", "stages", "attention")
