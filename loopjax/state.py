"""Model, optimizer and train-state construction, shared by training and eval."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from loopjax import grad_filters, sharding
from loopjax.model import LoopedTransformer


def build_model(model_cfg, vocab_size: int, max_len: int, seed: int):
  cfg = ml_collections.FrozenConfigDict(model_cfg)
  return LoopedTransformer(cfg, vocab_size, max_len, rngs=nnx.Rngs(seed))


def make_optimizer(tc) -> optax.GradientTransformation:
  """AdamW with linear warmup, then constant or cosine decay to 0, after the
  grokking accelerators `tc` asks for (`grad_filters`) and clipping; with a
  hop curriculum, its updates times a scale each stage sets
  (`curriculum.enter`, which reads it as the chain's last state)."""
  decay_steps = tc.decay_steps or max(tc.num_steps - tc.warmup_steps, 1)
  after = (
    optax.constant_schedule(tc.lr)
    if tc.schedule == "constant"
    else optax.cosine_decay_schedule(tc.lr, decay_steps)
  )
  lr = optax.join_schedules(
    [optax.linear_schedule(0.0, tc.lr, tc.warmup_steps), after], [tc.warmup_steps]
  )

  # "matrices": embeddings and projections, not biases or norms; "all": every
  # parameter (the papers' torch AdamW over model.parameters()).
  def decay_mask(p):
    return jax.tree.map(lambda x: tc.decay == "all" or x.ndim >= 2, p)

  adamw = optax.adamw(
    lr, b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay, mask=decay_mask
  )
  clip = [optax.clip_by_global_norm(tc.grad_clip)] if tc.grad_clip > 0 else []
  parts = [*grad_filters.make(tc), *clip, adamw]
  tx = optax.chain(*parts) if len(parts) > 1 else adamw
  if tc.curriculum.enabled:
    tx = optax.chain(tx, optax.inject_hyperparams(optax.scale)(step_size=1.0))
  return tx


def init_state(model, tx, seed: int, params=None):
  """(graphdef, state); params are a plain dict of arrays, not nnx Variables.
  `params`: values for some of the model's top-level params (a pretrained
  model's, `pretrained.init_from`); the others keep the model's init.

  Plain dicts flatten and unflatten several times faster than Variable trees,
  which is host time on every step call; `nnx.merge` takes them as they are.
  """
  graphdef, own = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(own) | (params or {})
  state = {
    "params": params,
    "opt_state": tx.init(params),
    "step": jnp.zeros((), jnp.int32),
    "rng": jax.random.key(seed),
  }
  return graphdef, state


def train_state(config, task, params=None):
  """(graphdef, initial train state, optimizer) for a config and its task data
  (`params`: see `init_state`); a curriculum run's state also holds its stage,
  and the `optional` entries its config asks for."""
  tx = make_optimizer(config.train)
  model = build_model(config.model, *task.model_dims(), config.seed)
  graphdef, state = init_state(model, tx, config.seed, params)
  if config.train.curriculum.enabled:
    state["stage"] = jnp.int32(config.train.curriculum.start)
  return graphdef, with_optional(config, state), tx


# Entries a train state holds only where its config asks, each begun as a copy
# of another: the params' EMA (train.param_ema, ema.py) and the step the
# curriculum's stage began (train.curriculum.last_stage_steps). Only then: a
# run without them keeps its checkpoints' layout and resumes as it was.
OPTIONAL = {"ema": "params", "stage_start": "step"}


def optional(config) -> set[str]:
  """The `OPTIONAL` entries `config`'s train state holds."""
  t = config.train
  out = {"ema"} if t.param_ema else set()
  if t.curriculum.enabled and t.curriculum.last_stage_steps:
    out.add("stage_start")
  return out


def _copy(x):
  return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.array(x, copy=True)


def with_optional(config, state):
  """`state` (arrays or abstract) with `config`'s `optional` entries: those it
  lacks begun as copies of their sources (a fork that turns the EMA on starts
  it at the fork's params), those `config` does not ask for dropped. Copies,
  not the same arrays: the step donates its state, and a buffer is donated
  once."""
  want = optional(config)
  out = {k: v for k, v in state.items() if k not in OPTIONAL or k in want}
  for k in sorted(want - set(state)):
    out[k] = jax.tree.map(_copy, state[OPTIONAL[k]])
  return out


def sharded_train_state(config, task, mesh, abstract: bool = False, params=None):
  """`train_state` created already sharded on `mesh`: the state's shapes come
  from an abstract init, their shardings from the logical-axis rules, and a
  jitted init writes each shard where it lives (no full copy on one device).
  Returns (graphdef, state, optimizer, the state's shardings); `abstract`:
  the state as ShapeDtypeStructs with shardings, nothing computed (restore
  targets, ahead-of-time compiles); `params`: arrays for some top-level params
  (`init_state`), put where the rules place them (already there: as they are)
  and donated."""
  tx = make_optimizer(config.train)
  abstract_model = nnx.eval_shape(
    lambda: build_model(config.model, *task.model_dims(), config.seed)
  )
  graphdef = nnx.split(abstract_model, nnx.Param)[0]

  def init(given):
    return train_state(config, task, given)[1]

  shapes = jax.eval_shape(init, params)
  shardings = sharding.state_shardings(
    shapes, sharding.param_axes(abstract_model), tx, mesh, config.sharding.rules
  )
  if "ema" in shardings:  # placed as the params it averages
    shardings["ema"] = shardings["params"]
  if abstract:
    state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes,
      shardings,
    )
  else:
    if params is not None:  # donated: the state's params are these arrays
      params = jax.device_put(params, {k: shardings["params"][k] for k in params})
    state = jax.jit(init, out_shardings=shardings, donate_argnums=0)(params)
  return graphdef, state, tx, shardings


def eval_key(config):
  """The key evaluations and analyses draw a random initial state from."""
  return jax.random.key(config.seed)


def cast(params, dtype: str):
  """Compute-dtype copy of float32 master weights (gradients flow back)."""
  return (
    jax.tree.map(lambda p: p.astype(dtype), params) if dtype != "float32" else params
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
  """A model as evaluation, analyses and halting take it: the static graph, the
  float32 params and the compute dtype. A pytree whose leaves are the params,
  so jitted functions take it as an argument; `module()` (inside them) merges
  it into the nnx module."""

  graphdef: Any = dataclasses.field(metadata=dict(static=True))
  params: Any
  dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

  def module(self):
    return nnx.merge(self.graphdef, cast(self.params, self.dtype))
