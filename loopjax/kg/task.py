"""The knowledge-graph families: 2-hop composition (grokking phases) and k-hop
chains (an optional hop curriculum). task.FAMILIES names them."""

import numpy as np

from loopjax import loss
from loopjax.data import kg
from loopjax.kg import curriculum, depth, evaluate, grokking, source
from loopjax.task import Family


class _KnowledgeGraph(Family):
  """What composition and chains share: probe splits, the answer's loss."""

  loss_fn = staticmethod(loss.loss_fn)

  def load(self, config):
    return source.knowledge_graph(config.data)

  def train_iterator(self, config, task, rows):
    return curriculum.train_iterator(config, task, rows)

  def evaluator(self, config, task, graphdef, depths=(), mesh=None, shardings=None):
    return evaluate.Evaluator(graphdef, config, task, depths, mesh, shardings)

  def eval_step(self, config, graphdef, mesh=None, shardings=None):
    return evaluate.eval_step(config, graphdef, self.deepest(config), mesh, shardings)

  def deepest(self, config) -> int:
    """The most iterations an evaluation runs."""
    return max(self.eval_depths(config) + [config.model.num_loops])

  def eval_table(self, config, report: dict):
    rows = [(name, res["acc"]) for name, res in report["splits"].items()]
    title = f"accuracy at step {report['step']} by inference depth R:"
    return title, report["depths"], rows

  def analyze(self, config, workdir, task, model, step, out_dir, phases=True):
    from loopjax.kg import analyze  # figures: matplotlib, not needed to train

    split = self.main_split(config)
    return analyze.run(config, workdir, task, model, step, out_dir, split, phases)

  def without_examples(self, config):
    return kg.without_examples(config.data)

  def batch_shapes(self, config, task, batch_size: int) -> dict:
    B = batch_size
    return {
      "inputs": ((B, task.model_dims()[1]), np.int32),
      "target": ((B,), np.int32),
      "answer_pos": ((B,), np.int32),
      "hops": ((B,), np.int32),
    }

  def random_batch(self, config, rng, vocab_size: int, seq_len: int) -> dict:
    B = config.train.batch_size
    return {
      "inputs": rng.integers(0, vocab_size - 1, (B, seq_len)).astype(np.int32),
      "target": rng.integers(0, config.data.num_entities, B).astype(np.int32),
      "answer_pos": np.full(B, seq_len - 1, np.int32),
      "hops": np.full(B, seq_len - 1, np.int32),
    }


class Composition(_KnowledgeGraph):
  """2-hop composition: memorize, then ID, then OOD generalization (phases)."""

  name = "composition"

  def main_split(self, config) -> str:
    """The held-out split the figures single out."""
    return "test_inferred_ood"

  def phase_names(self, config) -> tuple[str, ...]:
    return tuple(grokking.PHASES)

  def after_eval(self, config, step, metrics, phases, train_iter, state, tx):
    return state, grokking.newly_reached(metrics, config.phases, phases)

  def finished(self, config, phases: dict) -> str | None:
    return f"phases: {grokking.summary(phases)}"

  def follow_phases(self, config, records: list[dict]) -> dict | None:
    return grokking.detect(records, config.phases)


class Chains(_KnowledgeGraph):
  """k-hop chains: depth extrapolation, with a hop curriculum if enabled."""

  name = "chains"

  def main_split(self, config) -> str:
    """The held-out split the figures single out: the deepest trained k."""
    return f"test_k{config.data.train_hops}"

  def load(self, config):
    return curriculum.load(config)

  def phase_names(self, config) -> tuple[str, ...]:
    return curriculum.stage_names(config)

  def after_eval(self, config, step, metrics, phases, train_iter, state, tx):
    # On the cadence only: where a run stops must not change its course.
    if not config.train.curriculum.enabled or step % config.eval_every:
      return state, []
    k = curriculum.next_stage(config, train_iter.stage, metrics)
    if k is None:
      return state, []
    train_iter.set_stage(k)
    return curriculum.enter(state, k, tx, config), [f"stage_{k}"]

  def finished(self, config, phases: dict) -> str | None:
    return f"curriculum: {curriculum.stages_summary(phases, config)}"

  def update_scale(self, config, state):
    return curriculum.last_stage_scale(config, state)

  def evaluator(self, config, task, graphdef, depths=(), mesh=None, shardings=None):
    """Also at the depth fixed before training and where halting stops
    (kg/depth.py): how chains deeper than trained are answered."""
    depths = {*depths, depth.fixed_depth(config)}
    return evaluate.Evaluator(
      graphdef, config, task, depths, mesh, shardings, config.eval.halting
    )

  def eval_depths(self, config) -> list[int]:
    return sorted({*super().eval_depths(config), depth.fixed_depth(config)})

  def eval_table(self, config, report: dict):
    """The accuracy per depth, then the halting rule's ("halt")."""
    title, depths, rows = super().eval_table(config, report)
    halt = {n: r["halt"] for n, r in report["splits"].items() if "halt" in r}
    if not halt:
      return title, depths, rows
    h = next(iter(halt.values()))
    where = f"tuned on {', '.join(h['tuned_on'])}" if h["tuned_on"] else "config"
    title += (
      f"\n(fixed before training: R = {depth.fixed_depth(config)}; halt: KL < "
      f"{h['eps']:g} and entropy < {h['tau']:g}, {where})"
    )
    rows = [(name, acc | {"halt": halt[name]["acc"]}) for name, acc in rows]
    return title, [*depths, "halt"], rows

  def deepest(self, config) -> int:
    return max(super().deepest(config), config.eval.halting.r_max)
