"""What loopjax's command lines share: `--config`, `--workdir`, `--step` and
the multi-process flags (every entry point joins the processes they name:
`processes`); a workdir's own config where none is given; absl's start-up;
and the one boundary where a command line ends: a config file that does not
load, a bad flag, a bad config field and any user error (`ConfigError`) as
one line and exit 2, work that cannot go on (`errors.Stopped`) as one line
and exit 1, a bug with its traceback.

Every `python -m loopjax...` defines its own flags beside these and calls
`run(its_main)` (tests/test_cli.py finds them all and checks).
"""

import contextlib
import difflib
import functools
import os
import sys
import traceback
from pathlib import Path

from absl import app, flags, logging
from etils import epath
from ml_collections import config_flags

from loopjax import config as config_lib
from loopjax import liblog, storage, xla
from loopjax.errors import ConfigError, Stopped, exit_with, first_line
from loopjax.workdir import Workdir

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
  "config", None, "Experiment config file[:variant].", lock_config=True
)
flags.DEFINE_string(
  "workdir", None, "Directory of the run (config, logs, checkpoints)."
)
flags.DEFINE_integer("step", None, "The checkpoint to read (default: the newest).")
flags.DEFINE_bool(
  "distributed",
  False,
  "Join a multi-process run, letting JAX find the cluster (TPU VM slices, "
  "SLURM job steps); launch/tpu.py and launch/slurm.sbatch pass it.",
)
flags.DEFINE_string(
  "coordinator_address",
  None,
  "Multi-process runs elsewhere: host:port of process 0 (with --num_processes "
  "and --process_id; launch/local.py passes them).",
)
flags.DEFINE_integer("num_processes", None, "Multi-process runs: how many.")
flags.DEFINE_integer("process_id", None, "Multi-process runs: this one's index.")
flags.DEFINE_integer(
  "heartbeat_timeout", 60, "Seconds before a silent peer ends the whole run."
)


def _parse(argv):
  try:
    rest = FLAGS(argv)
    if isinstance(FLAGS.config, config_flags.config_flags._ErrorConfig):
      FLAGS.config.lock()  # config_flags defers a failed load: raises it now
    return rest
  except SyntaxError as e:  # the experiment file itself
    exit_with(f"{e.filename}:{e.lineno}: the config file does not parse ({e.msg})")
  except ImportError as e:  # it imports what is not installed
    path = _config_path(argv)
    lines = [
      n
      for frame, n in traceback.walk_tb(e.__traceback__)
      if os.path.abspath(frame.f_code.co_filename) == os.path.abspath(path)
    ]
    where = f"{path}:{lines[-1]}" if lines else path
    exit_with(f"{where}: the config file does not import ({first_line(e)})")
  except OSError as e:
    path = _config_path(argv)
    why = "no such file" if not os.path.exists(path) else first_line(e.__cause__ or e)
    exit_with(f"--config={path}: cannot load the config file ({why})")
  except (flags.Error, ValueError, KeyError, AttributeError) as e:
    if unknown := _unknown_field(argv):
      exit_with(unknown)
    lines = [x for x in str(e).splitlines() if x.strip()] or [repr(e)]
    exit_with(lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}")


def _config_path(argv) -> str:
  """FILE of the command line's `--config=FILE[:variant]`."""
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  return path.split(":", 1)[0]


def _unknown_field(argv) -> str | None:
  """The first `--config.a.b=` naming no field of the loaded config, as the
  line that says so and what is near it (config_flags only says 'b')."""
  given = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
  try:  # the flag holds no value when an override fails: load the file again
    c = FLAGS["config"].parser.parse(given[-1]) if given else None
  except Exception:  # noqa: BLE001 (the original error is the one to report)
    return None
  if not hasattr(c, "keys"):
    return None
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path, node = arg[2:].split("=", 1)[0].split(".")[1:], c
    for i, key in enumerate(path):
      section = ".".join(["config", *path[:i]])
      if not hasattr(node, "keys"):
        return f"--config.{'.'.join(path)}: {section} is a value, not a section"
      if key not in node:
        return f"--{section}.{key}: no such field; {_near(key, list(node), section)}"
      node = node[key]
  return None


