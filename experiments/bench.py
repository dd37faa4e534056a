"""Train-step benchmark shapes (python -m loopjax.bench; see docs/performance.md).

Sizes: `default` is the `cpu` variant of sysgen.py (the default experiment)
with the papers' loss on the last iteration, which the PyTorch reference also
computes; `d128` and `d256` bracket it; `paper` is LTG's model, for
accelerators (bf16).

  python -m loopjax.bench step --config=experiments/bench.py --torch
  python -m loopjax.bench scaling --config=experiments/bench.py
"""

from experiments import sysgen


def get_config(size: str = "default"):
  c = sysgen.get_config("cpu")
  c.train.supervise = "last"  # as torch_ref.py; atomic_every adds R readouts
  c.size = size
  c.bench = dict(warmup=20, steps=50, repeats=5)
  if size == "default":
    pass
  elif size == "d128":
    c.model.update(d_model=128, num_heads=4, num_layers=2)
  elif size == "d256":
    c.model.update(d_model=256, num_heads=8, num_layers=4)
    c.train.batch_size = 512
    c.bench = dict(warmup=5, steps=10, repeats=3)
  elif size == "paper":
    c = sysgen.get_config("paper")
    c.size = size
    c.bench = dict(warmup=10, steps=30, repeats=5)
    c.model.dtype = "bfloat16"
  else:
    raise ValueError(f"size: must be one of default, d128, d256, paper; got {size!r}")
  return c
