"""A local Hugging Face directory as a loopjax model: its family from
config.json, the model config, and the params mapped by name."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from loopjax import sharding
from loopjax.errors import ConfigError
from loopjax.pretrained import huginn, llama, ouro, retrofit
from loopjax.pretrained.hf_dir import HfDir
from loopjax.state import Model, build_model

# config.json model_type (each family's own) -> family module, or a function of
# the directory that picks one (huginn_raven: Huginn-0125's and the
# retrofitted models' type)
FAMILIES = {
  **dict.fromkeys(llama.LAYOUTS, llama),
  ouro.MODEL_TYPE: ouro,
  huginn.MODEL_TYPE: retrofit.family,
}


def split(config):
  """`model.hf_split` "p,c,k" as a tuple (None: the family's own layout)."""
  text = config.model.hf_split
  if not text:
    return None
  try:
    p, c, k = (int(x) for x in text.split(","))
  except ValueError:
    raise ConfigError(
      f"model.hf_split: must be 'prelude,core,coda' layer counts, e.g. 2,4,2; "
      f"got {text!r}"
    ) from None
  return p, c, k


def resolve(path, base, split=None, num_loops=None, dtype=None, weights=True):
  """(HfDir, family module, model config, vocab size, max length) of the
  directory `path`; `base`: the `model` section the family's fields are set
  on, its `dtype` the params' and compute dtype unless `dtype` is given;
  `split`, `num_loops`: see the family's `model_config`; weights=False: a
  directory of config.json only (a published model's shape, for `aot`)."""
  dtype = dtype or base.dtype
  hf = HfDir(path, dtype, weights=weights)
  kind = hf.config.get("model_type")
  if kind not in FAMILIES:
    raise ConfigError(
      f"{hf.path / 'config.json'}: model_type must be one of "
      f"{', '.join(FAMILIES)}; got {kind!r}"
    )
  family = FAMILIES[kind]
  if callable(family):
    family = family(hf)
  cfg, vocab_size, max_len = family.model_config(hf.config, base, split, num_loops)
  cfg.dtype = dtype
  return hf, family, cfg, vocab_size, max_len


def load(
  path, base, split=None, num_loops=None, dtype=None, overrides=None, mesh=None,
  rules=(),
):  # fmt: skip
  """(model config, Model) of the directory `path` (see `resolve`);
  `overrides`: model fields set after the family's (e.g. init_state "zeros"
  for a deterministic first state). The family's mapping builds every host
  array in the target dtype (bfloat16: a 3.5B model in 7 GB), then each is
  put on the device, or on a `mesh` into its shards by the logical-axis
  `rules`, and its host copy dropped: the host peaks at about one copy."""
  hf, family, cfg, vocab_size, max_len = resolve(path, base, split, num_loops, dtype)
  cfg.update(overrides or {})
  shapes = nnx.eval_shape(lambda: build_model(cfg, vocab_size, max_len, seed=0))
  graphdef, state = nnx.split(shapes)
  with hf:  # each tensor copied out, then every file unmapped
    pure = family.params(hf, cfg, vocab_size)
  if left := hf.unused():  # a tensor left over is an error, as a missing one is
    raise ConfigError(f"{hf.path}: unexpected tensor {left[0]}")
  want = jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(state))
  got = jax.tree.map(lambda a: tuple(a.shape), pure)
  if want != got:  # a mapping bug, not bad input: the family and model disagree
    raise ValueError(
      f"{hf.config['model_type']}: params do not match the model: {got} vs {want}"
    )
  # On the device, or into their shards on `mesh`, one array at a time, each
  # host copy dropped once put (the list holds the only reference): the host
  # never holds the model twice (3.5B in float32 on a 24 GB CPU host).
  leaves, tree = jax.tree.flatten(pure)
  del pure
  where = [None] * len(leaves)
  if mesh is not None:
    where = jax.tree.leaves(_shardings(shapes, mesh, rules))
  for i, placement in enumerate(where):
    leaves[i] = jax.device_put(leaves[i], placement)
  nnx.replace_by_pure_dict(state, jax.tree.unflatten(tree, leaves))
  return cfg, Model(graphdef, state, cfg.dtype)


def abstract(path, base, mesh, rules, split=None, num_loops=None, dtype=None):
  """(model config, Model) of a directory's config.json alone: every param a
  ShapeDtypeStruct, sharded on `mesh` by `rules` (ahead-of-time compiles)."""
  _, _, cfg, vocab_size, max_len = resolve(path, base, split, num_loops, dtype, False)
  shapes = nnx.eval_shape(lambda: build_model(cfg, vocab_size, max_len, seed=0))
  graphdef, state = nnx.split(shapes)
  pure = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.dtype(cfg.dtype), sharding=s),
    nnx.to_pure_dict(state),
    _shardings(shapes, mesh, rules),
  )
  nnx.replace_by_pure_dict(state, pure)
  return cfg, Model(graphdef, state, cfg.dtype)


def _shardings(shapes, mesh, rules) -> dict:
  """Each param's NamedSharding on `mesh`, by its logical axes and `rules`."""
  return jax.tree.map(
    lambda a, x: NamedSharding(mesh, sharding.spec(a, rules, x.shape, mesh)),
    sharding.param_axes(shapes),
    nnx.to_pure_dict(nnx.state(shapes, nnx.Param)),
    is_leaf=lambda a: isinstance(a, tuple),
  )
