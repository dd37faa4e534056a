"""`python -m loopjax.sample`: text from a language model (a run's checkpoint or a
pretrained directory, `restore.language_model`), by `lm.generate`."""

import numpy as np

from loopjax import restore, sharding
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.lm.generate import generate


def sample(
  config,
  workdir,
  prompt: str,
  *,
  max_new_tokens: int | None = None,
  step=None,
  num_loops=None,
  **kw,
) -> str:
  """`prompt` continued by `max_new_tokens` (None: up to DEFAULT_NEW_TOKENS,
  as many as the model's positions leave after the prompt) at `num_loops`
  recurrences (default: model.num_loops)
  by the run's checkpoint at `step` (default: the newest) or the pretrained
  model; the prompt is read from a document's start (`restore.Text`). The
  model is on the run's mesh (all processes' devices), its batch split there."""
  opened = restore.language_model(config, workdir)
  text = opened.text
  ids = text.prefix_ids + lm.encode(text.tokenizer_json, prompt)
  if not ids:
    raise ConfigError(
      "--prompt: encodes to no token, and the model puts none before a text: "
      "nothing to continue"
    )
  pos = opened.cfg.pos_encoding
  if max_new_tokens is None:  # a default that fits the model it is given
    max_new_tokens = default_new_tokens(len(ids), text.max_length, pos)
  _check_length(len(ids), max_new_tokens, text.max_length, pos)
  model = opened.model(step)
  out = generate(
    model,
    [ids],
    max_new_tokens,
    num_loops=num_loops or opened.num_loops,
    eos_id=text.eos_id,
    feed=sharding.Feed.like(model.params, config.sharding.rules),
    **kw,
  )
  skip = len(text.prefix_ids)  # the prompt as given, and what followed it
  return lm.decode(text.tokenizer_json, np.asarray(ids[skip:] + out.tokens[0]))


# Relative positions (RoPE, none) run past the trained context, up to this
# many times it: beyond, a sample is both far outside what the model learned
# and a long wait (one call per token, the cache growing with each).
RELATIVE_REACH = 4
DEFAULT_NEW_TOKENS = 128


def _reach(trained: int, pos_encoding: str) -> int:
  """The positions a model has: its table's (learned, sinusoidal), else
  RELATIVE_REACH times its context."""
  absolute = pos_encoding in ("learned", "sinusoidal")
  return trained if absolute else RELATIVE_REACH * trained


def default_new_tokens(prompt: int, trained: int, pos_encoding: str) -> int:
  """Up to DEFAULT_NEW_TOKENS, as many as the positions leave after `prompt`
  (at least 1: a prompt that fills them is refused by `_check_length`)."""
  return max(1, min(DEFAULT_NEW_TOKENS, _reach(trained, pos_encoding) - prompt + 1))


def _check_length(prompt: int, new: int, trained: int, pos_encoding: str) -> None:
  """Refuses a prompt and new tokens past the positions the model has: its
  table (learned, sinusoidal), else RELATIVE_REACH times its context."""
  absolute, limit = (
    pos_encoding in ("learned", "sinusoidal"),
    _reach(trained, pos_encoding),
  )
  if prompt + new - 1 > limit:  # the last new token is never fed back
    has = (
      f"the {trained} positions of a {pos_encoding}-position model"
      if absolute
      else f"{limit} positions ({RELATIVE_REACH} x the model's {trained}-token context)"
    )
    raise ConfigError(
      f"--max_new_tokens: the prompt ({prompt} tokens) and {new} new tokens "
      f"exceed {has}"
    )
