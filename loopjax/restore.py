"""A model to evaluate, analyze, sample, score or compile: from a run's
checkpoint or from a pretrained directory (`model.hf_dir`). The one way every
mode, the harness, generation, aot and the benchmarks open a model, and the
one module that reads `model.hf_dir` (beside config validation).

A checkpoint's params alone are read (not the optimizer's state), from
abstract shapes (nothing is initialized), and it is never moved: a trainer
may be writing beside it. They land on one device, or on a mesh given (all
devices of all processes), sharded by the rules as training places them,
so a model no one device holds still opens. A pretrained
directory's params go straight into their shards on the run's mesh.

A language model comes with how it reads text (`Text`); its prefix rule is
written once, there.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax

from loopjax import checkpoint, sharding, storage
from loopjax import config as config_lib
from loopjax import task as task_lib
from loopjax.data import lm
from loopjax.errors import ConfigError
from loopjax.pretrained import load
from loopjax.state import Model, sharded_train_state
from loopjax.workdir import Workdir


def pretrained(config) -> bool:
  """Whether `config` opens a pretrained directory, which records no run (no
  checkpoint, no training), rather than a run's checkpoint."""
  return bool(config.model.hf_dir)


def name(config, workdir=None) -> str:
  """What reports call the model: its pretrained directory, or the workdir."""
  return config.model.hf_dir if pretrained(config) else str(workdir)


def pretrained_config(path, config=None, **model):
  """`config` (default: base()'s; a mutable one, changed in place) opening
  the pretrained directory `path`, with `model` fields set (num_loops 0, the
  default here: the directory's own recurrences)."""
  config = config_lib.base() if config is None else config
  config.model.update(hf_dir=str(path), **{"num_loops": 0} | model)
  return config


def job_mesh(config):
  """The mesh of a job that reads a model (evaluation, analysis, sampling,
  lm_eval): the devices it was launched on, whatever mesh the run trained on,
  since a mesh is where a job runs, not part of the model. All devices of
  all processes (one process: the first `mesh.devices`, 0 = all); split as
  the config's data x fsdp x tensor where that fits them, else its fsdp and
  tensor with data the rest, else data alone."""
  m = {a: int(config.mesh[a]) for a in sharding.MESH_AXES}
  n = config.mesh.get("devices", 0)
  devices = jax.devices()[:n] if n and jax.process_count() == 1 else jax.devices()
  for shape in (m, m | {"data": -1}):
    try:
      return sharding.make_mesh(shape, devices)
    except ConfigError:
      continue
  return sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)


