"""Runs an experiment's sweep locally: one workdir per point, named by its overrides.

  python launch/sweep.py --config=experiments/sysgen.py[:variant] --root=runs/sweep \
      [--sweep=NAME] [--parallel=2] [--analyze] [--until=PHASE] [--dry-run] \
      [-- extra main flags]
  python launch/sweep.py ... --target=slurm --launcher_args='--nodes=2 --per=node'
  python launch/sweep.py ... --target=tpu --launcher_args='--name=NAME --zone=ZONE'

`sweep(name)` in the experiment file returns a list of {field: value} overrides
(`--sweep` picks which of the file's sweeps; default its first); run k of it
trains in `<root>/<field=value,...>`. With --parallel=N, N runs go at
once, each pinned to its own core; when one ends, the next run takes its core
(on 2 cores two pinned runs finish a sweep ~1.36x sooner than one run after
another: docs/performance.md). On a GPU or TPU host they share its
accelerator, each allowed 1/N of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION,
unless set): JAX would give the first run 75% of it and the next would fail
to allocate. With --analyze each run is `--mode=analyze`d
once it has trained (same flags, same core). A rerun resumes or skips
finished runs, since each run resumes from its own workdir. `--target=slurm`
submits one job per point (launch/slurm.py, job name = run name);
`--target=tpu` runs the points one after another on a TPU slice
(launch/tpu.py; the checkout is installed once). `--launcher_args` holds that
launcher's flags. `--until=PHASE` (a name of `config.phases`, e.g. ood)
stops each run once its phases.json records that phase (SIGTERM: the run
saves and exits as when preempted) and skips runs that have it: time to
grok, measured without training on past it.
"""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import slurm, tpu  # noqa: E402


def load_sweep(config_arg: str, name: str | None = None) -> list[dict]:
  path = config_arg.split(":", 1)[0]
  # Experiment files import each other as `experiments.<name>` (as loopjax.main
  # run from the repository root sees them).
  sys.path.insert(0, str(Path(path).resolve().parent.parent))
  spec = importlib.util.spec_from_file_location("experiment", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "sweep"):
    sys.exit(f"error: {path} defines no sweep()")
  try:
    return module.sweep() if name is None else module.sweep(name)
  except ValueError as e:
    sys.exit(f"error: --sweep: {e}")


def run_name(overrides: dict, fields=()) -> str:
  """`field=value,...` by the fields' last names, or their full names where
  two of `fields` (the sweep's) share one (`seed`, `data.seed`): distinct
  points, distinct workdirs. `default` for no overrides."""
  last = [f.split(".")[-1] for f in {*fields, *overrides}]

  def label(k):
    short = k.split(".")[-1]
    return short if last.count(short) == 1 else k

  return ",".join(f"{label(k)}={v}" for k, v in overrides.items()) or "default"


def commands(
  config_arg: str,
  root: Path,
  extra: list[str],
  name: str | None = None,
  analyze: bool = False,
) -> list[tuple[str, list[list[str]]]]:
  """(run name, the commands it runs one after another) per sweep point."""
  out = []
  points = load_sweep(config_arg, name)
  fields = {k for overrides in points for k in overrides}
  for overrides in points:
    name = run_name(overrides, fields)
    cmd = [
      sys.executable,
      "-m",
      "loopjax.main",
      f"--config={config_arg}",
      f"--workdir={root / name}",
      *extra,
      *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]
    out.append((name, [cmd, [*cmd, "--mode=analyze"]] if analyze else [cmd]))
  return out


def _shell(cmds: list[list[str]]) -> list[str]:
  """One command running `cmds` in turn, stopping at the first that fails."""
  return cmds[0] if len(cmds) == 1 else ["sh", "-c", " && ".join(map(shlex.join, cmds))]


