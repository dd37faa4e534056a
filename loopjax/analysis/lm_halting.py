"""`halting` on a language model: how many recurrences each token's
next-token prediction needs under each exit rule (`halting.adaptive` per
token, one jitted while_loop per rule), and what exiting costs.

For every (criterion, threshold) of the `analyze.halting` grid
(`halting_sweep.settings`), over the real tokens with a next token: the mean
iterations used, the share exiting before r_max, how often the exit's argmax
is the one at r_max, and the next-token loss at the exit against the loss at
r_max. Huginn's rules compare from a uniform start (`analyze.halting.start`),
Ouro's gate reads its cumulative exit probability.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import halting
from loopjax.analysis import halting_sweep


@functools.partial(jax.jit, static_argnames=("criterion", "r_min", "r_max", "start"))
def _tokens(model, batch, key, eps, tau, patience, threshold, **static):
  """Per token: iterations, exit argmax == r_max argmax, the losses."""
  m = model.module()
  logp_BTV, iters_BT = halting.adaptive(
    m, batch["inputs"], None, eps=eps, tau=tau, patience=patience,
    threshold=threshold, key=key, **static,
  )  # fmt: skip
  full_BTV = jax.nn.log_softmax(
    m(batch["inputs"], None, num_loops=static["r_max"], key=key)
  )
  target = batch["targets"][..., None]
  nll = lambda lp: -jnp.take_along_axis(lp, target, -1)[..., 0]  # noqa: E731
  return {
    "iters": iters_BT,
    "agree": logp_BTV.argmax(-1) == full_BTV.argmax(-1),
    "loss": nll(logp_BTV),
    "loss_full": nll(full_BTV),
  }


def table(model, batches: list, n: int, config, key) -> dict:
  """{"r_max", "tokens", "rows": [{criterion, thresholds, iterations,
  early, agree, loss, loss_full}]} over the first n rows of `batches`."""
  cfg = config.analyze.halting
  mask = np.concatenate([b["mask"] for b in batches])[:n] > 0
  rows = []
  for s in halting_sweep.settings(cfg):
    kw = dict(
      eps=s.get("eps", 0.0), tau=s.get("tau", 0.0), patience=s.get("patience", 0),
      threshold=s.get("threshold", 1.0), criterion=s["criterion"],
      r_min=cfg.r_min, r_max=cfg.r_max, start=cfg.start,
    )  # fmt: skip
    outs = jax.device_get([_tokens(model, b, key, **kw) for b in batches])
    per = {k: np.concatenate([o[k] for o in outs])[:n][mask] for k in outs[0]}
    rows.append(
      s
      | {
        "iterations": float(per["iters"].mean()),
        "early": float((per["iters"] < cfg.r_max).mean()),
        "agree": float(per["agree"].mean()),
        "loss": float(per["loss"].mean()),
        "loss_full": float(per["loss_full"].mean()),
      }
    )
  return {"r_max": cfg.r_max, "tokens": int(mask.sum()), "rows": rows}


def markdown(report: dict, split: str) -> str:
  t = report["halting"][split]
  lines = [
    f"# Exits per token ({split}: {t['tokens']} tokens, r_max {t['r_max']})",
    "",
    "| rule | mean iterations | exit before r_max | argmax = r_max's | loss | "
    "loss at r_max |",
    "|---|---|---|---|---|---|",
  ]
  for r in t["rows"]:
    rule = r["criterion"] + "".join(
      f" {k}={r[k]:g}" for k in ("eps", "tau", "patience", "threshold") if k in r
    )
    lines.append(
      f"| {rule} | {r['iterations']:.2f} | {r['early']:.2f} | {r['agree']:.3f} | "
      f"{r['loss']:.3f} | {r['loss_full']:.3f} |"
    )
  return "\n".join(lines) + "\n"


def summary(report: dict, split: str) -> str:
  t = report["halting"][split]
  fewest = min(t["rows"], key=lambda r: r["iterations"])
  return (
    f"{split}: {len(t['rows'])} rules; fewest iterations {fewest['iterations']:.2f} "
    f"of {t['r_max']} ({fewest['criterion']}), argmax kept {fewest['agree']:.2f}"
  )
