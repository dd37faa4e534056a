"""One attention layer's forward and backward by every kernel this backend
runs, against XLA's attention (model/attention_kernels.py):

  python -m loopjax.bench attention --config=experiments/lm.py:gpu

The config gives the shapes (train.batch_size sequences of data.seq_len
tokens, the model's heads and dtype) and config.bench the timing windows.
Each kernel runs on two batches: packed documents (three per row: segment
ids) and one document per row (none); cuDNN's kernel takes the second only.
Per row: ms per forward and backward, XLA's temporaries for it, compile time,
and the speed against XLA's attention on the same batch.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.bench import measure
from loopjax.errors import ConfigError
from loopjax.model import attention_kernels


def _inputs(config):
  m = config.model
  B, T, N = config.train.batch_size, config.data.seq_len, m.num_heads
  K, H = m.num_kv_heads or N, m.d_model // N
  keys = jax.random.split(jax.random.key(config.seed), 4)
  dtype = jnp.dtype(m.dtype)
  q, k, v, w = (
    jax.random.normal(key, (B, T, n, H), dtype)
    for key, n in zip(keys, (N, K, K, N), strict=True)
  )
  packed = jnp.asarray(np.repeat(np.arange(T)[None] * 3 // T, B, 0), jnp.int32)
  return (q, k, v), w, {"packed": packed, "one document": None}


def _takes(kernel: str, backend: str, packed: bool, w) -> bool:
  """Whether `kernel` runs this batch here (cuDNN: bf16, no segment ids)."""
  try:
    attention_kernels.choose(kernel, backend, w.shape[1], packed, w.dtype)
  except ConfigError:
    return False
  return True


def bench(config) -> dict:
  qkv, w, batches = _inputs(config)
  backend = jax.default_backend()
  t = config.bench
  rows = []
  native = [k for k, on in attention_kernels.RUNS_ON.items() if on[0] == backend]
  for kernel in ["xla", *(["blocked"] if backend == "cpu" else native)]:
    for batch, segments in batches.items():
      if not _takes(kernel, backend, segments is not None, w):
        continue

      def loss(q, k, v, segments=segments, kernel=kernel):
        out = attention_kernels.causal_attention(q, k, v, segments, kernel)
        return (out.astype(jnp.float32) * w).sum()

      start = time.perf_counter()
      step = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*qkv).compile()
      compile_s = time.perf_counter() - start
      step_s = measure.timed(
        lambda step=step: jax.block_until_ready(step(*qkv)),
        warmup=t.warmup,
        steps=t.steps,
        repeats=t.repeats,
      )
      mem = step.memory_analysis()
      rows.append(
        {
          "kernel": kernel,
          "batch": batch,
          "ms": step_s * 1e3,
          "temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
          "compile_s": compile_s,
        }
      )
  xla = {r["batch"]: r["ms"] for r in rows if r["kernel"] == "xla"}
  for r in rows:
    r["speed_vs_xla"] = xla[r["batch"]] / r["ms"]
  B, T, N, H = w.shape
  print(f"{backend}: {B} x {T} tokens, {N} heads of {H}, {w.dtype}, forward + backward")
  print(f"{'kernel':9}{'batch':>14}{'ms':>9}{'temp MiB':>10}{'compile s':>11}", end="")
  print(f"{'vs xla':>8}")
  for r in rows:
    temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.0f}"
    print(
      f"{r['kernel']:9}{r['batch']:>14}{r['ms']:9.2f}{temp:>10}"
      f"{r['compile_s']:11.1f}{r['speed_vs_xla']:7.2f}x"
    )
  shape = {"B": B, "T": T, "N": N, "H": H, "dtype": str(w.dtype)}
  return {"shape": shape, "rows": rows}
