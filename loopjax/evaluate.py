"""`--mode=eval`: a checkpoint's accuracy or loss at every `eval.depths`,
written to `eval/step_<N>.json` and printed as a table. The family's
evaluator does the work (kg/evaluate.py, lm/evaluate.py), on the run's mesh:
all devices of all processes, the params sharded as training places them,
each batch split over the devices; process 0 writes and prints."""

import json

import jax
from etils import epath

from loopjax import restore, sharding, storage
from loopjax import task as task_lib
from loopjax.workdir import Workdir


def results(config, task, per_depth: dict, step: int) -> dict:
  """What `eval/step_<N>.json` holds: accuracy and loss per split and depth
  (the evaluator's `per_depth`)."""
  return {
    "step": step,
    "depths": task_lib.for_config(config).eval_depths(config),
    "fingerprint": task.summary()["fingerprint"],
    "splits": per_depth,
  }


def write_results(workdir, report: dict) -> epath.Path:
  out = storage.path(workdir) / "eval" / f"step_{report['step']}.json"
  out.parent.mkdir(exist_ok=True)
  storage.write_whole(out, json.dumps(report, indent=2))
  return out


def evaluate_checkpoint(config, workdir, step: int | None = None) -> dict:
  """Restores a checkpoint (default: the newest good one), writes
  `eval/step_<N>.json` and prints its table."""
  wd = Workdir(workdir)
  wd.check(config)  # a config that conflicts with the run's is refused
  wd.check_writable("eval")  # before the work, not after it
  family, mesh = task_lib.for_config(config), sharding.make_mesh(config.mesh)
  task, model, step = restore.from_checkpoint(config, workdir, step, mesh=mesh)
  placed = jax.tree.map(lambda x: x.sharding, model.params)
  evaluator = family.evaluator(
    config, task, model.graphdef, config.eval.depths, mesh, placed
  )
  report = results(config, task, evaluator.per_depth(model.params)[0], step)
  if not sharding.writes():  # the same report: one writer
    return report
  out = write_results(workdir, report)
  title, depths, rows = family.eval_table(config, report)
  print(title)
  width = max(len(name) for name, _ in rows)
  label = lambda d: f"R={d}" if isinstance(d, int) else d  # noqa: E731
  print(" " * width + "".join(f"{label(d):>8}" for d in depths))
  for name, by_depth in rows:
    print(f"{name:<{width}}" + "".join(f"{by_depth[d]:8.3f}" for d in depths))
  print(f"wrote {out}")
  return report
