"""A local Hugging Face directory as a loopjax model: its family from
config.json, the model config, and the params mapped by name."""

import jax
import jax.numpy as jnp
from flax import nnx

from loopjax.errors import ConfigError
from loopjax.pretrained import llama, ouro, retrofit
from loopjax.pretrained.hf_dir import HfDir
from loopjax.state import Model, build_model

# config.json model_type -> family module, or a function of the directory that
# picks one (huginn_raven: Huginn-0125's and the retrofitted models' type)
FAMILIES = {
  "llama": llama,
  "olmo2": llama,
  "ouro": ouro,
  "huginn_raven": retrofit.family,
}


def load(path, base, split=None, num_loops=None, dtype=None, overrides=None):
  """(model config, Model) of the directory `path`; `base`: the `model`
  section the family's fields are set on (its `dtype` the params' and the
  compute dtype unless `dtype` is given: bfloat16 keeps a 3.5B model at 7 GB
  on the host); `split`, `num_loops`: see the family's `model_config`;
  `overrides`: model fields set after the family's (e.g. init_state "zeros"
  for a deterministic first state)."""
  dtype = dtype or base.dtype
  hf = HfDir(path, dtype)
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
  cfg.update(overrides or {})
  cfg.dtype = dtype
  abstract = nnx.eval_shape(lambda: build_model(cfg, vocab_size, max_len, seed=0))
  graphdef, state = nnx.split(abstract)
  pure = family.params(hf, cfg, vocab_size)
  if left := hf.unused():  # a tensor left over is an error, as a missing one is
    raise ConfigError(f"{hf.path}: unexpected tensor {left[0]}")
  want = jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(state))
  got = jax.tree.map(lambda a: tuple(a.shape), pure)
  if want != got:  # a mapping bug, not bad input: the family and model disagree
    raise ValueError(f"{kind}: params do not match the model: {got} vs {want}")
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return cfg, Model(graphdef, state, dtype)
