"""A knowledge-graph run's accuracy and loss on every probe split, at one or
several inference depths, and for chains at the depth a halting rule picks
per chain (kg/depth.py).

One forward pass to the deepest requested depth reads the answer after every
iteration, so all depths (and the halting rule, from the answers' KL and
entropy per iteration) cost one compiled program and one pass over the data.
"""

import jax
import optax

from loopjax import sharding
from loopjax.data import kg, pipeline
from loopjax.kg import depth
from loopjax.state import Model, eval_key


def logits_per_iteration(model: Model, batch, num_loops: int, key):
  """Answer logits after each iteration 1..num_loops, (R, B, V); `key` draws a
  random initial state (model.init_state random). Traced inside callers' jit."""
  _, logits_RBV = model.module()(
    batch["inputs"],
    batch["answer_pos"],
    num_loops=num_loops,
    per_iteration=True,
    key=key,
  )
  return logits_RBV


def eval_step(config, graphdef, deepest: int, mesh=None, param_shardings=None):
  """Jitted (params, batch) -> (cross-entropy, whether the argmax is right,
  KL(p_t || p_{t-1}), H(p_t)), each (deepest, B): per depth 1..deepest and
  example. With a mesh: batches split over it, results replicated."""
  key, dtype, rules = eval_key(config), config.model.dtype, config.sharding.rules

  def step(params, batch):
    with sharding.active(mesh, rules):
      model = Model(graphdef, params, dtype)
      logits_RBV = logits_per_iteration(model, batch, deepest, key)
      target_B = batch["target"]
      loss_RB = jax.vmap(optax.softmax_cross_entropy_with_integer_labels, (0, None))(
        logits_RBV, target_B
      )
      kl_RB, entropy_RB = depth.signals(logits_RBV)
      return loss_RB, logits_RBV.argmax(-1) == target_B[None], kl_RB, entropy_RB

  return sharding.jit_over_batch(step, mesh, rules, param_shardings)


class Evaluator:
  """Evaluates params on the task's probe splits (`kg.probes`)."""

  def __init__(
    self,
    graphdef,
    config,
    task,
    depths=(),
    mesh=None,
    param_shardings=None,
    halting=None,
  ):
    """With a mesh, batches are split over it (and `param_shardings` given for
    the params); results come back replicated on every process. `halting`
    (eval.halting): also the depth LTG's halting rule picks per example."""
    self.R, self.halting = config.model.num_loops, halting
    self.depths = sorted({int(d) for d in depths} | {self.R})
    deepest = max(self.depths[-1], halting.r_max if halting else 0)
    self.probes = kg.probes(task, config.data.train_hops, config.data.probe_size)
    self.pad, self.pad_to = task.vocab.pad_id, task.pad_to
    longest = max((len(v["target"]) for v in self.probes.values()), default=1)
    self.feed = sharding.Feed(mesh, tuple(config.sharding.rules))
    self.batch_size = self.feed.size(config.eval.batch_size, longest)
    self._eval_step = eval_step(config, graphdef, deepest, mesh, param_shardings)

  def per_example(self, params, split):
    """(loss, correct, KL, entropy), each (R_eval, N): one row per depth
    1..the deepest evaluated."""
    return pipeline.map_batches(
      lambda b: self._eval_step(params, b),
      split,
      self.batch_size,
      self.pad,
      axis=1,
      pad_to=self.pad_to,
      put=self.feed.put,
    )

  def per_depth(self, params) -> tuple[dict, dict]:
    """{split: {"acc": {depth: .}, "loss": {depth: .}}} (with halting, also
    "halt": {"acc", "iters", "eps", "tau", "tuned_on"}), and per-example
    results."""
    out, examples = {}, {}
    for name, split in self.probes.items():
      loss_RN, correct_RN, *_ = examples[name] = self.per_example(params, split)
      out[name] = {
        "acc": {d: float(correct_RN[d - 1].mean()) for d in self.depths},
        "loss": {d: float(loss_RN[d - 1].mean()) for d in self.depths},
      }
    if self.halting:
      for name, res in depth.report(examples, self.halting).items():
        out[name]["halt"] = res
    return out, examples

  def conditional_ood(self, params, correct_N) -> dict:
    """OOD accuracy on the queries whose two atomic facts the model answers.

    Tells composition failure apart from memorization failure: a model that
    knows both hops but misses the query has not learned to compose them.
    `correct_N`: whether each test_inferred_ood query is answered at depth R.
    """
    split = self.probes.get("test_inferred_ood")
    if split is None or not len(split["target"]):
      return {}
    hop1, hop2 = kg.hops(split, self.pad)
    known_N = (
      self.per_example(params, hop1)[1][self.R - 1]
      & self.per_example(params, hop2)[1][self.R - 1]
    )
    out = {"eval/test_inferred_ood/atomic_known": float(known_N.mean())}
    if known_N.any():
      out["eval/test_inferred_ood/acc_given_atomic"] = float(correct_N[known_N].mean())
    return out

  def run(self, params) -> dict:
    """Flat metrics: `eval/<split>/{acc,loss}` at the train depth, `acc@<d>` else."""
    return self.run_all(params)[0]

  def run_all(self, params) -> tuple[dict, dict]:
    """(flat metrics as `run`, results per split and depth as `per_depth`)."""
    results, examples = self.per_depth(params)
    out = {}
    if "test_inferred_ood" in examples:
      out |= self.conditional_ood(params, examples["test_inferred_ood"][1][self.R - 1])
    for name, res in results.items():
      if "halt" in res:  # the thresholds are the same for every split
        out[f"eval/{name}/acc@halt"] = res["halt"]["acc"]
        out[f"eval/{name}/iters@halt"] = res["halt"]["iters"]
        out |= {f"eval/halting/{t}": res["halt"][t] for t in ("eps", "tau")}
      out[f"eval/{name}/acc"] = res["acc"][self.R]
      out[f"eval/{name}/loss"] = res["loss"][self.R]
      out |= {f"eval/{name}/acc@{d}": a for d, a in res["acc"].items() if d != self.R}
    return out, results
