"""An exponential moving average of the params (`train.param_ema`), kept in
the train state as `state["ema"]` and evaluated beside the raw params.

Why: held-out accuracy on chains deeper than trained swings by 0.2-0.3
between evaluations 2,000 steps apart (docs/results/extrapolation.md), which
looks like optimization noise; an average of the weights over the last
~1 / (1 - decay) steps is the usual cure, and evaluating it beside the raw
weights shows whether it is one. The decay at step t is min(d, (1 + t) /
(10 + t)): early on the average follows the params closely (no start from
the random init dominates it), later it is d. It is float32, like the
master params, and costs one more copy of them (footprint.py counts it).
Evaluations report its metrics as the raw ones' with `ema/` in place of
`eval/` (`ema/test_k8/acc`).
"""

import jax
import jax.numpy as jnp

PREFIX = "ema/"


def decay(d: float, step):
  """The decay at `step` (the params' update count before this update)."""
  t = jnp.asarray(step, jnp.float32)
  return jnp.minimum(jnp.float32(d), (1.0 + t) / (10.0 + t))


def update(ema, params, d: float, step):
  """The average after the params became `params` at update `step`."""
  w = decay(d, step)
  return jax.tree.map(lambda e, p: w * e + (1.0 - w) * p, ema, params)


def renamed(flat: dict) -> dict:
  """An evaluation's metrics of the EMA, `eval/x` named `ema/x`."""
  return {PREFIX + k.removeprefix("eval/"): v for k, v in flat.items()}


def is_metric(name: str) -> bool:
  return name.startswith(PREFIX)
