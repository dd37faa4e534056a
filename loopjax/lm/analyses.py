"""A language model's analyses, one record each (lm/spec.ANALYSES names them;
lm/analyze.py runs them): three read the one streamed pass (depth_scan, which
computes their per-example outputs together), `halting` runs its own."""

from loopjax.analysis import (
  attention,
  fixed_points,
  lm_halting,
  stage_figures,
  stages,
)
from loopjax.analysis import mechanistic_figures as mf
from loopjax.analysis.record import Analysis

FIXED_POINTS = Analysis(
  summarize=fixed_points.from_pass,
  table=mf.fixed_points_table,
  plot=mf.fixed_points,
  summary=mf.fixed_points_summary,
)
STAGES = Analysis(
  summarize=lambda ex, config, memory: (
    stages.summarize(ex, config.analyze.sink_threshold, config.model.num_loops)
    | {"memory": memory}
  ),
  table=stage_figures.table,
  plot=stage_figures.plot,
  summary=stage_figures.summary,
)
ATTENTION = Analysis(
  summarize=lambda ex, config, memory: (
    attention.summarize(ex["attention"])
    | {"sink": ex["attention"]["sink"].mean(0).tolist()}
  ),
  table=mf.attention_table,
  plot=mf.attention,
  summary=mf.attention_summary,
)
HALTING = Analysis(
  compute=lm_halting.table,  # (model, batches, n, config, key)
  table=lm_halting.markdown,
  summary=lm_halting.summary,
)
