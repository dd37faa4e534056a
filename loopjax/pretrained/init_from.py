"""`model.init_from=hf:DIR`: a looped language model's training run that starts
from a pretrained feedforward Llama or OLMo 2 (retrofitted recurrence,
McLeish et al. 2025).

`resolve` sets the run's model shape (widths, heads, MLP, norms, RoPE, layer
counts, tied head) and its tokenizer from DIR, so the workdir's config.json
records what trains; `model.hf_split` "p,c,k" places DIR's layers as prelude,
core and coda. The looped options stay the run's: R and its sampling, the
injection, the first state. A fresh run's params are DIR's (`params`); a run
that resumes restores its own checkpoint and never reads DIR's tensors.

The concat adapter, which DIR lacks, starts as retrofitting's OLMo converter
sets it: [0 | I], the state's half zero and the input's the identity, so each
iteration starts from the prelude's output whatever the state, and at step 0
the looped model is DIR's model, less the layers a split drops, at every R
(its Llama converter leaves torch's random init, which makes even R = 1
another function). With injection add or
none, the state enters as those options say.
"""

import numpy as np
from flax import nnx

from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.pretrained import llama
from loopjax.pretrained.hf_dir import HfDir
from loopjax.pretrained.load import load, split

# `model` fields the family's config sets to a feedforward model's values that
# a looped run chooses itself.
LOOPED = ("injection", "init_state", "state_norm", "exit_gate")


def resolve(config, tokenizer: bool = True):
  """`config` with DIR's model shape, data.tokenizer and data.vocab_size (a
  copy; a config without init_from as it is). Reads config.json and the
  tokenizer, no tensor: a split that does not add up, or a tokenizer whose
  size is not the embedding's, fails here, before anything compiles.
  `tokenizer` False: the shapes alone, from config.json (ahead-of-time
  compiles of a published model's shape, experiments/hf_shapes)."""
  m = config.model
  if not m.init_from:
    return config
  hf_dir = HfDir(m.init_from, weights=False)
  hf, path = hf_dir.config, hf_dir.path
  if hf.get("model_type") not in llama.LAYOUTS:
    raise ConfigError(
      f"model.init_from: {path} must hold a feedforward {' or '.join(llama.LAYOUTS)} "
      f"model; got model_type {hf.get('model_type')!r}"
    )
  cfg, vocab_size, _ = llama.model_config(hf, m, split(config), m.num_loops)
  out = config.copy_and_resolve_references()
  out.model.update({k: v for k, v in cfg.items() if k not in LOOPED})
  out.data.vocab_size = vocab_size
  if not tokenizer:
    return out
  tokenizer = path / "tokenizer.json"
  try:
    n = lm.tokenizer_from_json(tokenizer.read_text()).get_vocab_size()
  except Exception as e:  # not a tokenizer.json
    raise ConfigError(
      f"model.init_from: {tokenizer} does not load as a tokenizer ({type(e).__name__})"
    ) from None
  if not lm.embeds(n, vocab_size):
    raise ConfigError(
      f"data.tokenizer: {tokenizer} has {n} tokens but {path}'s embedding has "
      f"{vocab_size} rows (at most {lm.padded(n)} would be padding); a tokenizer "
      "from another model?"
    )
  out.data.tokenizer = str(tokenizer)
  return out


def params(config, mesh=None) -> dict:
  """DIR's params as the resolved `config`'s model holds them, float32 (the
  run's masters), each tensor put straight into its shards on `mesh` by the
  run's rules (None: the default device); the concat adapter [0 | I] with a
  zero bias, on the host."""
  m, rules = config.model, tuple(config.sharding.rules)
  _, model = load(
    m.init_from, m, split(config), m.num_loops, "float32",
    mesh=mesh, rules=rules,
  )  # fmt: skip
  pure = nnx.to_pure_dict(model.params)
  if m.injection == "concat":  # rows: the state's D, then the input's D
    D = m.d_model
    pure["adapter"] = np.eye(2 * D, D, -D, np.float32)
    pure["adapter_b"] = np.zeros(D, np.float32)
  return pure
