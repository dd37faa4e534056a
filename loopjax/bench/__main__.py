"""Benchmarks (not timed tests). Results print as a table and go to --out as JSON.

  python -m loopjax.bench step --config=experiments/bench.py[:size] --torch
  python -m loopjax.bench scaling --config=experiments/bench.py --depths=4,16,64
  taskset -c 0 python -m loopjax.bench data --config=experiments/sysgen.py:paper
  python -m loopjax.bench generation --config=experiments/lm.py:cpu
  python -m loopjax.bench first_step --config=experiments/sysgen.py:paper
  python -m loopjax.bench storage --config=experiments/sysgen.py:cpu \
      --config.train.num_steps=10000 --config.checkpoint.every=1000
  python -m loopjax.bench accelerator --out=DIR [--smoke]

`step`: loopjax's train step (examples/s, tokens/s, FLOP/s, MFU against the
measured matmul peak, compile time, XLA's memory estimate), and with --torch the
same model and optimizer in PyTorch eager (the two timed in alternating
windows), with the speed ratio. `scaling`:
compile and step time, and memory with and without remat, across depths R.
`data`: generation time of a config's dataset (in memory). `depth`: a sampled
depth (one program: a scan to R_max whose iterations past the depth are
skipped, or masked) against fixed R, which is also what a cache of one
compiled program per depth would run. `halting`: inference
with adaptive halting's `while_loop` against the fixed scan at equal iterations.
`devices`: what JAX sees and each device's memory. `pretrained`: a pretrained
family at full size with random weights, its forward and analysis pass
(loopjax/bench/pretrained.py). `attention`: one attention layer's forward
and backward by each kernel the backend runs, against XLA's
(loopjax/bench/attention.py). `generation`: batched decoding of prompts of
different lengths against one at a time (loopjax/bench/generation.py).
`first_step`: time to the first step of a fresh start against restarts with
and without the compilation cache (loopjax/bench/first_step.py).
`storage`: the train step without checkpoints, saving to a disk and saving
to a bucket (a GCS emulator), and the bytes its logs upload
(loopjax/bench/storage.py).
`accelerator`: the parts of
the accelerator check (loopjax/bench/accelerator.py), each in its own process,
--out a directory.
"""

import copy
import json
import sys
import time

import jax
import numpy as np
from absl import flags

from loopjax import cli, recurrence
from loopjax import config as config_lib
from loopjax.bench import (
  accelerator,
  attention,
  first_step,
  generation,
  measure,
  pretrained,
  steps,
  storage,
)
from loopjax.data import kg, tfds_kg
from loopjax.errors import ConfigError

FLAGS = flags.FLAGS  # --config: cli's, loaded as every entry point loads it
_TORCH = flags.DEFINE_bool("torch", False, "Also time the PyTorch reference.")
_DEPTHS = flags.DEFINE_list("depths", ["4", "16", "64"], "`scaling`: depths R.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_SMOKE = flags.DEFINE_bool("smoke", False, "`accelerator`: tiny shapes, any machine.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "`generation`: prompts in the batch.")
_NEW = flags.DEFINE_integer("new_tokens", 32, "`generation`: tokens per prompt.")


