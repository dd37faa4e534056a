"""`python -m loopjax.sample`: text from a language model (a run's checkpoint or a
pretrained directory, `restore.language_model`), by `lm.generate`."""

import numpy as np

from loopjax import restore
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.lm.generate import generate


def sample(
  config, workdir, prompt: str, *, max_new_tokens: int, step=None, num_loops=None, **kw
) -> str:
  """`prompt` continued at `num_loops` recurrences (default: model.num_loops)
  by the run's checkpoint at `step` (default: the newest) or the pretrained
  model; the prompt is read from a document's start (`restore.Text`)."""
  opened = restore.language_model(config, workdir)
  text = opened.text
  ids = text.prefix_ids + lm.encode(text.tokenizer_json, prompt)
  if not ids:
    raise ConfigError(
      "--prompt: encodes to no token, and the model puts none before a text: "
      "nothing to continue"
    )
  if (
    opened.cfg.pos_encoding in ("learned", "sinusoidal")
    and len(ids) + max_new_tokens - 1 > text.max_length  # the last is never fed back
  ):
    raise ConfigError(
      f"--max_new_tokens: the prompt ({len(ids)} tokens) and {max_new_tokens} new "
      f"tokens exceed the {text.max_length} positions of a "
      f"{opened.cfg.pos_encoding}-position model"
    )
  out = generate(
    opened.model(step),
    [ids],
    max_new_tokens,
    num_loops=num_loops or opened.num_loops,
    eos_id=text.eos_id,
    **kw,
  )
  skip = len(text.prefix_ids)  # the prompt as given, and what followed it
  return lm.decode(text.tokenizer_json, np.asarray(ids[skip:] + out.tokens[0]))
