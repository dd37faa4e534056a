"""`--mode=analyze` and `--mode=sample` on a pretrained model: `model.hf_dir`
loaded (no checkpoint, no training), prompts from `data.source=prompts:FILE`.

The model's config is the directory's (its family's mapping, `pretrained.load`)
with `model.num_loops` recurrences and `model.dtype`; `model.hf_split` places
a feedforward model's layers as prelude, core and coda. Outputs go to the
workdir, which records the config (a later run with another refuses it).
"""

from pathlib import Path

import numpy as np
from flax import nnx

from loopjax import analyze_lm, sharding
from loopjax import config as config_lib
from loopjax import sample as sample_lib
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.pretrained import prompts as prompts_lib
from loopjax.pretrained.load import load
from loopjax.workdir import Workdir, write_atomic


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


def load_model(config):
  """(model config, Model, vocab size) of `model.hf_dir`, its params put
  straight into their shards on the run's mesh (`mesh`, `sharding.rules`)."""
  m, rules = config.model, tuple(config.sharding.rules)
  mesh = sharding.make_mesh(config.mesh)
  cfg, model = load(
    m.hf_dir, m, split(config), m.num_loops, m.dtype, mesh=mesh, rules=rules
  )
  return cfg, model, nnx.to_pure_dict(model.params)["embed"].shape[0]


def prepare(config, workdir):
  """(the loaded model's config, Model, task, prompts): everything checked
  (directory, tensors, tokenizer, prompts) before anything compiles."""
  prompts = prompts_lib.read(config.data.source, config.data.text_field)
  cfg, model, vocab_size = load_model(config)
  tokenizer = prompts_lib.tokenizer_json(config.model.hf_dir, vocab_size)
  task = prompts_lib.task(config, tokenizer, prompts)
  wd = Workdir(workdir)
  wd.check(config)
  wd.check_writable()
  write_atomic(wd.path / "config.json", config_lib.to_json(config))
  return cfg, model, task, prompts


def analyze(config, workdir) -> list[Path]:
  """The LM analyses (fixed points, stages, attention) of the loaded model on
  the prompts, to `analyze.max_depth` recurrences, under workdir/analysis."""
  cfg, model, task, prompts = prepare(config, workdir)
  run_config = config_lib.base()
  run_config.unlock()
  run_config.update(config.to_dict())
  run_config.model = cfg  # the directory's shapes, for the memory report
  probe = prompts_lib.batches(task, prompts, config.analyze.batch_size)
  return analyze_lm.run(
    run_config, task, model, 0, Path(workdir) / "analysis", probe, "prompts"
  )


def sample(config, workdir, prompt: str, *, max_new_tokens: int, num_loops=None, **kw):
  """`prompt` continued by the loaded model at `num_loops` recurrences
  (default `model.num_loops`), with a key/value cache (`sample.generate`)."""
  _, model, vocab_size = load_model(config)
  tokenizer = prompts_lib.tokenizer_json(config.model.hf_dir, vocab_size)
  ids = lm.encode(tokenizer, prompt)
  if not ids:
    raise ConfigError("--prompt: encodes to no token: nothing to continue")
  eos = lm.special_ids(tokenizer, "tokenizer.json")[2]
  tokens, _ = sample_lib.generate(
    model,
    np.asarray([ids], np.int32),
    max_new_tokens,
    num_loops=num_loops or config.model.num_loops,
    eos_id=eos,
    **kw,
  )
  return lm.tokenizer_from_json(tokenizer).decode(
    list(map(int, tokens[0])), skip_special_tokens=True
  )
