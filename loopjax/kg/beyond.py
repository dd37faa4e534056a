"""A depth-extrapolation run's held-out chains deeper than trained, against
step and inference depth: `plots/depths.png` and `plots/depths.md`.

LTG's claim is that a model trained on chains of up to K hops answers K + 1
to K + 4 given more iterations; a single accuracy at the training depth hides
it (K + 3 is at chance at R = 8 and at 0.5 from R = 10 in the `long` runs).
The curves come from evaluations at every `eval.depths`: those of the
evaluation job that follows training (`--mode=eval --follow`), or the
training loop's if they hold depths.
"""

from etils import epath

from loopjax import metrics, storage
from loopjax.analysis.plots import markdown, plt, save
from loopjax.kg import curriculum
from loopjax.workdir import run_config

BEYOND = 4  # held-out chains to K + 4 hops, the range of LTG's claim


def depth_records(workdir: epath.Path) -> list[dict]:
  """The run's evaluations that hold several depths: the training loop's, or
  else the evaluation job's; [] if none."""
  for where in (workdir, workdir / "eval"):
    if found := [r for r in metrics.read(where) if any("/acc@" in k for k in r)]:
      return found
  return []


def curves(records: list[dict], config) -> dict:
  """{k: {R: {step: accuracy}}} for the held-out chains K + 1..K + 4 hops
  deep at every depth R the evaluations `records` hold."""
  K, R = config.data.train_hops, config.model.num_loops
  out = {}
  for k in range(K + 1, K + BEYOND + 1):
    key = f"eval/test_k{k}/acc"
    at = {R: key} | {
      int(name.rpartition("@")[2]): name
      for name in records[-1]
      if name.startswith(key + "@")
    }
    by_depth = {
      d: {r["step"]: r[at[d]] for r in records if at[d] in r} for d in sorted(at)
    }
    if any(by_depth.values()):
      out[k] = by_depth
  return out


def write(workdir: epath.Path, phases: dict) -> list[epath.Path]:
  """`plots/depths.png` and `plots/depths.md` for a chains run evaluated at
  several depths; nothing else."""
  records = depth_records(workdir)
  if not records:
    return []
  config = run_config(workdir)
  if not (found := curves(records, config)):
    return []
  K = config.data.train_hops
  png = _figure(workdir / "plots" / "depths.png", K, found, phases)
  md = png.with_suffix(".md")
  storage.write_whole(
    md,
    f"Held-out accuracy beyond the trained {K} hops, at the best evaluated "
    "depth R (figure: depths.png).\n\n" + _table(config, found, phases),
  )
  return [png, md]


def _figure(path: epath.Path, K: int, found: dict, phases: dict) -> epath.Path:
  """One panel per k, a line per depth, the curriculum's stages marked."""
  fig, axes = plt.subplots(
    1, len(found), figsize=(4.2 * len(found), 3.8), sharey=True, squeeze=False
  )
  for ax, (k, by_depth) in zip(axes[0], found.items(), strict=True):
    colors = plt.cm.viridis(
      [i / max(1, len(by_depth) - 1) for i in range(len(by_depth))]
    )
    for color, (depth, acc) in zip(colors, by_depth.items(), strict=True):
      ax.plot(
        list(acc), list(acc.values()), "o-", ms=3, color=color, label=f"R = {depth}"
      )
    for phase, step in phases.items():
      ax.axvline(step, color="gray", ls=":", lw=1)
      ax.text(step, 1.02, phase, rotation=90, va="bottom", ha="center", fontsize=7)
    ax.set(xlabel="step", ylim=(0, 1.05))
    ax.set_title(f"k = {k} (K + {k - K})", pad=36)  # above the stages' labels
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("held-out accuracy")
  axes[0][-1].legend(fontsize=7)
  return save(fig, path)


def _table(config, found: dict, phases: dict) -> str:
  """Per evaluated step: the stage, and each k's best accuracy and its R."""
  K, rows = config.data.train_hops, []
  for step in sorted({s for d in found.values() for acc in d.values() for s in acc}):
    cells = [str(step), str(curriculum.stage_at(config, phases, step))]
    for by_depth in found.values():
      at = [(acc[step], -d) for d, acc in by_depth.items() if step in acc]
      best, d = max(at, default=(None, 0))  # ties: the fewest iterations
      cells.append("-" if best is None else f"{best:.3f} (R = {-d})")
    rows.append(cells)
  head = ["step", "stage", *(f"k = {k} (K + {k - K}): best" for k in found)]
  return markdown(head, rows)
