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
from loopjax.analysis import mechanistic_tables as mt
from loopjax.analysis.record import Analysis

FIXED_POINTS = Analysis(
  summarize=fixed_points.from_pass,
  table=mt.fixed_points_table,
  plot=mf.fixed_points,
  summary=mt.fixed_points_summary,
)
STAGES = Analysis(
  summarize=lambda ex, inputs: (
    stages.summarize(
      ex, inputs.config.analyze.sink_threshold, inputs.config.model.num_loops
    )
    | {"memory": inputs.memory}
  ),
  table=stage_figures.table,
  plot=stage_figures.plot,
  summary=stage_figures.summary,
)
ATTENTION = Analysis(
  summarize=lambda ex, inputs: (
    attention.summarize(ex["attention"])
    | {"sink": ex["attention"]["sink"].mean(0).tolist()}
  ),
  table=mt.attention_table,
  plot=mf.attention,
  summary=mt.attention_summary,
)
HALTING = Analysis(
  compute=lm_halting.table,
  table=lm_halting.markdown,
  summary=lm_halting.summary,
)
