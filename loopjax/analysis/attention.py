"""Where the core's attention goes, per head, layer and iteration.

ColSum concentration: with A[t, s] the weight query t gives key s (causal, rows
sum to 1), the column sum c_s = sum_t A[t, s] over the example's real query
positions is the attention mass key s receives; p_s = c_s / sum_s c_s (the
number of real queries). `top_share` is max_s p_s (1 = every query attends one
key) and `entropy` is -sum_s p_s log p_s in nats (0 = one key; log T = uniform).
Causality alone makes early keys receive more (key 0 is seen by every query),
so compare variants, not absolute values. `profile` is p_s per key position.
Stability: the total variation 0.5 * sum_s |A_{r+1}[t, s] - A_r[t, s]| between
successive iterations, averaged over real queries (0 = a head's pattern no
longer changes with depth).
"""

import jax.numpy as jnp
from jax.scipy.special import xlogy


def colsum(attn_BNTS, mask_BT):
  """Normalized column sums p_s, (..., B, N, S): real queries' weights summed."""
  lead = (1,) * (attn_BNTS.ndim - 4)
  c_BNS = (attn_BNTS * mask_BT.reshape(*lead, *mask_BT.shape[:1], 1, -1, 1)).sum(-2)
  return c_BNS / c_BNS.sum(-1, keepdims=True)


def per_example(trace: dict, batch, pad_id: int) -> dict:
  """profile (B, R, L, N, S), top_share and entropy (B, R, L, N), stability
  (B, R-1, L, N)."""
  attn_RLBNTS = trace["core"]["attn"].astype(jnp.float32)
  mask_BT = (batch["inputs"] != pad_id).astype(jnp.float32)
  p_RLBNS = colsum(attn_RLBNTS, mask_BT)
  tv_RLBNT = 0.5 * jnp.abs(attn_RLBNTS[1:] - attn_RLBNTS[:-1]).sum(-1)  # R - 1
  real_11B1T = mask_BT[None, None, :, None]
  out = {
    "profile": p_RLBNS,
    "top_share": p_RLBNS.max(-1),
    "entropy": -xlogy(p_RLBNS, p_RLBNS).sum(-1),
    "stability": (tv_RLBNT * real_11B1T).sum(-1) / real_11B1T.sum(-1),
  }
  return {k: jnp.moveaxis(v, 2, 0) for k, v in out.items()}


def summarize(examples: dict) -> dict:
  """Means over examples: top_share / entropy (R, L, N), stability (R-1, L, N),
  profile (L, N, S) at the last iteration."""
  out = {k: examples[k].mean(0).tolist() for k in ("top_share", "entropy", "stability")}
  out["profile"] = examples["profile"][:, -1].mean(0).tolist()
  return out
