"""Systematic generalization on 2-hop composition ("Grokked Transformers", LTG).

Variants: `tiny` (smoke test, under a minute), `cpu` (default: the whole
memorize -> ID -> OOD story in a few minutes on a 2-core laptop), `paper` (LTG's
systematicity setting), `paper_cpu` (LTG's recipe at the size one core trains
in an hour).

`cpu` departs from the papers' recipe in three measured ways (docs/results/sysgen.md):
atomic facts appear 8x per epoch (OOD atomic facts are otherwise ~1% of the
stream), atomic facts get a loss after every iteration (`atomic_every`: without
it OOD facts resolve iterations later than ID ones and OOD composition stalls
near 0.4-0.5), and the learning rate decays (cosine) over the run.

`paper` is LTG's `train_systematicity.py` field by field (its defaults; the data
as GrokkedTransformer's notebook makes composition.2000.200.7.2): GPT-2 blocks
(pre-LN, GELU, 4x MLP, LayerNorm eps 1e-5), d 768, 12 heads, L = 4 looped R = 4,
learned positions, tied embeddings; embeddings and positions N(0, 1), every
projection N(0, 0.02), unscaled output projections (no HF `_init_weights`);
AdamW (0.9, 0.999), eps 1e-8, lr 1e-4, weight decay 0.1 on every parameter;
2000 warmup steps; label smoothing 0.1; no gradient clipping; batch 128; the
loss on the answer after the last iteration; bf16 compute. What remains
different, and why:
- Dropout: the official blocks keep GPT-2's 0.1 (embeddings, attention,
  residual); loopjax has none (a deterministic step; the papers' claims are
  about the looped computation, and dropout is not part of them).
- Schedule: the official warmup is followed by a linear decay over 150,001
  epochs (~3.7e8 steps): the lr falls 0.3% over our 10^6 steps, so it is
  `constant` here.
- Length: 10^6 steps rather than 150,001 epochs; evaluations every 5000 steps
  rather than every epoch (2450 steps).
- The official trains atomic facts at a pad column (2-token inputs padded to
  the batch's 3) and evaluates them at the relation token; loopjax reads every
  answer at the last real token.

`paper_cpu` keeps `paper`'s block, optimizer, schedule and loss
(`ltg_recipe`) and its graph's ratios (out-degree 20, 5% OOD entities,
phi 7.2) at 200 entities and 20 relations, with d 64, 4 heads, L = 2 looped
R = 4 in float32: ~35 steps/s on one core of a 2-core AMD EPYC, so its 120k
steps are about an hour. The lr is 1e-3 rather than 1e-4: scaled as the
width shrinks (768 / 64 x 1e-4 ~ 1e-3, the 1/d rule for Adam).

  python -m loopjax.main --config=experiments/sysgen.py --workdir=runs/sysgen
  python -m loopjax.main --config=experiments/sysgen.py:tiny --workdir=runs/tiny
  python -m loopjax.main --config=experiments/sysgen.py:paper --workdir=runs/paper
  python launch/sweep.py --config=experiments/sysgen.py:paper_cpu --sweep=accelerators \
      --root=runs/grokspeed_ltg --until=ood
  python launch/sweep.py --config=experiments/sysgen.py --root=runs/sysgen_sweep --parallel=2
"""

from loopjax import config as config_lib
from loopjax.kg import ltg


def get_config(variant: str = "cpu"):
  c = config_lib.base()
  c.variant = variant
  if variant == "tiny":
    c.data.update(
      num_entities=24,
      num_relations=8,
      out_degree=6,
      ood_ratio=0.2,
      phi=3.0,
      probe_size=64,
    )
    c.model.update(d_model=32, num_heads=2, num_layers=1, num_loops=2)
    c.mesh.devices = 1  # smoke tests: one device (the sharding tests set more)
    c.train.update(batch_size=64, num_steps=60, lr=5e-3, warmup_steps=10)
    c.eval.batch_size = 256
    c.checkpoint.every = 20
    c.eval_every = 20
    c.log_every = 10
  elif variant == "cpu":
    c.data.atomic_repeat = 8
    c.train.update(
      num_steps=20_000,
      lr=4e-3,
      warmup_steps=500,
      schedule="cosine",
      supervise="atomic_every",
    )
    c.checkpoint.every = 2000
    c.eval_every = 500
  elif variant == "paper":
    c.data.update(
      num_entities=2000,
      num_relations=200,
      out_degree=20,
      ood_ratio=0.05,
      p_test_id=0.005,
      phi=7.2,
      probe_size=3000,
    )
    c.model.update(d_model=768, num_heads=12, num_layers=4, dtype="bfloat16")
    ltg_recipe(c)
    c.checkpoint.update(every=10_000, keep_every=100_000)
    c.eval_every = 5000
  elif variant == "paper_cpu":
    c.data.update(
      num_entities=200, num_relations=20, out_degree=20, ood_ratio=0.05, phi=7.2
    )
    c.model.update(d_model=64, num_heads=4, num_layers=2)
    ltg_recipe(c)
    c.train.update(num_steps=120_000, lr=1e-3)
    c.checkpoint.update(every=5000, keep_every=50_000)
    c.eval_every = 1000
  else:
    raise ValueError(
      f"variant: must be one of tiny, cpu, paper, paper_cpu; got {variant!r}"
    )
  return c


def ltg_recipe(c):
  """LTG's block and optimizer (`paper`), on any model size: the recipe its
  scripts share (loopjax/kg/ltg.py) with `train_systematicity.py`'s own values."""
  c.model.update(num_loops=4, pos_encoding="learned", out_init_scale=1.0)
  ltg.recipe(c, weight_decay=0.1, label_smoothing=0.1)


# The grokking accelerators (loopjax/grad_filters.py, loss.py) at their papers'
# defaults: Grokfast EMA alpha 0.98, lamb 2; MA window 100, lamb 5.
ACCELERATORS = [
  {},
  {"train.grokfast.kind": "ema"},
  {"train.grokfast.kind": "ma", "train.grokfast.lamb": 5.0},
  {"train.perp_grad": True},
  {"train.xent": "stablemax"},
]
# What the first sweep left untried: the pair of the two that grok (EMA and
# StableMax), perp-Grad without weight decay (as its paper pairs it), and EMA
# amplifying the slow component less.
MORE_ACCELERATORS = [
  {"train.grokfast.kind": "ema", "train.xent": "stablemax"},
  {"train.perp_grad": True, "train.weight_decay": 0.0},
  {"train.grokfast.kind": "ema", "train.grokfast.lamb": 0.5},
]


def sweep(name: str = "loops"):
  """`loops`: vanilla (R = 1) vs looped (R = 2, 4), the same block, data and
  optimizer. `seeds`: the default model on three more knowledge graphs (the
  default graph is data.seed 0). `accelerators`: each grokking accelerator
  against none, three model seeds each (docs/results/grokking_speed.md; run
  with launch/sweep.py --until=ood)."""
  sweeps = {
    "loops": [{"model.num_loops": r} for r in (1, 2, 4)],
    "seeds": [{"data.seed": s} for s in (1, 2, 3)],
    "accelerators": [a | {"seed": s} for s in (0, 1, 2) for a in ACCELERATORS],
    "more_accelerators": [
      a | {"seed": s} for s in (0, 1, 2) for a in MORE_ACCELERATORS
    ],
  }
  if name not in sweeps:
    raise ValueError(f"must be one of {', '.join(sweeps)}; got {name!r}")
  return sweeps[name]
