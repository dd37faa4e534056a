"""A language model scored as an evaluation harness asks: the log-likelihood
of continuations, greedy or sampled text until stop strings, and the
recurrences each request used.

Requests are token ids. Log-likelihoods run in batches of similar length
(sorted, right-padded to a multiple of `BUCKET` so few programs compile;
causal attention keeps the padding out of every real position), at a fixed R
or with a per-token exit rule (`halting.adaptive` over the whole text).
Generation is `lm.generate`'s batched decoding.

A model on a mesh (all devices of all processes) scores each batch split
over its devices (`sharding.Feed`; a batch is `batch_size` rounded up to
their split); every process asks for the same requests and reads every
score, so all run the same steps together (lm-evaluation-harness sees one
rank: `harness.run`).
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import halting, recurrence, restore, sharding, storage
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.lm.generate import generate
from loopjax.state import Model
from loopjax.workdir import Workdir

BUCKET = 32  # padded lengths are multiples of this: one program per bucket


@dataclasses.dataclass
class Score:
  """A continuation's log-likelihood, whether greedy decoding would produce
  it, and the mean recurrences its tokens used."""

  logprob: float
  greedy: bool
  iterations: float


@functools.partial(jax.jit, static_argnames=("num_loops",))
def _fixed(model: Model, tokens_BT, key, *, num_loops: int):
  logits_BTV = model.module()(tokens_BT, None, num_loops=num_loops, key=key)
  logp_BTV = jax.nn.log_softmax(logits_BTV)
  return logp_BTV, jnp.full(tokens_BT.shape, num_loops, jnp.int32)


@functools.partial(jax.jit, static_argnames=("rule", "num_loops"))
def _exiting(model: Model, tokens_BT, key, *, rule: halting.Rule, num_loops: int):
  return halting.adaptive(
    model.module(), tokens_BT, None, rule, r_max=num_loops, key=key
  )


@functools.partial(jax.jit, static_argnames=("depths",))
def _scores_at_depths(model: Model, tokens_BT, targets_BT, key, *, depths: tuple):
  """`_token_scores` at each of `depths` from one pass to the deepest, the
  readout applied after every iteration: (D, B, T) each."""
  m = model.module()
  x_BTD, h_BTD = m.encode(tokens_BT, key)

  def readout(h_BTD):  # what one iteration's logits score, not the logits
    return _targets(jax.nn.log_softmax(m.readout(h_BTD, None)), targets_BT)

  _, (logp_RBT, greedy_RBT) = recurrence.unroll(
    lambda h: m.core_step(h, x_BTD), h_BTD, max(depths), readout=readout
  )
  at = jnp.asarray(depths) - 1
  iters_DBT = jnp.broadcast_to(jnp.asarray(depths)[:, None, None], logp_RBT[at].shape)
  return logp_RBT[at], greedy_RBT[at], iters_DBT


@functools.partial(jax.jit, static_argnames=("rule", "num_loops"))
def _token_scores(model, tokens_BT, targets_BT, key, *, rule, num_loops):
  """Per position: the target's log-probability, whether it is the argmax,
  the recurrences used; (B, T) each."""
  if rule is None:
    logp_BTV, iters_BT = _fixed(model, tokens_BT, key, num_loops=num_loops)
  else:
    logp_BTV, iters_BT = _exiting(model, tokens_BT, key, rule=rule, num_loops=num_loops)
  return *_targets(logp_BTV, targets_BT), iters_BT


def _targets(logp_BTV, targets_BT):
  """Each target's log-probability, and whether it is the argmax; (B, T)."""
  target_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0]
  return target_BT, logp_BTV.argmax(-1) == targets_BT


