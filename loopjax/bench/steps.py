"""Train-step benchmarks: loopjax's real jitted step, and the PyTorch reference."""

import time

import jax

from loopjax.bench.measure import device_memory, model_flops, random_batch, timed
from loopjax.data.kg import Vocab
from loopjax.state import build_model, init_state, make_optimizer
from loopjax.train import make_train_step

SEQ_LEN = 3  # 2-hop composition: [h, r1, r2]


def vocab_size(config) -> int:
  return Vocab(config.data.num_entities, config.data.num_relations).vocab_size


def jax_step(config) -> dict:
  """Compile time, seconds per step, FLOPs (ours and XLA's) and memory of one step."""
  V = vocab_size(config)
  model = build_model(config.model, V, SEQ_LEN, config.seed)
  tx = make_optimizer(config.train)
  graphdef, state = init_state(model, tx, config.seed)
  step = make_train_step(config, graphdef, tx)
  batch = jax.device_put(random_batch(config, V, SEQ_LEN))
  t = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  mem = compiled.memory_analysis()
  holder = [state]

  def call():  # blocks on the loss, as the training loop's metric fetch does
    holder[0], metrics = compiled(holder[0], batch)
    metrics["train/loss"].block_until_ready()

  b = config.bench
  step_s = timed(call, warmup=b.warmup, steps=b.steps, repeats=b.repeats)
  measured = [
    m["peak_bytes_in_use"] for m in device_memory() if "peak_bytes_in_use" in m
  ]
  return {
    "compile_s": compile_s,
    "step_s": step_s,
    "flops": model_flops(config, SEQ_LEN, V),
    "xla_flops": float(cost["flops"]),
    "temp_bytes": mem.temp_size_in_bytes,
    "peak_bytes": mem.temp_size_in_bytes
    + mem.argument_size_in_bytes
    + mem.output_size_in_bytes
    - mem.alias_size_in_bytes,
    # The allocator's own peak where the backend reports one (GPU, TPU): what
    # the step really used, beside XLA's estimate above.
    **({"device_peak_bytes": max(measured)} if measured else {}),
  }


def torch_step(config) -> dict:
  """Seconds per step of the same model and optimizer in PyTorch eager."""
  from loopjax.bench import torch_ref

  V = vocab_size(config)
  step = torch_ref.make_train_step(config, V, SEQ_LEN)
  batch = torch_ref.to_torch(random_batch(config, V, SEQ_LEN))
  b = config.bench
  return {
    "step_s": timed(
      lambda: step(batch), warmup=b.warmup, steps=b.steps, repeats=b.repeats
    )
  }
