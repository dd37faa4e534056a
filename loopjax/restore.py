"""A model to evaluate, analyze or sample: from a run's checkpoint or from a
pretrained directory (`model.hf_dir`). The one way every mode opens a model.

A checkpoint is read on one device, from abstract shapes (nothing is
initialized), and never moved: a trainer may be writing beside it. A
pretrained directory's params go straight into their shards on the run's mesh.
"""

import jax

from loopjax import checkpoint, data, sharding
from loopjax.errors import ConfigError
from loopjax.pretrained import load
from loopjax.state import Model, sharded_train_state
from loopjax.workdir import Workdir


class Reader:
  """Restores a run's checkpoints, one after another (an evaluation job
  follows them): the state's abstract shapes are built once."""

  def __init__(self, config, workdir, task):
    self.config = config
    mesh = sharding.make_mesh(
      {"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1]
    )
    self.graphdef, self.abstract, _, _ = sharded_train_state(
      config, task, mesh, abstract=True
    )
    self.mngr = Workdir(workdir).checkpoints(config.checkpoint, read_only=True)

  def steps(self) -> list[int]:
    """The complete checkpoints on disk now, oldest first."""
    self.mngr.reload()
    return sorted(self.mngr.all_steps())

  def model(self, step: int | None = None) -> tuple[Model, int]:
    """(the model at `step`, default the newest good one; its step)."""
    if step is not None and step not in (have := self.steps()):
      listed = ", ".join(map(str, have[-8:])) if have else "none"
      raise ConfigError(
        f"--step={step}: no checkpoint at that step in {self.mngr.directory} "
        f"(the newest: {listed})"
      )
    state, step = checkpoint.restore(
      self.mngr, self.abstract, step=step, quarantine=False
    )
    if state is None:
      raise ConfigError(
        f"--workdir={self.mngr.directory.parent}: no checkpoint to evaluate"
      )
    return Model(self.graphdef, state["params"], self.config.model.dtype), step

  def close(self) -> None:
    self.mngr.close()


def from_checkpoint(config, workdir, step: int | None = None, task=None):
  """(task data, model, step) of a run's checkpoint (default: the newest good
  one); `task`: the run's data if already loaded (else read from the config)."""
  task = data.load(config.data) if task is None else task
  reader = Reader(config, workdir, task)
  try:
    model, step = reader.model(step)
  finally:
    reader.close()
  return task, model, step


def from_hf_dir(config):
  """(model config, Model) of `model.hf_dir` with `model.num_loops` recurrences
  in `model.dtype`, its params put straight into their shards on the run's mesh
  (`mesh`, `sharding.rules`)."""
  m, rules = config.model, tuple(config.sharding.rules)
  mesh = sharding.make_mesh(config.mesh)
  return load.load(
    m.hf_dir, m, load.split(config), m.num_loops, m.dtype, mesh=mesh, rules=rules
  )
