"""Figures of a run or a sweep, from the records the runs wrote (`metrics.read`).

`--mode=report --workdir=DIR`: if DIR is a run, `DIR/plots/accuracy.png` holds
its accuracy per probe split against step (log axis) with the grokking phase
transitions marked; if DIR holds runs (a sweep root), each run gets its plot and
`DIR/plots/sweep.png` overlays the runs, one panel per split. `DIR/results.md`
tabulates, per run, steps and wall time to each phase and the final accuracies;
a sweep whose runs were `--mode=analyze`d also gets `DIR/ablations.md` and
`DIR/plots/ablations.png` (kg/ablations.py), and a sweep of language
models `DIR/lm_study.md` and `DIR/plots/lm_study.png` (lm/study.py).
k-hop chains runs plot their held-out splits (`test_k<k>`) and mark the steps
where the hop curriculum advanced; evaluated at several depths (`--mode=eval
--follow`), they also get `plots/depths.png` and `plots/depths.md`: the
chains K + 1 to K + 4 hops deep against step at every depth (kg/beyond.py).
Language-model runs get `plots/lm.png`: training and validation loss against
step beside the unigram baseline, and validation loss by number of
iterations at evaluations along the run.
"""

import json
import statistics

from etils import epath

from loopjax import metrics, storage
from loopjax.analysis.plots import plt, save
from loopjax.data.kg import hop_count
from loopjax.kg import ablations, beyond, grokking
from loopjax.lm import study as lm_study
from loopjax.workdir import Workdir, run_config

SPLITS = (
  "train_inferred",
  "test_inferred_id",
  "test_inferred_ood",
  "id_atomic",
  "ood_atomic",
)


def _accs(record: dict) -> list[str]:
  """The splits whose accuracy at the training depth an eval record holds."""
  return [k[5:-4] for k in record if k.startswith("eval/") and k.endswith("/acc")]


def _evals(records: list[dict]) -> list[dict]:
  return [r for r in records if _accs(r)]


LM_LOSS = "eval/validation/loss"


