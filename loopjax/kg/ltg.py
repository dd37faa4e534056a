"""LTG's training recipe ("Loop, Think, & Generalize"): what its two train
scripts, `train_systematicity.py` (sysgen.py's `paper`) and
`train_extrapolation.py` (extrapolation.py's `paper`), set alike, written
once so the two experiments cannot drift apart. Each experiment still states
the values the scripts set differently, beside this call.
"""


def recipe(c, *, weight_decay: float, label_smoothing: float):
  """GPT-2's initialization and LTG's AdamW on any model size: embeddings
  N(0, 1), projections N(0, 0.02); batch 128, 10^6 steps, lr 1e-4 after 2000
  warmup steps, then constant; (0.9, 0.999), eps 1e-8, decay on every
  parameter, no clipping; the loss on the answer after the last iteration.
  `weight_decay` and `label_smoothing`: the scripts' own (0.1 and 0.1 for
  systematicity, 0.01 and 0 for extrapolation)."""
  c.model.update(embed_init_std=1.0, init_std=0.02)
  c.train.update(
    batch_size=128,
    num_steps=1_000_000,
    lr=1e-4,
    warmup_steps=2000,
    schedule="constant",
    weight_decay=weight_decay,
    decay="all",
    label_smoothing=label_smoothing,
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    grad_clip=0.0,
    supervise="last",
  )