def main(argv=None) -> int:
  p = slurm.Parser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--root", required=True, type=Path)
  p.add_argument("--sweep", default=None, help="which sweep of the file")
  p.add_argument("--parallel", type=int, default=1)
  p.add_argument("--analyze", action="store_true", help="then --mode=analyze")
  p.add_argument("--target", choices=("local", "slurm", "tpu"), default="local")
  p.add_argument("--launcher_args", default="", help="slurm.py / tpu.py flags")
  p.add_argument("--until", default=None, help="stop each run at this phase")
  p.add_argument("--dry-run", action="store_true")
  args, extra = p.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  runs = commands(args.config, args.root, extra, args.sweep, args.analyze)
  if args.target != "local":
    return remote(args, runs)
  if args.dry_run:
    for _, cmds in runs:
      print(" && ".join(map(shlex.join, cmds)))
    return 0
  args.root.mkdir(parents=True, exist_ok=True)
  cores = sorted(os.sched_getaffinity(0))
  free = [cores[i % len(cores)] for i in range(args.parallel)]
  failed, active = [], []
  for name, cmds in runs:
    cmd = _shell(cmds)
    if args.until and reached(args.root / name, args.until):
      print(f"skipped {name} ({args.until} reached)")
      continue
    if len(active) == args.parallel:  # the next run takes the first core to free
      done = _wait_any(active, args.root, args.until)
      failed += _wait(done)
      active.remove(done)
      free.append(done[3])
    core = free.pop(0) if args.parallel > 1 else None
    log = open(args.root / f"{name}.log", "a")
    proc = subprocess.Popen(
      cmd if core is None else _pinned(cmd, core),
      stdout=log,
      stderr=subprocess.STDOUT,
      env=shared_accelerator_env(args.parallel),
    )
    print(f"started {name} (pid {proc.pid}{'' if core is None else f', core {core}'})")
    active.append((name, proc, log, core))
  for job in active:
    failed += _wait(job, args.root, args.until)
  print(
    f"{len(runs) - len(failed)} of {len(runs)} runs finished in {args.root}"
    + (f"; failed: {', '.join(failed)} (see their .log)" if failed else "")
  )
  return 1 if failed else 0


def remote(args, runs) -> int:
  """Each point's training command through the SLURM or TPU launcher."""
  if args.analyze:
    sys.exit("error: --analyze: with --target=local only (analyze afterwards)")
  launcher = slurm if args.target == "slurm" else tpu
  largs = launcher.parser().parse_args(
    shlex.split(args.launcher_args) + (["--dry-run"] if args.dry_run else [])
  )
  for i, (name, cmds) in enumerate(runs):
    main_args = cmds[0][3:]  # after python -m loopjax.main
    if launcher is slurm:
      largs.job_name = name
      rc = slurm.submit(largs, main_args)
    else:
      largs.skip_install = largs.skip_install or i > 0
      rc = tpu.launch(largs, main_args)
    if rc:
      return rc
  return 0


def shared_accelerator_env(parallel: int) -> dict:
  """This environment, with N parallel runs each allowed 1/N of an
  accelerator's memory (a fraction already set wins; 0.9 leaves XLA room)."""
  env = dict(os.environ)
  if parallel > 1:
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
  return env


def _pinned(cmd: list, core: int) -> list:
  """`cmd` pinned to one core: a tiny Python sets its affinity, then execs `cmd`
  (affinity survives exec; this process, which may hold threads, never forks)."""
  pin = (
    "import os, sys; os.sched_setaffinity(0, {%d}); "
    "os.execvp(sys.argv[1], sys.argv[1:])"  # p: a command on PATH (sh) too
  )
  return [sys.executable, "-c", pin % core, *cmd]


def reached(workdir: Path, phase: str) -> bool:
  """Whether the run in `workdir` has recorded `phase` (phases.json)."""
  try:
    return json.loads((workdir / "phases.json").read_text()).get(phase) is not None
  except (OSError, ValueError):
    return False


_stopped: set[int] = set()  # pids sent SIGTERM by --until (once each)


def _wait_any(active: list, root=None, until=None, poll_s: float = 1.0):
  """The first of the running jobs to finish; with `until`, a job whose run
  reached that phase is sent SIGTERM (it saves and exits)."""
  while True:
    for job in active:
      if job[1].poll() is not None:
        return job
      if until and job[1].pid not in _stopped and reached(root / job[0], until):
        job[1].terminate()
        _stopped.add(job[1].pid)
    time.sleep(poll_s)


def _wait(job, root=None, until=None) -> list[str]:
  if until:
    _wait_any([job], root, until)
  name, proc, log, _ = job
  proc.wait()
  log.close()
  return [] if proc.returncode == 0 else [name]


if __name__ == "__main__":
  sys.exit(main())
