"""`--mode=analyze`: the analyses `config.analyze.names` picks, on one checkpoint.

Writes `workdir/analysis/<name>.json` (with the step and data fingerprint),
`<name>.md` (a table) and `<name>.png`. Analyses are pure functions of the
restored params and the probe splits (`data.probes`); nothing here trains or
moves a checkpoint. The mechanistic ones (logit lens, fixed points, attention,
massive activations) share one traced forward pass per batch
(`LoopedTransformer.trace`); the logit lens also runs on each grokking phase's
checkpoint (`analyze.lens_phases`).
"""

import json
from pathlib import Path

import jax
from flax import nnx

from loopjax import data, evaluate
from loopjax.analysis import (
  activations,
  attention,
  figures,
  fixed_points,
  grokking,
  halting_sweep,
  logit_lens,
  mechanistic_figures,
  overthinking,
)
from loopjax.config import MECHANISTIC, ConfigError
from loopjax.data import kg, pipeline
from loopjax.state import cast


def train_depths(config) -> list[int]:
  """The iteration counts the run trained with (marked on the figures)."""
  dd = config.train.depth
  if dd.dist == "fixed":
    return [config.model.num_loops]
  return [dd.min, dd.max]


def main_split(config) -> str:
  """The held-out split the figures single out: OOD composition, or the
  deepest trained k."""
  if config.data.task == "composition":
    return "test_inferred_ood"
  return f"test_k{config.data.train_hops}"


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
    "main_split": main_split(config),
  }
  traced = {}
  if any(n in MECHANISTIC for n in a.names):
    step_fn = traced_step(config, graphdef, pad, a.names)
    traced = trace_all(config, step_fn, params, probes, pad)
  if "logit_lens" in a.names and a.lens_phases:
    traced["logit_lens_phases"] = lens_phases(config, workdir, probes, pad)
  written = []
  for name in a.names:
    if name == "overthinking":
      result = overthinking.curves(*args, a.max_depth, batch, pad)
    elif name == "halting":
      result = halting_sweep.table(*args, a.halting, batch, pad)
    else:
      result = traced[name]
    report = head | {name: result}
    if name == "logit_lens" and "logit_lens_phases" in traced:
      report["phases"] = traced["logit_lens_phases"]
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2))
    table = out_dir / f"{name}.md"
    view = figures if name in ("overthinking", "halting") else mechanistic_figures
    table.write_text(view.table(name, report))
    written += [path, table, *view.plot(name, report, out_dir)]
    print(f"{name}: " + view.summary(name, report))
  return written


def traced_step(config, graphdef, pad, names):
  """One jitted pass for the mechanistic analyses among `names`: the model's
  trace to analyze.max_depth iterations, reduced per example by each."""
  names = [n for n in names if n in MECHANISTIC]
  dtype, depth = config.model.dtype, config.analyze.max_depth
  key = jax.random.key(config.seed)

  @jax.jit
  def step(params, batch):
    model = nnx.merge(graphdef, cast(params, dtype))
    trace = model.trace(batch["inputs"], depth, key)
    out = {}
    if "logit_lens" in names:
      out["logit_lens"] = logit_lens.per_example(model, trace, batch)
    for name, module in (
      ("fixed_points", fixed_points),
      ("attention", attention),
      ("activations", activations),
    ):
      if name in names:
        out[name] = module.per_example(trace, batch, pad)
    return out

  return step


def trace_all(config, step, params, probes, pad) -> dict:
  """{name: {split: summary}} from `traced_step`'s per-example results."""
  a, out = config.analyze, {}
  summarize = {
    "logit_lens": lambda ex, split: logit_lens.summarize(ex, split["bridge"]),
    "fixed_points": lambda ex, split: fixed_points.summarize(ex, a.tol),
    "attention": lambda ex, split: attention.summarize(ex),
    "activations": lambda ex, split: activations.summarize(ex, config.model.d_model),
  }
  for split_name, split in probes.items():
    split = split | {"bridge": kg.first_bridge(split)}
    ex = pipeline.map_batches(
      lambda b: step(params, b), split, a.batch_size, pad, columns=("bridge",)
    )
    for name, result in ex.items():
      out.setdefault(name, {})[split_name] = summarize[name](result, split)
  return out


def lens_phases(config, workdir: Path, probes, pad) -> list[dict]:
  """The logit lens on each grokking phase's checkpoint (phases.json), in step
  order: [{"phase", "step", "logit_lens": {split: summary}}]; phases whose
  checkpoint is gone are left out."""
  out, lens_step = [], None
  for phase, step in sorted(grokking.load(workdir).items(), key=lambda x: x[1]):
    if not (workdir / "checkpoints" / str(step)).is_dir():  # e.g. set aside
      continue
    try:
      _, graphdef, params, _ = evaluate.restore_params(config, workdir, step)
    except ConfigError as e:  # a damaged checkpoint: the other phases still count
      print(f"logit lens: phase {phase} left out: {e}")
      continue
    if lens_step is None:  # compiled once for every phase's params
      lens_step = traced_step(config, graphdef, pad, ["logit_lens"])
    lens = trace_all(config, lens_step, params, probes, pad)
    out.append({"phase": phase, "step": step, **lens})
  return out
