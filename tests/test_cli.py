"""The one boundary of loopjax's command lines (`cli.run`): every
`python -m loopjax...` goes through it, user errors end as one line and exit
2, work that cannot go on as one line and exit 1, bugs keep their traceback."""

import importlib.util
import json
import os
import pkgutil
import subprocess
import sys

import pytest
from conftest import CPU_ENV

import loopjax
from loopjax import cli
from loopjax.errors import ConfigError, Stopped

# Those the walk must find (more may come; each must go through cli.run).
KNOWN = {
  "loopjax.main",
  "loopjax.sample",
  "loopjax.lm_eval",
  "loopjax.lm.harness",
  "loopjax.aot",
  "loopjax.data",
  "loopjax.bench",
}


def _modules(path: str, prefix: str):
  """(name, spec) of every module under `path`, found as the import system
  finds them, none imported."""
  for m in pkgutil.iter_modules([path]):
    name = prefix + m.name
    yield name, m.module_finder.find_spec(name)
    if m.ispkg:
      yield from _modules(os.path.join(path, m.name), f"{name}.")


def entry_points() -> list[str]:
  """What `python -m` runs in loopjax: a package's __main__ (run by the
  package's name), and a module whose top level compares `__name__` with
  "__main__" (read from its compiled code, not its text)."""
  out = []
  for name, spec in _modules(loopjax.__path__[0], "loopjax."):
    code = spec.loader.get_code(name)
    if name.endswith(".__main__"):
      out.append(name.removesuffix(".__main__"))
    elif "__name__" in code.co_names and "__main__" in code.co_consts:
      out.append(name)
  return sorted(out)


# Runs each entry point as `python -m` would (runpy, as __main__) in one
# fresh process, `cli.run` replaced by a recorder and absl's `app.run` by a
# refusal; between modules, the flags each defined are removed (as each runs
# in its own process, two may define one name). Prints {name: what ran}.
_RUN_EACH = """
import json, os, runpy, sys
from unittest import mock
from absl import app, flags
from loopjax import cli

out = {}
for name in sys.argv[1:]:
  calls, before = [], set(flags.FLAGS)
  with (
    mock.patch.object(cli, "run", lambda main, **kw: calls.append(main)),
    mock.patch.object(app, "run", lambda *a, **kw: calls.append("absl app.run")),
    mock.patch.dict(os.environ),
    mock.patch.object(sys, "argv", [name]),
  ):
    ran = runpy.run_module(name, run_name="__main__")
  for flag in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, flag)
  out[name] = [
    "its main" if c is ran.get("main") else getattr(c, "__qualname__", c)
    for c in calls
  ]
print(json.dumps(out))
"""


def test_every_entry_point_runs_its_main_through_cli_run():
  found = entry_points()
  assert KNOWN <= set(found), found
  if importlib.util.find_spec("lm_eval") is None:  # the `lm_eval` extra
    found.remove("loopjax.lm.harness")
  proc = subprocess.run(
    [sys.executable, "-c", _RUN_EACH, *found],
    capture_output=True,
    text=True,
    env=CPU_ENV,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  ran = json.loads(proc.stdout.strip().splitlines()[-1])
  assert ran == {name: ["its main"] for name in found}


def _ended(fn, capsys):
  """(exit code, stderr's lines) of `fn` run as cli.run ends a main."""
  with pytest.raises(SystemExit) as e:
    cli.ended(fn)(["prog"])
  return e.value.code, capsys.readouterr().err.splitlines()


def test_user_errors_are_one_line_and_exit_2_stops_exit_1(capsys):
  def bad_input(argv):
    raise ConfigError("model.d_model: must be >= 1; got 0")

  def stopped(argv):
    raise Stopped("step 3: train/loss is nan; the run stopped")

  def multiline(argv):
    raise ConfigError("first\nsecond")

  assert _ended(bad_input, capsys) == (2, ["error: model.d_model: must be >= 1; got 0"])
  assert _ended(stopped, capsys) == (
    1,
    ["error: step 3: train/loss is nan; the run stopped"],
  )
  assert _ended(multiline, capsys) == (2, ["error: first"])
  assert cli.ended(lambda argv: 3)(["prog"]) == 3  # main's own exit code


def test_a_bug_keeps_its_traceback():
  def bug(argv):
    raise KeyError("a bug")

  with pytest.raises(KeyError, match="a bug"):
    cli.ended(bug)(["prog"])


def test_the_stopped_errors_of_runs_end_as_one_line():
  """What each mode raises when a run cannot go on is a Stopped (exit 1)."""
  from loopjax import follow, lease, passes, train

  for stop in (
    train.RunStopped,
    follow.TrainerStopped,
    lease.LeaseLost,
    passes.CompileFailed,
  ):
    assert issubclass(stop, Stopped), stop


def test_a_user_error_from_its_own_process_is_one_line_and_nothing_else(tmp_path):
  """The refusals tested by the dozen run in the test's process
  (conftest.in_process); here one runs as a user starts it: its stderr is the
  `error:` line alone (no library's output at import or exit), exit 2."""
  proc = subprocess.run(
    [sys.executable, "-m", "loopjax.main", "--config=experiments/sysgen.py:tiny",
     f"--workdir={tmp_path / 'run'}", "--config.model.num_loops=0"],
    capture_output=True, text=True, env=CPU_ENV, timeout=120,
  )  # fmt: skip
  says = "model.num_loops: must be in [1, 4096] (field_rules.MAX_ITERATIONS); got 0"
  assert (proc.returncode, proc.stderr) == (2, f"error: {says}\n")
  assert not (tmp_path / "run").exists()
