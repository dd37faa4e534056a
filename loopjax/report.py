"""Figures of a run or a sweep, from the metrics.jsonl the runs wrote.

`--mode=report --workdir=DIR`: if DIR is a run, `DIR/plots/accuracy.png` holds
its accuracy per probe split against step (log axis) with the grokking phase
transitions marked; if DIR holds runs (a sweep root), each run gets its plot and
`DIR/plots/sweep.png` overlays the runs, one panel per split.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from loopjax.analysis import grokking  # noqa: E402
from loopjax.metrics import read_jsonl  # noqa: E402

SPLITS = (
  "train_inferred",
  "test_inferred_id",
  "test_inferred_ood",
  "id_atomic",
  "ood_atomic",
)


def curves(workdir: Path) -> dict:
  """{split: (steps, accuracies)} at the training depth."""
  records = [
    r for r in read_jsonl(workdir / "metrics.jsonl") if "eval/train_inferred/acc" in r
  ]
  return {
    s: ([r["step"] for r in records], [r[f"eval/{s}/acc"] for r in records])
    for s in SPLITS
    if records and f"eval/{s}/acc" in records[0]
  }


def plot_run(workdir: Path) -> Path:
  fig, ax = plt.subplots(figsize=(7, 4))
  for split, (steps, acc) in curves(workdir).items():
    ax.plot(steps, acc, label=split)
  for phase, step in grokking.load(workdir).items():
    ax.axvline(step, color="gray", ls=":", lw=1)
    ax.text(step, 1.02, phase, rotation=90, va="bottom", ha="center", fontsize=7)
  _style(ax, workdir.name)
  return _save(fig, workdir / "plots" / "accuracy.png")


def plot_sweep(root: Path, runs: list[Path]) -> Path:
  fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
  for ax, split in zip(axes, SPLITS[:3], strict=False):
    for run in runs:
      steps, acc = curves(run).get(split, ([], []))
      ax.plot(steps, acc, label=run.name)
    _style(ax, split)
  return _save(fig, root / "plots" / "sweep.png")


def report(path: Path) -> list[Path]:
  """Writes the figures for a run or a sweep root; returns their paths."""
  if (path / "metrics.jsonl").exists():
    return [plot_run(path)]
  runs = sorted(p.parent for p in path.glob("*/metrics.jsonl"))
  if not runs:
    raise FileNotFoundError(f"{path}: no metrics.jsonl in it or its subfolders")
  return [plot_run(r) for r in runs] + [plot_sweep(path, runs)]


def _style(ax, title: str) -> None:
  ax.set(xscale="log", xlabel="step", ylabel="accuracy", ylim=(0, 1.05), title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
