"""What an analysis is: how its result is computed, and how its report (the
run's header and the result under the analysis's name) is shown."""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from etils import epath

from loopjax import storage


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What a family's runner hands each of its analyses: one type for every
  family, so a callback's arguments mean the same whoever calls it. A family
  fills what it has: a knowledge graph its task (pad id, batch layout) and
  probe splits, and `split`, the probe split being summarized; a language
  model its probe's device batches, the rows that count and, when
  summarizing the streamed pass, that pass's compiled `memory`."""

  config: Any
  key: Any = None  # the evaluation's key (state.eval_key)
  task: Any = None  # the family's data: its vocabulary and batch layout
  probes: dict | None = None  # {split: columns}
  batches: list | None = None  # the probe as device batches
  n: int = 0  # the rows of `batches` that count (the last batch is filled)
  split: dict | None = None  # the probe split `summarize` reads
  memory: dict | None = None  # the shared pass's compiled memory


@dataclasses.dataclass(frozen=True)
class Analysis:
  """One analysis (found by name: registry.py).

  Its result comes either from passes of its own, `compute(model, inputs)`,
  or from the pass its family's analyses share: `summarize(examples,
  inputs)` reads that pass's per-example outputs, by analysis name (a
  knowledge graph's traced pass runs each record's `per_example(model,
  trace, batch, pad)` on every batch, and summarizes per probe split; a
  language model's streamed pass, depth_scan, gives them all). `inputs` is
  an `Inputs` for every family. `phases`: also run on each grokking phase's
  checkpoint (`analyze.lens_phases`).
  """

  table: Callable[[dict], str]  # report -> markdown
  summary: Callable[[dict], str]  # report -> the console line
  # (report, out_dir) -> the figures' paths
  plot: Callable[[dict, epath.Path], list[epath.Path]] | None = None
  compute: Callable | None = None
  summarize: Callable | None = None
  per_example: Callable | None = None
  phases: bool = False

  def write(self, name: str, report: dict, out_dir: epath.Path) -> list[epath.Path]:
    """<name>.json, <name>.md and the figures under `out_dir`; prints the
    console line."""
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    storage.write_whole(paths[0], json.dumps(report, indent=2))
    storage.write_whole(paths[1], self.table(report))
    paths += self.plot(report, out_dir) if self.plot else []
    print(f"{name}: " + self.summary(report))
    return paths
