"""`--mode=sample`: text from a language model (a run's checkpoint or a
pretrained directory), with a key/value cache.

The prompt is one prefill call; every new token is one call of the same
compiled step at the next position (the position is an argument), so the
cost per token is one iteration stack over one position, not a forward pass
over the whole sequence.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import restore
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.lm import prompts
from loopjax.state import Model


@jax.jit
def prefill(model: Model, tokens_BT, cache, key):
  """The prompt in one call: the last position's logits (B, V), the cache
  filled. `key`: a random initial state's (Huginn's)."""
  logits_BTV, cache = model.module().decode(tokens_BT, cache, 0, key)
  return logits_BTV[:, -1], cache


@jax.jit
def decode_step(model: Model, token_B, cache, offset, key):
  """One new token at position `offset` (traced: one program for all)."""
  logits_BTV, cache = model.module().decode(token_B[:, None], cache, offset, key)
  return logits_BTV[:, 0], cache


def generate(
  model: Model,
  prompt_BT,
  max_new_tokens: int,
  *,
  num_loops: int,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  eos_id: int | None = None,
):
  """(tokens (B, T + max_new_tokens), the logits of each chosen token's step
  (B, max_new_tokens, V)). temperature 0: greedy; top_k > 0: sample among
  the k likeliest. Stops early only where every row has produced eos_id."""
  B, T = prompt_BT.shape
  cache = model.module().init_cache(B, T + max_new_tokens, num_loops, model.dtype)

  def choose(logits_BV, key):
    if temperature <= 0:
      return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if top_k:
      kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
      logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV)

  prefill_key, key = jax.random.split(jax.random.key(seed))
  logits_BV, cache = prefill(model, jnp.asarray(prompt_BT), cache, prefill_key)
  keys = jax.random.split(key, 2 * max_new_tokens).reshape(max_new_tokens, 2)
  out, seen = [], []
  for i in range(max_new_tokens):
    token_B = choose(logits_BV, keys[i, 0]).astype(jnp.int32)
    out.append(token_B)
    seen.append(logits_BV)
    if eos_id is not None and bool((token_B == eos_id).all()):
      break
    if i + 1 < max_new_tokens:
      offset = jnp.int32(T + i)
      logits_BV, cache = decode_step(model, token_B, cache, offset, keys[i, 1])
  tokens = np.concatenate([np.asarray(prompt_BT), np.stack(out, 1)], 1)
  return tokens, np.stack(seen, 1)


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
  tokens, _ = generate(
    model,
    np.asarray([ids], np.int32),
    max_new_tokens,
    num_loops=num_loops or config.model.num_loops,
    eos_id=eos,
    **kw,
  )
  return lm.decode(tok, tokens[0, skip:])


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
