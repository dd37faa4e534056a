"""A knowledge-graph run's analyses (`analyze.names`) of one checkpoint.

Writes `workdir/analysis/<name>.json` (with the step and data fingerprint),
`<name>.md` (a table) and `<name>.png`. Analyses are pure functions of the
restored params and the probe splits (`kg.probes`); nothing here trains or
moves a checkpoint. Each is a record found by name (kg/spec.py's
ANALYSES, records in kg/analyses.py). The shared ones (logit lens, fixed points,
attention, massive activations) read one traced forward pass per batch
(`LoopedTransformer.trace`), each reducing it per example; the logit lens also
runs on each grokking phase's checkpoint (`analyze.lens_phases`).
"""

import dataclasses
import functools

import jax
from etils import epath

from loopjax import checkpoint, restore, sharding
from loopjax import config as config_lib
from loopjax.analysis import registry
from loopjax.analysis.record import Inputs
from loopjax.data import kg, pipeline
from loopjax.errors import first_line
from loopjax.kg import spec
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
  `phases`: those whose record asks (the logit lens) also on every phase's
  checkpoint. Every process computes (the model may span them all); process
  0 writes, and returns the paths."""
  workdir, out_dir = epath.Path(workdir), epath.Path(out_dir)
  probes = kg.probes(task, config.data.train_hops, config.data.probe_size)
  pad, names = task.vocab.pad_id, config_lib.analyses(config)
  records = {n: registry.record(spec.ANALYSES, n) for n in names}
  writes = sharding.writes()
  if writes:
    out_dir.mkdir(parents=True, exist_ok=True)
  head = {
    "step": step,
    "fingerprint": task.summary()["fingerprint"],
    "train_depths": train_depths(config),
    "main_split": main_split,
  }
  traced, shared = {}, registry.shared(spec.ANALYSES, names)
  inputs = Inputs(config, eval_key(config), task, probes)
  if shared:
    traced = trace_all(inputs, traced_step(config, pad, shared), model)
  asked = config.analyze.lens_phases and phases
  phased = [n for n in shared if records[n].phases] if asked else []
  mesh = sharding.mesh_of(model.params)  # the phases' checkpoints go there too
  by_phase = lens_phases(config, workdir, task, probes, phased, mesh) if phased else []
  written = []
  for name, record in records.items():
    if name in shared:
      result = traced[name]
    else:
      result = record.compute(model, inputs)
    report = head | {name: result}
    if name in phased:
      report["phases"] = [
        {"phase": p["phase"], "step": p["step"], name: p[name]} for p in by_phase
      ]
    written += record.write(name, report, out_dir) if writes else []
  return written


def traced_step(config, pad, names):
  """One pass (model, batch) for the shared analyses `names`: the model's
  trace to analyze.max_depth iterations, reduced per example by each.
  Compiled once per model graph and settings, whatever the params."""
  return functools.partial(
    _traced,
    key=eval_key(config),
    depth=config.analyze.max_depth,
    names=tuple(names),
    pad=pad,
  )


@functools.partial(jax.jit, static_argnames=("depth", "names", "pad"))
def _traced(weights: Model, batch, key, *, depth: int, names: tuple, pad: int):
  model = weights.module()
  trace = model.trace(batch["inputs"], depth, key)
  return {
    n: registry.record(spec.ANALYSES, n).per_example(model, trace, batch, pad)
    for n in names
  }


def trace_all(inputs: Inputs, step, model: Model) -> dict:
  """{name: {split: summary}} from `traced_step`'s per-example results on
  each of `inputs.probes`."""
  config, task = inputs.config, inputs.task
  feed, out = sharding.Feed.like(model.params, config.sharding.rules), {}
  for split_name, split in inputs.probes.items():
    split = split | {"bridge": kg.first_bridge(split)}
    ex = pipeline.map_batches(
      lambda b: step(model, b),
      split,
      feed.size(config.analyze.batch_size),
      task.vocab.pad_id,
      columns=("bridge",),
      pad_to=task.pad_to,
      put=feed.put,
    )
    at = dataclasses.replace(inputs, split=split)
    for name in ex:
      record = registry.record(spec.ANALYSES, name)
      out.setdefault(name, {})[split_name] = record.summarize(ex, at)
  return out


def lens_phases(
  config, workdir: epath.Path, task, probes, names, mesh=None
) -> list[dict]:
  """The shared analyses `names` (the logit lens) on each grokking phase's
  checkpoint (phases.json), in step order: [{"phase", "step", name: {split:
  summary}}]; phases whose checkpoint is gone are left out. `mesh`: where
  their params go (`restore.Reader`)."""
  pad = task.vocab.pad_id
  out, step_fn = [], traced_step(config, pad, names)  # compiled once
  reader = restore.Reader(config, workdir, task, mesh)
  inputs = Inputs(config, eval_key(config), task, probes)
  try:
    for phase, step in sorted(Workdir(workdir).reached().items(), key=lambda x: x[1]):
      gone = not (workdir / "checkpoints" / str(step)).is_dir()
      if gone or step in checkpoint.damaged(workdir / "checkpoints"):
        continue
      try:
        model, _ = reader.model(step)
      except Exception as e:  # noqa: BLE001 - a damaged checkpoint: the others count
        print(f"logit lens: phase {phase} left out: {first_line(e)}")
        continue
      lens = trace_all(inputs, step_fn, model)
      out.append({"phase": phase, "step": step, **lens})
  finally:
    reader.close()
  return out
