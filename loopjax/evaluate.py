"""`--mode=eval`: a checkpoint's accuracy or loss at every `eval.depths`,
written to `eval/step_<N>.json` and printed as a table. The family's
evaluator does the work (kg/evaluate.py, lm/evaluate.py), on the run's mesh:
all devices of all processes, the params sharded as training places them,
each batch split over the devices; process 0 writes and prints. A run that
keeps an EMA of its params (train.param_ema) is evaluated twice: the raw
params, then the EMA's, reported under "ema" beside them."""

import json

import jax
from etils import epath

from loopjax import restore, sharding, storage
from loopjax import task as task_lib
from loopjax.workdir import Workdir


def results(config, task, per_depth: dict, step: int, ema: dict | None = None) -> dict:
  """What `eval/step_<N>.json` holds: accuracy and loss per split and depth
  (the evaluator's `per_depth`), and the params' EMA's (`ema`) if given."""
  return {
    "step": step,
    "depths": task_lib.for_config(config).eval_depths(config),
    "fingerprint": task.summary()["fingerprint"],
    "splits": per_depth,
  } | ({"ema": ema} if ema is not None else {})


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
  family, mesh = task_lib.for_config(config), restore.job_mesh(config)
  task = family.load(config)
  reader = restore.Reader(config, workdir, task, mesh, ema=True)
  try:
    models, step = reader.models(step)
  finally:
    reader.close()
  model = models["params"]
  placed = jax.tree.map(lambda x: x.sharding, model.params)
  evaluator = family.evaluator(
    config, task, model.graphdef, config.eval.depths, mesh, placed
  )
  ema = evaluator.per_depth(models["ema"].params)[0] if "ema" in models else None
  report = results(config, task, evaluator.per_depth(model.params)[0], step, ema)
  if not sharding.writes():  # the same report: one writer
    return report
  out = write_results(workdir, report)
  _print_table(*family.eval_table(config, report))
  if ema is not None:
    title, depths, rows = family.eval_table(config, report | {"splits": ema})
    _print_table(f"EMA of the params (train.param_ema): {title}", depths, rows)
  print(f"wrote {out}")
  return report


def _print_table(title: str, depths: list, rows: list) -> None:
  print(title)
  width = max(len(name) for name, _ in rows)
  label = lambda d: f"R={d}" if isinstance(d, int) else d  # noqa: E731
  print(" " * width + "".join(f"{label(d):>8}" for d in depths))
  for name, by_depth in rows:
    print(f"{name:<{width}}" + "".join(f"{by_depth[d]:8.3f}" for d in depths))
