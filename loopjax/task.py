"""The task family a config trains and evaluates: the one switch on `data.task`.

A family owns what differs between tasks: the checks its loaded data need, its
loss, its training iterator, its evaluator and how a report prints it, what
an evaluation decides (grokking phases, curriculum stages), its analyses, the
shapes of its batches (ahead-of-time compiles, benchmarks) and the line a
finished run prints. The loop, checkpoints, sharding and recurrence are shared
and never ask which family they serve. A new family is a package beside
`kg/` and `lm/` and one line in `FAMILIES`.
"""

from typing import Protocol

from loopjax.kg.task import Chains, Composition
from loopjax.lm.task import LanguageModel


class Family(Protocol):
  """What the shared code asks of a task family (kg/task.py, lm/task.py)."""

  name: str
  loss_fn: object  # (model, batch, train config, key, num_loops, depth) -> (loss, acc)
  reads_every_position: bool  # a readout per token (LM) or per sequence (KG)
  packs_documents: bool  # batches of packed documents, masked apart (B, T, T)

  def load(self, config):
    """The task's data (`data.load`), checked for what validation cannot see
    before they are loaded (ConfigError)."""

  def phase_names(self, config) -> tuple[str, ...]:
    """What a run records in phases.json (null until reached)."""

  def train_iterator(self, config, task, rows):
    """Endless, checkpointable training batches of the process's `rows`."""

  def evaluator(self, config, task, graphdef, depths=(), mesh=None, shardings=None):
    """An object with `run(params) -> flat metrics`, `per_depth(params) ->
    (results per split and depth, per example)` and `run_all(params) -> (flat
    metrics, results per split and depth)`."""

  def eval_step(self, config, graphdef, mesh=None, shardings=None):
    """The evaluator's jitted (params, batch) step at the deepest iteration
    count `--mode=eval` reads (ahead-of-time compiles)."""

  def after_eval(self, config, step, metrics, phases, train_iter, state, tx):
    """(state, the phases reached at this evaluation): what the evaluation's
    `metrics` decide, given the `phases` reached before; a curriculum moves
    `train_iter` and the train state to its next stage."""

  def finished(self, config, phases: dict) -> str | None:
    """The line a finished training run prints, if any."""

  def eval_depths(self, config) -> list[int]:
    """The iteration counts an evaluation reports."""

  def eval_table(self, config, report: dict):
    """(title, depths, rows of (name, {depth: value})) for `--mode=eval`."""

  def follow_phases(self, config, records: list[dict]) -> dict | None:
    """What an evaluation job records in eval/phases.json, if anything."""

  def analyze(self, config, workdir, task, model, step, out_dir, phases=True):
    """Writes the analyses of `model` under `out_dir`; returns the paths."""

  def sample(self, config, workdir, prompt: str, **kw) -> str:
    """`python -m loopjax.sample`: `prompt` continued (ConfigError where it
    cannot be)."""

  def without_examples(self, config):
    """The task's shapes from the config alone (no data read)."""

  def batch_shapes(self, config, task, batch_size: int) -> dict:
    """{column: (shape, dtype)} of a training batch."""

  def random_batch(self, config, rng, vocab_size: int, seq_len: int) -> dict:
    """A training batch of the right shapes, random tokens (benchmarks)."""


FAMILIES: dict[str, Family] = {
  "composition": Composition(),
  "chains": Chains(),
  "lm": LanguageModel(),
}


def for_config(config) -> Family:
  """The family of `config.data.task` (config.validate checked the name)."""
  return FAMILIES[config.data.task]
