"""The view of each analysis, by family and name: the module whose `table`,
`plot` and `summary` turn its report into a markdown table, figures and a
line. A new analysis adds its view here."""

from loopjax.analysis import figures, mechanistic_figures, stage_figures
from loopjax.names import MECHANISTIC

# Knowledge-graph runs: the probe splits' curves and tables, and the traced pass.
KG = {
  "overthinking": figures,
  "halting": figures,
  **dict.fromkeys(MECHANISTIC, mechanistic_figures),
}
# Language models' streamed pass (their halting table is lm_halting's own).
LM = {
  "fixed_points": mechanistic_figures,
  "attention": mechanistic_figures,
  "stages": stage_figures,
}
