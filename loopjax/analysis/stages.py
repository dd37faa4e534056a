"""Stages of inference along effective depth (MECH, section 5), on text.

After every layer (embedding, prelude, each core layer of each iteration, coda)
of a language model, per sequence:

- attention sinks (Gu et al. 2025): a head's `sink` mass is the attention its
  queries give the first token of their document (each query's own segment
  start; the start's own query excluded), averaged over queries; the sink rate
  is the share of (sequence, head) pairs whose mass exceeds `threshold` (each
  sequence thresholded, then averaged, as Gu et al. and MECH do);
- ColSum concentration (MECH): C = 1 - H(c) / log n of the column sums
  c_j = (1/n) sum_i A_ij over a sequence's n real tokens (0: every key gets
  the same share, 1: one key gets it all), beside `colsum_uniform`, the C
  that uniform causal attention gives on the same windows (its early keys
  are seen by more queries, so it is not 0: 0.18 at n = 3; one number, as it
  depends on the windows only); and the largest share one
  key receives (`top_share`, `attention.colsum`);
- massive activations (Sun et al. 2024): the first token's norm over the
  median token norm, and the largest |activation| over the median |activation|;
- the matrix-based entropy of the token representations (Queipo-de Llano et al.
  2025, "compression valleys"): the Shannon entropy of the normalized
  eigenvalues of Z^T Z (Z: the sequence's T x D states), over its largest
  value log min(T, D); 1 = spread over every direction, 0 = one direction;
- logit lens: the next-token loss of the model's final norm and unembedding
  applied to the layer's output (`LoopedTransformer.logits`).

`repetition` says how much of a statistic's variation across the core's
positions the layer index explains (eta squared): near 1, each iteration
repeats the same profile over its layers. MECH's two claims apart: within the
trained recurrence (iterations 2 to the trained R; the first, a transient, is
left out) and, as `repetition_past`, past it (the iterations after the
trained R, to the last analyzed).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import xlogy

from loopjax import loss
from loopjax.analysis import attention

STATS = (
  "lens_loss",
  "first_ratio",
  "massive_ratio",
  "entropy",
  "sink_rate",
  "sink_mass",
  "top_share",
  "colsum_concentration",
)


def first_tokens(segments_BT):
  """True at each document's first position in the window (and position 0)."""
  start_BT = segments_BT[:, 1:] != segments_BT[:, :-1]
  return jnp.concatenate([jnp.ones_like(start_BT[:, :1]), start_BT], 1)


def head_stats(probs_BNTS, real_BT, first_BT) -> dict:
  """Per sequence and head (B, N): sink mass, ColSum top share, entropy and
  concentration; and the normalized column sums (B, N, S)."""
  probs = probs_BNTS.astype(jnp.float32)
  queries_BT = (real_BT & ~first_BT).astype(jnp.float32)[:, None]
  mass_BNT = (probs * first_BT[:, None, None, :]).sum(-1)
  sink_BN = (mass_BNT * queries_BT).sum(-1) / jnp.maximum(queries_BT.sum(-1), 1.0)
  p_BNS = attention.colsum(probs, real_BT.astype(jnp.float32))
  return {
    "sink": sink_BN,
    "top_share": p_BNS.max(-1),
    "entropy": -xlogy(p_BNS, p_BNS).sum(-1),
    "concentration": attention.concentration(p_BNS, real_BT),
  }, p_BNS


def gram_eigenvalues(z_BTD):
  """(B, K) eigenvalues of each sequence's Gram matrix, K = min(T, D): those of
  Z Z^T (T x T) or Z^T Z (D x D), whichever is smaller (their nonzero ones are
  the same). On TPU by XLA's Jacobi solver: jnp.linalg's default there is JAX's
  QDWH divide-and-conquer past 256 rows, which libtpu had not compiled in 15
  minutes for one batch of 1024 x 1024 (Huginn's analysis pass, 9 of them at
  5280 x 5280, not in 25; docs/scaling_out.md)."""
  T, D = z_BTD.shape[-2:]
  gram = "btd,bsd->bts" if T <= D else "btd,bte->bde"
  g_BKK = jnp.einsum(gram, z_BTD, z_BTD)
  jacobi = jax.lax.linalg.EighImplementation.JACOBI
  return jax.lax.platform_dependent(
    g_BKK,
    tpu=lambda g: jax.lax.linalg.eigh(g, implementation=jacobi)[1],
    default=jnp.linalg.eigvalsh,
  )


