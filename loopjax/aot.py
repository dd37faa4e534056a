"""Ahead-of-time check of a config on a target mesh, from this machine's CPU.

  python -m loopjax.aot --config=experiments/lm.py:gpu --target=tpu:v5e:4x4 \
      --config.mesh.data=4 --config.mesh.fsdp=4
  python -m loopjax.aot --config=experiments/sysgen.py:paper --devices=64 \
      --config.mesh.data=8 --config.mesh.fsdp=4 --config.mesh.tensor=2

`--target=tpu:GEN:AxB[:SLICES]` compiles for a TPU slice's chips with libtpu
(the `tpu` extra; loopjax/targets.py), with the kernels the slice would run;
without it, for `--devices` forced CPU devices (XLA:CPU's kernels and memory
accounting, a guide for an accelerator's). The mesh is built from the config,
and the train step lowered and compiled from abstract shapes (nothing is
initialized, no data are generated: the vocabulary and sequence length come
from the config). Mesh, rule and shape errors show here instead of on pod
time. The report, per device: memory (arguments = its shard of the state and
batch, temporaries, outputs, peak) against the chip's, compile time, the
collectives in the compiled HLO, XLA's warnings (on a target an involuntary
rematerialization fails the check unless --allow_remat), and on a target the
step time the chips' peak FLOP/s and HBM bandwidth bound it to.

A pretrained model (`model.hf_dir`, of which only config.json is read:
experiments/hf_shapes holds the published models' shapes) instead compiles
its analysis pass and forward (`check_pretrained`):

  python -m loopjax.aot --config=experiments/pretrained.py:huginn --devices=1 \
      --config.model.hf_dir=experiments/hf_shapes/huginn-0125 --config.mesh.data=1
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "Experiment config file[:variant].")
flags.DEFINE_integer("devices", 8, "CPU devices to force (without --target).")
flags.DEFINE_string(
  "target",
  "",
  "tpu:GEN:AxB[:SLICES] (a TPU slice, e.g. tpu:v5e:4x4) or "
  "gpu:MODEL:SxHxG (slices x hosts x GPUs, e.g. gpu:h200:1x2x8).",
)
flags.DEFINE_bool(
  "allow_remat",
  False,
  "--target: pass a compile in which XLA rematerializes a tensor whole (on "
  "forced CPU devices it is reported only).",
)
flags.DEFINE_string("json", "", "Also write the report to this file.")
FLAGS = flags.FLAGS


def _gib(n: int) -> str:
  return f"{n / 2**30:.3f} GiB"


def _batch(family, config, task, B: int, put) -> dict:
  """The family's batch of B rows as abstract arrays placed by `put`."""
  import jax

  return {
    k: jax.ShapeDtypeStruct(shape, dtype, sharding=put)
    for k, (shape, dtype) in family.batch_shapes(config, task, B).items()
  }


def _compile(lowered, what: str, target: str, fields: str):
  """`lowered` compiled; a program the target's compiler finds too big for a
  chip (TPU's refuses at compile time) is a ConfigError naming the `fields`
  that size it."""
  import jax

  from loopjax.errors import ConfigError, first_line

  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise ConfigError(
      f"{fields}: {what} does not fit "
      f"{target}: {first_line(e).removeprefix('RESOURCE_EXHAUSTED: ')}"
    ) from None


def _passes(passes: dict, target: str, fields: str) -> tuple[dict, list]:
  """Compiles each of `passes` ({name: (jitted fn, args)}): ({name: memory
  and compile time}, XLA's rematerialization warnings)."""
  import time

  from loopjax import compiled

  out, remat = {}, []
  for name, (fn, args) in passes.items():
    t = time.perf_counter()
    with compiled.logged() as log:
      executable = _compile(fn.lower(*args), f"the {name} pass", target, fields)
    out[name] = compiled.memory(executable) | {"compile_s": time.perf_counter() - t}
    remat += [x for x in log if compiled.REMAT in x]
  return out, remat


