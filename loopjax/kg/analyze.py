"""A knowledge-graph run's analyses (`analyze.names`) of one checkpoint.

Writes `workdir/analysis/<name>.json` (with the step and data fingerprint),
`<name>.md` (a table) and `<name>.png`. Analyses are pure functions of the
restored params and the probe splits (`data.probes`); nothing here trains or
moves a checkpoint. The mechanistic ones (logit lens, fixed points, attention,
massive activations) share one traced forward pass per batch
(`LoopedTransformer.trace`); the logit lens also runs on each grokking phase's
checkpoint (`analyze.lens_phases`).
"""

import functools
import json
from pathlib import Path

import jax

from loopjax import config as config_lib
from loopjax import data, restore
from loopjax.analysis import (
  activations,
  attention,
  fixed_points,
  halting_sweep,
  logit_lens,
  views,
)
from loopjax.data import kg, pipeline
from loopjax.errors import first_line
from loopjax.kg import overthinking
from loopjax.names import MECHANISTIC
from loopjax.state import Model, eval_key
from loopjax.workdir import Workdir


def train_depths(config) -> list[int]:
  """The iteration counts the run trained with (marked on the figures)."""
  dd = config.train.depth
  if dd.dist == "fixed":
    return [config.model.num_loops]
  return [dd.min, dd.max]


def run(config, workdir, task, model: Model, step: int, out_dir, main_split, phases):
  """The analyses of `model` (the checkpoint at `step`), written under
  `out_dir`; `main_split`: the held-out split the figures single out;
  `phases`: the logit lens also on every phase's checkpoint."""
  workdir, out_dir = Path(workdir), Path(out_dir)
  probes = data.probes(task, config.data.train_hops, config.data.probe_size)
  pad, a, names = task.vocab.pad_id, config.analyze, config_lib.analyses(config)
  out_dir.mkdir(parents=True, exist_ok=True)
  head = {
    "step": step,
    "fingerprint": task.summary()["fingerprint"],
    "train_depths": train_depths(config),
    "main_split": main_split,
  }
  traced = {}
  if any(n in MECHANISTIC for n in names):
    step_fn = traced_step(config, pad, names)
    traced = trace_all(config, step_fn, model, probes, pad)
  if "logit_lens" in names and a.lens_phases and phases:
    traced["logit_lens_phases"] = lens_phases(config, workdir, task, probes)
  written = []
  for name in names:
    if name == "overthinking":
      result = overthinking.curves(model, probes, config, pad)
    elif name == "halting":
      result = halting_sweep.table(model, probes, config, pad)
    else:
      result = traced[name]
    report = head | {name: result}
    if name == "logit_lens" and "logit_lens_phases" in traced:
      report["phases"] = traced["logit_lens_phases"]
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2))
    table = out_dir / f"{name}.md"
    view = views.KG[name]
    table.write_text(view.table(name, report))
    written += [path, table, *view.plot(name, report, out_dir)]
    print(f"{name}: " + view.summary(name, report))
  return written


def traced_step(config, pad, names):
  """One pass (model, batch) for the mechanistic analyses among `names`: the
  model's trace to analyze.max_depth iterations, reduced per example by each.
  Compiled once per model graph and settings, whatever the params."""
  return functools.partial(
    _traced,
    key=eval_key(config),
    depth=config.analyze.max_depth,
    names=tuple(n for n in names if n in MECHANISTIC),
    pad=pad,
  )


@functools.partial(jax.jit, static_argnames=("depth", "names", "pad"))
def _traced(weights: Model, batch, key, *, depth: int, names: tuple, pad: int):
  model = weights.module()
  trace = model.trace(batch["inputs"], depth, key)
  out = {}
  if "logit_lens" in names:
    out["logit_lens"] = logit_lens.per_example(model, trace, batch)
  for name, module in (
    ("attention", attention),
    ("activations", activations),
  ):
    if name in names:
      out[name] = module.per_example(trace, batch, pad)
  if "fixed_points" in names:
    out["fixed_points"] = fixed_points.per_example(model, trace, batch, pad)
  return out


def trace_all(config, step, model: Model, probes, pad) -> dict:
  """{name: {split: summary}} from `traced_step`'s per-example results."""
  a, out = config.analyze, {}
  summarize = {
    "logit_lens": lambda ex, split: logit_lens.summarize(ex, split["bridge"]),
    "fixed_points": lambda ex, split: fixed_points.summarize(
      ex, a.tol, a.fp_share, a.cycle_margin
    ),
    "attention": lambda ex, split: attention.summarize(ex),
    "activations": lambda ex, split: activations.summarize(ex, config.model.d_model),
  }
  for split_name, split in probes.items():
    split = split | {"bridge": kg.first_bridge(split)}
    ex = pipeline.map_batches(
      lambda b: step(model, b),
      split,
      a.batch_size,
      pad,
      columns=("bridge",),
      pad_to=config.data.pad_to,
    )
    for name, result in ex.items():
      out.setdefault(name, {})[split_name] = summarize[name](result, split)
  return out


def lens_phases(config, workdir: Path, task, probes) -> list[dict]:
  """The logit lens on each grokking phase's checkpoint (phases.json), in step
  order: [{"phase", "step", "logit_lens": {split: summary}}]; phases whose
  checkpoint is gone are left out."""
  pad = task.vocab.pad_id
  out, lens_step = [], traced_step(config, pad, ["logit_lens"])  # compiled once
  reader = restore.Reader(config, workdir, task)
  try:
    for phase, step in sorted(Workdir(workdir).reached().items(), key=lambda x: x[1]):
      if not (workdir / "checkpoints" / str(step)).is_dir():  # e.g. set aside
        continue
      try:
        model, _ = reader.model(step)
      except Exception as e:  # noqa: BLE001 - a damaged checkpoint: the others count
        print(f"logit lens: phase {phase} left out: {first_line(e)}")
        continue
      lens = trace_all(config, lens_step, model, probes, pad)
      out.append({"phase": phase, "step": step, **lens})
  finally:
    reader.close()
  return out