def _bucket(n: int, most: int) -> int:
  """`n` rounded up to a multiple of BUCKET, at most `most` (and at least n)."""
  return max(n, min(-(-n // BUCKET) * BUCKET, most))


class Scorer:
  """`model` reading and writing `text` (`restore.Text`: an empty context
  starts from its `start_id`), at `num_loops` recurrences (the most, with an
  `exit` rule); `max_length`: the positions it is given; `feed`: the
  model's (`sharding.Feed`, which splits each batch over its devices)."""

  def __init__(
    self,
    model: Model,
    text: restore.Text,
    *,
    num_loops: int,
    depths: tuple[int, ...] = (),
    max_length: int | None = None,
    batch_size: int = 8,
    exit: halting.Rule | None = None,
    seed: int = 0,
    feed: sharding.Feed | None = None,
  ):
    self.model, self.num_loops, self.exit = model, num_loops, exit
    self.tok = lm.tokenizer_from_json(text.tokenizer_json)
    self.max_length, self.batch_size = max_length or text.max_length, batch_size
    self.start_id, self.eos_id, self.seed = text.start_id, text.eos_id, seed
    self.feed = feed or sharding.Feed(None, ())
    # With `depths` (and no exit rule), a log-likelihood is computed at every
    # depth in one pass and kept: a later call at another of them reads it.
    self.depths, self._kept = tuple(depths), {}

  def encode(self, text: str, special: bool = False) -> list[int]:
    """`text`'s ids; `special`: with what the tokenizer's post-processor adds."""
    return self.tok.encode(text, add_special_tokens=special).ids

  def decode(self, ids) -> str:
    return self.tok.decode(list(map(int, ids)))

  def loglikelihood(self, requests: list[tuple[list[int], list[int]]]) -> list[Score]:
    """Each (context ids, continuation ids): the continuation's score at
    `num_loops`. The text is cut on the left to `max_length` + 1 tokens."""
    shared = self.exit is None and self.num_loops in self.depths
    if not shared:
      return self._score(requests, None)[0]
    keys = [(tuple(c), tuple(x)) for c, x in requests]
    todo = [i for i, k in enumerate(keys) if k not in self._kept]
    if todo:
      at_depths = self._score([requests[i] for i in todo], self.depths)
      for j, i in enumerate(todo):
        self._kept[keys[i]] = {d: at_depths[n][j] for n, d in enumerate(self.depths)}
    return [self._kept[k][self.num_loops] for k in keys]

  def _score(self, requests, depths) -> list[list[Score]]:
    """Scores at `num_loops` ([one list]) or at each of `depths` (a list each)."""
    rows = []
    for context, continuation in requests:
      if not continuation:
        raise ValueError("loglikelihood: an empty continuation has nothing to score")
      ids = ((context or [self.start_id]) + continuation)[-(self.max_length + 1) :]
      rows.append((ids[:-1], ids[1:], len(continuation)))
    out = [[None] * len(rows) for _ in depths or (None,)]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    key, B = jax.random.key(self.seed), self.feed.size(self.batch_size)
    for at in range(0, len(order), B):
      chunk = order[at : at + B]
      T = _bucket(len(rows[chunk[0]][0]), self.max_length)
      inputs_BT, targets_BT = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
      for b, i in enumerate(chunk):
        inputs, targets, _ = rows[i]
        inputs_BT[b, : len(inputs)], targets_BT[b, : len(targets)] = inputs, targets
      batch = self.feed.put({"inputs": inputs_BT, "targets": targets_BT})
      args = (self.model, batch["inputs"], batch["targets"], key)
      if depths:
        scores = _scores_at_depths(*args, depths=depths)
      else:
        scores = [
          x[None]
          for x in _token_scores(*args, rule=self.exit, num_loops=self.num_loops)
        ]
      logp_DBT, greedy_DBT, iters_DBT = sharding.host(list(scores))
      for d, kept in enumerate(out):
        for b, i in enumerate(chunk):
          end = len(rows[i][0])
          n = min(rows[i][2], end)  # a continuation cut on the left to fit
          at_cont = slice(end - n, end)
          kept[i] = Score(
            float(logp_DBT[d, b, at_cont].sum()),
            bool(greedy_DBT[d, b, at_cont].all()),
            float(iters_DBT[d, b, at_cont].mean()),
          )
    return out

  def generate(
    self,
    contexts: list[list[int]],
    until: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
  ) -> list[tuple[str, list[int]]]:
    """Each context continued until one of the `until` strings (cut before
    it), eos or `max_new_tokens`: (text, the recurrences of each new token)."""

    def stop(new: list[int]) -> bool:
      return bool(until) and any(s in self.decode(new) for s in until)

    out = [None] * len(contexts)
    order = sorted(range(len(contexts)), key=lambda i: -len(contexts[i]))
    room = max(1, self.max_length - max_new_tokens)
    B = self.feed.size(self.batch_size)
    for at in range(0, len(order), B):
      chunk = order[at : at + B]
      prompts = [(contexts[i] or [self.start_id])[-room:] for i in chunk]
      # a full batch, its length bucketed: few programs to compile
      slots = _bucket(len(prompts[0]), room)
      g = generate(
        self.model, prompts, max_new_tokens, num_loops=self.num_loops,
        temperature=temperature, seed=self.seed, eos_id=self.eos_id,
        stop=stop, exit=self.exit, pad_to=(B, slots), feed=self.feed,
      )  # fmt: skip
      for b, i in enumerate(chunk):
        new = g.tokens[b]
        if new and new[-1] == self.eos_id:
          new = new[:-1]
        text = self.decode(new)
        for s in until:
          text = text.split(s)[0]
        out[i] = (text, g.iterations[b, : len(g.tokens[b])].tolist())
    return out


@dataclasses.dataclass
class Loaded:
  """A model ready to score: the `Scorer`, the chat template
  (tokenizer_config.json's, or None) with its special tokens, and a name."""

  scorer: Scorer
  name: str
  chat_template: str | None = None
  specials: dict = dataclasses.field(default_factory=dict)


def load(
  *,
  hf_dir: str | None = None,
  workdir: str | None = None,
  step: int | None = None,
  num_loops: int | None = None,
  dtype: str = "float32",
  **scorer_kw,
) -> Loaded:
  """A pretrained directory (`hf_dir`, in `dtype`) or a loopjax run's
  checkpoint (`workdir`, at `step`; default the newest) as a `Scorer`
  (`opened`)."""
  if (hf_dir is None) == (workdir is None):
    raise ConfigError("model_args: give one of hf_dir=DIR or workdir=DIR")
  if hf_dir is not None:
    config = restore.pretrained_config(hf_dir, dtype=dtype)
    return opened(config, step=step, num_loops=num_loops, **scorer_kw)
  path = storage.path(workdir, "model_args: workdir")
  config = Workdir(path).saved_config()
  if config is None or not (path / "tokenizer.json").is_file():
    raise ConfigError(
      f"model_args: workdir={workdir} is not a language-model run "
      "(it needs config.json and tokenizer.json)"
    )
  return opened(config, workdir, step=step, num_loops=num_loops, **scorer_kw)


def opened(
  config, workdir=None, *, step=None, num_loops=None, max_length=None, **scorer_kw
) -> Loaded:
  """The language model `config` opens (`restore.language_model`) as a
  `Scorer`, every input checked (ConfigError) before a weight is read."""
  source = restore.language_model(config, workdir, num_loops)
  if (rule := scorer_kw.get("exit")) is not None:
    rule.check(source.cfg, "exit", source.name)
  template, specials = chat_template(source.directory)
  model = source.model(step)
  scorer = Scorer(
    model, source.text, num_loops=source.num_loops, max_length=max_length,
    feed=sharding.Feed.like(model.params, config.sharding.rules), **scorer_kw,
  )  # fmt: skip
  return Loaded(scorer, source.name, template, specials)


def chat_template(directory: Path | None) -> tuple[str | None, dict]:
  """A pretrained directory's tokenizer_config.json's chat template (the
  default one of several) and the special tokens it may name; (None, {})
  where the model has none (a run's never has)."""
  path = directory and directory / "tokenizer_config.json"
  if path is None or not path.is_file():
    return None, {}
  try:
    cfg = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
  template = cfg.get("chat_template")
  if isinstance(template, list):  # [{"name", "template"}, ...]
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default")
  content = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
  specials = {k: content(cfg.get(k)) for k in ("bos_token", "eos_token")}
  return template, {k: v for k, v in specials.items() if v is not None}
