"""Logit lens: what each layer's residual stream would answer if it were the last.

The model's final norm and unembedding (`LoopedTransformer.logits`) are applied
to the output of every layer of every iteration (and of prelude and coda
layers). For inferred queries (a bridge entity exists) we read, at the first
relation's position (1) and at the answer position, the rank (0 = top, over the
whole vocabulary) and probability of the bridge entity (the first hop's result)
and of the answer. "Loop, Think, & Generalize" reads the bridge decoded at the
relation's position mid-depth as evidence that the model composes the hops.
"""

import jax
import jax.numpy as jnp
import numpy as np

POSITIONS = ("relation", "answer")  # where it is read: position 1, answer_pos
TARGETS = ("bridge", "answer")  # what is looked for


def ranks(logits_V, target):
  """(rank, probability) of `target` under logits (..., V); target (...).
  The rank counts strictly larger logits: ties go in the target's favour."""
  logit = jnp.take_along_axis(logits_V, target[..., None], -1)
  rank = (logits_V > logit).sum(-1)
  logp = jax.nn.log_softmax(logits_V, -1)
  return rank, jnp.exp(jnp.take_along_axis(logp, target[..., None], -1)[..., 0])


def per_example(model, trace: dict, batch) -> dict:
  """{group: (rank, prob)} for prelude / core / coda, each (B, ..., 2, 2): the
  group's layer axes, then POSITIONS x TARGETS."""
  pos_BP = jnp.stack([jnp.ones_like(batch["answer_pos"]), batch["answer_pos"]], 1)
  target_BK = jnp.stack([jnp.maximum(batch["bridge"], 0), batch["target"]], 1)
  out = {}
  for group in ("prelude", "core", "coda"):
    if trace[group] is None:
      continue
    h_BTD = trace[group]["hidden"]
    lead = h_BTD.ndim - 3  # the group's layer axes
    h_BPD = jnp.take_along_axis(h_BTD, pos_BP.reshape((1,) * lead + (-1, 2, 1)), -2)
    logits_BPV = model.logits(h_BPD)
    rank_prob = [
      ranks(logits_BPV, jnp.broadcast_to(target_BK[:, None, k], logits_BPV.shape[:-1]))
      for k in range(len(TARGETS))
    ]
    out[group] = tuple(
      jnp.moveaxis(jnp.stack([rp[i] for rp in rank_prob], -1), lead, 0)
      for i in range(2)
    )
  return out


def summarize(examples: dict, bridge_N) -> dict:
  """Over inferred queries: {group: {target: {position: {mrr, top1, prob}}}},
  each value an array over the group's layer axes ((R, L) for the core)."""
  keep = np.asarray(bridge_N) >= 0
  out = {"examples": int(keep.sum())}
  if not keep.any():
    return out
  for group, (rank, prob) in examples.items():
    rank, prob = rank[keep], prob[keep]
    out[group] = {
      t: {
        p: {
          "mrr": (1 / (rank[..., i, k] + 1)).mean(0).tolist(),
          "top1": (rank[..., i, k] == 0).mean(0).tolist(),
          "prob": prob[..., i, k].mean(0).tolist(),
        }
        for i, p in enumerate(POSITIONS)
      }
      for k, t in enumerate(TARGETS)
    }
  return out
