"""The run directory: what a run keeps there, and the rules for reusing one.

`workdir/` holds `config.json` and `dataset.json` (what the run is), `phases.json`
(the step each named phase was first reached, null until then), `checkpoints/`,
the logs, and the single-writer rule's lock (a disk) or lease (a bucket). A new
config may reuse a workdir only if it differs in RESUMABLE fields; a run on
other data refuses to start; so does a second trainer. Only this module writes
these records, each whole (`storage.write_whole`). The workdir may be a local
path or `gs://BUCKET/PATH` (`storage.path`): one code path for both.
"""

import json
import tempfile

import orbax.checkpoint as ocp
from etils import epath

from loopjax import checkpoint, sharding, storage
from loopjax import config as config_lib
from loopjax.errors import ConfigError, first_line
from loopjax.lease import Exclusive

# Fields that may change when a run resumes: how long and how often, not what.
RESUMABLE = (
  "model.scan_unroll",  # how the loop is compiled, not what it computes
  "model.remat",
  "model.past_depth",  # whether skipped iterations run, not what they compute
  "model.attention",  # which kernel computes attention, not what it is
  "train.num_steps",
  "eval_every",
  "log_every",
  "checkpoint",
  "eval",
  "data.data_dir",
  "data.val_per_hop",  # chains no step trains on (the data fingerprint guards resumes)
  "phases",
  "analyze",
  "mesh",  # a checkpoint restores on any mesh: where the math runs, not what
  "sharding",
  "compile_cache",  # where compiled programs are kept, not what they compute
  "variant",  # a preset's name: the fields it sets are compared one by one
)


def conflicts(
  old: dict, new: dict, prefix: str = "", defaults=None, free=RESUMABLE
) -> list[str]:
  """Fields whose values differ between two config dicts, except `free` ones.

  A field the old run did not have (added to loopjax since) is no conflict when
  the new config leaves it at its default: old runs keep resuming.
  """
  defaults = config_lib.base().to_dict() if defaults is None else defaults
  out = []
  for k in sorted(set(old) | set(new)):
    path = prefix + (k if k.isprintable() else repr(k))  # a key edited in
    if any(path == r or path.startswith(r + ".") for r in free):
      continue
    a, b = old.get(k, "<missing>"), new.get(k, "<missing>")
    d = defaults.get(k, "<missing>") if isinstance(defaults, dict) else "<missing>"
    if isinstance(a, dict) and isinstance(b, dict):
      out += conflicts(a, b, path + ".", d, free)
    elif a != b and not (k not in old and b == d):
      out.append(f"{path}={_short(a)} (workdir) vs {_short(b)} (new)")
  return out


