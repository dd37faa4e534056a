"""A lower bound on a train step's memory per device, from the config alone,
held against the devices' memory before anything compiles.

A step that cannot fit should fail in seconds with the fields that make it
big, not after minutes of compiling and a kill by the OS (a 100k-token
sequence's document mask alone is 80 GB). The bound counts only what the step
must hold at once: the train state's shard (float32 params, Adam's two
moments, the gradient) and what the attention kernel the step will run
builds for one layer (model/attention_kernels.py): for packed text under the
CPU's blocked or XLA's attention, the (B, T, T) document mask, and under
XLA's on an accelerator the attention logits (B, N, T, T) in float32 (the
fused kernels hold neither). Choosing the kernel here also refuses one the
target cannot run, before anything compiles. The compiled step's own memory
analysis is the full account: `check_compiled` holds it against the same
capacity before the first step runs (and `python -m loopjax.aot` reports it
for a target).
"""

import math
import os

import jax

from loopjax import sharding
from loopjax.errors import ConfigError
from loopjax.model import attention_kernels

GIB = 2**30
STATE = "params, Adam moments, gradient"  # float32: 16 bytes per parameter


def lower_bound(config, family, task, mesh, params) -> dict[str, float]:
  """{term: bytes per device} of a step's memory that no schedule avoids;
  `params`: the model's (abstract) params."""
  m = config.model
  _, T = task.model_dims()
  platform = mesh.devices.flat[0].platform
  packed = family.packs_documents and m.document_mask
  kernel = attention_kernels.choose(m.attention, platform, T, packed, m.dtype)
  rows = config.train.batch_size / sharding.batch_split(mesh, config.sharding.rules)
  size = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  out = {STATE: 16 * size / mesh.devices.size}
  if packed and kernel in ("xla", "blocked"):
    out["document mask (B, T, T)"] = rows * T * T
  if kernel == "xla" and platform != "cpu":
    out["attention logits (B, N, T, T)"] = 4 * rows * m.num_heads * T * T
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


def check(config, family, task, mesh, params) -> None:
  """Raises ConfigError when the lower bound exceeds the devices' memory."""
  have, what = capacity(mesh)
  terms = lower_bound(config, family, task, mesh, params)
  need = sum(terms.values())
  if need > have:
    big = max(terms, key=terms.get)
    fields = (  # the state's shard grows with the model, not the batch
      "model (d_model, num_layers, mlp_ratio), mesh.fsdp, mesh.tensor"
      if big == STATE
      else "train.batch_size, data.seq_len"
    )
    raise ConfigError(
      f"{fields}: a step needs at least {need / GIB:.1f} "
      f"GiB per device ({big}: {terms[big] / GIB:.1f} GiB; batch "
      f"{config.train.batch_size}, {task.model_dims()[1]} tokens) and "
      f"{what} is {have / GIB:.1f} GiB"
    )


def check_compiled(config, memory: dict, mesh) -> None:
  """Raises ConfigError when the compiled step's peak (`compiled.memory`)
  exceeds the devices' memory, naming the fields that drive its biggest part:
  the state's shard (arguments, outputs) grows with the model, temporaries
  with the batch."""
  have, what = capacity(mesh)
  if memory["peak"] <= have:
    return
  parts = {k: memory[k] for k in ("arguments", "temporaries", "outputs")}
  big = max(parts, key=parts.get)
  fields = (
    "train.batch_size, data.seq_len, model.remat"
    if big == "temporaries"
    else "model (d_model, num_layers, mlp_ratio), mesh.fsdp, mesh.tensor"
  )
  raise ConfigError(
    f"{fields}: the compiled train step needs {memory['peak'] / GIB:.2f} GiB "
    f"per device ({', '.join(f'{k} {v / GIB:.2f}' for k, v in parts.items())}) "
    f"and {what} is {have / GIB:.2f} GiB"
  )
