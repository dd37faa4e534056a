"""Grokking phases: memorization -> in-distribution -> systematic generalization.

A phase is reached at the first evaluation where its probe accuracy crosses the
threshold in `config.phases`. The training loop records the steps in
`workdir/phases.json` and keeps the checkpoint of each transition forever.
"""

import json
from pathlib import Path

# phase -> the metric that marks it, in the order the phases are expected.
PHASES = {
  "memorize": "eval/train_inferred/acc",
  "id": "eval/test_inferred_id/acc",
  "ood": "eval/test_inferred_ood/acc",
}


def newly_reached(metrics: dict, thresholds, reached: dict) -> list[str]:
  """Phases whose metric is at or above its threshold now, not reached before."""
  return [
    p
    for p, key in PHASES.items()
    if p not in reached and key in metrics and metrics[key] >= thresholds[p]
  ]


def detect(records: list[dict], thresholds) -> dict:
  """{phase: first step reached, or None} over a metrics.jsonl history."""
  reached = {}
  for r in sorted(records, key=lambda r: r["step"]):
    reached |= {p: r["step"] for p in newly_reached(r, thresholds, reached)}
  return {p: reached.get(p) for p in PHASES}


def load(workdir: Path) -> dict:
  path = workdir / "phases.json"
  return json.loads(path.read_text()) if path.exists() else {}


def save(workdir: Path, reached: dict) -> None:
  (workdir / "phases.json").write_text(json.dumps(reached, indent=2))


def summary(reached: dict) -> str:
  return ", ".join(
    f"{p} at step {reached[p]}" if p in reached else f"{p} not reached" for p in PHASES
  )
