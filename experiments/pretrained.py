"""Pretrained looped language models, loaded from a local Hugging Face
directory (loopjax/pretrained), analyzed as MECH does: fixed points per layer
of the block, attention heads' stability and the stages of inference, at
recurrences from 1 to well past the trained mean, on GSM8K-style prompts.

Variants (the family's recurrences and analysis depth; bf16):
  huginn    Huginn-0125: prelude 2, core 4, coda 2; R 32 (its default at
            inference), analyzed to 64
  ouro      Ouro-1.4B / 2.6B: the whole stack looped; R 4 (trained), to 16
  retrofit  Llama / OLMo 2 retrofitted with recurrence (McLeish et al.); R 4,
            to 32
  llama, olmo2  the feedforward models MECH compares against (R 1); the
            analyses' iteration 1 is the model itself, iterations 2-4 apply
            the whole stack again to its own output (looping the whole model,
            a baseline of retrofitting's paper)

  python -m loopjax.main --config=experiments/pretrained.py:huginn \\
      --config.model.hf_dir=~/models/huginn-0125 --workdir=runs/huginn --mode=analyze
  python -m loopjax.sample --config=experiments/pretrained.py:huginn \\
      --config.model.hf_dir=~/models/huginn-0125 --workdir=runs/huginn \\
      --prompt="The capital of France is"

`--config.data.source=prompts:FILE` (one prompt per line, or JSONL with the
prompt under data.text_field) replaces the 8 arithmetic questions shipped in
experiments/prompts; `--config.model.hf_split=2,4,2` re-splits a feedforward
model (all its layers in a split, at R 1, are the same function). On a CPU host,
`--config.model.dtype=float32`: XLA:CPU computes bf16 matmuls by converting
the weights to float32 first, so bf16 needs more memory there, not less.
Memory on a target mesh, from config.json alone (experiments/hf_shapes holds
the published models' shapes):

  python -m loopjax.aot --config=experiments/pretrained.py:huginn --devices=8 \
      --config.model.hf_dir=experiments/hf_shapes/huginn-0125 \
      --config.mesh.data=1 --config.mesh.fsdp=8
"""

from pathlib import Path

from loopjax import config as config_lib
from loopjax.lm import spec

PROMPTS = Path(__file__).parent / "prompts" / "arithmetic.jsonl"
SHAPES = Path(__file__).parent / "hf_shapes"  # published models' config.json
# Huginn's exit criteria (its names: kl, entropy-diff, latent-diff, cosine,
# argmax-stability) as loopjax.halting's
HUGINN_EXITS = ("kl_reverse", "entropy_diff", "latent_diff", "cosine", "argmax")
# variant -> (model.num_loops, analyze.max_depth, analyze.batch_size): looped
# models analyzed to MECH's 128 iterations; the analysis pass holds every layer
# of the block's outputs and attention weights for a few iterations, whatever
# the depth, so Ouro's 48-layer block analyzes one prompt at a time
# (python -m loopjax.aot: docs/pretrained.md)
FAMILIES = {
  "huginn": (32, 128, 4),
  "ouro": (4, 128, 1),
  "retrofit": (4, 128, 4),
  "llama": (1, 4, 4),
  "olmo2": (1, 4, 4),
}


def get_config(variant: str = "huginn"):
  if variant == "huginn_random":  # Huginn-0125's shape, random weights: the
    c = get_config("huginn")  # accelerator check (python -m loopjax.bench pretrained)
    c.variant = variant
    c.model.hf_dir = str(SHAPES / "huginn-0125")
    return c
  if variant not in FAMILIES:
    raise ValueError(
      f"variant: must be one of {', '.join(FAMILIES)}, huginn_random; got {variant!r}"
    )
  c = config_lib.base()
  c.variant = variant
  c.data.update(task="lm", source=f"prompts:{PROMPTS}", text_field="question")
  c.data.seq_len = 256  # a prompt's tokens beyond are cut
  num_loops, depth, batch = FAMILIES[variant]
  c.model.update(num_loops=num_loops, dtype="bfloat16", hf_dir="")
  c.analyze.update(names=tuple(spec.ANALYSES), max_depth=depth, batch_size=batch)
  # `halting`: each token's exit under the family's own rules, up to R
  if variant == "ouro":  # its gate; 1.0 (its config's default): all 4 steps
    c.analyze.halting.update(criteria=("gate",), r_min=1, r_max=4)
    c.analyze.halting.gate = (0.3, 0.5, 0.7, 0.9)
  elif variant in ("llama", "olmo2"):  # nothing to exit from
    c.analyze.names = spec.SHARED
  else:  # Huginn's evaluators, their default thresholds among the eps
    c.analyze.halting.update(
      criteria=HUGINN_EXITS, r_min=1, r_max=num_loops, start="uniform",
      eps=(1e-4, 1e-3, 1e-2, 3e-2), patience=(2, 5),
    )  # fmt: skip
  c.mesh.devices = 1
  return c
