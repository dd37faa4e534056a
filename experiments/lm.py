"""Looped language models trained from scratch on text (MECH's small models).

A block of L layers applied R times with the standard next-token loss, on a
corpus tokenized by a byte-level BPE trained on it. The default corpus is the
running Python's standard library (data.source=stdlib: ~3.4M tokens of code at
a 4096-token vocabulary, on every machine, offline); any local text
(`text:GLOB`) or prepared TFDS text dataset (`tfds:NAME`) works the same.
Variants: `tiny` (seconds: tests), `cpu` (the default: a 2-core CPU),
`study` (`cpu` at 1000 steps, rows aligned at <bos>: the from-scratch study's
base), `control` and `control_tiny` (the positive control), `gpu` (the shape
a GPU or TPU user starts from, bf16), `retrofit` (a pretrained feedforward
model made recurrent, below) and `retrofit_tiny` (`retrofit` in seconds on a
tiny checkpoint: tests).

The from-scratch study (MECH): `sweep("study")` varies one factor at a time
from `study` (injection add, pre-norm, 2 x 4): input injection, norm placement
and block size L x R at equal effective depth 8, on rows aligned at <bos>;
each run is evaluated to 32 iterations (4x the largest R) and analyzed to 128
(MECH's horizon) (docs/results/lm_study.md). The sink analyses' positive
control, `sweep("control")` from `control` (Bigram-Backcopy), beside it:

  python launch/sweep.py --config=experiments/lm.py:study --sweep=study \
      --root=runs/lm_study --analyze --parallel=2
  python -m loopjax.main --mode=report --workdir=runs/lm_study
  python launch/sweep.py --config=experiments/lm.py:control --sweep=control \
      --root=runs/lm_control --analyze --parallel=2

  python -m loopjax.main --config=experiments/lm.py --workdir=runs/lm
  python -m loopjax.main --config=experiments/lm.py --workdir=runs/lm --mode=eval
  python -m loopjax.sample --workdir=runs/lm --prompt="def "
  python -m loopjax.bench step --config=experiments/lm.py --torch
  python -m loopjax.main --config=experiments/lm.py:gpu --workdir=/shared/runs/lm_gpu \\
      --config.data.source=tfds:lm1b
  python -m loopjax.aot --config=experiments/lm.py:gpu --devices=8 --config.mesh.fsdp=4

Retrofitted recurrence (McLeish et al. 2025, LoopedLMs/retrofitting-recurrence):
`model.init_from=hf:DIR` starts from a pretrained Llama or OLMo 2, its layers
placed as prelude, core and coda by `model.hf_split`, the core applied R times
after the concat adapter, which starts at [0 | I] (loopjax/pretrained/
init_from.py: their OLMo converter's; their Llama converter leaves it random).
As its train.py and shells/ (tinyllama.sh, llama.sh,
olmo.sh): R sampled per batch, Poisson with a log-normal rate (sigma 0.5) +
1, around a mean of 4 (their Figures 5-8; Figure 4 ramps to 32), backprop
through every iteration (their backprop depth 8 exceeds the mean); the first
state a truncated normal of Huginn-0125's std; AdamW at lr 5e-5, weight decay
1e-4 on every parameter, betas (0.9, 0.95), gradients clipped at 1.0,
1024-token sequences, bf16 compute on float32 masters, 25k steps with 0.5%
warmup. Not reproduced: their mean-R curriculum (from 1 over the first 25-75%
of steps), the warmup-stable-decay schedule (cosine here) and Muon (most of
their runs).

Their splits drop layers, and so may loopjax's: TinyLlama's 4,8,4 (the
default) keeps layers 0-3, 10-17 and 18-21 of its 22 (convert_llama.py), the
core the 8 before the coda; Llama 3.2 1B's 2,4,2 eight of its 16
(`--config.model.hf_split=2,4,2`). OLMo 2's embedding, padded past its
tokenizer (100352 rows, 100278 tokens), is used as it is.

  python -m loopjax.main --config=experiments/lm.py:retrofit --workdir=runs/retro \\
      --config.model.init_from=hf:$HOME/models/TinyLlama-1.1B-intermediate-step-1431k-3T \\
      --config.data.source='text:corpus/*.txt'
"""

import math

from loopjax import config as config_lib
from loopjax.lm import spec

