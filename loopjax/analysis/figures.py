"""Figures, markdown tables and one-line summaries of the overthinking curves
and the halting table (knowledge-graph probe splits; their records:
kg/analyses.py)."""

import numpy as np
from etils import epath

from loopjax.analysis.plots import markdown, plt, save
from loopjax.data.kg import hop_count


def _lines(names):
  """(split, label, colour): chains' test splits by k on one colour scale, or
  every split (composition)."""
  tests = sorted(
    (k, n) for n in names if n.startswith("test_") and (k := hop_count(n)) is not None
  )
  if not tests:
    return [(n, n, None) for n in names]
  cmap = plt.get_cmap("viridis")
  return [
    (n, f"k={k}", cmap(i / max(len(tests) - 1, 1))) for i, (k, n) in enumerate(tests)
  ]


def overthinking(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Accuracy and mean logit margin against iterations, one line per split."""
  curves = report["overthinking"]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  for name, label, colour in _lines(curves):
    r = np.arange(1, len(curves[name]["acc"]) + 1)
    axes[0].plot(r, curves[name]["acc"], label=label, color=colour)
    axes[1].plot(r, curves[name]["margin"], label=label, color=colour)
  for ax, ylabel in zip(axes, ("accuracy", "mean logit margin"), strict=True):
    for d in report["train_depths"]:
      ax.axvline(d, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("iterations (dotted: training depth)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  axes[1].axhline(0, color="black", lw=0.5)
  axes[1].legend(fontsize=7, ncol=2)
  fig.suptitle(f"step {report['step']}")
  return [save(fig, out_dir / "overthinking.png")]


def _pooled(row: dict, names) -> tuple[float, float]:
  """(accuracy, mean iterations) over the given splits, weighted equally."""
  return (
    float(np.mean([row["splits"][n]["acc"] for n in names])),
    float(np.mean([row["splits"][n]["iterations"] for n in names])),
  )


def _test_splits(rows) -> list[str]:
  names = list(rows[0]["splits"])
  tests = [n for n in names if n.startswith("test_")]
  return tests or names


def halting(report: dict, out_dir: epath.Path) -> list[epath.Path]:
  """Left: accuracy against mean iterations (test splits pooled), one line per
  criterion through its thresholds. Right: per split, the default rules."""
  rows = report["halting"]
  tests = _test_splits(rows)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  for criterion in dict.fromkeys(r["criterion"] for r in rows):
    pts = [_pooled(r, tests) for r in rows if r["criterion"] == criterion]
    acc, iters = zip(*pts, strict=True)
    axes[0].plot(iters, acc, "o-", label=criterion, ms=4)
  axes[0].set_xlabel("mean iterations")
  axes[0].set_ylabel("accuracy (test splits pooled)")
  axes[0].legend(fontsize=8)
  for row in _defaults(rows):
    lines = _lines(tests)
    x = np.arange(len(lines))
    axes[1].plot(
      x, [row["splits"][n]["acc"] for n, _, _ in lines], "o-", label=_name(row)
    )
    axes[1].set_xticks(x, [label for _, label, _ in lines], fontsize=7)
  axes[1].set_ylabel("accuracy")
  axes[1].legend(fontsize=8)
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.suptitle(f"step {report['step']}")
  return [save(fig, out_dir / "halting.png")]


def _defaults(rows):
  """The rows at the halting defaults (eps 1e-3) and the fixed baseline."""
  return [r for r in rows if r.get("eps") == 1e-3 or r["criterion"] == "fixed"]


def _name(row: dict) -> str:
  thresholds = ", ".join(
    f"{k} {row[k]:g}" for k in ("eps", "tau", "patience") if k in row
  )
  return f"{row['criterion']} ({thresholds})" if thresholds else row["criterion"]


def overthinking_summary(report: dict) -> str:
  """The best iteration per split (avg_t_first)."""
  curves = report["overthinking"]
  best = {n: int(np.argmax(c["acc"])) + 1 for n, c in curves.items()}
  return "best iteration per split (avg_t_first): " + ", ".join(
    f"{n} {r} ({curves[n]['acc'][r - 1]:.2f}; {_first(curves[n])})"
    for n, r in best.items()
  )


def halting_summary(report: dict) -> str:
  """The default rules' accuracy and iterations, test splits pooled."""
  rows = report["halting"]
  tests = _test_splits(rows)
  return "; ".join(
    f"{_name(r)}: acc {a:.3f} at {i:.1f} iterations"
    for r in _defaults(rows)
    for a, i in [_pooled(r, tests)]
  )


def _first(curve: dict) -> str:
  first = curve.get("avg_t_first")
  return "-" if first is None else f"{first:.1f}"


def overthinking_table(report: dict) -> str:
  """Per split, accuracy (mean margin) at R = 1, 2, 4, ... and the best R."""
  curves = report["overthinking"]
  R = len(next(iter(curves.values()))["acc"])
  depths = [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= R]
  head = ["split", *(f"R={d}" for d in depths), "best R", "avg_t_first"]
  lines = []
  for split, c in curves.items():
    best = int(np.argmax(c["acc"])) + 1
    cells = [f"{c['acc'][d - 1]:.3f} ({c['margin'][d - 1]:+.1f})" for d in depths]
    lines.append([split, *cells, f"{best} ({c['acc'][best - 1]:.3f})", _first(c)])
  return markdown(head, lines)


def halting_table(report: dict) -> str:
  """Per rule, accuracy / mean iterations per split."""
  rows = report["halting"]
  splits = _test_splits(rows)
  head = ["rule", "all: acc / iters", *splits]
  lines = []
  for r in rows:
    acc, iters = _pooled(r, splits)
    cells = [
      f"{r['splits'][n]['acc']:.3f} / {r['splits'][n]['iterations']:.1f}"
      for n in splits
    ]
    lines.append([_name(r), f"{acc:.3f} / {iters:.1f}", *cells])
  return markdown(head, lines)
