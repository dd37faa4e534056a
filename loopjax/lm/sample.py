"""`python -m loopjax.sample`: text from a language model (a run's checkpoint or a
pretrained directory), by `lm.generate`."""

from pathlib import Path

import numpy as np

from loopjax import restore
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.lm import prompts
from loopjax.lm.generate import generate


def sample(
  config, workdir, prompt: str, *, max_new_tokens: int, step=None, num_loops=None, **kw
) -> str:
  """`prompt` continued at `num_loops` recurrences (default: the trained R) by
  the run's checkpoint at `step` (default: the newest) or, with
  `model.hf_dir`, by that pretrained model."""
  if config.model.hf_dir:
    tok = prompts.tokenizer(config)
    ids = lm.encode(tok, prompt)
    if not ids:
      raise ConfigError("--prompt: encodes to no token: nothing to continue")
    eos, skip = lm.special_ids(tok, "tokenizer.json")[2], 0
    model = restore.from_hf_dir(config)[1]
  else:
    task, ids = _run_prompt(config, workdir, prompt, max_new_tokens)
    tok, eos, skip = task.tokenizer_json, task.eos_id, 1 if config.data.bos else 0
    model = restore.from_checkpoint(config, workdir, step, task=task)[1]
  out = generate(
    model,
    [ids],
    max_new_tokens,
    num_loops=num_loops or config.model.num_loops,
    eos_id=eos,
    **kw,
  )
  return lm.decode(tok, np.asarray(ids[skip:] + out.tokens[0]))


def _run_prompt(config, workdir, prompt: str, new: int):
  """(the run's task without its corpus, the prompt's ids), checked against
  the positions the model has."""
  path = Path(workdir) / "tokenizer.json"
  if not path.exists():
    raise ConfigError(f"--workdir={workdir}: no tokenizer.json; is it an LM run?")
  task = lm.without_streams(config.data, path.read_text())
  ids = ([task.bos_id] if config.data.bos else []) + lm.encode(
    task.tokenizer_json, prompt
  )
  if not ids:
    raise ConfigError("--prompt: empty, and data.bos is off: nothing to continue")
  if (
    config.model.pos_encoding in ("learned", "sinusoidal")
    and len(ids) + new - 1 > task.seq_len  # the last token is never fed back
  ):
    raise ConfigError(
      f"--max_new_tokens: the prompt ({len(ids)} tokens) and {new} new tokens exceed "
      f"the {task.seq_len} positions of a {config.model.pos_encoding}-position model"
    )
  return task, ids
