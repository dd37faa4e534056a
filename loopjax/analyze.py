"""`--mode=analyze`: the analyses `analyze.names` picks (by default the task
family's), on one checkpoint, written under `workdir/analysis` as .json, .md
and .png (an earlier checkpoint's, `--step=N`, under `analysis/step_N`, so
the newest's stay). Nothing here trains or moves a checkpoint."""

from pathlib import Path

from loopjax import restore
from loopjax import task as task_lib
from loopjax.workdir import Workdir


def analyze(config, workdir, step: int | None = None) -> list[Path]:
  """The analyses of the checkpoint at `step` (default: the newest good one)."""
  workdir, asked = Path(workdir), step
  Workdir(workdir).check_writable("analysis")  # before the work, not after it
  task, model, step = restore.from_checkpoint(config, workdir, step)
  family = task_lib.for_config(config)
  out = workdir / "analysis" if asked is None else workdir / "analysis" / f"step_{step}"
  return family.analyze(config, workdir, task, model, step, out)
