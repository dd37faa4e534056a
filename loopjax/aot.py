"""Ahead-of-time check of a config on a target mesh, on this machine's CPU.

  python -m loopjax.aot --config=experiments/sysgen.py:paper --devices=64 \\
      --config.mesh.data=8 --config.mesh.fsdp=4 --config.mesh.tensor=2

Forces `--devices` CPU devices, builds the mesh from the config, and lowers and
compiles the train step for it from abstract shapes (nothing is initialized,
no data are generated: the vocabulary and sequence length come from the
config). Mesh, rule and shape errors show here instead of on pod time; the
report gives each device's memory for the step (arguments = its shard of the
state and batch, temporaries, outputs; XLA:CPU's accounting, a guide for an
accelerator's) and the specs of the largest parameters.

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
flags.DEFINE_integer("devices", 8, "CPU devices to force (the target mesh's size).")
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


def check_pretrained(config, num_devices: int) -> dict:
  """A pretrained model's (`model.hf_dir`: config.json is all it reads):
  lowers and compiles the MECH analyses' streamed pass to analyze.max_depth
  recurrences over analyze.batch_size prompts of data.seq_len tokens, and
  the forward at model.num_loops, its params in model.dtype sharded by the
  rules; returns their memory reports."""
  import jax
  import numpy as np

  from loopjax import sharding
  from loopjax import task as task_lib
  from loopjax.analysis import depth_scan
  from loopjax.pretrained import load

  m, rules = config.model, tuple(config.sharding.rules)
  config.mesh.devices = num_devices
  mesh = sharding.make_mesh(config.mesh)
  cfg, model = load.abstract(
    m.hf_dir, m, mesh, rules, load.split(config), m.num_loops, m.dtype
  )
  B, T, put = config.analyze.batch_size, config.data.seq_len, sharding.replicated(mesh)
  family = task_lib.for_config(config)
  batch = _batch(family, config, family.without_examples(config), B, put) | {
    "real": jax.ShapeDtypeStruct((B, T), bool, sharding=put)
  }
  tokens = batch["inputs"]

  def analysis(model, batch):
    with sharding.active(mesh, rules):
      key = jax.random.key(config.seed)  # a random first state (Huginn's)
      return depth_scan.run(model.module(), batch, config.analyze.max_depth, key)

  def forward(model, tokens_BT):
    with sharding.active(mesh, rules):
      key = jax.random.key(config.seed)
      return model.module()(tokens_BT, None, num_loops=cfg.num_loops, key=key)

  passes = {
    f"analysis, {config.analyze.max_depth} recurrences": (analysis, batch),
    f"forward, {cfg.num_loops} recurrences": (forward, tokens),
  }
  out = {"mesh": dict(mesh.shape), "batch": [B, T], "passes": {}}
  for name, (fn, arg) in passes.items():
    mem = jax.jit(fn).lower(model, arg).compile().memory_analysis()
    out["passes"][name] = {
      "arguments": mem.argument_size_in_bytes,
      "temporaries": mem.temp_size_in_bytes,
      "outputs": mem.output_size_in_bytes,
    }
  params = jax.tree_util.tree_flatten_with_path(model.params)[0]
  out["params"] = sum(int(np.prod(x.shape)) for _, x in params)
  return out


def check(config, num_devices: int) -> dict:
  """Lowers and compiles the train step; returns the memory report."""
  import jax
  import numpy as np

  from loopjax import sharding, state, train
  from loopjax import task as task_lib

  family = task_lib.for_config(config)
  task = family.without_examples(config)
  config.mesh.devices = num_devices  # the target's, whatever the variant says
  mesh = sharding.run_mesh(config).mesh
  graphdef, abstract, tx, shardings = state.sharded_train_state(
    config, task, mesh, abstract=True
  )
  step = train.make_train_step(config, graphdef, tx, mesh, shardings)
  B, put = config.train.batch_size, sharding.batch_sharding(mesh, config.sharding.rules)
  batch = _batch(family, config, task, B, put)
  compiled = step.lower(abstract, batch).compile()
  mem = compiled.memory_analysis()
  params = jax.tree_util.tree_flatten_with_path(abstract["params"])[0]
  largest = sorted(params, key=lambda p: -int(np.prod(p[1].shape)))[:6]
  return {
    "mesh": dict(mesh.shape),
    "arguments": mem.argument_size_in_bytes,
    "temporaries": mem.temp_size_in_bytes,
    "outputs": mem.output_size_in_bytes,
    "largest": [
      (jax.tree_util.keystr(path), x.shape, tuple(x.sharding.spec))
      for path, x in largest
    ],
  }


def main(argv):
  del argv
  from loopjax import config as config_lib
  from loopjax.errors import ConfigError, exit_with

  config = FLAGS.config
  try:
    config_lib.validate(config)
    if config.model.hf_dir:
      report = check_pretrained(config, FLAGS.devices)
    else:
      report = check(config, FLAGS.devices)
  except ConfigError as e:
    exit_with(str(e))
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  if config.model.hf_dir:
    print(
      f"{config.model.hf_dir}: {report['params'] / 1e9:.2f}B params in "
      f"{config.model.dtype}, batch {report['batch'][0]} x {report['batch'][1]} "
      f"tokens, mesh {mesh} ({FLAGS.devices} CPU devices)"
    )
    print("memory per device (XLA:CPU): arguments, temporaries, outputs")
    for name, mem in report["passes"].items():
      print(f"  {name:<28} " + ", ".join(_gib(mem[k]) for k in mem))
    return
  print(f"compiled the train step for mesh {mesh} ({FLAGS.devices} CPU devices)")
  print("memory per device (XLA:CPU):")
  for k in ("arguments", "temporaries", "outputs"):
    print(f"  {k:<12} {_gib(report[k])}")
  print("largest parameters: shape -> spec")
  for name, shape, spec in report["largest"]:
    print(f"  {name:<36} {shape} -> {spec}")


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
