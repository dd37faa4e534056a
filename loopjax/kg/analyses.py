"""A knowledge-graph run's analyses, one record each (kg/spec.ANALYSES names them;
kg/analyze.py runs them). The traced ones share one pass, each reducing it
per example; the measures live in analysis/ because a language model's
streamed pass (depth_scan) computes them too, without figures."""

from loopjax.analysis import (
  activations,
  attention,
  figures,
  fixed_points,
  halting_sweep,
  logit_lens,
)
from loopjax.analysis import mechanistic_figures as mf
from loopjax.analysis import mechanistic_tables as mt
from loopjax.analysis.record import Analysis
from loopjax.kg import overthinking

OVERTHINKING = Analysis(
  compute=overthinking.curves,
  table=figures.overthinking_table,
  plot=figures.overthinking,
  summary=figures.overthinking_summary,
)
HALTING = Analysis(
  compute=halting_sweep.table,
  table=figures.halting_table,
  plot=figures.halting,
  summary=figures.halting_summary,
)
LOGIT_LENS = Analysis(
  per_example=lambda model, trace, batch, pad: logit_lens.per_example(
    model, trace, batch
  ),
  summarize=lambda ex, inputs: logit_lens.summarize(
    ex["logit_lens"], inputs.split["bridge"]
  ),
  phases=True,
  table=mt.lens_table,
  plot=mf.logit_lens,
  summary=mt.lens_summary,
)
FIXED_POINTS = Analysis(
  per_example=fixed_points.per_example,
  summarize=fixed_points.from_pass,
  table=mt.fixed_points_table,
  plot=mf.fixed_points,
  summary=mt.fixed_points_summary,
)
ATTENTION = Analysis(
  per_example=lambda model, trace, batch, pad: attention.per_example(trace, batch, pad),
  summarize=lambda ex, inputs: attention.summarize(ex["attention"]),
  table=mt.attention_table,
  plot=mf.attention,
  summary=mt.attention_summary,
)
ACTIVATIONS = Analysis(
  per_example=lambda model, trace, batch, pad: activations.per_example(
    trace, batch, pad
  ),
  summarize=lambda ex, inputs: activations.summarize(
    ex["activations"], inputs.config.model.d_model
  ),
  table=mt.activations_table,
  plot=mf.activations,
  summary=mt.activations_summary,
)
