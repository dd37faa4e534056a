"""Where the core's attention goes, per head, layer and iteration.

ColSum concentration: with A[t, s] the weight query t gives key s (causal, rows
sum to 1), the column sum c_s = sum_t A[t, s] over the example's real query
positions is the attention mass key s receives; p_s = c_s / sum_s c_s (the
number of real queries). MECH's `concentration` is C = 1 - H(p) / log n over
the n real tokens (0: every key the same share, 1: one key all of it);
`top_share` is max_s p_s and `entropy` H(p) in nats. Causality alone makes
early keys receive more (key 0 is seen by every query), so each comes with
what uniform causal attention gives on the same examples (`uniform`: 0.18
and 0.61 at n = 3): a concentration means something beside it.
`profile` is p_s per key position.
Stability: the total variation 0.5 * sum_s |A_{r+1}[t, s] - A_r[t, s]| between
successive iterations, averaged over real queries (0 = a head's pattern no
longer changes with depth).
"""

import jax.numpy as jnp
import numpy as np
from jax.scipy.special import xlogy


def colsum(attn_BNTS, mask_BT):
  """Normalized column sums p_s, (..., B, N, S): real queries' weights summed."""
  lead = (1,) * (attn_BNTS.ndim - 4)
  c_BNS = (attn_BNTS * mask_BT.reshape(*lead, *mask_BT.shape[:1], 1, -1, 1)).sum(-2)
  return c_BNS / c_BNS.sum(-1, keepdims=True)


def concentration(p_BNS, real_BT):
  """MECH's ColSum concentration (..., B, N) of column sums `colsum`."""
  n_B = jnp.maximum(real_BT.sum(-1), 2).astype(jnp.float32)
  log_n_B1 = jnp.log(n_B).reshape(*(1,) * (p_BNS.ndim - 3), -1, 1)
  return 1.0 - (-xlogy(p_BNS, p_BNS).sum(-1)) / log_n_B1


def uniform_attention(real_BT, first_BT):
  """(B, 1, T, T): each real query spread evenly over the real keys it may
  see (earlier ones of its own document, itself included); `first_BT` marks
  where documents start."""
  T = real_BT.shape[1]
  seg_BT = jnp.cumsum(first_BT, -1)
  seen_BTS = (seg_BT[:, :, None] == seg_BT[:, None]) & jnp.tril(
    jnp.ones((1, T, T), bool)
  )
  seen_BTS = seen_BTS & real_BT[:, None, :]
  return (seen_BTS / jnp.maximum(seen_BTS.sum(-1, keepdims=True), 1))[:, None]


def uniform(real_BT, first_BT) -> dict:
  """Per example (B,): the concentration and top share of uniform causal
  attention, the baselines of the heads'."""
  p_BNS = colsum(uniform_attention(real_BT, first_BT), real_BT.astype(jnp.float32))
  return {
    "uniform_concentration": concentration(p_BNS, real_BT)[:, 0],
    "uniform_top_share": p_BNS.max(-1)[:, 0],
  }


def per_example(trace: dict, batch, pad_id: int) -> dict:
  """profile (B, R, L, N, S), top_share, entropy and concentration (B, R, L,
  N), stability (B, R-1, L, N), and the `uniform` baselines (B,)."""
  attn_RLBNTS = trace["core"]["attn"].astype(jnp.float32)
  real_BT = batch["inputs"] != pad_id
  mask_BT = real_BT.astype(jnp.float32)
  p_RLBNS = colsum(attn_RLBNTS, mask_BT)
  tv_RLBNT = 0.5 * jnp.abs(attn_RLBNTS[1:] - attn_RLBNTS[:-1]).sum(-1)  # R - 1
  real_11B1T = mask_BT[None, None, :, None]
  out = {
    "profile": p_RLBNS,
    "top_share": p_RLBNS.max(-1),
    "entropy": -xlogy(p_RLBNS, p_RLBNS).sum(-1),
    "concentration": concentration(p_RLBNS, real_BT),
    "stability": (tv_RLBNT * real_11B1T).sum(-1) / real_11B1T.sum(-1),
  }
  first_BT = jnp.zeros_like(real_BT).at[:, 0].set(True)  # one sequence each
  return {k: jnp.moveaxis(v, 2, 0) for k, v in out.items()} | uniform(real_BT, first_BT)


def summarize(examples: dict) -> dict:
  """Means over examples: top_share / entropy / concentration (R, L, N),
  stability (R-1, L, N), profile (L, N, S) at the last iteration, and the
  uniform-attention baselines."""
  keys = ("top_share", "entropy", "concentration", "stability")
  out = {k: np.asarray(examples[k]).mean(0).tolist() for k in keys}
  out["profile"] = np.asarray(examples["profile"])[:, -1].mean(0).tolist()
  out["uniform"] = {
    k: float(np.mean(examples[f"uniform_{k}"])) for k in ("concentration", "top_share")
  }
  return out
