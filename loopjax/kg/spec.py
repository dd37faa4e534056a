"""What config validation reads of the knowledge-graph families: their config
rules and their analyses by name (`task.Spec`s, which `task.FAMILIES`
names). JAX-free (no data library either), so a bad value fails in a
fraction of a second.
"""

from loopjax import field_rules
from loopjax.analysis.registry import Entry, shared
from loopjax.errors import ConfigError
from loopjax.task import Spec

# Numbers a knowledge-graph generator holds at once (int64 and float64: 8
# bytes each, 2 GiB): composition enumerates every 2-hop chain (E * D^2 of
# them, and E * R draws; the grokked transformer's largest, 2000 * 20^2 =
# 800,000), chains pads each example of k = 2 .. max_hops hops to max_hops +
# 1 tokens. Past it, numpy's MemoryError (2^31 entities asked for 128 GiB).
MAX_GENERATED = 2**28


def _kg_source(c) -> None:
  if not (c.data.source == "generate" or c.data.source.startswith("grokked_json:")):
    raise ConfigError(
      f"data.source: must be 'generate' or 'grokked_json:DIR'; got {c.data.source!r}"
    )


def _generated(c, fields: str, what: str, n: int) -> None:
  """Refuses a generated task of more than MAX_GENERATED numbers, before the
  generator tries (a MemoryError, or minutes of it)."""
  if c.data.source == "generate" and n > MAX_GENERATED:
    raise ConfigError(
      f"{fields}: the generator would hold {n:.3g} {what}, more than "
      f"{MAX_GENERATED:,} (kg/spec.MAX_GENERATED)"
    )


def _random_positions(c, longest: int) -> None:
  """`model.random_positions` draws a sequence's positions from [0, P)."""
  P = c.model.random_positions
  if P and P < longest:
    raise ConfigError(
      f"model.random_positions: must be 0 or >= the longest sequence ({longest} "
      f"tokens), the range a sequence's positions are drawn from; got {P}"
    )


def composition(c) -> None:
  """The fields a 2-hop composition run reads (config.validate)."""
  _kg_source(c)
  d = c.data
  if d.pad_to:
    raise ConfigError(
      f"data.pad_to: k-hop chains only (data.task 'chains'); got {d.pad_to}"
    )
  if d.out_degree > d.num_relations:
    raise ConfigError(
      f"data.out_degree: must be <= data.num_relations "
      f"({d.num_relations}); got {d.out_degree}"
    )
  _random_positions(c, 3)
  numbers = d.num_entities * max(d.out_degree**2, d.num_relations)
  fields = "data.num_entities, data.out_degree"
  _generated(c, fields, "numbers (E * D^2 chains)", numbers)


