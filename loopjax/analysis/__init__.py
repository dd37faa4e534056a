"""Analyses of runs and checkpoints, and the names `--mode=analyze` knows them by."""

# The mechanistic ones read one traced pass (every layer's output and weights).
MECHANISTIC = ("logit_lens", "fixed_points", "attention", "activations")
ANALYSES = ("overthinking", "halting", *MECHANISTIC)
# A language model's: from one streamed pass over validation text (analyze_lm),
# and each exit criterion's iterations per token (lm_halting).
LM_STREAMED = ("fixed_points", "stages", "attention")
LM_ANALYSES = (*LM_STREAMED, "halting")
