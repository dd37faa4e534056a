"""The from-scratch study's table and figure: a sweep of analyzed LM runs.

Per run (config.json names the variant; `--mode=analyze` wrote
`analysis/{fixed_points,stages}.json`): the factors (injection, norm
placement, L x R), validation loss at R, 2R and 4R iterations and the best
iteration count (the last in-loop evaluation), whether the core reaches a
(cyclic) fixed point and by which iteration, the attention-sink rate and
massive-activation ratio and ColSum concentration (beside uniform
attention's) of the first iteration's layers and of the last trained
iteration's, whether the stages repeat per iteration (eta squared of the
massive-activation ratio and of the sink mass over the core's layers) within
the trained recurrence and past it, and wall time.
"""

import json

import numpy as np
from etils import epath

from loopjax import metrics
from loopjax.analysis import mechanistic_tables
from loopjax.analysis.plots import markdown, plt, save, write_sweep_report
from loopjax.workdir import run_config

COLUMNS = (
  "run",
  "injection",
  "norm",
  "L x R",
  "loss @R",
  "@2R",
  "@4R",
  "best (iterations)",
  "fixed point (converged at; last layer's read change at the last iteration)",
  "settled (MECH: within tol of the last iterate), per layer",
  "sink rate: iter 1 / R (max over layers)",
  "ColSum C: iter 1 / R (max over layers; uniform)",
  "max/median |h|: iter 1 / R (max over layers)",
  "first-token norm ratio: iter 1 / R (max over layers)",
  "stages repeat (eta^2: massive, sink): within R; past R",
  "wall",
)


def is_lm(run: epath.Path) -> bool:
  """Whether the run is a language model's (a run without config.json is not)."""
  return (run / "config.json").exists() and run_config(run).data.task == "lm"


def _analysis(run: epath.Path, name: str) -> dict | None:
  path = run / "analysis" / f"{name}.json"
  return json.loads(path.read_text())[name]["validation"] if path.exists() else None


def losses(run: epath.Path) -> dict[int, float]:
  """{iterations: validation loss} of the run's last in-loop evaluation."""
  records = [r for r in metrics.read(run) if "eval/validation/loss" in r]
  if not records:
    return {}
  last, R = records[-1], run_config(run).model.num_loops
  out = {R: last["eval/validation/loss"]}
  out |= {int(k.split("@")[1]): v for k, v in last.items() if "validation/loss@" in k}
  return dict(sorted(out.items()))


def row(run: epath.Path) -> dict:
  cfg = run_config(run).model
  R, L = cfg.num_loops, cfg.num_layers
  out = {"run": run.name, "L": L, "R": R, "injection": cfg.injection}
  out["norm"] = cfg.norm_position
  out["loss"] = losses(run)
  out["wall_s"] = max(metrics.wall_times(metrics.read(run)).values(), default=None)
  fp = _analysis(run, "fixed_points")
  if fp:
    out["kind"] = fp["kind"]
    out["converged_at"] = [x["converged_at"] for x in fp["layers"]]
    out["settled_at"] = [x.get("settled_at") for x in fp["layers"]]
    out["change"] = fp["layers"][-1]["change"]
  st = _analysis(run, "stages")
  if st:
    core = [p for p in st["positions"] if p["label"][0] == "r"]
    out["core"] = core

    def at(r, stat):  # the largest over iteration r's layers (None: not traced)
      return max((p[stat] for p in core if p["iteration"] == r), default=None)

    for stat in ("sink_rate", "massive_ratio", "first_ratio", "colsum_concentration"):
      out[stat] = (at(1, stat), at(R, stat))
    out["colsum_uniform"] = st.get("colsum_uniform")
    out["repeat"] = [
      (st[k]["massive_ratio"], st[k]["sink_mass"])
      for k in ("repetition", "repetition_past")
      if k in st
    ]
  return out


def _num(x, fmt=".2f") -> str:
  return "-" if x is None else f"{x:{fmt}}"


def table(rows: list[dict]) -> str:
  lines = []
  for r in rows:
    loss, R = r["loss"], r["R"]
    best = min(loss, key=loss.get) if loss else None
    conv = r.get("converged_at")

    def pair(stat, fmt=".2f", r=r):  # iteration 1 / R
      return " / ".join(_num(v, fmt) for v in r[stat]) if stat in r else "-"

    lines.append(
      [
        r["run"],
        r["injection"],
        r["norm"],
        f"{r['L']} x {R}",
        *(_num(loss.get(k * R), ".3f") for k in (1, 2, 4)),
        f"{loss[best]:.3f} ({best})" if best else "-",
        mechanistic_tables.fixed_cell(r) if conv else "-",
        " / ".join(str(x or "-") for x in r.get("settled_at", [])) or "-",
        pair("sink_rate"),
        pair("colsum_concentration") + f" ({_num(r.get('colsum_uniform'))})"
        if "colsum_concentration" in r
        else "-",
        pair("massive_ratio", ".1f"),
        pair("first_ratio"),
        "; ".join(" / ".join(_num(v) for v in x) for x in r.get("repeat", [])) or "-",
        "-" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min",
      ]
    )
  return markdown(list(COLUMNS), lines)


