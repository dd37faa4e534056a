"""The task families a config can name: the one registry of `data.task`.

A family owns what differs between tasks: the checks its loaded data need, its
loss, its training iterator, its evaluator and how a report prints it, what
an evaluation decides (grokking phases, curriculum stages), its analyses, the
shapes of its batches (ahead-of-time compiles, benchmarks) and the line a
finished run prints. The loop, checkpoints, sharding and recurrence are shared
and never ask which family they serve.

`FAMILIES` is strings, as big_vision names its evaluators: config
validation reads a family's rules (a JAX-free module) and analyses in a
fraction of a second, and `for_config` imports the family's class only when
a run needs it; its `load` reads the data with the family's own reader. A new
family is a package beside `kg/` and `lm/` (its `Family` subclass, its reader,
its checks) and one line here.
"""

import abc
import functools
import importlib
from typing import NamedTuple

from loopjax.analysis import registry
from loopjax.errors import ConfigError


class Record(NamedTuple):
  """A family by its `data.task` name: what validation and loading read."""

  family: str  # "module:Class" of its Family subclass
  check: str  # "module:function": its config rules (JAX-free: task_checks.py)
  analyses: dict[str, registry.Entry]  # its table in analysis/registry.py
  default_analyses: tuple[str, ...]  # those `--mode=analyze` runs by default


FAMILIES = {
  "composition": Record(
    "loopjax.kg.task:Composition",
    "loopjax.task_checks:composition",
    registry.KG,
    tuple(registry.KG),
  ),
  "chains": Record(
    "loopjax.kg.task:Chains",
    "loopjax.task_checks:chains",
    registry.KG,
    tuple(registry.KG),
  ),
  "lm": Record(
    "loopjax.lm.task:LanguageModel",
    "loopjax.task_checks:lm",
    registry.LM,
    registry.shared(registry.LM),
  ),
}


def imported(path: str):
  """The attribute "module:ATTRIBUTE" names, its module imported now."""
  module, _, attribute = path.partition(":")
  return getattr(importlib.import_module(module), attribute)


class Family(abc.ABC):
  """What the shared code asks of a task family (kg/task.py, lm/task.py).

  A subclass gives `name`, `loss_fn` and the abstract methods; the others
  default to a family with no phases, no sampling and no streamed analyses,
  evaluated at eval.depths (or model.num_loops)."""

  name: str
  loss_fn: object  # (model, batch, train config, key, num_loops, depth) -> (loss, acc)
  reads_every_position = False  # a readout per token (LM) or per sequence (KG)
  packs_documents = False  # batches of packed documents, masked apart (B, T, T)
  # Its analyses' shared pass streams windows (analysis/depth_scan), which
  # ahead-of-time compiles check; otherwise a traced pass per probe split.
  streams_analyses = False

  @abc.abstractmethod
  def load(self, config):
    """The task's data, read by the family's reader and checked for what
    validation cannot see before they are loaded (ConfigError)."""

  def phase_names(self, config) -> tuple[str, ...]:
    """What a run records in phases.json (null until reached)."""
    return ()

  @abc.abstractmethod
  def train_iterator(self, config, task, rows):
    """Endless, checkpointable training batches of the process's `rows`."""

  @abc.abstractmethod
  def evaluator(self, config, task, graphdef, depths=(), mesh=None, shardings=None):
    """An object with `run(params) -> flat metrics`, `per_depth(params) ->
    (results per split and depth, per example)` and `run_all(params) -> (flat
    metrics, results per split and depth)`."""

  @abc.abstractmethod
  def eval_step(self, config, graphdef, mesh=None, shardings=None):
    """The evaluator's jitted (params, batch) step at the deepest iteration
    count `--mode=eval` reads (ahead-of-time compiles)."""

  def after_eval(self, config, step, metrics, phases, train_iter, state, tx):
    """(state, the phases reached at this evaluation): what the evaluation's
    `metrics` decide, given the `phases` reached before; a curriculum moves
    `train_iter` and the train state to its next stage."""
    return state, []

  def finished(self, config, phases: dict) -> str | None:
    """The line a finished training run prints, if any."""
    return None

  def eval_depths(self, config) -> list[int]:
    """The iteration counts an evaluation reports."""
    return list(config.eval.depths) or [config.model.num_loops]

  @abc.abstractmethod
  def eval_table(self, config, report: dict):
    """(title, depths, rows of (name, {depth: value})) for `--mode=eval`."""

  def follow_phases(self, config, records: list[dict]) -> dict | None:
    """What an evaluation job records in eval/phases.json, if anything."""
    return None

  @abc.abstractmethod
  def analyze(self, config, workdir, task, model, step, out_dir, phases=True):
    """Writes the analyses of `model` under `out_dir`; returns the paths."""

  def sample(self, config, workdir, prompt: str, **kw) -> str:
    """`python -m loopjax.sample`: `prompt` continued (ConfigError where it
    cannot be)."""
    raise ConfigError(
      f"python -m loopjax.sample: needs a language-model run; this one is {self.name!r}"
    )

  def sampling_programs(self, config, task, model) -> dict:
    """{name: (jitted fn, abstract args)}: what sampling compiles, for
    ahead-of-time checks; none where the family does not sample."""
    return {}

  @abc.abstractmethod
  def without_examples(self, config):
    """The task's shapes from the config alone (no data read)."""

  @abc.abstractmethod
  def batch_shapes(self, config, task, batch_size: int) -> dict:
    """{column: (shape, dtype)} of a training batch."""

  @abc.abstractmethod
  def random_batch(self, config, rng, vocab_size: int, seq_len: int) -> dict:
    """A training batch of the right shapes, random tokens (benchmarks)."""


@functools.cache
def family(name: str) -> Family:
  """The family `name`, its class imported now (config.validate checked it)."""
  return imported(FAMILIES[name].family)()


def for_config(config) -> Family:
  """The family of `config.data.task`."""
  return family(config.data.task)
