"""One table and one figure comparing a sweep's analyzed runs (architecture ablations).

Per run (each `--mode=analyze`d; config.json names the variant), on the run's
main held-out split: accuracy at the training depth R and iterating 2x and 4x
beyond it (overthinking curves), how the core's layers settle (fixed points),
the ColSum profile at the last analyzed iteration (attention), the logit lens's
best bridge MRR at the relation position, and wall time.
"""

import json

import numpy as np
from etils import epath

from loopjax import metrics
from loopjax.analysis import mechanistic_tables
from loopjax.analysis.mechanistic_tables import main_result
from loopjax.analysis.plots import markdown, plt, save, write_sweep_report
from loopjax.workdir import run_config

COLUMNS = (
  "run",
  "L x R",
  "acc @R",
  "acc @2R",
  "acc @4R",
  "fixed points (converged at; last layer's read change at the last iteration)",
  "ColSum profile (last iteration)",
  "ColSum C / top share (uniform attention's)",
  "bridge MRR @relation",
  "wall",
)


def _load(run: epath.Path, name: str) -> dict | None:
  path = run / "analysis" / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def row(run: epath.Path) -> dict:
  """The numbers of one run (None where an analysis is missing)."""
  model = run_config(run).model
  R, L = model.num_loops, model.num_layers
  out = {"run": run.name, "L": L, "R": R}
  walls = metrics.wall_times(metrics.read(run))
  out["wall_s"] = max(walls.values(), default=None)
  over = _load(run, "overthinking")
  if over:
    out["split"], res = main_result(over, "overthinking")
    acc = out["acc"] = res["acc"]
    out["acc_at"] = {
      k: acc[k * R - 1] if k * R <= len(acc) else None for k in (1, 2, 4)
    }
  fp = _load(run, "fixed_points")
  if fp:
    res = main_result(fp, "fixed_points")[1]
    out["kind"] = res["kind"]
    out["converged_at"] = [x["converged_at"] for x in res["layers"]]
    out["change"] = res["layers"][-1]["change"]
  att = _load(run, "attention")
  if att:
    res = main_result(att, "attention")[1]
    out["profile"] = np.asarray(res["profile"]).mean((0, 1)).tolist()
    out["top_share"] = float(np.asarray(res["top_share"])[-1].mean())
    if "concentration" in res:  # analyses before MECH's C have the top share only
      out["concentration"] = float(np.asarray(res["concentration"])[-1].mean())
      out["uniform"] = res["uniform"]
  lens = _load(run, "logit_lens")
  if lens:
    core = main_result(lens, "logit_lens")[1].get("core")
    if core:
      out["bridge_mrr"] = float(np.max(core["bridge"]["relation"]["mrr"]))
  return out


def table(rows: list[dict]) -> str:
  """Markdown, one line per run."""
  lines = []
  for r in rows:
    acc = r.get("acc_at", {})
    conv = r.get("converged_at")
    cells = [
      r["run"],
      f"{r['L']} x {r['R']}",
      *(_num(acc.get(k)) for k in (1, 2, 4)),
      mechanistic_tables.fixed_cell(r) if conv else "-",
      _profile(r["profile"]) if "profile" in r else "-",
      _attention_cell(r),
      _num(r.get("bridge_mrr")),
      "-" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min",
    ]
    lines.append(cells)
  return markdown(list(COLUMNS), lines)


def _attention_cell(r: dict) -> str:
  """C / top share at the last iteration, uniform causal attention's beside."""
  if "concentration" not in r:
    return _num(r.get("top_share"))
  u = r["uniform"]
  return (
    f"{r['concentration']:.2f} / {r['top_share']:.2f} "
    f"({u['concentration']:.2f} / {u['top_share']:.2f})"
  )


def _profile(shares) -> str:
  """Shares per key position; trailing positions no query reaches (padding of
  shorter chains, < 0.005) left out."""
  cells = [f"{p:.2f}" for p in shares]
  while len(cells) > 1 and cells[-1] == "0.00":
    cells.pop()
  return " ".join(cells)


def _num(x) -> str:
  return "-" if x is None else f"{x:.3f}"


def figure(rows: list[dict], path: epath.Path) -> epath.Path:
  """Accuracy against layer applications (L x iterations), each core's last
  layer's relative change per iteration, and the ColSum profiles."""
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
  width = 0.8 / max(len(rows), 1)
  for i, r in enumerate(rows):
    if "acc" in r:
      depth = r["L"] * np.arange(1, len(r["acc"]) + 1)
      axes[0].plot(depth, r["acc"], label=r["run"])
    if "change" in r:
      axes[1].plot(np.arange(1, len(r["change"]) + 1), r["change"], label=r["run"])
    if "profile" in r:
      x = np.arange(len(r["profile"])) + i * width
      axes[2].bar(x, r["profile"], width, label=r["run"])
  axes[0].set(
    xscale="log", xlabel="layer applications (L x iterations)", ylabel="accuracy"
  )
  axes[1].set(
    xscale="log", yscale="log", xlabel="iteration", ylabel="relative change, last layer"
  )
  axes[2].set(xlabel="key position", ylabel="ColSum share (last iteration)")
  for ax in axes[:2]:
    ax.grid(alpha=0.3)
  for depth in {r["L"] * r["R"] for r in rows}:  # the trained effective depths
    axes[0].axvline(depth, color="gray", ls=":", lw=1)
  axes[0].legend(fontsize=7)
  axes[2].legend(fontsize=7)
  split = next((r["split"] for r in rows if "split" in r), "")
  fig.suptitle(f"ablations on {split}")
  return save(fig, path)


def write(root: epath.Path, runs: list[epath.Path]) -> list[epath.Path]:
  """`root/ablations.md` and `root/plots/ablations.png` for the analyzed runs."""
  rows = [row(r) for r in runs if (r / "analysis").is_dir()]
  if not rows:
    return []
  return write_sweep_report(root, "ablations", table(rows), lambda p: figure(rows, p))
