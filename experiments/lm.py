"""Looped language models trained from scratch on text (MECH's small models).

A block of L layers applied R times with the standard next-token loss, on a
corpus tokenized by a byte-level BPE trained on it. The default corpus is the
running Python's standard library (data.source=stdlib: ~3.4M tokens of code at
a 4096-token vocabulary, on every machine, offline); any local text
(`text:GLOB`) or prepared TFDS text dataset (`tfds:NAME`) works the same.
Variants: `tiny` (seconds: tests), `cpu` (the default: a 2-core CPU),
`study` (`cpu` at 1000 steps: the from-scratch study's base), `gpu` (the shape
a GPU or TPU user starts from, bf16).

The from-scratch study (MECH): `sweep("study")` varies one factor at a time
from `study` (injection add, pre-norm, 2 x 4): input injection, norm placement
and block size L x R at equal effective depth 8; each run is analyzed and
evaluated to 32 iterations, 4x the largest R (docs/results/lm_study.md):

  python launch/sweep.py --config=experiments/lm.py:study --sweep=study \
      --root=runs/lm_study --analyze --parallel=2
  python -m loopjax.main --mode=report --workdir=runs/lm_study

  python -m loopjax.main --config=experiments/lm.py --workdir=runs/lm
  python -m loopjax.main --config=experiments/lm.py --workdir=runs/lm --mode=eval
  python -m loopjax.main --workdir=runs/lm --mode=sample --prompt="def "
  python -m loopjax.bench step --config=experiments/lm.py --torch
  python -m loopjax.main --config=experiments/lm.py:gpu --workdir=/shared/runs/lm_gpu \\
      --config.data.source=tfds:lm1b
"""

from loopjax import config as config_lib
from loopjax.analysis import LM_ANALYSES


def get_config(variant: str = "cpu"):
  c = config_lib.base()
  c.variant = variant
  c.data.update(task="lm", source="stdlib")
  c.model.update(
    pos_encoding="rope",
    injection="add",
    norm_type="rmsnorm",
    tie_embeddings=True,
  )
  # --mode=analyze: fixed points, stages and attention to 4R iterations.
  c.analyze.update(names=LM_ANALYSES, batch_size=8)
  c.bench = dict(warmup=5, steps=10, repeats=3)  # python -m loopjax.bench step
  c.train.update(
    schedule="cosine",
    weight_decay=0.1,
    b2=0.95,
    grad_clip=1.0,
    supervise="last",
  )
  if variant == "tiny":
    c.data.update(vocab_size=300, seq_len=32, valid_sequences=16)
    c.model.update(d_model=32, num_heads=2, num_layers=1, num_loops=2)
    c.mesh.devices = 1
    c.train.update(batch_size=8, num_steps=20, lr=3e-3, warmup_steps=5)
    c.eval.update(batch_size=16, depths=(4,))
    c.analyze.update(max_depth=4, lm_windows=8)
    c.checkpoint.every = 10
    c.eval_every = 10
    c.log_every = 5
  elif variant in ("cpu", "study"):
    c.data.update(vocab_size=4096, seq_len=256, valid_sequences=64)
    c.model.update(d_model=128, num_heads=4, num_layers=2, num_loops=4)
    # 1.0 steps/s (4.2k tokens/s) on one core of a 2-core AMD EPYC: 1500
    # steps in 24 minutes (docs/results/lm.md).
    c.train.update(batch_size=16, num_steps=1500, lr=3e-3, warmup_steps=100)
    if variant == "study":  # 8 runs in ~70 min, two at a time on 2 cores
      c.train.num_steps = 1000
    c.eval.update(batch_size=16, depths=(8, 16))
    c.analyze.max_depth = 16
    if variant == "study":  # every variant to 4x the largest R (1 x 8's)
      c.eval.depths, c.analyze.max_depth = (32,), 32
    c.checkpoint.every = 250
    c.eval_every = 250
  elif variant == "gpu":
    c.data.update(vocab_size=32768, seq_len=1024, valid_sequences=256)
    c.model.update(
      d_model=1024,
      num_heads=16,
      num_prelude=2,
      num_layers=4,
      num_coda=2,
      num_loops=4,
      dtype="bfloat16",
      remat="full",
    )
    c.train.update(batch_size=64, num_steps=100_000, lr=6e-4, warmup_steps=2000)
    c.train.z_loss = 1e-4
    c.eval.update(batch_size=32, depths=(8, 16))
    c.analyze.update(max_depth=16, batch_size=4)
    c.checkpoint.update(every=2000, keep_every=20_000)
    c.eval_every = 1000
  else:
    raise ValueError(f"variant: must be one of tiny, cpu, study, gpu; got {variant!r}")
  return c


def sweep(name: str = "study"):
  """One factor at a time from the base (injection add, pre-norm, L x R = 2 x 4):
  injection none / concat, norm sandwich / Huginn's residual-stream norm, and
  L x R = 1 x 8, 4 x 2, 8 x 1 (feedforward)."""
  if name != "study":
    raise ValueError(f"must be study; got {name!r}")

  def shape(L, R):
    return {"model.num_layers": L, "model.num_loops": R}

  return [
    {},
    {"model.injection": "none"},
    {"model.injection": "concat"},
    {"model.norm_position": "sandwich"},
    {"model.norm_position": "residual"},
    shape(1, 8),
    shape(4, 2),
    shape(8, 1),
  ]
