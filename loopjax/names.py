"""The names a config gives analyses, halting criteria and attention kernels:
one JAX-free leaf that config validation and the modules using them read."""

# The mechanistic ones read one traced pass (every layer's output and weights).
MECHANISTIC = ("logit_lens", "fixed_points", "attention", "activations")
ANALYSES = ("overthinking", "halting", *MECHANISTIC)
# A language model's: from one streamed pass over validation text (lm/analyze.py),
# and each exit criterion's iterations per token (lm_halting).
LM_STREAMED = ("fixed_points", "stages", "attention")
LM_ANALYSES = (*LM_STREAMED, "halting")

# Adaptive halting (halting.py, whose CRITERIA has one rule per name): what
# iteration 1 is compared with, the criteria, and the ones LTG compares.
HALTING_START = ("readout", "uniform")
HALTING_CRITERIA = ("kl_entropy", "kl_entropy_len", "kl", "kl_reverse", "entropy",
                    "entropy_diff", "latent", "latent_diff", "cosine", "argmax",
                    "gate", "fixed")  # fmt: skip
HALTING_LTG = ("kl_entropy", "kl_entropy_len", "kl", "kl_reverse", "entropy",
               "latent", "argmax", "fixed")  # fmt: skip

# Attention's kernels (model/attention_kernels.py); "auto" picks by the target.
ATTENTION_KERNELS = ("auto", "xla", "blocked", "splash", "triton", "cudnn")