def bench_step(config) -> dict:
  peak = measure.matmul_peak(config.model.dtype)
  out = {
    "size": config.get("size"),
    "matmul_peak_flops": peak,
    **steps.side_by_side(config, torch=_TORCH.value),
  }
  B, T = config.train.batch_size, steps.dims(config)[1]
  print(
    f"{'':8}{'step ms':>9}{'ex/s':>9}{'tok/s':>9}{'GFLOP/s':>9}{'MFU':>7}"
    f"{'compile s':>11}{'peak MB':>9}"
  )
  for impl in ("jax", "torch"):
    if impl not in out:
      continue
    r = out[impl]
    r |= {
      "examples_per_s": B / r["step_s"],
      "tokens_per_s": B * T / r["step_s"],
      "flops_per_s": out["jax"]["flops"] / r["step_s"],
    }
    r["mfu"] = r["flops_per_s"] / peak["jax"]
    mem = f"{r['peak_bytes'] / 2**20:9.1f}" if "peak_bytes" in r else f"{'-':>9}"
    comp = f"{r['compile_s']:11.2f}" if "compile_s" in r else f"{'-':>11}"
    print(
      f"{impl:8}{r['step_s'] * 1e3:9.2f}{r['examples_per_s']:9.0f}"
      f"{r['tokens_per_s']:9.0f}{r['flops_per_s'] / 1e9:9.1f}{r['mfu']:7.1%}"
      f"{comp}{mem}"
    )
  if "torch" in out:
    out["speedup_vs_torch"] = out["torch"]["step_s"] / out["jax"]["step_s"]
    print(f"loopjax is {out['speedup_vs_torch']:.2f}x PyTorch eager's speed")
  print(
    f"matmul peak ({peak['n']}^3 {peak['dtype']}): jax {peak['jax'] / 1e9:.0f} GFLOP/s"
    + (f", torch {peak['torch'] / 1e9:.0f} GFLOP/s" if "torch" in peak else "")
  )
  return out


