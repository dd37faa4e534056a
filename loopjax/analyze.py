"""`--mode=analyze`: the analyses `analyze.names` picks (by default the task
family's), on one checkpoint, written under `workdir/analysis` as .json, .md
and .png. Nothing here trains or moves a checkpoint."""

from pathlib import Path

from loopjax import restore
from loopjax import task as task_lib


def analyze(config, workdir, step: int | None = None) -> list[Path]:
  """The analyses of the checkpoint at `step` (default: the newest good one)."""
  workdir = Path(workdir)
  task, model, step = restore.from_checkpoint(config, workdir, step)
  family = task_lib.for_config(config)
  return family.analyze(config, workdir, task, model, step, workdir / "analysis")
