"""Grokking phases: memorization -> in-distribution -> systematic generalization.

A phase is reached at the first evaluation where its probe accuracy crosses the
threshold in `config.phases`. These are pure functions of the metrics; the
training loop records what they return in `workdir/phases.json` (workdir.py),
which keeps each transition's checkpoint forever.
"""

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
    if reached.get(p) is None and key in metrics and metrics[key] >= thresholds[p]
  ]


def detect(records: list[dict], thresholds) -> dict:
  """{phase: first step reached, or None} over a run's records."""
  reached = {}
  for r in sorted(records, key=lambda r: r["step"]):
    reached |= {p: r["step"] for p in newly_reached(r, thresholds, reached)}
  return {p: reached.get(p) for p in PHASES}


def summary(reached: dict) -> str:
  return ", ".join(
    f"{p} at step {reached[p]}" if reached.get(p) is not None else f"{p} not reached"
    for p in PHASES
  )
