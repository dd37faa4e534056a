"""Accuracy against compute for each adaptive-halting criterion and threshold.

For every (criterion, threshold) the probe splits are answered with
`halting.adaptive` up to r_max iterations; per split the table holds accuracy
and mean iterations used, the trade-off a halting rule is chosen by.
"""

import functools

import jax

from loopjax import halting
from loopjax.data import pipeline
from loopjax.state import eval_key

# criteria whose one threshold is `eps`
EPS = ("kl", "kl_reverse", "entropy_diff", "latent", "latent_diff", "cosine")


def settings(cfg) -> list[dict]:
  """The (criterion, threshold) grid from the `analyze.halting` config."""
  grid = []
  for criterion in cfg.criteria:
    if criterion == "kl_entropy":
      grid += [{"criterion": criterion, "eps": e, "tau": cfg.tau} for e in cfg.eps]
    elif criterion == "kl_entropy_len":
      grid += [
        {"criterion": criterion, "eps": e, "tau": cfg.tau, "tau_len": cfg.tau_len}
        for e in cfg.eps
      ]
    elif criterion in EPS:
      grid += [{"criterion": criterion, "eps": e} for e in cfg.eps]
    elif criterion == "gate":
      grid += [{"criterion": criterion, "threshold": q} for q in cfg.gate]
    elif criterion == "entropy":
      grid += [{"criterion": criterion, "tau": t} for t in cfg.tau_grid]
    elif criterion == "argmax":
      grid += [{"criterion": criterion, "patience": p} for p in cfg.patience]
    else:
      grid.append({"criterion": criterion})
  return grid


def table(model, probes: dict, config, pad: int):
  """[{criterion, thresholds..., splits: {split: {acc, iterations}}}] over the
  `analyze.halting` grid; the initial state drawn as evaluations draw it."""
  cfg, key = config.analyze.halting, eval_key(config)
  rows = []
  for s in settings(cfg):
    kw = {
      "eps": s.get("eps", 0.0),
      "tau": s.get("tau", 0.0),
      "patience": s.get("patience", 0),
      "tau_len": s.get("tau_len", 0.0),
      "threshold": s.get("threshold", 1.0),
      "criterion": s["criterion"],
      "r_min": cfg.r_min,
      "r_max": cfg.r_max,
      "seq_len": cfg.seq_len,
      "start": cfg.start,
    }
    splits = {}
    for name, split in probes.items():
      correct_N, iters_N = pipeline.map_batches(
        lambda b: _answers(model, b, key, **kw),
        split,
        config.eval.batch_size,
        pad,
        pad_to=config.data.pad_to,
      )
      splits[name] = {
        "acc": float(correct_N.mean()),
        "iterations": float(iters_N.mean()),
      }
    rows.append(s | {"splits": splits})
  return rows


@functools.partial(
  jax.jit, static_argnames=("criterion", "r_min", "r_max", "seq_len", "start")
)
def _answers(
  model, batch, key, eps, tau, patience, tau_len, threshold, *, criterion, r_min,
  r_max, seq_len, start,
):  # fmt: skip
  """(correct, iterations) per example; compiled once per graph and rule."""
  logp_BV, iters_B = halting.adaptive(
    model.module(),
    batch["inputs"],
    batch["answer_pos"],
    criterion=criterion,
    r_min=r_min,
    r_max=r_max,
    eps=eps,
    tau=tau,
    tau_len=tau_len,
    seq_len=seq_len,
    patience=patience,
    threshold=threshold,
    start=start,
    key=key,
  )
  return logp_BV.argmax(-1) == batch["target"], iters_B
