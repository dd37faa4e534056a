"""The from-scratch study's table and figure: a sweep of analyzed LM runs.

Per run (config.json names the variant; `--mode=analyze` wrote
`analysis/{fixed_points,stages}.json`): the factors (injection, norm
placement, L x R), validation loss at R, 2R and 4R iterations and the best
iteration count (the last in-loop evaluation), whether the core reaches a
(cyclic) fixed point and by which iteration, the attention-sink rate and
massive-activation ratio of the first iteration's layers and of the last
trained iteration's, whether the stages repeat per iteration (eta squared of
the massive-activation ratio and of the sink mass over the core's layers), and
wall time.
"""

import json
from pathlib import Path

import numpy as np

from loopjax.analysis import mechanistic_figures
from loopjax.analysis.plots import markdown, plt, save, write_sweep_report
from loopjax.metrics import read_jsonl, wall_times

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
  "sink rate: iter 1 / R (max over layers)",
  "max/median |h|: iter 1 / R (max over layers)",
  "first-token norm ratio: iter 1 / R (max over layers)",
  "stages repeat (eta^2: massive, sink)",
  "wall",
)


def is_lm(run: Path) -> bool:
  """Whether the run is a language model's (a run without config.json is not)."""
  path = run / "config.json"
  return path.exists() and json.loads(path.read_text())["data"]["task"] == "lm"


def _analysis(run: Path, name: str) -> dict | None:
  path = run / "analysis" / f"{name}.json"
  return json.loads(path.read_text())[name]["validation"] if path.exists() else None


def losses(run: Path) -> dict[int, float]:
  """{iterations: validation loss} of the run's last in-loop evaluation."""
  records = [
    r for r in read_jsonl(run / "metrics.jsonl") if "eval/validation/loss" in r
  ]
  if not records:
    return {}
  last, R = (
    records[-1],
    json.loads((run / "config.json").read_text())["model"]["num_loops"],
  )
  out = {R: last["eval/validation/loss"]}
  out |= {int(k.split("@")[1]): v for k, v in last.items() if "validation/loss@" in k}
  return dict(sorted(out.items()))


def row(run: Path) -> dict:
  cfg = json.loads((run / "config.json").read_text())["model"]
  R, L = cfg["num_loops"], cfg["num_layers"]
  out = {"run": run.name, "L": L, "R": R, "injection": cfg["injection"]}
  out["norm"] = cfg["norm_position"]
  out["loss"] = losses(run)
  out["wall_s"] = max(
    wall_times(read_jsonl(run / "metrics.jsonl")).values(), default=None
  )
  fp = _analysis(run, "fixed_points")
  if fp:
    out["kind"] = fp["kind"]
    out["converged_at"] = [x["converged_at"] for x in fp["layers"]]
    out["change"] = fp["layers"][-1]["change"]
  st = _analysis(run, "stages")
  if st:
    core = [p for p in st["positions"] if p["label"][0] == "r"]
    out["core"] = core

    def at(r, stat):  # the largest over iteration r's layers (None: not traced)
      return max((p[stat] for p in core if p["iteration"] == r), default=None)

    for stat in ("sink_rate", "massive_ratio", "first_ratio"):
      out[stat] = (at(1, stat), at(R, stat))
    out["repeat"] = (st["repetition"]["massive_ratio"], st["repetition"]["sink_mass"])
  return out


def _num(x, fmt=".2f") -> str:
  return "-" if x is None else f"{x:{fmt}}"


def table(rows: list[dict]) -> str:
  lines = []
  for r in rows:
    loss, R = r["loss"], r["R"]
    best = min(loss, key=loss.get) if loss else None
    conv = r.get("converged_at")
    lines.append(
      [
        r["run"],
        r["injection"],
        r["norm"],
        f"{r['L']} x {R}",
        *(_num(loss.get(k * R), ".3f") for k in (1, 2, 4)),
        f"{loss[best]:.3f} ({best})" if best else "-",
        mechanistic_figures.fixed_cell(r) if conv else "-",
        *(
          " / ".join(_num(v, fmt) for v in r[stat]) if stat in r else "-"
          for stat, fmt in (
            ("sink_rate", ".2f"),
            ("massive_ratio", ".1f"),
            ("first_ratio", ".2f"),
          )
        ),
        " / ".join(_num(v) for v in r["repeat"]) if "repeat" in r else "-",
        "-" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min",
      ]
    )
  return markdown(list(COLUMNS), lines)


def figure(rows: list[dict], path: Path) -> Path:
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
    yscale="log",
    xlabel="core layer applications",
    ylabel="max |h| / median |h|",
  )
  axes[1, 1].set(
    xlabel="core layer applications",
    ylabel="attention mass on the first token (mean over heads)",
  )
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=7)
  fig.suptitle("looped LMs from scratch: one factor at a time")
  return save(fig, path)


def write(root: Path, runs: list[Path]) -> list[Path]:
  """`root/lm_study.md` and `root/plots/lm_study.png` for the LM runs."""
  rows = [row(r) for r in runs if is_lm(r)]
  if not rows:
    return []
  return write_sweep_report(root, "lm_study", table(rows), lambda p: figure(rows, p))