def plot_lm(workdir: epath.Path) -> epath.Path:
  records = metrics.read(workdir)
  train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
  evals = [r for r in records if LM_LOSS in r]
  R = run_config(workdir).model.num_loops  # read before a figure is open
  fig, (ax, by_r) = plt.subplots(1, 2, figsize=(11, 4))
  if train:
    ax.plot(*zip(*train, strict=True), label="train", alpha=0.6)
  if evals:
    ax.plot(
      [r["step"] for r in evals], [r[LM_LOSS] for r in evals], "o-", label="validation"
    )
    if (unigram := evals[-1].get("eval/validation/unigram_loss")) is not None:
      ax.axhline(unigram, color="gray", ls="--", label="unigram")
  ax.set(xscale="log", xlabel="step", ylabel="loss (nats / token)", title=workdir.name)
  picks = (
    evals if len(evals) <= 4 else [evals[i * (len(evals) - 1) // 3] for i in range(4)]
  )
  for r in picks:
    d = sorted(int(k.rpartition("@")[2]) for k in r if k.startswith(LM_LOSS + "@"))
    depths = sorted([*d, R])
    losses = [r[LM_LOSS] if x == R else r[f"{LM_LOSS}@{x}"] for x in depths]
    by_r.plot(depths, losses, "o-", label=f"step {r['step']}")
  by_r.axvline(R, color="gray", ls=":", lw=1)
  by_r.set(
    xlabel="iterations R at evaluation",
    ylabel="validation loss",
    title=f"trained at R = {R}",
  )
  for a in (ax, by_r):
    a.grid(alpha=0.3)
    if a.get_legend_handles_labels()[0]:
      a.legend(fontsize=8)
  return save(fig, workdir / "plots" / "lm.png")


def splits(records: list[dict]) -> list[str]:
  """The splits to plot: composition's probes, or chains' atomic and test_k<k>."""
  keys = list(dict.fromkeys(k for r in _evals(records) for k in _accs(r)))
  composition = [s for s in SPLITS if s in keys]
  chains = sorted(
    (k for k in keys if k.startswith("test_") and hop_count(k)), key=hop_count
  )
  return composition or (["atomic"] if "atomic" in keys else []) + chains


def eval_records(workdir: epath.Path) -> list[dict]:
  """A run's evaluations: the training loop's, or (trained with
  eval_every=0) those of the evaluation job that followed it."""
  return _evals(metrics.read(workdir)) or _evals(metrics.read(workdir / "eval"))


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
    for s in splits(records)
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


def plot_sweep(root: epath.Path, runs: list[epath.Path]) -> epath.Path:
  """Composition: train_inferred, test_inferred_id/ood. Chains: held-out
  chains of the four fewest hop counts (where a curriculum is at work)."""
  names = list(dict.fromkeys(n for run in runs for n in curves(run)))
  tests = [n for n in names if n not in SPLITS and n.startswith("test_")]
  names = tests[:4] if tests else names[:3] or list(SPLITS[:3])  # no eval: empty
  fig, axes = plt.subplots(
    1, len(names), figsize=(4.7 * len(names), 4), sharey=True, squeeze=False
  )
  for ax, split in zip(axes[0], names, strict=True):
    for run in runs:
      steps, acc = curves(run).get(split, ([], []))
      ax.plot(steps, acc, label=run.name)
    _style(ax, split)
  return save(fig, root / "plots" / "sweep.png")


FINAL = (
  "train_inferred/acc",
  "test_inferred_id/acc",
  "test_inferred_ood/acc",
  "test_inferred_ood/acc_given_atomic",
)


def results_row(workdir: epath.Path) -> dict:
  """Steps/s, (step, wall seconds) of each phase, and the last eval's accuracies."""
  records = metrics.read(workdir)
  walls = metrics.wall_times(records)
  rates = [r["train/steps_per_s"] for r in records if "train/steps_per_s" in r]
  evals = eval_records(workdir)
  phases = reached_phases(workdir)
  final = FINAL if evals and "eval/train_inferred/acc" in evals[-1] else None
  if final is None and evals:
    final = tuple(f"{s}/acc" for s in splits(evals))
  lm = [r for r in records if LM_LOSS in r]
  if lm:
    evals, final = lm, ("validation/loss", "validation/unigram_loss", "validation/ppl")
  return {
    "run": workdir.name,
    "steps": max((r["step"] for r in records), default=0),
    "wall_s": max(walls.values(), default=None),
    "steps_per_s": statistics.median(rates) if rates else None,
    "phases": {p: (s, walls.get(s)) for p, s in phases.items()},
    "final": {k: evals[-1].get(f"eval/{k}") for k in final} if evals else {},
  }


def results_table(rows: list[dict]) -> str:
  """Markdown: one line per run (phase cells: step / wall time). Chains runs'
  phases are the curriculum stages; their finals, each split's accuracy."""
  final = list(dict.fromkeys(k for r in rows for k in r["final"]))
  phases = list(grokking.PHASES) if any(k in FINAL for k in final) else []
  phases += sorted(
    {p for r in rows for p in r["phases"] if p not in grokking.PHASES},
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
    runs, figures = [path], _plot(path)
  else:
    runs = sorted(p for p in path.iterdir() if _is_run(p)) if path.is_dir() else []
    if not runs:
      raise FileNotFoundError(
        f"{path}: no loopjax run's records (metrics/) in it or its subfolders"
      )
    Workdir(path).check_writable("", "plots")
    for run in runs:
      Workdir(run).check_writable("plots")
    figures = [f for r in runs for f in _plot(r)] + [plot_sweep(path, runs)]
    kg = [r for r in runs if not lm_study.is_lm(r)]
    figures += ablations.write(path, kg) + lm_study.write(path, runs)
  table = path / "results.md"
  storage.write_whole(table, results_table([results_row(r) for r in runs]))
  return [*figures, table]


def _plot(workdir: epath.Path) -> list[epath.Path]:
  """A run's figures: a language model's losses, else accuracies (and, for
  chains evaluated at several depths, those beyond the trained hops)."""
  if any(LM_LOSS in r for r in metrics.read(workdir)):
    return [plot_lm(workdir)]
  return [plot_run(workdir), *beyond.write(workdir, reached_phases(workdir))]


def _style(ax, title: str) -> None:
  ax.set(xscale="log", xlabel="step", ylabel="accuracy", ylim=(0, 1.05), title=title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:  # a run without evals has no lines
    ax.legend(fontsize=8)
