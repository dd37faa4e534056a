"""How analyses are found by name, as big_vision finds its evaluators: each
task family's `ANALYSES` table (kg/spec.py, lm/spec.py) maps a name to where
its record lives and whether it reads the pass the family's analyses share.

Strings only (no JAX, no matplotlib), so config validation reads the names and
ahead-of-time compiles know the shared pass is needed before anything loads;
`record` imports a record's module only when a run analyzes. A new analysis
is a module holding its `record.Analysis` and one line in its family's table.
"""

from typing import NamedTuple

from loopjax.errors import ConfigError
from loopjax.names import imported


class Entry(NamedTuple):
  record: str  # "module:ATTRIBUTE" of its record.Analysis
  shared: bool  # reads the family's shared pass (it needs >= 2 iterations)


def shared(table: dict[str, Entry], names=None) -> tuple[str, ...]:
  """Those of `names` (default: all of `table`'s) that read the shared pass."""
  return tuple(n for n in (table if names is None else names) if table[n].shared)


def record(table: dict[str, Entry], name: str):
  """The `record.Analysis` of `name` in `table` (a family's `ANALYSES`),
  imported now."""
  if name not in table:
    raise ConfigError(
      f"analyze.names: each must be one of {', '.join(table)}; got {name!r}"
    )
  return imported(table[name].record)
