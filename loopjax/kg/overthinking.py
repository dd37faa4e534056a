"""Accuracy and logit margin after every iteration, per probe split, and the
mean first iteration at which the answer is right (LTG's `avg_t_first`).

A looped model answers a k-hop chain once it has iterated enough; iterating far
beyond its training depth may undo the answer ("overthinking"): the margin
(answer logit minus the best other logit) then shrinks and accuracy falls.
"""

import functools

import jax
import jax.numpy as jnp

from loopjax import sharding
from loopjax.data import pipeline
from loopjax.kg.evaluate import logits_per_iteration
from loopjax.state import eval_key


def margin(logits_RBV, target_B):
  """Answer logit minus the largest other logit, (R, B); > 0 iff answered."""
  answer_RB = jnp.take_along_axis(logits_RBV, target_B[None, :, None], -1)[..., 0]
  others_RBV = jnp.where(
    jax.nn.one_hot(target_B, logits_RBV.shape[-1], dtype=bool)[None],
    -jnp.inf,
    logits_RBV,
  )
  return answer_RB - others_RBV.max(-1)


def curves(model, inputs):
  """{split: {"acc": [..], "margin": [..]}} of `inputs.probes` (a
  record.Inputs), entry r-1 after r iterations, up to `analyze.max_depth`;
  the initial state drawn as evaluations draw it."""
  config, task = inputs.config, inputs.task
  max_depth, key = config.analyze.max_depth, eval_key(config)
  feed, out = sharding.Feed.like(model.params, config.sharding.rules), {}
  for name, split in inputs.probes.items():
    margin_RN = pipeline.map_batches(
      lambda b: _margins(model, b, key, max_depth),
      split,
      feed.size(config.eval.batch_size),
      task.vocab.pad_id,
      axis=1,
      pad_to=task.pad_to,
      put=feed.put,
    )
    out[name] = {
      "acc": (margin_RN > 0).mean(1).tolist(),
      "margin": margin_RN.mean(1).tolist(),
      "avg_t_first": avg_t_first(margin_RN > 0),
    }
  return out


def avg_t_first(correct_RN) -> float | None:
  """LTG's `avg_t_first`: the mean first iteration (1-based) at which the answer
  is right, over the examples that are right at some iteration; None if none is."""
  ever_N = correct_RN.any(0)
  if not ever_N.any():
    return None
  return float((correct_RN.argmax(0)[ever_N] + 1).mean())


@functools.partial(jax.jit, static_argnames="max_depth")
def _margins(model, batch, key, max_depth: int):
  """Compiled once per model graph and depth, for any params (followed checkpoints)."""
  return margin(logits_per_iteration(model, batch, max_depth, key), batch["target"])
