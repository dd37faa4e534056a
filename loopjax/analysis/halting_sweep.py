"""Accuracy against compute for each adaptive-halting criterion and threshold.

For every rule of `halting.grid` (each criterion over its thresholds) the
probe splits are answered with `halting.adaptive` up to r_max iterations;
per split the table holds accuracy and mean iterations used, the trade-off a
halting rule is chosen by.
"""

import functools

import jax

from loopjax import halting, sharding
from loopjax.data import pipeline
from loopjax.state import eval_key


def table(model, inputs):
  """[{criterion, thresholds..., splits: {split: {acc, iterations}}}] over the
  `analyze.halting` grid, on `inputs.probes` (a record.Inputs); the initial
  state drawn as evaluations draw it."""
  config, task, probes = inputs.config, inputs.task, inputs.probes
  cfg, key = config.analyze.halting, eval_key(config)
  feed, rows = sharding.Feed.like(model.params, config.sharding.rules), []
  for rule in halting.grid(cfg):
    splits = {}
    for name, split in probes.items():
      correct_N, iters_N = pipeline.map_batches(
        lambda b: _answers(model, b, key, rule, r_max=cfg.r_max),
        split,
        feed.size(config.eval.batch_size),
        task.vocab.pad_id,
        pad_to=task.pad_to,
        put=feed.put,
      )
      splits[name] = {
        "acc": float(correct_N.mean()),
        "iterations": float(iters_N.mean()),
      }
    rows.append(rule.row() | {"splits": splits})
  return rows


@functools.partial(jax.jit, static_argnames=("r_max",))
def _answers(model, batch, key, rule: halting.Rule, *, r_max: int):
  """(correct, iterations) per example; compiled once per graph and criterion
  (the rule's thresholds are traced)."""
  logp_BV, iters_B = halting.adaptive(
    model.module(), batch["inputs"], batch["answer_pos"], rule, r_max=r_max, key=key
  )
  return logp_BV.argmax(-1) == batch["target"], iters_B
