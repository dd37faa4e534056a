"""Every analysis, found by name as big_vision finds its evaluators: per kind
of model, name -> where its record lives and whether it reads the pass its
family's analyses share.

Strings only (no JAX, no matplotlib), so config validation reads the names and
ahead-of-time compiles know the shared pass is needed before anything loads;
`record` imports a record's module only when a run analyzes. A new analysis
is a module holding its `record.Analysis` and one line here.
"""

import importlib
from typing import NamedTuple

from loopjax.errors import ConfigError


class Entry(NamedTuple):
  record: str  # "module:ATTRIBUTE" of its record.Analysis
  shared: bool  # reads the family's shared pass (it needs >= 2 iterations)


# Knowledge-graph runs (kg/analyze.py): the probe splits' own passes, then one
# traced pass (LoopedTransformer.trace) that every shared analysis reads.
KG = {
  "overthinking": Entry("loopjax.kg.analyses:OVERTHINKING", shared=False),
  "halting": Entry("loopjax.kg.analyses:HALTING", shared=False),
  "logit_lens": Entry("loopjax.kg.analyses:LOGIT_LENS", shared=True),
  "fixed_points": Entry("loopjax.kg.analyses:FIXED_POINTS", shared=True),
  "attention": Entry("loopjax.kg.analyses:ATTENTION", shared=True),
  "activations": Entry("loopjax.kg.analyses:ACTIVATIONS", shared=True),
}
# Language models (lm/analyze.py): one streamed pass over validation windows
# (depth_scan), and each exit rule's iterations per token (lm_halting).
LM = {
  "fixed_points": Entry("loopjax.lm.analyses:FIXED_POINTS", shared=True),
  "stages": Entry("loopjax.lm.analyses:STAGES", shared=True),
  "attention": Entry("loopjax.lm.analyses:ATTENTION", shared=True),
  "halting": Entry("loopjax.lm.analyses:HALTING", shared=False),
}


def shared(table: dict[str, Entry], names=None) -> tuple[str, ...]:
  """Those of `names` (default: all of `table`'s) that read the shared pass."""
  return tuple(n for n in (table if names is None else names) if table[n].shared)


def record(table: dict[str, Entry], name: str):
  """The `record.Analysis` of `name` in `table` (KG or LM), imported now."""
  if name not in table:
    raise ConfigError(
      f"analyze.names: each must be one of {', '.join(table)}; got {name!r}"
    )
  module, _, attribute = table[name].record.partition(":")
  return getattr(importlib.import_module(module), attribute)