def _near(key: str, fields: list[str], section: str) -> str:
  """What `section` has that `key` may have meant: a short section's every
  field, else the few nearest to it and where all are listed."""
  if len(fields) <= 8:
    return f"{section} has: {', '.join(fields)}"
  where = f"base() in {config_lib.base.__module__.replace('.', '/')}.py"
  if close := difflib.get_close_matches(key, fields, n=3, cutoff=0.6):
    return f"did you mean {' or '.join(close)}? (all {len(fields)}: {where})"
  return f"none of {section}'s {len(fields)} fields is near it (all: {where})"


def workdir(argv) -> epath.Path:
  """--workdir, required; no positional arguments. A local path or
  gs://BUCKET/PATH; a bucket that does not exist or answer is one line now."""
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.workdir:
    raise ConfigError("--workdir is required")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  path = storage.path(FLAGS.workdir)
  storage.check_bucket(path, write=False)
  return path


def config(path: epath.Path, training: bool = False):
  """--config validated; but for training, the workdir's own config.json
  where none is given, and a model.init_from run's shapes resolved as its
  training recorded them (training resolves its own)."""
  from loopjax.pretrained import init_from

  c = FLAGS.config
  if c is None and not training:
    c = Workdir(path).saved_config()
  if c is None:
    raise ConfigError(
      "--config is required" + ("" if training else " (or a workdir with config.json)")
    )
  config_lib.validate(c)
  _cache_compiles(c.compile_cache)
  return c if training else init_from.resolve(c)


def _cache_compiles(where: str) -> None:
  """Points JAX's persistent compilation cache at `compile_cache`, so a
  restarted run (a preempted pod's, every resume) reaches its first step
  without compiling again; JAX_COMPILATION_CACHE_DIR, where set, wins."""
  import jax

  if where == "off" or jax.config.jax_compilation_cache_dir:
    return
  home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
  path = storage.path(where, "compile_cache") if where else home / "loopjax" / "xla"
  jax.config.update("jax_compilation_cache_dir", str(path))  # gs:// too


def run(main, own_flags: bool = False) -> None:
  """`main(argv)` as a command line: loopjax's XLA defaults, absl's start-up
  with loopjax's flag parser, and the errors that end it (`ended`).
  `own_flags`: the command line is another parser's (lm-evaluation-harness's):
  absl reads none of it and `main` gets sys.argv whole."""
  xla.apply_defaults()
  if own_flags:
    sys.exit(ended(main)(sys.argv))
  app.run(ended(main), flags_parser=_parse)


def ended(main):
  """`main` whose user error (`ConfigError`) ends the process with its one
  line and exit 2, and whose work that cannot go on (`errors.Stopped`) with
  its one line and exit 1; any other exception is a bug and keeps its
  traceback. The one place a command line turns an error into a line; the
  libraries' restatements of it go to their log (`liblog`), named there."""

  @functools.wraps(main)
  def one_line(argv):
    liblog.divert()  # here: app.run has set up absl's handler
    mark = liblog.writes()
    try:
      return main(argv)
    except ConfigError as e:
      exit_with(first_line(e, limit=2000) + _library_log(mark))
    except Stopped as e:
      exit_with(first_line(e, limit=2000) + _library_log(mark), code=1)

  return one_line


def _library_log(mark: int) -> str:
  """Where the libraries' own reports of the error went, if they made any
  since `mark`."""
  return f" (library log: {where})" if (where := liblog.written(mark)) else ""


@contextlib.contextmanager
def processes():
  """Joins a multi-process run where the flags (or the cluster) say so;
  within, a failed cross-process operation ends this process
  (`leave_if_a_peer_failed`)."""
  import jax

  from loopjax import sharding

  sharding.initialize(
    FLAGS.distributed, FLAGS.coordinator_address, FLAGS.num_processes,
    FLAGS.process_id, FLAGS.heartbeat_timeout,
  )  # fmt: skip
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    leave_if_a_peer_failed(e)
    raise


def leave_if_a_peer_failed(e: Exception) -> None:
  """In a multi-process run, a failed collective means a peer died (or its
  device failed): leave now, as JAX's exit barrier would wait out the
  heartbeat timeout and then abort. In one process, returns (a bug)."""
  import jax

  if jax.process_count() == 1:
    return
  print(
    f"error: process {jax.process_index()}: a cross-process operation failed "
    f"({first_line(e)}); a peer process has probably died. Saved "
    "checkpoints are intact: rerun the same command on all hosts to resume",
    file=sys.stderr,
    flush=True,
  )
  sys.stdout.flush()
  os._exit(1)
