"""Figures of a run or a sweep, from the records the runs wrote (`metrics.read`).

`--mode=report --workdir=DIR`: if DIR is a run, its figures go under
`DIR/plots/`; if DIR holds runs (a sweep root), each run gets its figures and
`DIR/plots/sweep.png` overlays the runs' accuracy curves, one panel per
split. `DIR/results.md` tabulates, per run, steps and wall time to each phase
and the final metrics.

What differs by task family is the family's own (`Parts`, named by its
`task.Spec.report`): which splits it plots, its figures of a run, the final
metrics, the phases shown first, a sweep's extra tables. This module knows
no family: a run's family is its config.json's `data.task`, or for a run
without one, the first registered family whose records it claims.
"""

import dataclasses
import functools
import json
import statistics
from collections.abc import Callable

from etils import epath

from loopjax import metrics, storage, task
from loopjax.analysis.plots import plt, save
from loopjax.names import imported
from loopjax.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class Parts:
  """A family's part of a report; `task.Spec.report` names it ("module:ATTR")."""

  claims: Callable[[list[dict]], bool]  # records -> whether they are its run's
  plots: Callable[[epath.Path], list[epath.Path]]  # a run's figures
  # (records, eval records) -> (the records results.md reads, their metric keys)
  final: Callable[[list[dict], list[dict]], tuple[list[dict], tuple]]
  splits: Callable[[list[dict]], list[str]] = lambda records: []  # accuracy curves
  panels: Callable[[list[str]], list[str]] = lambda names: []  # sweep.png's splits
  phases: Callable[[tuple], tuple[str, ...]] = lambda final: ()  # shown first
  # (sweep root, its runs of this family) -> the extra files written
  sweep: Callable[[epath.Path, list[epath.Path]], list[epath.Path]] | None = None


@functools.cache
def _family_parts(name: str) -> Parts:
  return imported(task.spec(name).report)


def parts(workdir: epath.Path) -> Parts:
  """The report parts of the run in `workdir` (see the module docstring)."""
  config = Workdir(workdir).saved_config()
  if config is not None:
    return _family_parts(config.data.task)
  records = metrics.read(workdir)
  found = (_family_parts(n) for n in task.FAMILIES if task.spec(n).report)
  first = _family_parts(next(n for n in task.FAMILIES if task.spec(n).report))
  return next((p for p in found if p.claims(records)), first)


def accs(record: dict) -> list[str]:
  """The splits whose accuracy at the training depth an eval record holds."""
  return [k[5:-4] for k in record if k.startswith("eval/") and k.endswith("/acc")]


def evals(records: list[dict]) -> list[dict]:
  return [r for r in records if accs(r)]


def eval_records(workdir: epath.Path) -> list[dict]:
  """A run's evaluations: the training loop's, or (trained with
  eval_every=0) those of the evaluation job that followed it."""
  return evals(metrics.read(workdir)) or evals(metrics.read(workdir / "eval"))


def reached_phases(workdir: epath.Path) -> dict:
  """{phase: step}: the training loop's phases.json, or the evaluation job's."""
  if reached := Workdir(workdir).reached():
    return reached
  job = workdir / "eval" / "phases.json"
  found = json.loads(job.read_text()) if job.exists() else {}
  return {p: s for p, s in found.items() if s is not None}


def curves(workdir: epath.Path) -> dict:
  """{split: (steps, accuracies)} at the training depth."""
  records = eval_records(workdir)
  if not records:
    return {}
  return {
    s: ([r["step"] for r in records], [r[f"eval/{s}/acc"] for r in records])
    for s in parts(workdir).splits(records)
  }


def plot_run(workdir: epath.Path) -> epath.Path:
  fig, ax = plt.subplots(figsize=(7, 4))
  for split, (steps, acc) in curves(workdir).items():
    ax.plot(steps, acc, label=split)
  for phase, step in reached_phases(workdir).items():
    ax.axvline(step, color="gray", ls=":", lw=1)
    ax.text(step, 1.02, phase, rotation=90, va="bottom", ha="center", fontsize=7)
  _style(ax, workdir.name)
  return save(fig, workdir / "plots" / "accuracy.png")


