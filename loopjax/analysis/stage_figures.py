"""The stages-of-inference figure, table and summary (`stages.py`'s results;
its record: lm/analyses.py)."""

import numpy as np
from etils import epath

from loopjax.analysis.mechanistic_tables import main_result
from loopjax.analysis.plots import markdown, plt, save

PANELS = (
  ("sink_rate", "attention-sink rate", False),
  ("top_share", "ColSum top share", False),
  ("colsum_concentration", "ColSum concentration C\n(dashed: uniform)", False),
  ("first_ratio", "first-token norm / median", True),
  ("massive_ratio", "max |h| / median |h|", True),
  ("entropy", "matrix entropy (normalized)", False),
  ("lens_loss", "logit-lens loss (nats)", False),
)


def plot(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Every statistic against effective depth in one column of panels; shaded
  bands mark every other iteration of the core (darker: within the trained R)."""
  split, res = main_result(report, "stages")
  rows = res["positions"]
  x = np.arange(len(rows))
  fig, axes = plt.subplots(
    len(PANELS), 1, figsize=(min(max(8, len(rows) * 0.18), 24), 13), sharex=True
  )
  trained = report["train_depths"][-1]
  for ax, (stat, label, log) in zip(axes, PANELS, strict=True):
    y = np.asarray([np.nan if r[stat] is None else r[stat] for r in rows], float)
    ax.plot(x, y, marker=".", lw=1)
    if stat == "colsum_concentration":  # what uniform causal attention gives
      ax.axhline(res["colsum_uniform"], ls="--", lw=1, color="gray")
    for r in range(1, res["num_loops"] + 1):
      at = [i for i, row in enumerate(rows) if row["label"].startswith(f"r{r} ")]
      shade = 0.12 if r <= trained else 0.05
      if r % 2:
        ax.axvspan(at[0] - 0.5, at[-1] + 0.5, color="tab:blue", alpha=shade, lw=0)
    ax.set_ylabel(label, fontsize=8)
    if log:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
  axes[0].set_ylim(-0.05, 1.05)  # a share of heads
  step = max(1, len(rows) // 40)
  axes[-1].set_xticks(
    x[::step], [r["label"] for r in rows][::step], rotation=90, fontsize=7
  )
  axes[-1].set_xlabel("effective depth (embedding, prelude, iteration r layer l, coda)")
  fig.suptitle(
    f"stages of inference, {split} ({report['windows']} windows of "
    f"{report['seq_len']}), step {report['step']}; shaded: odd iterations"
  )
  return [save(fig, out_dir / "stages.png")]


def table(report: dict) -> str:
  """One row per depth position, and the repetition (eta squared) per statistic."""
  split, res = main_result(report, "stages")
  stats = [p[0] for p in PANELS]
  head = ["position", *stats]
  body = [
    [r["label"], *("-" if r[k] is None else f"{r[k]:.3g}" for k in stats)]
    for r in res["positions"]
  ]
  trained = res.get("trained_loops")
  for key, label in (
    ("repetition", f"repetition (eta^2), iterations 2-{trained}"),
    ("repetition_past", f"repetition past R = {trained}"),
  ):
    rep = res.get(key, {})
    body.append(
      [label, *("-" if rep.get(k) is None else f"{rep[k]:.2f}" for k in stats)]
    )
  mem = res["memory"]
  return (
    markdown(head, body)
    + f"\nSink threshold {res['threshold']}; {split}. Memory of the pass at batch "
    f"{mem['batch']} and {mem['iterations']} iterations: "
    f"{mem['temp_bytes'] / 2**20:.1f} MiB temporary; every attention weight "
    f"stacked would take {mem['attention_all_iterations_bytes'] / 2**20:.1f} MiB "
    f"(one iteration's: {mem['attention_one_iteration_bytes'] / 2**20:.1f} MiB).\n"
  )


def summary(report: dict) -> str:
  _, res = main_result(report, "stages")
  core = [r for r in res["positions"] if r["iteration"] and r["label"][0] == "r"]
  best = max(core, key=lambda r: r["massive_ratio"])
  rep = res["repetition"]["massive_ratio"]
  past = res.get("repetition_past", {}).get("massive_ratio")
  return (
    f"sink rate up to {max(r['sink_rate'] for r in core):.2f}, max/median |h| up to "
    f"{best['massive_ratio']:.0f} ({best['label']}), repetition of it "
    + ("-" if rep is None else f"{rep:.2f}")
    + " within the trained R, "
    + ("-" if past is None else f"{past:.2f}")
    + " past it"
  )


def compare(report: dict, baseline: dict, out_dir: epath.Path) -> list[epath.Path]:
  """The looped model's statistics and a feedforward baseline's (MECH: the
  block repeats the feedforward stages in every iteration) against depth as
  a share of each model's own (0: embedding, 1: last layer)."""
  (_, looped), (_, feedforward) = (
    main_result(report, "stages"),
    main_result(baseline, "stages"),
  )
  fig, axes = plt.subplots(len(PANELS), 1, figsize=(9, 13), sharex=True)
  for ax, (stat, label, log) in zip(axes, PANELS, strict=True):
    for res, name in ((looped, "looped"), (feedforward, "feedforward baseline")):
      rows = res["positions"]
      y = np.asarray([np.nan if r[stat] is None else r[stat] for r in rows], float)
      ax.plot(np.linspace(0, 1, len(rows)), y, marker=".", lw=1, label=name)
    ax.set_ylabel(label, fontsize=8)
    if log:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  axes[-1].set_xlabel("depth / the model's depth (looped: every iteration's layers)")
  fig.suptitle(
    f"stages of inference: looped ({looped['num_loops']} x {looped['num_layers']} "
    f"core layers) vs feedforward ({feedforward['num_layers']} layers)"
  )
  return [save(fig, out_dir / "stages_vs_baseline.png")]
