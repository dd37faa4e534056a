"""`--mode=analyze`: the analyses `analyze.names` picks (by default the task
family's), on one checkpoint, written under `workdir/analysis` as .json, .md
and .png (an earlier checkpoint's, `--step=N`, under `analysis/step_N`, so
the newest's stay). Nothing here trains or moves a checkpoint. The checkpoint
is restored onto the run's mesh (all devices of all processes, sharded as
training places it), the analyses' batches split over it; process 0 writes."""

from etils import epath

from loopjax import restore, storage
from loopjax import task as task_lib
from loopjax.workdir import Workdir


def analyze(config, workdir, step: int | None = None) -> list[epath.Path]:
  """The analyses of the checkpoint at `step` (default: the newest good one);
  the paths written (none but in process 0)."""
  workdir, asked = storage.path(workdir), step
  wd = Workdir(workdir)
  wd.check(config)  # a config that conflicts with the run's is refused
  wd.check_writable("analysis")  # before the work, not after it
  mesh = restore.job_mesh(config)  # where this job runs, not where it trained
  task, model, step = restore.from_checkpoint(config, workdir, step, mesh=mesh)
  family = task_lib.for_config(config)
  out = workdir / "analysis" if asked is None else workdir / "analysis" / f"step_{step}"
  return family.analyze(config, workdir, task, model, step, out)
