"""`--mode=analyze`: the analyses `config.analyze.names` picks, on one checkpoint.

Writes `workdir/analysis/<name>.json` (with the step and data fingerprint),
`<name>.md` (a table) and `<name>.png`. Analyses are pure functions of the
restored params and the probe splits (`data.probes`); nothing here trains or
moves a checkpoint.
"""

import json
from pathlib import Path

import jax

from loopjax import data, evaluate
from loopjax.analysis import figures, halting_sweep, overthinking


def train_depths(config) -> list[int]:
  """The iteration counts the run trained with (marked on the figures)."""
  dd = config.train.depth
  if dd.dist == "fixed":
    return [config.model.num_loops]
  return [dd.min, dd.max]


def analyze(config, workdir, step: int | None = None) -> list[Path]:
  workdir = Path(workdir)
  task, graphdef, params, step = evaluate.restore_params(config, workdir, step)
  probes = data.probes(task, config.data.train_hops, config.data.probe_size)
  key = jax.random.key(config.seed)  # the evaluator's, for init_state random
  args = (graphdef, params, config.model.dtype, key, probes)
  batch, pad, a = config.eval.batch_size, task.vocab.pad_id, config.analyze
  out_dir = workdir / "analysis"
  out_dir.mkdir(exist_ok=True)
  head = {
    "step": step,
    "fingerprint": data.fingerprint(task),
    "train_depths": train_depths(config),
  }
  written = []
  for name in a.names:
    if name == "overthinking":
      result = overthinking.curves(*args, a.max_depth, batch, pad)
      plot = figures.overthinking
    else:
      result = halting_sweep.table(*args, a.halting, batch, pad)
      plot = figures.halting
    report = head | {name: result}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2))
    table = out_dir / f"{name}.md"
    table.write_text(figures.table(name, report))
    written += [path, table, plot(report, out_dir / f"{name}.png")]
    print(f"{name}: " + figures.summary(name, report))
  return written
