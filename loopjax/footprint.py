"""A lower bound on a train step's memory per device, from the config alone,
held against the devices' memory before anything compiles.

A step that cannot fit should fail in seconds with the fields that make it
big, not after minutes of compiling and a kill by the OS (a 100k-token
sequence's document mask alone is 80 GB). The bound counts only what the step
must hold at once: the train state's shard (float32 params, Adam's two
moments, the gradient, an EMA of the params if kept (train.param_ema: 4
bytes per parameter), and a Grokfast filter's state: 4 bytes per parameter
for its "ema" kind, 4 x (window + 2) for the MA's window, their sum and the next
to leave, 25x the rest at window 100: the bound is then within 2x of the
compiled step's peak, `sysgen.py:tiny` 4.6 MiB against aot's 6.7, where
without the filter it counted 0.23), the state (B, T, D) the scan over
iterations keeps of each of its R_max iterations for the backward pass, and
what the attention kernel the step will run builds for one layer
(model/attention_kernels.py): under XLA's, for packed text the (B, T, T)
document mask, and on an accelerator the attention logits (B, N, T, T) in
float32; under the CPU's blocked kernel, the float32 scores, their weights'
cotangent and the scores' of every block, which XLA:CPU computes side by
side (`python -m loopjax.aot` of `lm.py:tiny`, batch 1, 2 heads: a peak of
0.88 GiB at 8,192 tokens and 124 GiB at 100,000, against 0.80 and 119 GiB
counted here; model/blocked_attention.py). The other fused kernels hold
none of these. Choosing the kernel here also refuses one
the target cannot run, before anything compiles. The compiled step's own
memory analysis is the full account: `check_compiled` holds it against the
same capacity before the first step runs (and `python -m loopjax.aot`
reports it for a target).
"""

import os

import jax
import jax.numpy as jnp

from loopjax import grad_filters, sharding
from loopjax.errors import ConfigError
from loopjax.model import attention_kernels, blocked_attention

GIB = 2**30
STATE = "params, Adam moments, gradient"  # float32: 16 bytes per parameter
FILTER = "Grokfast filter state"  # grad_filters.state_bytes per parameter
EMA = "params' EMA (train.param_ema)"  # float32: 4 bytes per parameter
ITERATIONS = "each iteration's state"
BLOCKED = "attention scores of every block (3 x B, N, ~T^2 / 2)"


def params(m, vocab: int) -> int:
  """At least how many parameters the model `m` (config.model) has: the
  token embedding, and per block the query and output projections and the
  MLP's two matrices (keys, values, norms, biases and an untied unembedding
  come on top). Counted from the config: a model too big to fit fails here
  before it is built (a block is a Python object: 2^31 of them never are)."""
  blocks = m.num_prelude + m.num_layers + m.num_coda
  hidden = m.mlp_hidden or m.mlp_ratio * m.d_model
  return vocab * m.d_model + blocks * 2 * m.d_model * (m.d_model + hidden)


def lower_bound(config, family, task, mesh, evaluation=False) -> dict[str, float]:
  """{term: bytes per device} of a step's memory that no schedule avoids
  (the blocked kernel's: what XLA:CPU's schedule holds). `evaluation`: an
  in-loop evaluation's batch, forward only, beside the train state it
  shares the devices with."""
  m = config.model
  V, T = task.model_dims()
  platform = mesh.devices.flat[0].platform
  packed = family.packs_documents and m.document_mask
  kernel = attention_kernels.choose(m.attention, platform, T, packed, m.dtype)
  B = config.eval.batch_size if evaluation else config.train.batch_size
  rows = B / sharding.batch_split(mesh, config.sharding.rules)
  P = params(m, V) / mesh.devices.size
  out = {STATE: 16 * P}
  if config.train.param_ema:
    out[EMA] = 4 * P
  if filt := grad_filters.state_bytes(config.train):
    g = config.train.grokfast
    window = f", window {g.window}" if g.kind == "ma" else ""
    out[f"{FILTER} ({g.kind}{window})"] = filt * P
  depth = config.train.depth
  R = m.num_loops if depth.dist == "fixed" else depth.max
  width = jnp.dtype(m.dtype).itemsize
  if not evaluation:  # kept for the backward pass
    out[f"{ITERATIONS} (R {R}, B, T, D)"] = R * rows * T * m.d_model * width
  if packed and kernel == "xla":
    out["document mask (B, T, T)"] = rows * T * T
  if kernel == "xla" and platform != "cpu":
    out["attention logits (B, N, T, T)"] = 4 * rows * m.num_heads * T * T
  if kernel == "blocked":  # XLA:CPU runs the unrolled blocks side by side
    scores = sum((e - s) * e for s, e in blocked_attention.blocks(T))
    out[BLOCKED] = (4 if evaluation else 12) * rows * m.num_heads * scores
  return out


