"""Timing, FLOP and memory measurements shared by the benchmarks."""

import os
import platform
import time

import jax
import numpy as np

from loopjax import task as task_lib


def timed(fn, *, warmup: int, steps: int, repeats: int) -> float:
  """Median over `repeats` of the mean seconds per call over `steps` calls.

  `fn()` must block until its work is done (e.g. `block_until_ready`) at least on
  its last call of a window, so that every window measures finished work.
  """
  times = timed_side_by_side({"fn": fn}, warmup=warmup, steps=steps, repeats=repeats)
  return times["fn"]["step_s"]


def timed_side_by_side(fns: dict, *, warmup: int, steps: int, repeats: int) -> dict:
  """`timed` for several functions, their windows taken in turn (a, b, a, b,
  ...), so a shared machine's slow drifts in speed hit each alike: per name,
  {"step_s": the median window, "windows_s": every window}."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  windows = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t = time.perf_counter()
      for _ in range(steps):
        fn()
      windows[name].append((time.perf_counter() - t) / steps)
  return {
    name: {"step_s": float(np.median(w)), "windows_s": w} for name, w in windows.items()
  }


def random_batch(config, vocab_size: int, seq_len: int) -> dict:
  """A training batch of the task's shapes (tokens are random: speed only)."""
  rng = np.random.default_rng(config.seed)
  return task_lib.for_config(config).random_batch(config, rng, vocab_size, seq_len)


def model_flops(config, seq_len: int, vocab_size: int) -> float:
  """Training FLOPs per step, counted the usual way: 3x the forward's matmuls.

  XLA's cost analysis counts a rolled loop's body once, so it undercounts
  looped models; this count does not depend on how the loop is compiled.
  """
  m, B, T = config.model, config.train.batch_size, seq_len
  d = m.d_model
  layers = m.num_layers * m.num_loops + m.num_prelude + m.num_coda
  F = m.mlp_hidden or m.mlp_ratio * d
  kv = (m.num_kv_heads or m.num_heads) / m.num_heads
  mlp = (3 if m.mlp_type == "swiglu" else 2) * d * F
  # Weights (q and out, k and v, MLP), then the QK and AV products: causal
  # attention computes (and counts) the full T x T, as PaLM's count does.
  per_layer = 2 * ((2 + 2 * kv) * d * d + mlp) + 2 * 2 * T * d
  adapter = 2 * 2 * d * d * m.num_loops if m.injection == "concat" else 0
  # logits per position (LM) or per sequence (the answer)
  readouts = B * T if task_lib.for_config(config).reads_every_position else B
  return 3.0 * (B * T * (layers * per_layer + adapter) + readouts * 2 * d * vocab_size)


def matmul_peak(dtype: str = "float32", n: int | None = None, repeats: int = 5) -> dict:
  """Measured matmul FLOP/s of this machine in `dtype`, JAX (and PyTorch if present).

  n defaults to 2048 on a CPU and 8192 on an accelerator, where a smaller
  product does not fill the device and understates its peak.
  """
  n = n or (2048 if jax.default_backend() == "cpu" else 8192)
  a = jax.numpy.ones((n, n), dtype)
  f = jax.jit(lambda a: a @ a)
  flops = 2 * n**3
  out = {
    "n": n,
    "dtype": dtype,
    "jax": flops
    / timed(lambda: f(a).block_until_ready(), warmup=2, steps=5, repeats=repeats),
  }
  try:
    import torch
  except ImportError:
    return out
  if jax.default_backend() != "cpu":
    return out  # the PyTorch reference is timed on the CPU only
  t = torch.ones(n, n, dtype=getattr(torch, dtype))
  out["torch"] = flops / timed(lambda: t @ t, warmup=2, steps=5, repeats=repeats)
  return out


def device_memory() -> list[dict]:
  """Per device: bytes in use, peak and limit where the backend reports them."""
  keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
  rows = []
  for d in jax.local_devices():
    stats = d.memory_stats() or {}
    rows.append({"device": str(d), **{k: stats[k] for k in keys if k in stats}})
  return rows


def machine() -> dict:
  info = {
    "cpu": _cpu_name(),
    "cores": len(os.sched_getaffinity(0)),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": [d.device_kind for d in jax.devices()],
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "python": platform.python_version(),
  }
  try:
    import torch

    info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
  except ImportError:
    pass
  return info


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()
