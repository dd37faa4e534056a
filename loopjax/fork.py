"""`checkpoint.fork_from`: a new run that starts from another run's checkpoint
and trains on with other train.* settings; the source run is only read."""

import dataclasses
import json

from loopjax import checkpoint, storage
from loopjax import config as config_lib
from loopjax.errors import ConfigError, first_line
from loopjax.workdir import RESUMABLE, Workdir, conflicts, read_json


@dataclasses.dataclass(frozen=True)
class Fork:
  """`checkpoint.fork_from`: another run's checkpoint a new workdir starts
  from, to train on with other train.* settings (a decaying lr, an
  accelerator) from a point of that run; the other run is only read."""

  source: Workdir
  step: int

  FREE = (*RESUMABLE, "train")  # how it trains on; the model and data stay

  @classmethod
  def source_of(cls, config) -> tuple[Workdir, int | None] | None:
    """(the run `checkpoint.fork_from` names, its step or None for the
    newest), checked before any data is built: a bucket that does not answer
    (one line in seconds), a path that holds no run, a config that differs
    outside FREE."""
    spec = config.checkpoint.fork_from
    if not spec:
      return None
    head, _, tail = spec.rpartition(":")
    field = "checkpoint.fork_from"
    path, step = (head, int(tail)) if head and tail.isdigit() else (spec, None)
    where = storage.path(path, field)
    storage.check_bucket(where, field, write=False)  # before Workdir reads it
    source = Workdir(where)
    if not (source.path / "config.json").is_file():
      raise ConfigError(f"{field}: {source.path} holds no run (no config.json)")
    old = read_json(source.path / "config.json", config_lib.base().to_dict())
    diff = conflicts(old, json.loads(config_lib.to_json(config)), free=cls.FREE)
    if diff:
      raise ConfigError(
        f"{field}: a fork may change train.* only; {source.path} differs in "
        f"{'; '.join(diff[:3])}"
      )
    return source, step

  @classmethod
  def of(cls, config, named: tuple[Workdir, int | None], dataset: dict) -> "Fork":
    """The fork `config` asks for (`named`: what `source_of` returned),
    checked before anything compiles: a run on the same data, with the step."""
    (source, step), field = named, "checkpoint.fork_from"
    if (got := source.fingerprint()) is None:
      raise ConfigError(f"{field}: {source.path} has no dataset.json")
    if got != dataset["fingerprint"]:
      raise ConfigError(f"{field}: {source.path} was trained on other data")
    have = []
    if source.has_checkpoints():
      mngr = source.checkpoints(config.checkpoint, read_only=True)
      have = checkpoint.steps(mngr)  # complete ones, as a resume sees them
      mngr.close()
    if not have or (step is not None and step not in have):
      raise ConfigError(
        f"{field}: {source.checkpoint_dir} has no checkpoint "
        f"{step if step is not None else ''}; it has: {have or 'none'}"
      )
    return cls(source, have[-1] if step is None else step)

  def restore(self, cfg, abstract_state, data_iter):
    """(state, step) of the source's checkpoint, the data iterator moved to it."""
    mngr = self.source.checkpoints(cfg, read_only=True)
    try:
      return checkpoint.restore(
        mngr, abstract_state, data_iter, step=self.step, quarantine=False
      )
    except Exception as e:  # noqa: BLE001 - shown as the one line it is
      raise ConfigError(
        f"checkpoint.fork_from: step {self.step} of {self.source.path} does not "
        f"restore under this config ({first_line(e, 200)}); a fork may change "
        "the optimizer's settings, not its parts"
      ) from None
    finally:
      mngr.close()

  def phases(self) -> dict:
    """{phase: step} the source reached up to the fork's step."""
    return {p: s for p, s in self.source.reached().items() if s <= self.step}
