"""The names a config gives halting criteria and attention kernels: one
JAX-free leaf that config validation and the modules using them read (the
analyses' names are their families', kg/spec.py and lm/spec.py), and
`imported`, which turns a registry's "module:ATTRIBUTE" into the object."""

import importlib


def imported(path: str):
  """The attribute "module:ATTRIBUTE" names, its module imported now."""
  module, _, attribute = path.partition(":")
  return getattr(importlib.import_module(module), attribute)


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
