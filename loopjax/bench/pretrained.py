"""`python -m loopjax.bench pretrained`: a pretrained family at full size with
random weights (`restore.abstract` of `model.hf_dir`: config.json is all it
reads, e.g. experiments/hf_shapes/huginn-0125), placed by the run's sharding rules and
run as `--mode=analyze` and sampling's prefill run it: the forward at
model.num_loops recurrences and the streamed analysis pass to
analyze.max_depth, over analyze.batch_size prompts of data.seq_len tokens.
Reports compile seconds, seconds per prompt, XLA's memory and the device's
peak: what the accelerator check records for Huginn-0125 on a GPU.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import restore, sharding
from loopjax.analysis import depth_scan
from loopjax.bench import measure
from loopjax.state import Model


def random_model(config):
  """(model config, Model, vocab size): config.json's shapes, random weights
  made on the devices where the rules put them (norm scales one, the rest
  N(0, 0.02^2))."""
  cfg, shapes, vocab = restore.abstract(config, sharding.make_mesh(config.mesh))
  leaves, tree = jax.tree.flatten(shapes.params)

  def init(key):
    keys = jax.random.split(key, len(leaves))
    return [
      jnp.ones(x.shape, x.dtype)
      if x.ndim == 1
      else (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
      for k, x in zip(keys, leaves, strict=True)
    ]

  out = jax.jit(init, out_shardings=[x.sharding for x in leaves])(jax.random.key(0))
  model = Model(shapes.graphdef, jax.tree.unflatten(tree, out), shapes.dtype)
  return cfg, model, vocab


def _timed_pass(fn, *args, prompts: int) -> dict:
  t = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t
  jax.block_until_ready(compiled(*args))  # warm
  s = measure.timed(
    lambda: jax.block_until_ready(compiled(*args)), warmup=0, steps=2, repeats=1
  )
  mem = compiled.memory_analysis()
  return {
    "compile_s": compile_s,
    "seconds": s,
    "seconds_per_prompt": s / prompts,
    "temp_bytes": mem.temp_size_in_bytes,
    "argument_bytes": mem.argument_size_in_bytes,
  }


def bench(config) -> dict:
  t = time.perf_counter()
  cfg, model, V = random_model(config)
  jax.block_until_ready(model.params)
  place_s = time.perf_counter() - t
  B, T, depth = config.analyze.batch_size, config.data.seq_len, config.analyze.max_depth
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, (B, T + 1)).astype(np.int32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "mask": np.ones((B, T), np.float32),
    "segments": np.zeros((B, T), np.int32),
    "real": np.ones((B, T), bool),
  }
  key = jax.random.key(config.seed)
  mesh, rules = sharding.make_mesh(config.mesh), tuple(config.sharding.rules)

  def forward(model, tokens_BT, key):
    with sharding.active(mesh, rules):
      return model.module()(tokens_BT, None, num_loops=cfg.num_loops, key=key)

  def analysis(model, batch, key):
    with sharding.active(mesh, rules):
      return depth_scan.run(model.module(), batch, depth, key)

  out = {
    "hf_dir": restore.name(config),
    "dtype": config.model.dtype,
    "params": sum(x.size for x in jax.tree.leaves(model.params)),
    "batch": [B, T],
    "place_s": place_s,
    f"forward_r{cfg.num_loops}": _timed_pass(
      forward, model, batch["inputs"], key, prompts=B
    ),
    f"analysis_r{depth}": _timed_pass(analysis, model, batch, key, prompts=B),
    "device_memory": measure.device_memory(),
  }
  for name in (k for k in out if k.startswith(("forward", "analysis"))):
    r = out[name]
    print(
      f"{name}: compile {r['compile_s']:.1f} s, {r['seconds_per_prompt']:.3f} s per "
      f"prompt, temporaries {r['temp_bytes'] / 2**30:.2f} GiB"
    )
  return out