def _analysis(config, mesh, family, task, model) -> tuple:
  """The MECH analyses' streamed pass (`depth_scan`) to analyze.max_depth
  iterations over analyze.batch_size windows, on every device whole:
  (name, (jitted fn, args))."""
  import jax

  from loopjax import sharding
  from loopjax.analysis import depth_scan

  a, rules, put = (
    config.analyze,
    tuple(config.sharding.rules),
    sharding.replicated(mesh),
  )
  B, T = a.batch_size, task.seq_len
  batch = _batch(family, config, task, B, put) | {
    "real": jax.ShapeDtypeStruct((B, T), bool, sharding=put)
  }

  def analysis(model, batch):
    with sharding.active(mesh, rules):
      key = jax.random.key(config.seed)  # a random first state (Huginn's)
      return depth_scan.run(model.module(), batch, a.max_depth, key)

  name = f"analysis, {a.max_depth} iterations, {B} x {T} tokens"
  return name, (jax.jit(analysis), (model, batch))


def check_pretrained(config, devices, target=None) -> dict:
  """A pretrained model's (`model.hf_dir`: config.json is all it reads):
  lowers and compiles the MECH analyses' streamed pass to analyze.max_depth
  recurrences over analyze.batch_size prompts of data.seq_len tokens, and
  the forward at model.num_loops, its params in model.dtype sharded by the
  rules; returns each one's memory, compile time and XLA's warnings."""
  import jax
  import numpy as np

  from loopjax import sharding
  from loopjax import task as task_lib
  from loopjax.pretrained import load

  m, rules = config.model, tuple(config.sharding.rules)
  mesh = sharding.make_mesh(config.mesh, devices)
  cfg, model = load.abstract(
    m.hf_dir, m, mesh, rules, load.split(config), m.num_loops, m.dtype
  )
  family = task_lib.for_config(config)
  task = family.without_examples(config)
  name, analysis = _analysis(config, mesh, family, task, model)
  tokens = analysis[1][1]["inputs"]

  def forward(model, tokens_BT):
    with sharding.active(mesh, rules):
      key = jax.random.key(config.seed)
      return model.module()(tokens_BT, None, num_loops=cfg.num_loops, key=key)

  where = target.name if target else f"cpu:{len(devices)}"
  passes, remat = _passes(
    {
      name: analysis,
      f"forward, {cfg.num_loops} iterations": (jax.jit(forward), (model, tokens)),
    },
    where,
    "analyze.batch_size, analyze.max_depth, data.seq_len, mesh",
  )
  out = {
    "target": where,
    "capacity": target.bytes_per_device if target else None,
    "mesh": dict(mesh.shape),
    "batch": list(tokens.shape),
    "passes": passes,
    "rematerialized": remat,
  }
  params = jax.tree_util.tree_flatten_with_path(model.params)[0]
  out["params"] = sum(int(np.prod(x.shape)) for _, x in params)
  return out


def _other_passes(config, family, task, mesh, graphdef, abstract, shardings) -> dict:
  """A run's passes besides the train step: evaluation at its deepest
  iteration count over eval.batch_size rows (rounded up to the batch's
  split, as the evaluators do), and the streamed analysis pass where the
  run's analyses use it."""
  import math

  from loopjax import config as config_lib
  from loopjax import sharding, state
  from loopjax.names import LM_STREAMED

  rules = tuple(config.sharding.rules)
  split = sharding.batch_split(mesh, rules)
  B = split * math.ceil(config.eval.batch_size / split)
  batch = _batch(family, config, task, B, sharding.batch_sharding(mesh, rules))
  step = family.eval_step(config, graphdef, mesh, shardings["params"])
  out = {f"evaluation, {B} rows": (step, (abstract["params"], batch))}
  if not family.reads_every_position:  # a language model's windows below
    return out
  model = state.Model(graphdef, abstract["params"], config.model.dtype)
  if set(config_lib.analyses(config)) & set(LM_STREAMED):
    name, analysis = _analysis(config, mesh, family, task, model)
    out[name] = analysis
  return out | _sampling(config, task, model)


