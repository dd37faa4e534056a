"""`python -m loopjax.bench generation`: greedy decoding with the key/value
cache per recurrence (`lm.generate`), prompts of different lengths batched
against the same prompts one at a time.

The model: `model.hf_dir`'s weights (a pretrained directory, e.g. the tiny
Huginn checkpoint of tests/fixtures/hf) or, without one, the config's shapes
with random weights (`experiments/lm.py:tiny`, `:cpu`). `--prompts`
prompts of 1/4 to 1/2 of `data.seq_len` tokens, each continued by
`--new_tokens` tokens at `model.num_loops` recurrences (no stop). Reports
new tokens per second both ways (the median of 3 runs after one that
compiles), the cache's bytes and the one-token step's compiled memory.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from loopjax import restore
from loopjax.lm import generate as gen
from loopjax.state import Model, build_model


def _model(config) -> tuple[Model, int]:
  """(Model, vocab size): the pretrained directory's, placed on the run's mesh
  (`restore.language_model`), or random at the config's shapes."""
  m = config.model
  if restore.pretrained(config):
    model = restore.language_model(config).model()
    return model, model.module().unembedding.shape[-1]
  V = config.data.vocab_size
  module = build_model(m, V, config.data.seq_len, seed=config.seed)
  return Model(nnx.graphdef(module), nnx.to_pure_dict(nnx.state(module, nnx.Param))), V


def bench(config, prompts: int = 8, new_tokens: int = 32) -> dict:
  model, V = _model(config)
  B, N = prompts, new_tokens
  T, R = config.data.seq_len, config.model.num_loops
  rng = np.random.default_rng(0)
  prompts = [
    rng.integers(0, V, rng.integers(T // 4, T // 2 + 1)).tolist() for _ in range(B)
  ]

  def batched():
    return gen.generate(model, prompts, N, num_loops=R)

  def one_at_a_time():
    return [gen.generate(model, [p], N, num_loops=R) for p in prompts]

  out = {"prompts": B, "prompt_tokens": [len(p) for p in prompts], "new_tokens": N}
  for name, fn in (("batched", batched), ("one_at_a_time", one_at_a_time)):
    fn()  # compiles every program it needs
    windows = []
    for _ in range(3):
      t = time.perf_counter()
      fn()
      windows.append(time.perf_counter() - t)
    s = float(np.median(windows))
    out[name] = {"seconds": s, "tokens_per_s": B * N / s, "windows_s": windows}
  Tp = max(len(p) for p in prompts)
  cache = model.module().init_cache(B, Tp + N, R, model.dtype)
  out["cache_bytes"] = sum(x.nbytes for x in jax.tree.leaves(cache))
  step = gen.decode_step.lower(
    model,
    jnp.zeros((B,), jnp.int32),
    cache,
    jnp.int32(Tp),
    jax.random.key(0),
    jnp.zeros((B,), jnp.int32),
  ).compile()
  mem = step.memory_analysis()
  out["step_temp_bytes"] = mem.temp_size_in_bytes
  out["params_bytes"] = sum(x.nbytes for x in jax.tree.leaves(model.params))
  print(
    f"{B} prompts of {min(out['prompt_tokens'])}-{Tp} tokens, {N} new tokens each "
    f"at R {R}: batched {out['batched']['tokens_per_s']:.0f} tok/s, one at a time "
    f"{out['one_at_a_time']['tokens_per_s']:.0f} tok/s "
    f"({out['one_at_a_time']['seconds'] / out['batched']['seconds']:.1f}x); cache "
    f"{out['cache_bytes'] / 2**20:.1f} MiB, step temporaries "
    f"{out['step_temp_bytes'] / 2**20:.1f} MiB"
  )
  return out