def plot_sweep(root: epath.Path, runs: list[epath.Path]) -> list[epath.Path]:
  """The runs' accuracy curves overlaid, on the panels the first run's family
  picks; none where it plots no accuracies (a language model's sweep)."""
  names = list(dict.fromkeys(n for run in runs for n in curves(run)))
  names = parts(runs[0]).panels(names)
  if not names:
    return []
  fig, axes = plt.subplots(
    1, len(names), figsize=(4.7 * len(names), 4), sharey=True, squeeze=False
  )
  for ax, split in zip(axes[0], names, strict=True):
    for run in runs:
      steps, acc = curves(run).get(split, ([], []))
      ax.plot(steps, acc, label=run.name)
    _style(ax, split)
  return [save(fig, root / "plots" / "sweep.png")]


def results_row(workdir: epath.Path) -> dict:
  """Steps/s, (step, wall seconds) of each phase, and the final metrics the
  run's family picks (of its last evaluation)."""
  records = metrics.read(workdir)
  walls = metrics.wall_times(records)
  rates = [r["train/steps_per_s"] for r in records if "train/steps_per_s" in r]
  family = parts(workdir)
  evaluated, final = family.final(records, eval_records(workdir))
  phases = reached_phases(workdir)
  return {
    "run": workdir.name,
    "steps": max((r["step"] for r in records), default=0),
    "wall_s": max(walls.values(), default=None),
    "steps_per_s": statistics.median(rates) if rates else None,
    "phases": {p: (s, walls.get(s)) for p, s in phases.items()},
    "first_phases": family.phases(final),
    "final": {k: evaluated[-1].get(f"eval/{k}") for k in final} if evaluated else {},
  }


def results_table(rows: list[dict]) -> str:
  """Markdown: one line per run (phase cells: step / wall time): the phases
  the runs' families show first, then the others by their number (a
  curriculum's stages)."""
  final = list(dict.fromkeys(k for r in rows for k in r["final"]))
  phases = list(dict.fromkeys(p for r in rows for p in r.get("first_phases", ())))
  phases += sorted(
    {p for r in rows for p in r["phases"] if p not in phases},
    key=lambda p: int(p.rpartition("_")[2]) if p[-1].isdigit() else 0,
  )
  head = ["run", "steps", "wall", "steps/s", *phases, *final]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r["run"], str(r["steps"]), _dur(r["wall_s"]), _num(r["steps_per_s"], 0)]
    for p in phases:
      step, wall = r["phases"].get(p, (None, None))
      cells.append("not reached" if step is None else f"{step} / {_dur(wall)}")
    cells += [_num(r["final"].get(k), 3) for k in final]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _dur(seconds) -> str:
  if seconds is None:
    return "-"
  return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _num(x, digits: int) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def _is_run(path: epath.Path) -> bool:
  """Whether `path` holds a run's records (a trainer writes its first one as
  it starts; a pretrained model's analysis folder has none)."""
  return metrics.Log(path).exists()


def report(path) -> list[epath.Path]:
  """Writes the figures and results.md for a run or a sweep root (a local
  path or gs://); returns paths."""
  path = storage.path(path)
  with metrics.cached():  # each run's records read once, by every figure
    return _report(path)


def _report(path: epath.Path) -> list[epath.Path]:
  if _is_run(path):
    Workdir(path).check_writable("", "plots")  # before the work, not after it
    runs, figures = [path], parts(path).plots(path)
  else:
    runs = sorted(p for p in path.iterdir() if _is_run(p)) if path.is_dir() else []
    if not runs:
      raise FileNotFoundError(
        f"{path}: no loopjax run's records (metrics/) in it or its subfolders"
      )
    Workdir(path).check_writable("", "plots")
    for run in runs:
      Workdir(run).check_writable("plots")
    figures = [f for r in runs for f in parts(r).plots(r)] + plot_sweep(path, runs)
    by_family: dict[Parts, list[epath.Path]] = {}
    for run in runs:
      by_family.setdefault(parts(run), []).append(run)
    for family, theirs in by_family.items():
      figures += family.sweep(path, theirs) if family.sweep else []
  table = path / "results.md"
  storage.write_whole(table, results_table([results_row(r) for r in runs]))
  return [*figures, table]


def _style(ax, title: str) -> None:
  ax.set(xscale="log", xlabel="step", ylabel="accuracy", ylim=(0, 1.05), title=title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # a run without evals has no lines
    ax.legend(fontsize=8)