def figure(rows: list[dict], path: epath.Path) -> epath.Path:
  """Loss against iterations relative to the trained R; the last layer's
  read-state change per iteration; the massive-activation ratio and sink mass
  along the core's layer applications."""
  fig, axes = plt.subplots(2, 2, figsize=(14, 9))
  for r in rows:
    if r["loss"]:
      d = np.asarray(list(r["loss"]))
      axes[0, 0].plot(d / r["R"], list(r["loss"].values()), label=r["run"])
    if "change" in r:
      axes[0, 1].plot(np.arange(1, len(r["change"]) + 1), r["change"], label=r["run"])
    if "core" in r:
      x = np.arange(1, len(r["core"]) + 1)
      axes[1, 0].plot(x, [p["massive_ratio"] for p in r["core"]], lw=1, label=r["run"])
      axes[1, 1].plot(x, [p["sink_mass"] for p in r["core"]], lw=1, label=r["run"])
  axes[0, 0].axvline(1, color="gray", ls=":", lw=1)
  axes[0, 0].set(
    xscale="log", xlabel="iterations / trained R", ylabel="validation loss"
  )
  axes[0, 1].set(
    xscale="log",
    yscale="log",
    xlabel="iteration",
    ylabel="read-state change, last layer (median over tokens)",
  )
  axes[1, 0].set(
    xscale="log",
    yscale="log",
    xlabel="core layer applications",
    ylabel="max |h| / median |h|",
  )
  axes[1, 1].set(
    xscale="log",
    xlabel="core layer applications",
    ylabel="attention mass on the first token (mean over heads)",
  )
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  fig.suptitle("looped LMs from scratch: one factor at a time")
  return save(fig, path)


def along_training(runs: list[epath.Path], path: epath.Path) -> epath.Path | None:
  """Per run, one panel: the sink mass per iteration (max over the layers) at
  every checkpoint analyzed (`analysis/step_N`, and the newest), so a sink
  that forms, moves between iterations or fades shows; None if no run has
  an earlier checkpoint analyzed."""
  courses = {}
  for run in runs:
    found = sorted(
      (int(p.parent.name.removeprefix("step_")), p)
      for p in run.glob("analysis/step_*/stages.json")
    )
    if found and (run / "analysis/stages.json").exists():
      last = json.loads((run / "analysis/stages.json").read_text())
      found.append((last["step"], run / "analysis/stages.json"))
      courses[run.name] = found
  if not courses:
    return None
  fig, axes = plt.subplots(
    1, len(courses), figsize=(4.5 * len(courses), 4), sharey=True, squeeze=False
  )
  for ax, (name, found) in zip(axes[0], courses.items(), strict=True):
    for i, (step, p) in enumerate(dict(found).items()):
      res = json.loads(p.read_text())["stages"]["validation"]
      core = [x for x in res["positions"] if x["label"][0] == "r"]
      R = max(x["iteration"] for x in core)
      mass = [
        max(x["sink_mass"] for x in core if x["iteration"] == r)
        for r in range(1, R + 1)
      ]
      color = plt.cm.viridis(i / max(len(found) - 1, 1))
      ax.plot(np.arange(1, R + 1), mass, marker=".", color=color, label=f"step {step}")
    ax.axvline(res["trained_loops"], color="gray", ls=":", lw=1)
    ax.set(xscale="log", xlabel="iteration (dotted: trained R)", title=name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0, 0].set_ylabel("attention mass on <bos> (max over layers)")
  fig.suptitle("attention sinks along training, per iteration")
  return save(fig, path)


def write(root: epath.Path, runs: list[epath.Path]) -> list[epath.Path]:
  """`root/lm_study.md` and `root/plots/lm_study.png` for the LM runs, and
  `plots/lm_study_sinks.png` where earlier checkpoints were analyzed."""
  lm_runs = [r for r in runs if is_lm(r)]
  rows = [row(r) for r in lm_runs]
  if not rows:
    return []
  out = write_sweep_report(root, "lm_study", table(rows), lambda p: figure(rows, p))
  course = along_training(lm_runs, root / "plots" / "lm_study_sinks.png")
  return out + ([course] if course else [])
