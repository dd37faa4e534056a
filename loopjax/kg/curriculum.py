"""The hop curriculum of k-hop chains runs: stages, their data, when to advance.

Stage k trains on atomic facts and chains of <= k hops. The stage lives in the
train state (`state["stage"]`; its learning-rate scale in the optimizer's
state, `enter`) and in the data iterator's checkpointed state, so a resumed
run rebuilds the stage's split before seeking in it.
"""

import jax.numpy as jnp

from loopjax.data import kg, pipeline
from loopjax.errors import ConfigError
from loopjax.kg import source


def load(config):
  """The chains' data (`source.knowledge_graph`), checked for what validation cannot see
  before they are loaded (the papers' files fix their own hop counts): the
  hops to train on and the held-out chains each curriculum stage advances on
  must exist."""
  task = source.knowledge_graph(config.data)
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
  return task


def train_iterator(config, task, shard=(0, 1)):
  """The pipeline over the training split; per curriculum stage, if enabled.
  `shard`: which block of each batch this process feeds (pipeline)."""

  def make(max_hops=config.data.train_hops):
    return pipeline.train_iterator(
      kg.train_split(task, max_hops),
      config.train.batch_size,
      config.seed,
      task.vocab.pad_id,
      config.data.atomic_repeat,
      shard,
      task.pad_to,
    )

  cur = config.train.curriculum
  return pipeline.StagedIterator(make, cur.start) if cur.enabled else make()


def stage_names(config) -> tuple[str, ...]:
  """The phases a curriculum run records: `stage_<k>`, the step stage k began."""
  cur = config.train.curriculum
  if not cur.enabled:
    return ()
  return tuple(f"stage_{k}" for k in range(cur.start + 1, config.data.train_hops + 1))


def stage_at(config, phases: dict, step: int) -> int:
  """The stage trained at `step`, from the steps the stages began (phases)."""
  stage = config.train.curriculum.start
  for k, name in enumerate(stage_names(config), stage + 1):
    if phases.get(name) is not None and phases[name] <= step:
      stage = k
  return stage


def next_stage(config, stage: int, metrics: dict) -> int | None:
  """The stage to move to after an evaluation with `metrics`, or None to stay:
  the next, once the current stage's held-out chains are answered well enough."""
  cur = config.train.curriculum
  acc = metrics.get(f"eval/test_k{stage}/acc", 0.0)
  passed = acc > cur.threshold if cur.strict else acc >= cur.threshold
  if cur.enabled and stage < config.data.train_hops and passed:
    return stage + 1
  return None


def lr_scale(config, stage: int):
  """The updates' scale in `stage`: lr_decay per stage passed, >= lr_min / lr."""
  cur = config.train.curriculum
  scale = jnp.float32(cur.lr_decay) ** jnp.int32(stage - cur.start)
  return jnp.maximum(scale, cur.lr_min / config.train.lr)


def enter(state, stage: int, tx, config):
  """The train state for a new stage: its number, a fresh optimizer state with
  `reset_optimizer`, and the stage's `lr_scale` in the optimizer's last
  transform (`state.make_optimizer`): the jitted step knows no stages but
  the last (`last_stage_scale`), whose decay counts from `stage_start`."""
  opt_state = state["opt_state"]
  if config.train.curriculum.reset_optimizer:
    opt_state = tx.init(state["params"])
  *inner, scale = opt_state
  hyper = scale.hyperparams | {"step_size": lr_scale(config, stage)}
  opt_state = (*inner, scale._replace(hyperparams=hyper))
  out = state | {"stage": jnp.int32(stage), "opt_state": opt_state}
  if "stage_start" in state:  # a new array: the step donates each once
    out["stage_start"] = jnp.int32(int(state["step"]))
  return out


def last_stage_scale(config, state):
  """The updates' multiplier in the last stage (data.train_hops), traced in
  the step: a cosine from 1 to `last_stage_lr` over `last_stage_steps` steps
  from the step the stage began (`state["stage_start"]`), then flat; 1 in
  the other stages; None where the config asks for none. Why: the last
  stage runs longest, and the answers deeper than trained swing at its
  full lr (docs/results/extrapolation.md)."""
  cur = config.train.curriculum
  if not cur.enabled or (cur.last_stage_lr == 1 and not cur.last_stage_steps):
    return None
  low = jnp.float32(cur.last_stage_lr)
  if cur.last_stage_steps:
    t = (state["step"] - state["stage_start"]).astype(jnp.float32)
    done = jnp.clip(t / cur.last_stage_steps, 0.0, 1.0)
    low = low + (1.0 - low) * 0.5 * (1.0 + jnp.cos(jnp.pi * done))
  return jnp.where(state["stage"] == config.data.train_hops, low, jnp.float32(1.0))


def stages_summary(phases: dict, config) -> str:
  """When each curriculum stage began (chains runs)."""
  cur = config.train.curriculum
  if not cur.enabled:
    return f"off (hops <= {config.data.train_hops} throughout)"
  return (
    ", ".join(
      f"k={name[6:]} at step {phases[name]}"
      if phases.get(name) is not None
      else f"k={name[6:]} not reached"
      for name in stage_names(config)
    )
    or f"one stage (k <= {cur.start})"
  )