# The first state's std: the converters keep Huginn-0125's (its 5280 width).
HUGINN_STATE_STD = math.sqrt(2 / (5 * 5280))


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
  c.analyze.update(names=spec.SHARED, batch_size=8)
  c.bench = dict(warmup=5, steps=5, repeats=8)  # python -m loopjax.bench step
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
    c.analyze.max_depth = 128  # MECH's horizon (fixed points)
    if variant == "study":  # every variant evaluated to 4x the largest R (1 x 8's)
      c.data.align = True  # rows start at <bos>, where a sink can form
      c.eval.depths = (32,)
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
    c.analyze.update(max_depth=128, batch_size=4)
    c.checkpoint.update(every=2000, keep_every=20_000)
    c.eval_every = 1000
  elif variant in ("retrofit", "retrofit_tiny"):
    retrofit(c, tiny=variant == "retrofit_tiny")
  elif variant in ("control", "control_tiny"):
    control(c, tiny=variant == "control_tiny")
  else:
    raise ValueError(
      "variant: must be one of tiny, cpu, study, gpu, retrofit, retrofit_tiny, "
      f"control, control_tiny; got {variant!r}"
    )
  return c


def control(c, tiny: bool) -> None:
  """The sink analyses' positive control: Guo et al.'s Bigram-Backcopy (one
  symbol per token), rows aligned at <bos>, a 1-layer 1-head model (learned
  positions, weight decay 0.5) applied R = 4 times; `sweep("control")` adds
  the feedforward R = 1 and the injection and norm variants. Checkpoints
  every 500 steps are kept, to analyze the sink along training: it depends
  on the shape (at d 128, 128-token rows and lr 1e-3 the feedforward model
  put 0.14 of its attention on <bos> at step 3000; docs/results/
  lm_control.md). `tiny`: a smaller model in seconds (the default suite)."""
  c.data.update(
    source="bigram_backcopy", vocab_size=259, seq_len=64, align=True, valid_sequences=32
  )
  c.model.update(
    d_model=64, num_heads=1, num_layers=1, num_loops=4, pos_encoding="learned"
  )
  c.train.update(
    batch_size=32, num_steps=3000, lr=3e-3, warmup_steps=100, weight_decay=0.5
  )
  c.eval.update(batch_size=32, depths=(8, 16))
  c.analyze.update(max_depth=128, lm_windows=32, batch_size=8)
  c.checkpoint.update(every=500, keep_every=500)
  c.eval_every = 500
  if tiny:
    c.data.update(seq_len=32, valid_sequences=8)
    c.model.update(d_model=32, num_loops=2)
    c.mesh.devices = 1
    c.train.update(num_steps=300, warmup_steps=20)
    c.checkpoint.keep_every = 0
    c.eval.update(batch_size=8, depths=(4,))
    c.analyze.update(max_depth=8, lm_windows=8)
    c.checkpoint.every = 300
    c.eval_every = 300
    c.log_every = 100


def retrofit(c, tiny: bool) -> None:
  """Retrofitted recurrence's recipe (the docstring); `tiny`: on a 3-layer
  checkpoint (tests/fixtures/hf), in seconds."""
  # The model's tokenizer adds <bos> itself (its post-processor), as it trained.
  c.data.update(seq_len=1024, bos=False, valid_sequences=64)
  c.model.update(
    hf_split="4,8,4",  # TinyLlama's: layers 0-3, 10-17, 18-21 of 22
    injection="concat",
    init_state="trunc_normal",
    init_state_std=HUGINN_STATE_STD,
    num_loops=4,  # evaluations' R: the trained mean
    dtype="bfloat16",
    remat="full",
  )
  c.train.update(
    batch_size=32,
    num_steps=25_000,
    lr=5e-5,
    warmup_steps=125,
    weight_decay=1e-4,
    decay="all",
    b2=0.95,
  )
  c.train.depth.update(dist="lognormal_poisson", mean=4.0, min=1, max=8, sigma=0.5)
  c.eval.update(batch_size=16, depths=(16,))
  c.analyze.update(max_depth=128, batch_size=4)
  c.checkpoint.update(every=1000, keep_every=5000)
  c.eval_every = 1000
  if tiny:
    c.data.update(seq_len=16, valid_sequences=8)
    c.model.update(hf_split="1,1,1", num_loops=2, dtype="float32", remat="none")
    c.mesh.devices = 1
    c.train.update(batch_size=4, num_steps=8, lr=3e-3, warmup_steps=2)
    c.train.depth.update(mean=2.0, max=3)
    c.eval.update(batch_size=8, depths=(3,))
    c.analyze.update(max_depth=4, lm_windows=4)
    c.checkpoint.update(every=4, keep_every=0)
    c.eval_every = 4
    c.log_every = 1


def sweep(name: str = "study"):
  """study: one factor at a time from the base (injection add, pre-norm, L x R
  = 2 x 4): injection none / concat, norm sandwich / Huginn's residual-stream
  norm, and L x R = 1 x 8, 4 x 2, 8 x 1 (feedforward). control: from its base
  (1 x 4, injection add, pre-norm), the feedforward 1 x 1, injection none and
  Huginn's residual-stream norm."""
  if name == "control":
    return [
      {},
      {"model.num_loops": 1},
      {"model.injection": "none"},
      {"model.norm_position": "residual"},
    ]
  if name != "study":
    raise ValueError(f"must be study or control; got {name!r}")

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
