"""The task families a config can name: the one registry of `data.task`.

A family owns what differs between tasks: the checks its loaded data need, its
loss, its training iterator, its evaluator and how a report prints it, what
an evaluation decides (grokking phases, curriculum stages), its analyses, the
shapes of its batches (ahead-of-time compiles, benchmarks) and the line a
finished run prints. The loop, checkpoints, sharding and recurrence are shared
and never ask which family they serve.

`FAMILIES` is strings, as big_vision names its evaluators: per family, its
class and its `Spec` (what config validation reads: its config rules, its
analyses by name, whether it has a hop curriculum or pretrained models), in
its package's JAX-free `spec.py`. `spec` imports the latter in a fraction of
a second; `for_config` imports the class only when a run needs it, and its
`load` reads the data with the family's own reader. A new family is a
package beside `kg/` and `lm/` (its `Family` subclass, its reader, its
`spec.py`, naming its report's parts) and one line here.
"""

import abc
import functools
from collections.abc import Callable
from typing import NamedTuple

from loopjax.analysis.registry import Entry
from loopjax.errors import ConfigError
from loopjax.names import imported


class Record(NamedTuple):
  """A family by its `data.task` name: "module:ATTRIBUTE" of its parts."""

  family: str  # its Family subclass (imported when a run needs it)
  spec: str  # its Spec (JAX-free: config validation imports it)


class Spec(NamedTuple):
  """What config validation reads of a family; a family without pretrained
  models or a curriculum leaves those out."""

  check: Callable  # its config rules: (config) -> None, raises ConfigError
  analyses: dict[str, Entry]  # its analyses by name (analysis/registry.py)
  default_analyses: tuple[str, ...]  # those `--mode=analyze` runs by default
  curriculum: bool = False  # trains with a hop curriculum (train.curriculum.*)
  pretrained: Callable | None = None  # rules of a pretrained model's run (model.hf_dir)
  init_from: Callable | None = None  # of a run started from one (model.init_from)
  report: str | None = None  # "module:ATTRIBUTE" of its report.Parts (--mode=report)
  export: str | None = None  # of its (config, out_dir) -> papers' files (data export)


FAMILIES = {
  "composition": Record("loopjax.kg.task:Composition", "loopjax.kg.spec:COMPOSITION"),
  "chains": Record("loopjax.kg.task:Chains", "loopjax.kg.spec:CHAINS"),
  "lm": Record("loopjax.lm.task:LanguageModel", "loopjax.lm.spec:LM"),
}


@functools.cache
def spec(name: str) -> Spec:
  """The Spec of family `name` (`data.task`, field_rules checked it)."""
  return imported(FAMILIES[name].spec)


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

  def update_scale(self, config, state):
    """A multiplier of the optimizer's updates, traced inside the train step
    from its `state` (a curriculum's decayed last stage); None: none."""
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
