"""Accuracy and loss on every probe split, at one or several inference depths.

One forward pass to the deepest requested depth reads the answer after every
iteration, so all depths cost one compiled program and one pass over the data.
"""

import json
import math
from pathlib import Path

import jax
import optax

from loopjax import checkpoint, data, evaluate_lm, sharding
from loopjax.data import kg, pipeline
from loopjax.errors import ConfigError
from loopjax.state import Model, eval_key, sharded_train_state
from loopjax.workdir import Workdir, write_atomic


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


def make_evaluator(config, task, graphdef, depths=(), mesh=None, param_shardings=None):
  """The task's evaluator: probe splits at `depths` (knowledge graphs), or
  validation text at every iteration count (evaluate_lm)."""
  if config.data.task == "lm":
    return evaluate_lm.LmEvaluator(graphdef, config, task, mesh, param_shardings)
  return Evaluator(graphdef, config, task, depths, mesh, param_shardings)


class Evaluator:
  """Evaluates params on the task's probe splits (`data.probes`)."""

  def __init__(
    self, graphdef, config, task, depths=(), mesh=None, param_shardings=None
  ):
    """With a mesh, batches are split over it (and `param_shardings` given for
    the params); results come back replicated on every process."""
    self.R = config.model.num_loops
    self.depths = sorted({int(d) for d in depths} | {self.R})
    self.probes = data.probes(task, config.data.train_hops, config.data.probe_size)
    self.pad = task.vocab.pad_id
    split = 1 if mesh is None else sharding.batch_split(mesh, config.sharding.rules)
    longest = max((len(v["target"]) for v in self.probes.values()), default=1)
    # A multiple of the split (eval_batches pads the last batch).
    self.batch_size = split * math.ceil(min(config.eval.batch_size, longest) / split)
    key, dtype, R_eval = eval_key(config), config.model.dtype, self.depths[-1]

    def eval_step(params, batch):
      """Per example and depth: cross-entropy and whether the argmax is right."""
      with sharding.active(mesh, config.sharding.rules):
        return _eval_step(params, batch)

    def _eval_step(params, batch):
      model = Model(graphdef, params, dtype)
      logits_RBV = logits_per_iteration(model, batch, R_eval, key)
      target_B = batch["target"]
      loss_RB = jax.vmap(optax.softmax_cross_entropy_with_integer_labels, (0, None))(
        logits_RBV, target_B
      )
      return loss_RB, logits_RBV.argmax(-1) == target_B[None]

    if mesh is None:
      self._eval_step = jax.jit(eval_step)
      self._put = lambda batch: batch
    else:
      batch_sharding = sharding.batch_sharding(mesh, config.sharding.rules)
      self._eval_step = jax.jit(
        eval_step,
        in_shardings=(param_shardings, batch_sharding),
        out_shardings=sharding.replicated(mesh),
      )
      self._put = lambda batch: sharding.global_from_full(batch, batch_sharding)

  def per_example(self, params, split):
    """(loss, correct), each (R_eval, N): one row per depth 1..max(depths)."""
    return pipeline.map_batches(
      lambda b: self._eval_step(params, self._put(b)),
      split,
      self.batch_size,
      self.pad,
      axis=1,
    )

  def per_depth(self, params) -> tuple[dict, dict]:
    """{split: {"acc": {depth: .}, "loss": {depth: .}}}, and per-example results."""
    out, examples = {}, {}
    for name, split in self.probes.items():
      loss_RN, correct_RN = examples[name] = self.per_example(params, split)
      out[name] = {
        "acc": {d: float(correct_RN[d - 1].mean()) for d in self.depths},
        "loss": {d: float(loss_RN[d - 1].mean()) for d in self.depths},
      }
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
      out[f"eval/{name}/acc"] = res["acc"][self.R]
      out[f"eval/{name}/loss"] = res["loss"][self.R]
      out |= {f"eval/{name}/acc@{d}": a for d, a in res["acc"].items() if d != self.R}
    return out, results


class Reader:
  """Restores a run's checkpoints for evaluation, on one device: the state's
  abstract shapes are built once, nothing is initialized, no checkpoint is
  moved (a trainer may be writing beside it)."""

  def __init__(self, config, workdir, task):
    self.config = config
    mesh = sharding.make_mesh(
      {"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1]
    )
    self.graphdef, self.abstract, _, _ = sharded_train_state(
      config, task, mesh, abstract=True
    )
    self.mngr = Workdir(workdir).checkpoints(config.checkpoint, read_only=True)

  def steps(self) -> list[int]:
    """The complete checkpoints on disk now, oldest first."""
    self.mngr.reload()
    return sorted(self.mngr.all_steps())

  def model(self, step: int | None = None) -> tuple[Model, int]:
    """(the model at `step`, default the newest good one; its step)."""
    state, step = checkpoint.restore(
      self.mngr, self.abstract, step=step, quarantine=False
    )
    if state is None:
      raise ConfigError(
        f"--workdir={self.mngr.directory.parent}: no checkpoint to evaluate"
      )
    return Model(self.graphdef, state["params"], self.config.model.dtype), step

  def close(self) -> None:
    self.mngr.close()


def restore_model(config, workdir, step: int | None = None):
  """(task data, model, step) of a run's checkpoint (default: the newest good
  one); reads only, never moves a checkpoint."""
  task = data.load(config.data)
  reader = Reader(config, workdir, task)
  try:
    model, step = reader.model(step)
  finally:
    reader.close()
  return task, model, step


def results(config, task, per_depth: dict, step: int) -> dict:
  """What `eval/step_<N>.json` holds: accuracy and loss per split and depth
  (`Evaluator.per_depth`)."""
  lm = config.data.task == "lm"
  return {
    "step": step,
    "depths": evaluate_lm.depths(config)
    if lm
    else list(config.eval.depths) or [config.model.num_loops],
    "fingerprint": data.summary(task)["fingerprint"],
    "splits": per_depth,
  }


def write_results(workdir: Path, report: dict) -> Path:
  out = Path(workdir) / "eval" / f"step_{report['step']}.json"
  out.parent.mkdir(exist_ok=True)
  write_atomic(out, json.dumps(report, indent=2))
  return out


def evaluate_checkpoint(config, workdir, step: int | None = None) -> dict:
  """`--mode=eval`: restores a checkpoint, writes `eval/step_<N>.json`."""
  task, model, step = restore_model(config, workdir, step)
  evaluator = make_evaluator(config, task, model.graphdef, config.eval.depths)
  report = results(config, task, evaluator.per_depth(model.params)[0], step)
  out = write_results(workdir, report)
  splits, depths = report["splits"], report["depths"]
  if config.data.task == "lm":
    depths = [d for d in depths if d in (1, config.model.num_loops) or d % 2 == 0]
    rows = [(k, splits["validation"][k]) for k in ("loss", "ppl", "acc")]
    print(f"validation at step {step} by number of iterations R:")
  else:
    rows = [(name, res["acc"]) for name, res in splits.items()]
    print(f"accuracy at step {step} by inference depth R:")
  width = max(len(name) for name, _ in rows)
  print(" " * width + "".join(f"{'R=' + str(d):>8}" for d in depths))
  for name, by_depth in rows:
    print(f"{name:<{width}}" + "".join(f"{by_depth[d]:8.3f}" for d in depths))
  print(f"wrote {out}")
  return report
