"""A language model's validation loss after every iteration, from one pass.

The per-iteration readout reduces each iteration's logits to summed
cross-entropy and correct counts per sequence inside the scan, so evaluating
at 1..R_eval iterations holds one iteration's (B, T, V) logits, never R_eval of
them. Iterations past the trained R show what more recurrence does.
"""

import math
import time

import jax
import numpy as np

from loopjax import loss, recurrence, sharding
from loopjax.state import Model, eval_key


def depths(config) -> list[int]:
  """1..max(eval.depths, R): every iteration count one pass reads."""
  deepest = max([config.model.num_loops, *map(int, config.eval.depths)])
  return list(range(1, deepest + 1))


def per_iteration_sums(model: Model, batch, num_loops: int, key):
  """(loss, correct) summed per sequence after each iteration: (R, B) each."""
  m = model.module()
  seg = batch["segments"]
  x_BTD, h_BTD = m.encode(batch["inputs"], key, seg)

  def readout(h_BTD):
    h_BTD = m.coda_out(h_BTD, seg)
    return loss.lm_row_sums(
      lambda h: m.logits(h, m.readout_norm), h_BTD, batch["targets"], batch["mask"]
    )[:2]

  _, (loss_RB, correct_RB) = recurrence.unroll(
    lambda h: m.core_step(h, x_BTD, segments_BT=seg),
    h_BTD,
    num_loops,
    scan_unroll=m.cfg.scan_unroll,
    readout=readout,
  )
  return loss_RB, correct_RB


def unigram_loss(task, batches) -> float:
  """The baseline: validation loss of the training set's token frequencies
  (add-one smoothed), over the same targets the model is scored on."""
  counts = np.bincount(task.streams["train"]["tokens"], minlength=task.vocab_size)
  logp = np.log((counts + 1) / (counts.sum() + task.vocab_size))
  total = sum(float(-(logp[b["targets"]] * b["mask"]).sum()) for b in batches)
  return total / sum(float(b["mask"].sum()) for b in batches)


def eval_step(config, graphdef, deepest: int, mesh=None, param_shardings=None):
  """Jitted (params, batch) -> `per_iteration_sums` for iterations 1..deepest.
  With a mesh: batches split over it, sums replicated."""
  key, dtype, rules = eval_key(config), config.model.dtype, config.sharding.rules

  def step(params, batch):
    with sharding.active(mesh, rules):
      return per_iteration_sums(Model(graphdef, params, dtype), batch, deepest, key)

  return sharding.jit_over_batch(step, mesh, rules, param_shardings)


class LmEvaluator:
  """Validation loss, perplexity and next-token accuracy per iteration count."""

  def __init__(self, graphdef, config, task, mesh=None, param_shardings=None):
    self.R, self.depths = config.model.num_loops, depths(config)
    self.data = task
    n = task.num_windows("validation")
    limit = config.data.valid_sequences
    self.windows = np.arange(min(n, limit) if limit else n)
    self.feed = sharding.Feed(mesh, tuple(config.sharding.rules))
    self.batch_size = self.feed.size(config.eval.batch_size, len(self.windows))
    self.unigram_loss = unigram_loss(task, list(self._batches()))
    self._step = eval_step(config, graphdef, self.depths[-1], mesh, param_shardings)

  def _batches(self):
    B = self.batch_size
    for start in range(0, len(self.windows), B):
      idx = self.windows[start : start + B]
      real = len(idx)
      batch = self.data.windows("validation", np.resize(idx, B))
      batch["mask"][real:] = 0.0  # the repeated windows that fill the last batch
      yield batch

  def per_depth(self, params) -> tuple[dict, dict]:
    """({"validation": {"loss", "ppl", "acc": {depth: .}}, "tokens_per_s"}, {})."""
    t = time.perf_counter()
    batches = list(self._batches())
    outs = jax.device_get([self._step(params, self.feed.put(b)) for b in batches])
    seconds = time.perf_counter() - t
    tokens = sum(float(b["mask"].sum()) for b in batches)
    loss_R = sum(o[0].sum(-1) for o in outs) / tokens
    acc_R = sum(o[1].sum(-1) for o in outs) / tokens
    res = {
      "loss": {d: float(loss_R[d - 1]) for d in self.depths},
      "ppl": {d: float(math.exp(min(loss_R[d - 1], 50.0))) for d in self.depths},
      "acc": {d: float(acc_R[d - 1]) for d in self.depths},
      "tokens": tokens,
      "unigram_loss": self.unigram_loss,
      # At R_eval iterations, forward only; the first evaluation includes
      # compiling its program.
      "tokens_per_s": tokens / seconds,
    }
    return {"validation": res}, {}

  def run(self, params) -> dict:
    return self.run_all(params)[0]

  def run_all(self, params) -> tuple[dict, dict]:
    """(`eval/validation/{loss,ppl,acc}` at the trained R and `loss@<d>` for
    every d, results per depth as `per_depth`)."""
    per_depth = self.per_depth(params)[0]
    res = per_depth["validation"]
    out = {f"eval/validation/{k}": res[k][self.R] for k in ("loss", "ppl", "acc")}
    out |= {
      f"eval/validation/loss@{d}": v for d, v in res["loss"].items() if d != self.R
    }
    out["eval/validation/unigram_loss"] = self.unigram_loss
    out["eval/tokens_per_s"] = res["tokens_per_s"]
    return out, per_depth
