"""Adaptive halting on k-hop chains ("Loop, Think, & Generalize").

The model and training are extrapolation.py's dynamic-R run; this file sets
what `--mode=analyze` measures: the accuracy / compute trade-off of each
halting criterion over its thresholds, up to r_max = 16 iterations (the paper's
evaluation), each comparing an iteration with the one before from the second
on (r_min = 2, as LTG's code does); kl_entropy_len is LTG's in-training rule
(KL < 0.5 and entropy < 3 + 12 / 50, which LTG caps at 8 iterations). Its
fields differ from extrapolation.py's only under `analyze`, so
it can analyze a run trained with either file:

  python -m loopjax.main --config=experiments/halting.py --workdir=runs/halting
  python -m loopjax.main --config=experiments/halting.py --workdir=runs/halting \\
      --mode=analyze
"""

from experiments import extrapolation


def get_config(variant: str = "cpu"):
  c = extrapolation.get_config(variant)
  c.analyze.names = ("halting", "overthinking")
  c.analyze.halting.update(
    r_min=2,
    r_max=16,
    eps=(1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 0.5),  # KL (nats) or relative latent change
    tau=3.0,  # kl_entropy: LTG's entropy bound
    tau_grid=(0.01, 0.1, 0.3, 1.0, 3.0),  # entropy-only thresholds
    patience=(1, 2, 3, 4),
  )
  c.analyze.max_depth = 32
  if variant == "tiny":
    c.analyze.halting.r_max = 6
    c.analyze.max_depth = 8
  return c