def _short(value, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def read_json(path: epath.Path, like: dict | None = None):
  """A record of the run; one that cannot be read or does not parse (cut
  short by a full disk, edited by hand), or that is not shaped `like` (an
  object, with an object wherever `like` has one), is a ConfigError naming it."""
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(
      f"{path}: not valid JSON ({e.msg}, line {e.lineno}); restore it or move "
      "the workdir away"
    ) from None
  except UnicodeDecodeError:
    raise ConfigError(
      f"{path}: not text (not UTF-8); restore it or move the workdir away"
    ) from None
  except OSError as e:  # missing, a directory, unreadable
    raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
  if like is not None:
    _check_shape(data, like, path)
  return data


def _check_shape(value, like: dict, path: epath.Path, at: str = "") -> None:
  if not isinstance(value, dict):
    raise ConfigError(
      f"{path}: {at[:-1] or 'the file'} must be a JSON object, not "
      f"{type(value).__name__}; restore it or move the workdir away"
    )
  for k, sub in like.items():
    if isinstance(sub, dict) and k in value:
      _check_shape(value[k], sub, path, f"{at}{k}.")


def run_config(path):
  """The config of the run in `path`, read as `Workdir.saved_config` reads
  it, for the readers of finished runs (reports); none is a ConfigError."""
  config = Workdir(path).saved_config()
  if config is None:
    raise ConfigError(f"{path}: no config.json (every loopjax run writes one)")
  return config


def _tuples(value):
  """JSON's lists back to the tuples a config holds, at every depth (a rule's
  mesh axes are a tuple inside a tuple)."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


class Workdir:
  """One run's directory. Reading is safe beside a live trainer; writing
  (`record`, `reach`, the checkpoints) is for the one holding `exclusive`."""

  def __init__(self, path):
    self.path = storage.path(path)
    self._phases = self._read_phases()
    self._exclusive = None

  @property
  def checkpoint_dir(self) -> epath.Path:
    return self.path / "checkpoints"

  def saved_config(self):
    """The run's config.json over base(): fields added to loopjax after the run
    get their defaults. None if there is none yet."""
    saved = self.path / "config.json"
    if not saved.exists():
      return None
    c = config_lib.base()
    c.unlock()
    data = read_json(saved, c.to_dict())
    try:
      config_lib.check_types(data)  # each field by name, before update's own
      c.update(_tuples(data))  # recursive
    except (TypeError, ValueError, KeyError) as e:  # ConfigError among them
      raise ConfigError(
        f"{saved}: does not read as a loopjax config ({first_line(e, 200)}); "
        "restore it or move the workdir away"
      ) from None
    return c

  def check(self, config) -> None:
    """Raises ConfigError if the workdir holds a run with a conflicting config."""
    saved = self.path / "config.json"
    if saved.exists():
      old = read_json(saved, config_lib.base().to_dict())
      diff = conflicts(old, json.loads(config_lib.to_json(config)))
      if diff:
        more = f"; and {len(diff) - 3} more" if len(diff) > 3 else ""
        fork = all(d.startswith("train.") for d in diff)  # e.g. train.param_ema
        raise ConfigError(
          f"--workdir={self.path} holds a run with another config: "
          f"{'; '.join(diff[:3])}{more}. Use a new --workdir"
          + (" (checkpoint.fork_from=DIR trains on from this run)." if fork else ".")
        )
    elif self.has_checkpoints():
      raise ConfigError(
        f"--workdir={self.path} has checkpoints but no config.json; "
        "refusing to touch it. Use a new --workdir."
      )

  def has_checkpoints(self) -> bool:
    """Anything under checkpoints/, committed or not (a run's, to protect)."""
    return self.checkpoint_dir.is_dir() and any(self.checkpoint_dir.iterdir())

  def has_committed(self) -> bool:
    """A step a resume can restore (a save cut short is not one)."""
    return self.has_checkpoints() and bool(
      ocp.path.step.checkpoint_steps(self.checkpoint_dir)
    )

  def check_writable(self, *folders: str) -> None:
    """Fails now, not at the first checkpoint or result, if the workdir (or
    each of its `folders`, made if missing) cannot be written: read-only, a
    file in the way, another user's; a bucket that does not exist or answer."""
    if storage.is_bucket(self.path):  # no folders on a bucket: one probe
      return storage.check_bucket(self.path)
    for where in [self.path / f for f in folders] or [self.path]:
      try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):  # a name no other process has
          pass
      except OSError as e:
        there = "there" if where == self.path else f"in {where}"
        why = "a file is in the way" if isinstance(e, FileExistsError) else None
        raise ConfigError(
          f"--workdir={self.path}: cannot write {there} ({why or e.strerror or e})"
        ) from e

  def exclusive(self, role: str = "train", stale_s: float = 120.0):
    """One trainer (role "train") or one evaluation job ("follow") per
    workdir: a second would interleave checkpoints, logs or evaluations. A
    lock per process on a disk, process 0's lease on a bucket (`lease.py`),
    checked before every save (`fence`)."""
    self._exclusive = Exclusive(self.path, role, stale_s)
    return self._exclusive.held()

  def fence(self) -> None:
    """Before a save: raises LeaseLost, on every process, if this job's lease
    was taken over."""
    if self._exclusive is not None:
      self._exclusive.fence()

  def lost(self) -> bool:
    """Whether this job knows it lost its lease: it writes nothing more."""
    return self._exclusive is not None and self._exclusive.lost()

  def fingerprint(self) -> str | None:
    """The fingerprint of the data the run was trained on (dataset.json);
    None before the run has written it."""
    saved = self.path / "dataset.json"
    if not saved.exists():
      return None
    got = read_json(saved, {}).get("fingerprint")
    if not isinstance(got, str):
      raise ConfigError(
        f"{saved}: has no fingerprint (the data the run was trained on); "
        "restore it or move the workdir away"
      )
    return got

  def check_data(self, dataset: dict) -> None:
    """Raises ConfigError if the workdir's run was trained on other data (a
    changed corpus, tokenizer or generator) than `dataset` (`task.summary()`);
    touches nothing."""
    got = self.fingerprint()
    if got is not None and got != dataset["fingerprint"]:
      raise ConfigError(
        f"--workdir={self.path} was trained on other data (fingerprint "
        f"in {self.path / 'dataset.json'} differs); use a new --workdir"
      )

  def record(self, config, task, phases, dataset: dict, reached=None) -> None:
    """Writes config.json, dataset.json (`dataset`: `task.summary()`) and
    phases.json (each of `phases` null until reached; `reached`: {phase: step}
    already), after `check_data`."""
    self.check_data(dataset)
    sizes, saved = dataset["sizes"], self.path / "dataset.json"
    print(
      f"data: fingerprint {dataset['fingerprint'][:16]}, "
      + ", ".join(f"{k}={n}" for k, n in sizes.items())
    )
    self._phases = dict.fromkeys(phases) | (reached or {}) | self._phases
    if sharding.writes():
      self.path.mkdir(parents=True, exist_ok=True)
      storage.write_whole(self.path / "config.json", config_lib.to_json(config))
      storage.write_whole(saved, json.dumps(dataset, indent=2))
      if (tok := getattr(task, "tokenizer_json", None)) is not None:
        storage.write_whole(self.path / "tokenizer.json", tok)  # sampling reads it
      self._write_phases()

  @property
  def phases(self) -> dict:
    """{phase: first step reached, or None}, in the order they were named."""
    return dict(self._phases)

  def reached(self) -> dict:
    """{phase: step} of the phases reached so far."""
    return {p: s for p, s in self._phases.items() if s is not None}

  def reach(self, names, step: int) -> None:
    """Records that `names` were reached at `step`; their checkpoints are kept."""
    self._phases |= dict.fromkeys(names, step)
    if sharding.writes() and not self.lost():
      self._write_phases()

  def kept_steps(self) -> set[int]:
    return set(self.reached().values())

  def _read_phases(self) -> dict:
    path = self.path / "phases.json"
    return read_json(path, {}) if path.exists() else {}

  def _write_phases(self) -> None:
    storage.write_whole(self.path / "phases.json", json.dumps(self._phases, indent=2))

  def checkpoints(self, cfg, read_only: bool = False) -> ocp.CheckpointManager:
    """The orbax manager of `checkpoints/`: keeps the last `cfg.keep`, every
    `cfg.keep_every`-th step, and the steps of reached phases. `read_only`:
    for readers beside a trainer (evaluation), which create and delete nothing."""
    where = (  # orbax takes absolute paths only
      self.checkpoint_dir
      if storage.is_bucket(self.path)
      else self.checkpoint_dir.absolute()
    )
    if read_only:  # it never saves, so it never deletes either
      options = ocp.CheckpointManagerOptions(create=False)
      return ocp.CheckpointManager(where, options=options)
    cm = ocp.checkpoint_managers
    policies = [checkpoint.LatestGood(self.checkpoint_dir, cfg.keep), _Kept(self)]
    if cfg.keep_every:
      policies.append(cm.EveryNSteps(interval_steps=cfg.keep_every))
    options = ocp.CheckpointManagerOptions(
      preservation_policy=cm.AnyPreservationPolicy(policies),
      enable_async_checkpointing=cfg.async_save,
      create=True,
    )
    return ocp.CheckpointManager(where, options=options)


class _Kept:
  """orbax preservation policy: the workdir's reached phases' steps."""

  def __init__(self, wd: Workdir):
    self.wd = wd

  def should_preserve(self, checkpoints, *, context):
    del context
    steps = self.wd.kept_steps()
    return [c.step in steps for c in checkpoints]