def bench_scaling(config) -> dict:
  rows = []
  print(f"{'R':>4}{'remat':>7}{'compile s':>11}{'step ms':>9}{'peak MB':>9}")
  for R in map(int, _DEPTHS.value):
    for remat in ("none", "full"):
      c = copy.deepcopy(config)
      c.model.update(num_loops=R, remat=remat)
      c.bench.update(warmup=2, steps=max(2, 4 * c.bench.steps // R))
      r = steps.jax_step(c) | {"num_loops": R, "remat": remat}
      rows.append(r)
      print(
        f"{R:4}{remat:>7}{r['compile_s']:11.2f}{r['step_s'] * 1e3:9.2f}"
        f"{r['peak_bytes'] / 2**20:9.1f}"
      )
  return {"size": config.get("size"), "rows": rows}


def bench_depth(config) -> dict:
  """Sampled depth vs fixed R, per-depth compile cache, truncated backprop."""
  dd = dict(dist="poisson", mean=4.0, min=2, max=8, sigma=0.5)
  keys = jax.random.split(jax.random.key(0), 10_000)
  draws = np.asarray(
    jax.vmap(lambda k: recurrence.sample_depth(k, *list(dd.values())[:4]))(keys)
  )
  p = {d: float((draws == d).mean()) for d in range(dd["min"], dd["max"] + 1)}
  rows = []
  print(f"{'regime':40}{'compile s':>11}{'step ms':>9}")

  def row(name, compile_s, step_s):
    rows.append({"regime": name, "compile_s": compile_s, "step_s": step_s})
    print(f"{name:40}{compile_s:11.2f}{step_s * 1e3:9.2f}")
    return rows[-1]

  def run(name, model=None, train=None):
    c = copy.deepcopy(config)
    c.model.update(model or {})
    c.train.update(train or {})
    r = steps.jax_step(c)
    return row(name, r["compile_s"], r["step_s"])

  fixed = {d: run(f"fixed R={d}", model={"num_loops": d}) for d in p}
  row(
    "cache: one program per depth",
    sum(fixed[d]["compile_s"] for d in p),
    sum(p[d] * fixed[d]["step_s"] for d in p),  # expected over sampled depths
  )
  for how in ("skip", "mask"):  # model.past_depth, whatever auto picks here
    run(f"sampled ({how}): Poisson(4) in [2, 8]", {"past_depth": how}, {"depth": dd})
  run("sampled + backprop last 2", train={"depth": dd, "backprop_depth": 2})
  return {"size": config.get("size"), "depth": dd, "p_depth": p, "rows": rows}


def bench_halting(config) -> dict:
  """Forward pass to R = 16: lax.scan vs halting's while_loop (criterion fixed,
  so both run 16 iterations) and the KL+entropy rule, which may stop early."""
  from flax import nnx

  from loopjax import halting
  from loopjax.state import build_model

  R, (V, T) = 16, steps.dims(config)
  model = build_model(config.model, V, T, config.seed)
  graphdef, params = nnx.split(model)
  b = measure.random_batch(config, V, T)
  tokens, pos = jax.device_put(b["inputs"]), jax.device_put(b["answer_pos"])
  programs = {
    "scan, R=16": lambda p: nnx.merge(graphdef, p)(tokens, pos, num_loops=R),
    "while_loop, R=16 (fixed)": lambda p: halting.adaptive(
      nnx.merge(graphdef, p), tokens, pos, halting.Rule("fixed"), r_max=R
    )[0],
    "while_loop, kl_entropy": lambda p: halting.adaptive(
      nnx.merge(graphdef, p), tokens, pos, r_max=R
    )[0],
  }
  rows = []
  print(f"{'program':28}{'ms':>9}")
  for name, fn in programs.items():
    f = jax.jit(fn)
    run = lambda f=f: f(params).block_until_ready()  # noqa: E731
    ms = 1e3 * measure.timed(run, warmup=3, steps=20, repeats=5)
    rows.append({"program": name, "ms": ms})
    print(f"{name:28}{ms:9.2f}")
  ratio = rows[1]["ms"] / rows[0]["ms"]
  print(f"while_loop / scan at 16 iterations: {ratio:.3f}")
  return {"size": config.get("size"), "rows": rows, "while_over_scan": ratio}


def bench_data(config) -> dict:
  t = time.perf_counter()
  task = tfds_kg.generate(config.data)
  kg.fingerprint(task)
  seconds = time.perf_counter() - t
  n = sum(len(v["target"]) for v in task.splits.values())
  print(f"generated {n:,} examples in {seconds:.3f} s")
  return {"params": tfds_kg.params(config.data), "examples": n, "seconds": seconds}


def bench_devices(config) -> dict:
  del config
  memory = measure.device_memory()
  for row in memory:
    print(row)
  return {"devices": [str(d) for d in jax.devices()], "memory": memory}


# The benchmarks timed in `config.bench` windows.
TIMED = ("step", "scaling", "depth", "attention")
BENCHMARKS = {
  "step": bench_step,
  "scaling": bench_scaling,
  "data": bench_data,
  "depth": bench_depth,
  "halting": bench_halting,
  "devices": bench_devices,
  "pretrained": pretrained.bench,
  "attention": attention.bench,
  "generation": lambda c: generation.bench(c, _PROMPTS.value, _NEW.value),
  "first_step": lambda c: first_step.bench(
    c, [a for a in sys.argv[1:] if a.startswith("--config")]
  ),
  "storage": storage.bench,
}


def main(argv):
  if argv[1:] == ["accelerator"]:  # the parent of the parts: it starts no backend
    if not _OUT.value:
      raise ConfigError("accelerator: --out=DIR is required")
    report = accelerator.run(_OUT.value, smoke=_SMOKE.value)
    failed = [
      k for k, v in report["parts"].items() if v["status"] not in ("ok", "skipped")
    ]
    print(
      f"wrote {_OUT.value}/accelerator.json" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0
  if len(argv) != 2 or argv[1] not in BENCHMARKS:
    names = ", ".join([*BENCHMARKS, "accelerator"])
    raise ConfigError(f"expected one benchmark, one of {names}; got {argv[1:]}")
  config = FLAGS.config
  if config is None and argv[1] != "devices":
    raise ConfigError(f"{argv[1]}: --config is required")
  if argv[1] in TIMED and "bench" not in config:
    raise ConfigError(
      f"{argv[1]}: the config has no `bench` section (warmup, steps, repeats); "
      "use experiments/bench.py or experiments/lm.py, or add one"
    )
  if config is not None:  # a bad field is one line, before anything compiles
    config_lib.validate(config)
    config.unlock()  # benchmarks vary a copy's fields
  result = {
    "benchmark": argv[1],
    "machine": measure.machine(),
    **BENCHMARKS[argv[1]](config),
  }
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
