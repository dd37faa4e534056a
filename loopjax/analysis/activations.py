"""Massive activations (Sun et al. 2024) in the residual stream.

Per layer and iteration of the core: the largest |activation| over the probe
split's real tokens and model dimensions, the median |activation| (the median
over examples of each example's median, which batches can compute), their
ratio (Sun et al. call activations ~1000x the median "massive"), and where the
largest
sits: the (token position, dimension) most often holding an example's maximum,
with the share of examples for which it does.
"""

import jax.numpy as jnp
import numpy as np


def per_example(trace: dict, batch, pad_id: int) -> dict:
  """max, median (B, R, L) of |h| over real tokens x dimensions; argmax (B, R,
  L), a flat index t * D + d."""
  abs_RLBTD = jnp.abs(trace["core"]["hidden"].astype(jnp.float32))
  real_11BT1 = (batch["inputs"] != pad_id)[None, None, :, :, None]
  abs_RLBF = abs_RLBTD.reshape(*abs_RLBTD.shape[:3], -1)  # F = T * D
  real_RLBF = jnp.broadcast_to(real_11BT1, abs_RLBTD.shape).reshape(abs_RLBF.shape)
  out = {
    "max": jnp.where(real_RLBF, abs_RLBF, -1.0).max(-1),
    "argmax": jnp.where(real_RLBF, abs_RLBF, -1.0).argmax(-1),
    "median": jnp.nanmedian(jnp.where(real_RLBF, abs_RLBF, jnp.nan), -1),
  }
  return {k: jnp.moveaxis(v, 2, 0) for k, v in out.items()}


def summarize(examples: dict, d_model: int) -> dict:
  """Per (iteration, layer): max, median, ratio, position, dim, share."""
  top_RL = examples["max"].max(0)
  median_RL = np.median(examples["median"], 0)
  R, L = top_RL.shape
  where = [[_mode(examples["argmax"][:, r, l]) for l in range(L)] for r in range(R)]
  return {
    "max": top_RL.tolist(),
    "median": median_RL.tolist(),
    "ratio": (top_RL / median_RL).tolist(),
    "position": [[w // d_model for w, _ in row] for row in where],
    "dim": [[w % d_model for w, _ in row] for row in where],
    "share": [[s for _, s in row] for row in where],
  }


def _mode(x_N: np.ndarray) -> tuple[int, float]:
  values, counts = np.unique(x_N, return_counts=True)
  i = int(counts.argmax())
  return int(values[i]), float(counts[i] / len(x_N))
