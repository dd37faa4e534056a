"""Train-step benchmarks: loopjax's real jitted step, and the PyTorch reference."""

import time

import jax

from loopjax import task as task_lib
from loopjax.bench.measure import (
  device_memory,
  model_flops,
  random_batch,
  timed_side_by_side,
)
from loopjax.compiled import memory
from loopjax.state import build_model, init_state, make_optimizer
from loopjax.train import make_train_step


def dims(config) -> tuple[int, int]:
  """(vocab size, sequence length) of the config's task, from the config alone."""
  return task_lib.for_config(config).without_examples(config).model_dims()


def jax_step(config) -> dict:
  """Compile time, seconds per step, FLOPs (ours and XLA's) and memory of one step."""
  return side_by_side(config, torch=False)["jax"]


def side_by_side(config, torch: bool) -> dict:
  """{"jax": `jax_step`'s results, "torch": the same model and optimizer's
  step in PyTorch eager (with `torch`)}, the two timed in alternating windows."""
  call, out = _jax_program(config)
  calls = {"jax": call}
  if torch:
    calls["torch"] = _torch_program(config)
  b = config.bench
  times = timed_side_by_side(calls, warmup=b.warmup, steps=b.steps, repeats=b.repeats)
  measured = [
    m["peak_bytes_in_use"] for m in device_memory() if "peak_bytes_in_use" in m
  ]
  # The allocator's own peak where the backend reports one (GPU, TPU): what
  # the step really used, beside XLA's estimate.
  out |= {"device_peak_bytes": max(measured)} if measured else {}
  return {"jax": out | times["jax"], **({"torch": times["torch"]} if torch else {})}


def _jax_program(config):
  """The compiled step as a blocking call, and what compiling it measured."""
  V, T = dims(config)
  model = build_model(config.model, V, T, config.seed)
  tx = make_optimizer(config.train)
  graphdef, state = init_state(model, tx, config.seed)
  step = make_train_step(config, graphdef, tx)
  batch = jax.device_put(random_batch(config, V, T))
  t = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  mem = memory(compiled)
  holder = [state]

  def call():  # blocks on the loss, as the training loop's metric fetch does
    holder[0], metrics = compiled(holder[0], batch)
    metrics["train/loss"].block_until_ready()

  return call, {
    "compile_s": compile_s,
    "flops": model_flops(config, T, V),
    "xla_flops": float(cost["flops"]),
    "temp_bytes": mem["temporaries"],
    "peak_bytes": mem["peak"],
  }


def _torch_program(config):
  """A step of the same model and optimizer in PyTorch eager, as a call."""
  from loopjax.bench import torch_ref

  V, T = dims(config)
  step = torch_ref.make_train_step(config, V, T)
  batch = torch_ref.to_torch(random_batch(config, V, T))
  return lambda: step(batch)