def layer_stats(h_BTD, batch, first_BT, logits_fn) -> dict:
  """Per sequence (B,): the residual-stream statistics of one layer's output."""
  real_BT = batch["real"]
  h = h_BTD.astype(jnp.float32)
  norm_BT = jnp.linalg.norm(h, axis=-1)
  others_BT = real_BT & ~first_BT
  first_BT = first_BT & real_BT
  abs_BF = jnp.where(real_BT[..., None], jnp.abs(h), jnp.nan).reshape(h.shape[0], -1)
  lam_BK = jnp.clip(gram_eigenvalues(h * real_BT[..., None]), 0)
  p_BK = lam_BK / jnp.maximum(lam_BK.sum(-1, keepdims=True), 1e-30)
  rank_B = jnp.minimum(real_BT.sum(-1), h.shape[-1]).astype(jnp.float32)
  lens, _, tokens = loss.lm_row_sums(logits_fn, h_BTD, batch["targets"], batch["mask"])
  return {
    "first_norm": (norm_BT * first_BT).sum(-1) / jnp.maximum(first_BT.sum(-1), 1),
    "median_norm": jnp.nanmedian(jnp.where(others_BT, norm_BT, jnp.nan), -1),
    "max_abs": jnp.nanmax(abs_BF, -1),
    "median_abs": jnp.nanmedian(abs_BF, -1),
    "entropy": -xlogy(p_BK, p_BK).sum(-1) / jnp.log(jnp.maximum(rank_B, 2.0)),
    "lens_loss": lens,
    "tokens": tokens,
  }


def position_summary(layer: dict, heads: dict | None, threshold: float) -> dict:
  """The STATS of one depth position from its per-sequence values (numpy)."""
  real = layer["tokens"] > 0
  out = {
    "lens_loss": float(layer["lens_loss"].sum() / layer["tokens"].sum()),
    "first_ratio": float(
      np.mean(layer["first_norm"][real] / layer["median_norm"][real])
    ),
    "massive_ratio": float(np.mean(layer["max_abs"][real] / layer["median_abs"][real])),
    "entropy": float(np.mean(layer["entropy"][real])),
  }
  if heads is None:  # the embedding: no attention
    return out | {k: None for k in STATS[4:]}
  sink_BN = heads["sink"][real]
  return out | {
    # thresholded per sequence, then averaged (Gu et al., MECH): a head that
    # sinks on some inputs only counts for those
    "sink_rate": float((sink_BN > threshold).mean()),
    "sink_mass": float(sink_BN.mean()),
    "top_share": float(heads["top_share"][real].mean()),
    "colsum_concentration": float(heads["concentration"][real].mean()),
  }


def summarize(ex: dict, threshold: float, trained: int) -> dict:
  """Along effective depth: `positions` (label, iteration, layer) with every
  STAT per position, `colsum_uniform` (ColSum concentration of uniform causal
  attention on these windows), and `repetition` within the `trained` R and
  `repetition_past` it (eta squared per STAT, None where the block has one
  layer, fewer than 2 iterations are in the range or the statistic is
  constant)."""
  R, L = ex["core"]["tokens"].shape[1:3]
  positions = [
    ("embed", 0, 0, ex["embed"], None),
    *_group(ex, "prelude", 0),
    *(
      (
        f"r{r + 1} l{l + 1}",
        r + 1,
        l + 1,
        _at(ex["core"], r, l),
        _at(ex["core_heads"], r, l),
      )
      for r in range(R)
      for l in range(L)
    ),
    *_group(ex, "coda", R + 1),
  ]
  rows = [
    {"label": lbl, "iteration": r, "layer": l} | position_summary(s, h, threshold)
    for lbl, r, l, s, h in positions
  ]
  core = [x for x in rows if x["label"].startswith("r")]
  within = [x for x in core if 2 <= x["iteration"] <= trained]
  past = [x for x in core if x["iteration"] > trained]
  real = ex["embed"]["tokens"] > 0
  return {
    "threshold": threshold,
    "num_loops": R,
    "trained_loops": trained,
    "num_layers": L,
    "colsum_uniform": float(np.mean(ex["uniform_concentration"][real])),
    "positions": rows,
    "repetition": {k: repetition(within, k, L) for k in STATS},
    "repetition_past": {k: repetition(past, k, L) for k in STATS},
  }


def _at(tree, *i):
  """Every leaf at index `i` after its sequence axis."""
  return jax.tree.map(lambda a: a[(slice(None), *i)], tree)


def _group(ex: dict, name: str, iteration: int) -> list[tuple]:
  """The positions of the prelude's or coda's layers (none without layers)."""
  if ex[name] is None:
    return []
  n = ex[name]["tokens"].shape[1]
  heads = ex[f"{name}_heads"]
  return [
    (f"{name} {i + 1}", iteration, i + 1, _at(ex[name], i), _at(heads, i))
    for i in range(n)
  ]


def repetition(core_rows: list[dict], stat: str, L: int) -> float | None:
  """Eta squared of `stat` over the core positions grouped by layer."""
  if L < 2 or len(core_rows) < 2 * L:
    return None
  m_RL = np.asarray([x[stat] for x in core_rows], float).reshape(-1, L)
  total = ((m_RL - m_RL.mean()) ** 2).sum()
  if not np.isfinite(total) or total <= 1e-12 * max(1.0, (m_RL**2).sum()):
    return None
  between = m_RL.shape[0] * ((m_RL.mean(0) - m_RL.mean()) ** 2).sum()
  return float(between / total)
