"""`halting` on a language model: how many recurrences each token's
next-token prediction needs under each exit rule (`halting.adaptive` per
token, one jitted while_loop per rule), and what exiting costs.

For every (criterion, threshold) of the `analyze.halting` grid
(`halting.grid`), over the real tokens with a next token: the mean
iterations used, the share exiting before r_max, how often the exit's argmax
is the one at r_max, and the next-token loss at the exit against the loss at
r_max. Huginn's rules compare from a uniform start (`analyze.halting.start`),
Ouro's gate reads its cumulative exit probability.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import halting, sharding


def _nll(logp_BTV, targets_BT):
  return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0]


@functools.partial(jax.jit, static_argnames=("r_max",))
def _at_r_max(model, batch, key, *, r_max):
  """Per token at r_max recurrences: the argmax and the next-token loss."""
  logits_BTV = model.module()(batch["inputs"], None, num_loops=r_max, key=key)
  logp_BTV = jax.nn.log_softmax(logits_BTV)
  return logp_BTV.argmax(-1), _nll(logp_BTV, batch["targets"])


@functools.partial(jax.jit, static_argnames=("r_max",))
def _exits(model, batch, key, rule: halting.Rule, *, r_max: int):
  """Per token at its exit: iterations used, the argmax, the loss."""
  logp_BTV, iters_BT = halting.adaptive(
    model.module(), batch["inputs"], None, rule, r_max=r_max, key=key
  )
  return iters_BT, logp_BTV.argmax(-1), _nll(logp_BTV, batch["targets"])


def table(model, inputs) -> dict:
  """{"r_max", "tokens", "rows": [{criterion, thresholds, iterations,
  early, agree, loss, loss_full}]} over the first `inputs.n` rows of
  `inputs.batches` (a record.Inputs)."""
  batches, n, key = inputs.batches, inputs.n, inputs.key
  cfg = inputs.config.analyze.halting
  mask = np.concatenate(sharding.host([b["mask"] for b in batches]))[:n] > 0

  def tokens(outs):  # per batch (arrays,) -> per real token, concatenated
    return [np.concatenate(a)[:n][mask] for a in zip(*sharding.host(outs), strict=True)]

  full_arg, full_nll = tokens(
    [_at_r_max(model, b, key, r_max=cfg.r_max) for b in batches]
  )
  rows = []
  for rule in halting.grid(cfg):
    # kl_entropy_len's length: the text's own (seq_len is LTG's padded chains)
    rule = dataclasses.replace(rule, seq_len=0)
    iters, arg, nll = tokens(
      [_exits(model, b, key, rule, r_max=cfg.r_max) for b in batches]
    )
    rows.append(
      rule.row()
      | {
        "iterations": float(iters.mean()),
        "early": float((iters < cfg.r_max).mean()),
        "agree": float((arg == full_arg).mean()),
        "loss": float(nll.mean()),
        "loss_full": float(full_nll.mean()),
      }
    )
  return {"r_max": cfg.r_max, "tokens": int(mask.sum()), "rows": rows}


def markdown(report: dict) -> str:
  """Per rule: mean iterations, early exits, agreement with r_max, losses."""
  split = report["main_split"]
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


def summary(report: dict) -> str:
  split = report["main_split"]
  t = report["halting"][split]
  fewest = min(t["rows"], key=lambda r: r["iterations"])
  return (
    f"{split}: {len(t['rows'])} rules; fewest iterations {fewest['iterations']:.2f} "
    f"of {t['r_max']} ({fewest['criterion']}), argmax kept {fewest['agree']:.2f}"
  )