def capacity(mesh) -> tuple[int, str]:
  """(bytes per device, what they are): an accelerator's own limit, or this
  host's memory shared by its CPU devices."""
  device = mesh.devices.flat[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"{device.device_kind} memory"
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  local = max(len(jax.local_devices()), 1)
  return host // local, f"this host's memory / {local} devices"


def check(config, family, task, mesh) -> None:
  """Raises ConfigError when the lower bound of a step, or of the in-loop
  evaluation's batch (eval_every > 0), exceeds the devices' memory."""
  have, what = capacity(mesh)
  for evaluation in (False, True) if config.eval_every else (False,):
    terms = lower_bound(config, family, task, mesh, evaluation)
    need = sum(terms.values())
    if need <= have:
      continue
    big = max(terms, key=terms.get)
    batch, B = (
      ("eval.batch_size", config.eval.batch_size)
      if evaluation
      else ("train.batch_size", config.train.batch_size)
    )
    fields = (  # the state's shard grows with the model, not the batch
      "model (d_model, num_layers, mlp_ratio), mesh.fsdp, mesh.tensor"
      if big in (STATE, EMA)
      else "train.grokfast (kind, window, state_dtype), model (d_model, "
      "num_layers, mlp_ratio), mesh.fsdp, mesh.tensor"
      if big.startswith(FILTER)
      else f"model.num_loops (or train.depth.max), {batch}, data.seq_len"
      if big.startswith(ITERATIONS)
      else f"{batch}, data.seq_len"
    )
    raise ConfigError(
      f"{fields}: {'an evaluation' if evaluation else 'a step'} needs at least "
      f"{need / GIB:.1f} GiB per device ({big}: {terms[big] / GIB:.1f} GiB; "
      f"batch {B}, {task.model_dims()[1]} tokens) and {what} is "
      f"{have / GIB:.1f} GiB"
    )


def compiled_fields(memory: dict) -> str:
  """The fields behind a compiled train step's peak (`compiled.memory`): the
  model's where its state (the arguments: params and optimizer moments) is a
  quarter of the peak or more, since the gradient and the update held among
  the temporaries grow with it too; the batch's otherwise."""
  if 4 * memory["arguments"] >= memory["peak"]:
    return "model (d_model, num_layers, mlp_ratio), mesh.fsdp, mesh.tensor"
  return "train.batch_size, data.seq_len, mesh, model.remat"


def check_compiled(config, memory: dict, mesh) -> None:
  """Raises ConfigError when the compiled step's peak (`compiled.memory`)
  exceeds the devices' memory, naming the fields that drive it (`compiled_fields`)."""
  have, what = capacity(mesh)
  if memory["peak"] <= have:
    return
  parts = {k: memory[k] for k in ("arguments", "temporaries", "outputs")}
  fields = compiled_fields(memory)
  raise ConfigError(
    f"{fields}: the compiled train step needs {memory['peak'] / GIB:.2f} GiB "
    f"per device ({', '.join(f'{k} {v / GIB:.2f}' for k, v in parts.items())}) "
    f"and {what} is {have / GIB:.2f} GiB"
  )