class Reader:
  """Restores a run's checkpoints' params, one after another (an evaluation
  job follows them): their abstract shapes are built once. Only the params
  are read (`checkpoint.restore`'s partial restore): never the optimizer's
  moments or a grad filter's state, 3x to 100x their bytes. `mesh`: where
  the params go (default: this process's first device); `ema`: also the
  params' EMA where the run keeps one (train.param_ema), in the same read
  (`models`)."""

  def __init__(self, config, workdir, task, mesh=None, ema: bool = False):
    self.config = config
    if mesh is None:
      mesh = sharding.make_mesh(
        {"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1]
      )
    self.graphdef, state, _, _ = sharded_train_state(config, task, mesh, abstract=True)
    self.abstract = {"params": state["params"]}
    if ema and "ema" in state:
      self.abstract["ema"] = state["ema"]
    self.mngr = Workdir(workdir).checkpoints(config.checkpoint, read_only=True)

  def steps(self) -> list[int]:
    """The complete checkpoints on disk now, oldest first."""
    return checkpoint.steps(self.mngr)

  def model(self, step: int | None = None) -> tuple[Model, int]:
    """(the model at `step`, default the newest good one; its step)."""
    models, step = self.models(step)
    return models["params"], step

  def models(self, step: int | None = None) -> tuple[dict[str, Model], int]:
    """({"params": the model at `step`, "ema": its EMA's if read}, its step)."""
    if step is not None and step not in (have := self.steps()):
      listed = ", ".join(map(str, have[-8:])) if have else "none"
      raise ConfigError(
        f"--step={step}: no checkpoint at that step in {self.mngr.directory} "
        f"(the newest: {listed})"
      )
    state, step = checkpoint.restore(
      self.mngr, self.abstract, step=step, quarantine=False, partial=True
    )
    if state is None:
      raise ConfigError(
        f"--workdir={self.mngr.directory.parent}: no checkpoint to evaluate"
      )
    dtype = self.config.model.dtype
    return {k: Model(self.graphdef, v, dtype) for k, v in state.items()}, step

  def close(self) -> None:
    self.mngr.close()


def from_checkpoint(config, workdir, step: int | None = None, task=None, mesh=None):
  """(task data, model, step) of a run's checkpoint (default: the newest good
  one); `task`: the run's data if already loaded (else read from the config);
  `mesh`: see `Reader`."""
  task = task_lib.for_config(config).load(config) if task is None else task
  reader = Reader(config, workdir, task, mesh)
  try:
    model, step = reader.model(step)
  finally:
    reader.close()
  return task, model, step


@dataclasses.dataclass(frozen=True)
class Text:
  """How a language model reads and writes text: its tokenizer (a
  tokenizer.json's text), the ids before a text, its <eos>, its positions.

  The prefix rule. A text read from a document's start (a prompt to
  continue, a context to score) is `prefix_ids` followed by the tokenizer's
  encoding of it, post-processor included, as the model's training documents
  were: `prefix_ids` is [<bos>] for a run trained with data.bos and empty
  otherwise; a pretrained tokenizer's post-processor writes the <bos> its
  model expects itself (a Llama tokenizer's <s>). Where there is no text to
  encode (an empty context before a scored continuation), or where
  lm-evaluation-harness asks for the model's <bos> (its prefix_token_id,
  add_bos_token), the text starts from `start_id`: the model's <bos> (a
  pretrained tokenizer's, a data.bos run's), else <eos> (a run without
  data.bos reads each document after the previous one's <eos>)."""

  tokenizer_json: str
  prefix_ids: list[int]
  start_id: int
  eos_id: int
  max_length: int  # the positions the model has


@dataclasses.dataclass
class LanguageModel:
  """A language model opened up to its weights: its text read and checked,
  its model config (`cfg`) and recurrences. `model(step)` reads the weights
  (a run's checkpoint at `step`, default the newest good one; a pretrained
  directory's, every tensor checked); `directory`: the pretrained directory
  (its tokenizer_config.json), or None."""

  name: str
  cfg: object
  num_loops: int
  text: Text
  directory: Path | None
  model: Callable[[int | None], Model]


def language_model(config, workdir=None, num_loops: int | None = None):
  """The `LanguageModel` that `config` opens: `model.hf_dir`, or the run in
  `workdir`; at `num_loops` recurrences (default: model.num_loops). Every
  input is checked (ConfigError) before a weight is read; the weights land
  on the run's mesh (`config.mesh`: all devices of all processes)."""
  if pretrained(config):
    return _pretrained(config, num_loops)
  path = storage.path(workdir) / "tokenizer.json"
  if not path.is_file():
    raise ConfigError(f"--workdir={workdir}: no tokenizer.json; is it an LM run?")
  task = lm.without_streams(config.data, path.read_text())
  bos = config.data.bos
  text = Text(
    task.tokenizer_json, [task.bos_id] if bos else [],
    task.bos_id if bos else task.eos_id, task.eos_id, task.seq_len,
  )  # fmt: skip

  def weights(step=None):
    mesh = job_mesh(config)
    return from_checkpoint(config, workdir, step, task=task, mesh=mesh)[1]

  return LanguageModel(
    str(workdir), config.model, num_loops or config.model.num_loops, text, None,
    weights,
  )  # fmt: skip


def _pretrained(config, num_loops):
  """`language_model` of `model.hf_dir`: its config.json and tokenizer read."""
  m, split = config.model, load.split(config)
  _, _, cfg, vocab, max_len = load.resolve(
    m.hf_dir, m, split, num_loops or m.num_loops, m.dtype, weights=False
  )
  path = Path(m.hf_dir).expanduser()
  tok = _tokenizer(path, vocab)
  _, bos, eos = lm.special_ids(tok, f"{m.hf_dir}/tokenizer.json")

  def weights(step=None):
    del step  # a directory has one
    rules = tuple(config.sharding.rules)
    mesh = job_mesh(config)
    return load.load(
      m.hf_dir, m, split, cfg.num_loops, m.dtype, mesh=mesh, rules=rules
    )[1]

  text = Text(tok, [], bos, eos, max_len)
  return LanguageModel(m.hf_dir, cfg, cfg.num_loops, text, path, weights)


def _tokenizer(path: Path, vocab_size: int) -> str:
  """The directory's tokenizer.json, whose vocabulary must fit the embedding."""
  file = path / "tokenizer.json"
  if not file.is_file():
    raise ConfigError(f"model.hf_dir: {path} has no tokenizer.json")
  text = file.read_text()
  try:
    n = lm.tokenizer_from_json(text).get_vocab_size()
  except Exception as e:  # not a tokenizer.json
    raise ConfigError(
      f"{file}: does not load as a tokenizer ({type(e).__name__})"
    ) from None
  if n > vocab_size:
    raise ConfigError(
      f"{file}: its {n} tokens do not fit the model's {vocab_size}-row embedding "
      "(a tokenizer from another model?)"
    )
  return text


def abstract(config, mesh):
  """(model config, Model, vocab size) of `model.hf_dir`'s config.json alone:
  every param a ShapeDtypeStruct sharded on `mesh` by the config's rules
  (ahead-of-time compiles, random weights)."""
  m, rules = config.model, tuple(config.sharding.rules)
  split = load.split(config)
  cfg, model = load.abstract(m.hf_dir, m, mesh, rules, split, m.num_loops, m.dtype)
  vocab = load.resolve(m.hf_dir, m, split, m.num_loops, m.dtype, weights=False)[3]
  return cfg, model, vocab
