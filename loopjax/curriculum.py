"""The hop curriculum of k-hop chains runs: stages, their data, when to advance.

Stage k trains on atomic facts and chains of <= k hops. The stage lives in the
train state (`state["stage"]`, which scales the learning rate in the jitted
step) and in the data iterator's checkpointed state, so a resumed run rebuilds
the stage's split before seeking in it.
"""

import jax.numpy as jnp

from loopjax import data
from loopjax.config import ConfigError
from loopjax.data import pipeline


def check_task(config, task) -> None:
  """What validation cannot see before the data are loaded (the papers' files
  fix their own hop counts): the hops to train on and the held-out chains each
  curriculum stage advances on must exist."""
  if task.task != "chains":
    return
  if config.data.train_hops > task.max_hops:
    raise ConfigError(
      f"data.train_hops: must be <= the data's longest chain ({task.max_hops} "
      f"hops); got {config.data.train_hops}"
    )
  cur = config.train.curriculum
  stages = range(cur.start, config.data.train_hops) if cur.enabled else ()
  for k in stages:
    if not len(task.splits[f"test_k{k}"]["target"]):
      raise ConfigError(
        f"train.curriculum.enabled: stage {k} advances on {k}-hop held-out "
        f"chains and the data have none"
      )


def train_iterator(config, task, shard=(0, 1)):
  """The pipeline over the training split; per curriculum stage, if enabled.
  `shard`: which block of each batch this process feeds (pipeline)."""

  def make(max_hops=config.data.train_hops):
    return pipeline.train_iterator(
      data.train_split(task, max_hops),
      config.train.batch_size,
      config.seed,
      task.vocab.pad_id,
      config.data.atomic_repeat,
      shard,
    )

  cur = config.train.curriculum
  return pipeline.StagedIterator(make, cur.start) if cur.enabled else make()


def advance(run, state, step: int, last: dict):
  """Moves the curriculum on when the current stage's held-out chains are
  answered well enough; returns the new state and whether it advanced. `run`
  holds the config, the StagedIterator (`train_iter`), the optimizer (`tx`)
  and the phases dict the transition is recorded in."""
  cur, it = run.config.train.curriculum, run.train_iter
  if not (
    cur.enabled
    and it.stage < run.config.data.train_hops
    and last.get(f"eval/test_k{it.stage}/acc", 0.0) >= cur.threshold
  ):
    return state, False
  it.set_stage(it.stage + 1)
  state = state | {"stage": jnp.int32(it.stage)}
  if cur.reset_optimizer:
    state["opt_state"] = run.tx.init(state["params"])
  run.phases[f"stage_{it.stage}"] = step
  return state, True


def stages_summary(phases: dict, config) -> str:
  """When each curriculum stage began (chains runs)."""
  cur = config.train.curriculum
  if not cur.enabled:
    return f"off (hops <= {config.data.train_hops} throughout)"
  stages = range(cur.start + 1, config.data.train_hops + 1)
  return (
    ", ".join(
      f"k={k} at step {phases[f'stage_{k}']}"
      if f"stage_{k}" in phases
      else f"k={k} not reached"
      for k in stages
    )
    or f"one stage (k <= {cur.start})"
  )
