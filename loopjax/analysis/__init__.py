"""Analyses of runs and checkpoints, and the names `--mode=analyze` knows them by."""

# The mechanistic ones read one traced pass (every layer's output and weights).
MECHANISTIC = ("logit_lens", "fixed_points", "attention", "activations")
ANALYSES = ("overthinking", "halting", *MECHANISTIC)