def _sampling(config, task, model) -> dict:
  """`--mode=sample`'s two programs for one prompt of half a window, its
  cache as long as the window: the prefill and one new token."""
  import jax
  import jax.numpy as jnp

  from loopjax.lm import sample

  T, S, R = task.seq_len // 2, task.seq_len, config.model.num_loops
  cache = jax.eval_shape(lambda m: m.module().init_cache(1, S, R, m.dtype), model)
  key = jax.eval_shape(lambda: jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
  token, offset = jax.ShapeDtypeStruct((1,), jnp.int32), jnp.int32(T)
  return {
    f"sampling, prefill of {T} tokens": (sample.prefill, (model, tokens, cache, key)),
    f"sampling, one token (cache of {S})": (
      sample.decode_step,
      (model, token, cache, offset, key),
    ),
  }


def check(config, devices, target=None) -> dict:
  """Lowers and compiles the train step for a mesh over `devices`; returns
  the report (`target`: the chips' figures, if they are a target's)."""
  import time

  import jax
  import numpy as np

  from loopjax import compiled as compiled_lib
  from loopjax import sharding, state, train
  from loopjax import task as task_lib
  from loopjax.bench import measure

  family = task_lib.for_config(config)
  task = family.without_examples(config)
  mesh = sharding.run_mesh(config, devices).mesh
  graphdef, abstract, tx, shardings = state.sharded_train_state(
    config, task, mesh, abstract=True
  )
  step = train.make_train_step(config, graphdef, tx, mesh, shardings)
  B, put = config.train.batch_size, sharding.batch_sharding(mesh, config.sharding.rules)
  batch = _batch(family, config, task, B, put)
  report_target = target.name if target else f"cpu:{len(devices)}"
  t = time.perf_counter()
  with compiled_lib.logged() as log:
    compiled = _compile(
      step.lower(abstract, batch),
      "the train step",
      report_target,
      "train.batch_size, data.seq_len, mesh, model.remat",
    )
  params = jax.tree_util.tree_flatten_with_path(abstract["params"])[0]
  largest = sorted(params, key=lambda p: -int(np.prod(p[1].shape)))[:6]
  report = {
    "target": report_target,
    "mesh": dict(mesh.shape),
    "compile_s": time.perf_counter() - t,
    "memory": compiled_lib.memory(compiled),
    "collectives": compiled_lib.collectives(compiled.as_text()),
    "rematerialized": [x for x in log if compiled_lib.REMAT in x],
    "largest": [
      (jax.tree_util.keystr(path), x.shape, tuple(x.sharding.spec))
      for path, x in largest
    ],
  }
  report["passes"], remat = _passes(
    _other_passes(config, family, task, mesh, graphdef, abstract, shardings),
    report_target,
    "eval.batch_size, analyze.batch_size, analyze.max_depth, data.seq_len, mesh",
  )
  report["rematerialized"] += remat
  if target is None:
    return report
  V, T = task.model_dims()
  flops = measure.model_flops(config, T, V) / len(devices)  # per device
  cost = compiled.cost_analysis()  # None from XLA's GPU compiler
  cost = (cost[0] if isinstance(cost, list) else cost) or {}
  moved = float(cost.get("bytes accessed", 0.0))
  bound = {
    "compute_s": flops / target.peak_flops_per_device,
    "hbm_s": moved / target.hbm_bytes_per_s_per_device,  # 0: not reported
  }
  return report | {
    "capacity": target.bytes_per_device,
    "model_flops_per_device": flops,
    "xla_bytes_accessed": moved,
    "step_s_bound": bound,
    "mfu_bound": bound["compute_s"] / max(bound.values()) if moved else None,
  }


def _pass_lines(passes: dict, cap) -> list[str]:
  """Each pass's memory per device (arguments, temporaries, outputs, peak),
  compile time and, on a target, whether it fits."""
  out = []
  for name, mem in passes.items():
    line = f"  {name}: " + ", ".join(_gib(mem[k]) for k in list(mem)[:4])
    line += f"; {mem['compile_s']:.1f} s"
    if cap is not None:
      fits = "fits" if mem["peak"] <= cap else "DOES NOT FIT"
      line += f"; {fits}, headroom {_gib(cap - mem['peak'])}"
    out.append(line)
  return out


def _pretrained_table(report: dict, config) -> list[str]:
  """A pretrained model's passes as lines."""
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  B, T = report["batch"]
  out = [
    f"{config.model.hf_dir}: {report['params'] / 1e9:.2f}B params in "
    f"{config.model.dtype}, batch {B} x {T} tokens, mesh {mesh} on "
    f"{report['target']}",
    "memory per device (arguments, temporaries, outputs, peak); compile time:",
  ]
  out += _pass_lines(report["passes"], report["capacity"])
  if n := len(report["rematerialized"]):
    out.append(f"XLA rematerialized {n} tensor(s) whole to reshard them (stderr)")
  return out


def _table(report: dict) -> list[str]:
  """The train step's report as lines."""
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  mem, cap = report["memory"], report.get("capacity")
  where = f"{report['target']} ({'XLA:CPU' if cap is None else 'compiled for it'})"
  out = [
    f"compiled the train step for mesh {mesh} on {where} in "
    f"{report['compile_s']:.1f} s",
    "memory per device:",
  ]
  out += [f"  {k:<12} {_gib(mem[k])}" for k in mem]
  if cap is not None:
    verdict = "fits" if mem["peak"] <= cap else "DOES NOT FIT"
    out.append(
      f"  {'capacity':<12} {_gib(cap)}: {verdict}, headroom {_gib(cap - mem['peak'])}"
    )
  coll = report["collectives"]
  out.append(
    "collectives per step: "
    + (
      ", ".join(
        f"{k} {v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in coll.items()
      )
      or "none"
    )
  )
  if cap is not None:
    b = report["step_s_bound"]
    line = (
      f"step time bound: compute {b['compute_s'] * 1e3:.2f} ms (model FLOPs at peak)"
    )
    if report["mfu_bound"] is None:
      line += "; bytes accessed: not reported by this compiler"
    else:
      line += (
        f", HBM {b['hbm_s'] * 1e3:.2f} ms (XLA's bytes; a rolled scan's body "
        f"counted once): MFU at most {report['mfu_bound']:.0%}"
      )
    out.append(line)
  out.append("other passes, memory per device (arguments, temporaries, outputs, peak):")
  out += _pass_lines(report["passes"], cap)
  if n := len(report["rematerialized"]):
    out.append(f"XLA rematerialized {n} tensor(s) whole to reshard them (stderr)")
  out.append("largest parameters: shape -> spec")
  out += [f"  {name:<36} {shape} -> {spec}" for name, shape, spec in report["largest"]]
  return out


def main(argv):
  del argv
  import json

  import jax

  from loopjax import compiled, targets
  from loopjax import config as config_lib
  from loopjax.errors import ConfigError, exit_with
  from loopjax.pretrained import init_from

  # A cached executable skips the compile and with it XLA's warnings and time.
  jax.config.update("jax_enable_compilation_cache", False)
  config = FLAGS.config
  try:
    if config.model.init_from:  # its shapes; the compile reads no tensor
      config = init_from.resolve(config, tokenizer=False)
      config.model.update(init_from="", hf_split="")
    config_lib.validate(config)
    target = targets.make(FLAGS.target) if FLAGS.target else None
    devices = target.devices if target else jax.devices()
    if config.model.hf_dir:
      report = check_pretrained(config, devices, target)
    else:
      report = check(config, devices, target)
  except ConfigError as e:
    exit_with(str(e))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report, f, indent=2, default=str)
  pretrained = config.model.hf_dir
  print("\n".join(_pretrained_table(report, config) if pretrained else _table(report)))
  on_target, remat = target is not None, report["rematerialized"]
  if (why := compiled.refusal(remat, on_target, FLAGS.allow_remat)) is not None:
    exit_with(why, code=1)


if __name__ == "__main__":
  # Devices are fixed when JAX starts: set them before anything imports it.
  n = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "8")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from loopjax import xla

  xla.apply_defaults()
  app.run(main)
