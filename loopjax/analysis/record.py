"""What an analysis is: how its result is computed, and how its report (the
run's header and the result under the analysis's name) is shown."""

import dataclasses
import json
from collections.abc import Callable

from etils import epath

from loopjax import storage


@dataclasses.dataclass(frozen=True)
class Analysis:
  """One analysis (found by name: registry.py).

  Its result comes either from passes of its own, `compute` (its family's
  runner says with what), or from the pass its family's analyses share:
  `summarize(examples, config, extra)` reads that pass's per-example outputs,
  by analysis name (a knowledge graph's traced pass runs each record's
  `per_example(model, trace, batch, pad)` on every batch, `extra` the probe
  split; a language model's streamed pass, depth_scan, gives them all,
  `extra` its compiled memory). `phases`: also run on each grokking phase's
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