def chains(c) -> None:
  """The fields a k-hop chains run reads (config.validate)."""
  _kg_source(c)
  d, cur = c.data, c.train.curriculum
  if d.max_hops < 2:
    raise ConfigError(f"data.max_hops: must be >= 2; got {d.max_hops}")
  if not 2 <= d.train_hops <= d.max_hops:
    raise ConfigError(
      f"data.train_hops: must be in [2, data.max_hops={d.max_hops}]; got {d.train_hops}"
    )
  rows = (d.max_hops - 1) * (d.train_per_hop + d.test_per_hop + d.val_per_hop)
  fields = "data.max_hops, data.train_per_hop, data.test_per_hop, data.val_per_hop"
  _generated(c, fields, "padded tokens", rows * (d.max_hops + 1))
  if d.pad_to and d.pad_to < d.max_hops + 2:
    raise ConfigError(
      f"data.pad_to: 0 (the answer at the chain's last token) or >= "
      f"data.max_hops + 2 = {d.max_hops + 2} (a pad column after every chain); "
      f"got {d.pad_to}"
    )
  _random_positions(c, max(d.max_hops + 1, d.pad_to))
  for field, least in (("train_per_hop", 1), ("test_per_hop", 0), ("val_per_hop", 0)):
    if d[field] < least:
      raise ConfigError(f"data.{field}: must be >= {least}; got {d[field]!r}")
  _extrapolation(c)
  if not cur.enabled:
    if cur.last_stage_lr != 1 or cur.last_stage_steps:
      raise ConfigError(
        "train.curriculum.last_stage_lr, last_stage_steps: the last curriculum "
        "stage's lr; need train.curriculum.enabled (else there are no stages)"
      )
    return
  if not 2 <= cur.start <= d.train_hops:
    raise ConfigError(
      f"train.curriculum.start: must be in [2, data.train_hops={d.train_hops}]; "
      f"got {cur.start}"
    )
  if not 0 <= cur.threshold <= 1:
    raise ConfigError(
      f"train.curriculum.threshold: must be in [0, 1]; got {cur.threshold!r}"
    )
  if not 0 < cur.lr_decay <= 1:
    raise ConfigError(
      f"train.curriculum.lr_decay: must be in (0, 1]; got {cur.lr_decay!r}"
    )
  if not 0 <= cur.lr_min <= c.train.lr:
    raise ConfigError(
      f"train.curriculum.lr_min: must be in [0, train.lr={c.train.lr}]; got "
      f"{cur.lr_min!r}"
    )
  if d.test_per_hop < 1:
    raise ConfigError(
      "data.test_per_hop: must be >= 1 with a curriculum (it advances on "
      "held-out accuracy); got 0"
    )
  if c.eval_every < 1:
    raise ConfigError(
      "eval_every: must be >= 1 with a curriculum (it advances at evaluations); got 0"
    )


def _extrapolation(c) -> None:
  """eval.extrapolation_depth and eval.halting (kg/depth.py)."""
  e, h = c.eval, c.eval.halting
  top = field_rules.MAX_ITERATIONS
  if not 0 <= e.extrapolation_depth <= top:
    raise ConfigError(
      f"eval.extrapolation_depth: must be in [0, {top}] (0: model.num_loops); "
      f"got {e.extrapolation_depth!r}"
    )
  if not 2 <= h.r_min <= h.r_max <= top:
    raise ConfigError(
      f"eval.halting: must have 2 <= r_min <= r_max <= {top} (iteration t is "
      f"compared with t - 1); got r_min={h.r_min!r}, r_max={h.r_max!r}"
    )
  for name in ("eps", "tau"):
    grid = h[f"{name}_grid"]
    if not isinstance(grid, tuple | list) or not all(v > 0 for v in (h[name], *grid)):
      raise ConfigError(
        f"eval.halting.{name}, eval.halting.{name}_grid: positive numbers (a "
        f"tuple for the grid); got {h[name]!r}, {grid!r}"
      )


# Analyses (kg/analyze.py): the probe splits' own passes, then one traced pass
# (LoopedTransformer.trace) that every shared analysis reads; records in
# kg/analyses.py.
ANALYSES = {
  "overthinking": Entry("loopjax.kg.analyses:OVERTHINKING", shared=False),
  "halting": Entry("loopjax.kg.analyses:HALTING", shared=False),
  "logit_lens": Entry("loopjax.kg.analyses:LOGIT_LENS", shared=True),
  "fixed_points": Entry("loopjax.kg.analyses:FIXED_POINTS", shared=True),
  "attention": Entry("loopjax.kg.analyses:ATTENTION", shared=True),
  "activations": Entry("loopjax.kg.analyses:ACTIVATIONS", shared=True),
}
SHARED = shared(ANALYSES)
PARTS = {"report": "loopjax.kg.report:PARTS", "export": "loopjax.kg.source:export"}
COMPOSITION = Spec(composition, ANALYSES, tuple(ANALYSES), **PARTS)
CHAINS = Spec(chains, ANALYSES, tuple(ANALYSES), curriculum=True, **PARTS)
