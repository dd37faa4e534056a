"""k-hop chains end to end: the hop curriculum, resume, and `--mode=analyze`."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import as_ltg_writes_it, losses, run

from experiments import extrapolation
from loopjax import metrics, restore, train
from loopjax.analysis.record import Inputs
from loopjax.data import kg, pipeline
from loopjax.errors import ConfigError
from loopjax.kg import curriculum, depth, overthinking
from loopjax.kg import source as kg_source
from loopjax.kg import spec as kg_spec
from loopjax.kg.evaluate import Evaluator
from loopjax.state import Model, train_state


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.fixture
def config(data_dir):
  """Advances a stage at every eval (threshold 0): 2 -> 3 at step 20, 4 at 40."""
  c = extrapolation.get_config("tiny")
  c.data.data_dir = str(data_dir)
  return c


@pytest.fixture(scope="module")
def whole(data_dir, tmp_path_factory):
  """A 60-step tiny run, uninterrupted."""
  c = extrapolation.get_config("tiny")
  c.data.data_dir = str(data_dir)
  workdir = tmp_path_factory.mktemp("whole")
  train.train_and_evaluate(c, workdir)
  return workdir


def small_chains(**kw):
  """A 16-entity, 4-relation chains task, in memory."""
  return kg.chains(**{"num_entities": 16, "num_relations": 4, "seed": 0} | kw)


def stages(workdir):
  return {
    r["step"]: r["train/stage"] for r in metrics.read(workdir) if "train/stage" in r
  }


# ~27 s of fixture: a curriculum run (test_paper and test_train keep resume in-suite).
@pytest.mark.slow
def test_curriculum_advances_and_resumes_in_its_stage(config, whole, tmp_path):
  assert json.loads((whole / "phases.json").read_text()) == {
    "stage_3": 20,
    "stage_4": 40,
  }
  assert stages(whole) == {10: 2, 20: 2, 30: 3, 40: 3, 50: 4, 60: 4}
  saved = json.loads((whole / "checkpoints" / "60" / "data" / "metadata").read_text())
  assert saved["stage"] == 4

  parts = tmp_path / "parts"
  config.train.num_steps = 30  # stops in stage 3, mid-way between evals
  train.train_and_evaluate(config, parts)
  config.train.num_steps = 60
  train.train_and_evaluate(config, parts)
  assert losses(parts) == losses(whole)
  assert stages(parts) == stages(whole)


@pytest.mark.parametrize(  # lr_min as a fraction of the lr; the floor: slow tier
  "floor", [0.0, pytest.param(0.75, marks=pytest.mark.slow)]
)
def test_stage_decays_the_lr(config, floor):
  config.train.curriculum.update(lr_decay=0.5, lr_min=floor * config.train.lr)
  task = small_chains(max_hops=5, train_per_hop=50, test_per_hop=8)
  graphdef, state, tx = train_state(config, task)
  step = train.make_train_step(config, graphdef, tx)
  batch = next(
    pipeline.train_iterator(kg.train_split(task, 4), 32, 0, task.vocab.pad_id)
  )
  for _ in range(config.train.warmup_steps + 1):  # the schedule's count lives in
    state, _ = step(state, batch)  # opt_state: past warmup, the lr is constant

  def delta(stage):
    s = curriculum.enter(jax.tree.map(jnp.copy, state), stage, tx, config)
    new, out = step(s, batch)
    assert int(out["train/stage"]) == stage
    return jax.tree.map(lambda a, b: b - a, state["params"], new["params"])

  d2, d3 = delta(2), delta(3)
  assert max(float(jnp.abs(a).max()) for a in jax.tree.leaves(d2)) > 1e-4
  for a, b in zip(jax.tree.leaves(d2), jax.tree.leaves(d3), strict=True):
    np.testing.assert_allclose(b, max(0.5, floor) * a, rtol=1e-4, atol=1e-7)


def test_data_must_hold_the_hops_the_config_trains_on(config, monkeypatch):
  """The papers' files fix their own hop counts; checked once loaded."""
  task = small_chains(max_hops=3, train_per_hop=20, test_per_hop=4)
  monkeypatch.setattr(curriculum.source, "knowledge_graph", lambda data_cfg: task)
  with pytest.raises(ConfigError, match=r"^data.train_hops: must be <= the data's"):
    curriculum.load(config)  # train_hops 4
  config.data.train_hops = 3
  assert curriculum.load(config) is task
  task.splits["test_k2"] = kg.sample(task.splits["test_k2"], 0, seed=0)
  with pytest.raises(ConfigError, match=r"^train.curriculum.enabled: stage 2 adv"):
    curriculum.load(config)


@pytest.mark.parametrize("reset", [False, True])
def test_next_stage_and_entering_it_optionally_resets_the_optimizer(config, reset):
  config.train.curriculum.update(threshold=0.9, reset_optimizer=reset)
  task = small_chains(max_hops=5, train_per_hop=50, test_per_hop=8)
  _, state, tx = train_state(config, task)
  state["opt_state"] = jax.tree.map(lambda x: x + 1, state["opt_state"])
  assert curriculum.next_stage(config, 2, {"eval/test_k2/acc": 0.89}) is None
  assert curriculum.next_stage(config, 2, {"eval/test_k2/acc": 0.9}) == 3
  assert curriculum.next_stage(config, 3, {"eval/test_k2/acc": 1.0}) is None
  assert curriculum.stage_names(config) == ("stage_3", "stage_4")
  config.train.curriculum.lr_decay = 0.7
  new = curriculum.enter(state, 3, tx, config)
  assert int(new["stage"]) == 3 and int(state["stage"]) == 2  # the old one unchanged
  # The optimizer's state is the old one or a fresh one, but for the stage's
  # lr scale, which the optimizer's last transform holds.
  *inner, scale = new["opt_state"]
  assert float(scale.hyperparams["step_size"]) == np.float32(0.7)
  *want, want_scale = tx.init(state["params"]) if reset else state["opt_state"]
  for a, b in zip(
    jax.tree.leaves((want, want_scale.count)),
    jax.tree.leaves((inner, scale.count)),
    strict=True,
  ):
    np.testing.assert_array_equal(b, a)
  # At the last stage (data.train_hops = 4) it stays.
  assert curriculum.next_stage(config, 4, {"eval/test_k4/acc": 1.0}) is None


def test_avg_t_first_is_ltgs():
  """The mean first iteration (1-based) right, over examples ever right."""
  correct_RN = np.array([[0, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
  assert overthinking.avg_t_first(correct_RN) == 1.5  # (2 + 1) / 2
  assert overthinking.avg_t_first(np.zeros((3, 2), bool)) is None


def test_margin_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
  target = rng.integers(0, 7, 5)
  want = np.array(
    [[l[b, t] - np.delete(l[b], t).max() for b, t in enumerate(target)] for l in logits]
  )
  got = overthinking.margin(jnp.asarray(logits), jnp.asarray(target))
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.slow  # ~10 s of CLI
def test_analyze_agrees_with_evaluation(config, whole):
  """`--mode=analyze` from the command line writes every analysis (chains: padded
  queries, the first bridge); its curves equal the evaluator's accuracy at every
  depth, and fixed-R halting equals the curve at r_max."""
  out = run(
    [
      sys.executable,
      "-m",
      "loopjax.main",
      "--mode=analyze",
      f"--workdir={whole}",
      "--config=experiments/extrapolation.py:tiny",
      f"--config.data.data_dir={config.data.data_dir}",
      "--config.analyze.max_depth=6",
      "--config.analyze.halting.criteria=('fixed','kl_entropy','argmax')",
      "--config.analyze.halting.r_max=6",
    ]
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert {p.name for p in (whole / "analysis").iterdir()} == {
    f"{name}.{ext}" for name in kg_spec.ANALYSES for ext in ("json", "md", "png")
  } | {"logit_lens_phases.png"}  # the curriculum's stages are its phases
  curves = json.loads((whole / "analysis" / "overthinking.json").read_text())
  assert curves["step"] == 60 and curves["train_depths"] == [2, 4]
  task, model, _ = restore.from_checkpoint(config, whole)
  ev = Evaluator(model.graphdef, config, task, depths=range(1, 7))
  results, _ = ev.per_depth(model.params)
  assert set(results) == set(curves["overthinking"])
  for name, res in results.items():
    acc = curves["overthinking"][name]["acc"]
    np.testing.assert_allclose(acc, [res["acc"][d] for d in range(1, 7)], atol=1e-6)

  rows = json.loads((whole / "analysis" / "halting.json").read_text())["halting"]
  fixed = next(r for r in rows if r["criterion"] == "fixed")
  for name, res in fixed["splits"].items():  # fixed = all r_max iterations
    assert res["iterations"] == 6
    assert res["acc"] == pytest.approx(curves["overthinking"][name]["acc"][5])
  assert len(rows) == 1 + 5 + 3  # fixed, 5 eps, 3 patience values
  for r in rows:
    for res in r["splits"].values():
      assert 1 <= res["iterations"] <= 6


def test_curves_with_a_random_initial_state_equal_the_evaluator(config):
  config.model.init_state = "random"  # the state drawn from the evaluator's key
  task = small_chains(max_hops=3, train_per_hop=20, test_per_hop=8)
  config.data.train_hops = 3
  graphdef, state, _ = train_state(config, task)
  ev = Evaluator(graphdef, config, task, depths=(1, 2, 3))
  want, _ = ev.per_depth(state["params"])
  config.analyze.max_depth, config.eval.batch_size = 3, 64
  model = Model(graphdef, state["params"], "float32")
  got = overthinking.curves(model, Inputs(config, task=task, probes=ev.probes))
  for name, res in want.items():
    np.testing.assert_allclose(got[name]["acc"], [res["acc"][d] for d in (1, 2, 3)])


# Shares that run.
@pytest.mark.slow
def test_ltgs_own_files_train_like_the_generated_data(config, whole, tmp_path):
  """The official on-disk format (off-by-two labels, one line per file) trains
  with data.source=grokked_json:DIR on the very examples generated ones hold."""
  from loopjax.data import grokked_json

  grokked_json.export(kg_source.knowledge_graph(config.data), tmp_path / "ltg")
  as_ltg_writes_it(tmp_path / "ltg")
  config.data.source = f"grokked_json:{tmp_path / 'ltg'}"
  config.train.num_steps = 20
  train.train_and_evaluate(config, tmp_path / "run")
  want = {s: v for s, v in losses(whole).items() if s <= 20}
  assert losses(tmp_path / "run") == want


@pytest.mark.slow  # ~17 s of training; test_pipeline checks the pad column
def test_a_chains_run_reads_its_answer_at_a_pad_column(tmp_path):
  """data.pad_to (LTG's 50 / 49): the tiny run trains and evaluates with every
  chain padded to 8 tokens (max_hops 5 + 3) and the loss's supervised
  iterations still counted from each chain's hops; too short a pad is one
  line."""
  from loopjax import config as config_lib
  from loopjax.errors import ConfigError

  c = extrapolation.get_config("tiny")
  c.data.data_dir = str(tmp_path / "data")
  c.data.pad_to = 6
  with pytest.raises(ConfigError, match=r"data.pad_to: 0 .* >= data.max_hops \+ 2 = 7"):
    config_lib.validate(c)
  c.data.pad_to = 8
  c.train.update(num_steps=20, supervise="from_hops")
  last = train.train_and_evaluate(c, tmp_path / "run")
  assert np.isfinite(last["train/loss"]) and "eval/test_k5/acc" in last


def test_validation_chains_leave_train_and_test_as_they_were():
  """val_k<k>: held out from training and disjoint from the test chains; the
  train and test chains are those of a task without them."""
  plain, with_val = (
    small_chains(max_hops=4, train_per_hop=40, test_per_hop=10),
    (small_chains(max_hops=4, train_per_hop=40, test_per_hop=10, val_per_hop=12)),
  )
  assert set(with_val.splits) - set(plain.splits) == {"val_k2", "val_k3", "val_k4"}
  for name, split in plain.splits.items():
    for column, a in split.items():
      np.testing.assert_array_equal(with_val.splits[name][column], a)
  for k in (2, 3, 4):
    rows = lambda s: {tuple(r) for r in with_val.splits[f"{s}_k{k}"]["inputs"]}  # noqa: E731
    assert len(rows("val")) == 12
    assert not rows("val") & (rows("train") | rows("test"))
  probes = kg.probes(with_val, train_hops=3, size=8)
  assert "val_k3" in probes and "val_k4" not in probes  # trained depths only


def test_halting_stops_at_the_first_settled_iteration_after_r_min():
  inf = np.inf
  kl_RN = np.array([[inf, inf, inf], [0.5, 1e-4, 1e-4], [1e-4, 1e-4, 0.2], [1e-4] * 3])
  entropy_RN = np.array([[0.1] * 3, [0.1, 0.1, 5.0], [0.1, 0.1, 5.0], [0.1] * 3])
  # example 0 settles at t = 3, 1 at t = 2 (r_min), 2 never: r_max
  iters_N = depth.halt_at(kl_RN, entropy_RN, 1e-3, 3.0, r_min=2, r_max=3)
  np.testing.assert_array_equal(iters_N, [3, 2, 3])
  np.testing.assert_array_equal(
    depth.halt_at(kl_RN, entropy_RN, 1e-3, 3.0, r_min=3, r_max=4), [3, 3, 4]
  )


def test_halting_thresholds_are_tuned_on_validation_chains_only(config):
  """The test chains would choose other thresholds; the rule never sees them."""
  h = config.eval.halting
  h.update(r_min=2, r_max=3, eps_grid=(1e-3,), tau_grid=(0.5, 5.0))
  one = np.ones((3, 1))
  # entropy 1.0 at t = 2: tau 5 halts there, tau 0.5 runs to t = 3
  signals = (None, None, np.full((3, 1), 1e-4), np.full((3, 1), 1.0))

  def split(right_at):
    correct = np.zeros((3, 1), bool)
    correct[right_at - 1] = True
    return (one, correct, *signals[2:])

  examples = {"val_k2": split(2), "test_k5": split(3)}
  eps, tau, tuned_on = depth.thresholds(examples, h)
  assert (eps, tau, tuned_on) == (1e-3, 5.0, ["val_k2"])
  res = depth.report(examples, h)
  assert res["test_k5"]["acc"] == 0.0 and res["test_k5"]["iters"] == 2.0
  assert res["val_k2"]["acc"] == 1.0
  # no validation chains: the config's thresholds
  assert depth.thresholds({"test_k5": split(3)}, h)[:2] == (h.eps, h.tau)


@pytest.mark.slow  # the `whole` run (~50 s here); the unit tests above: default
def test_evaluation_reports_fixed_depth_and_halting(config, whole):
  """The evaluator's halting accuracy is the per-iteration accuracy at each
  example's halting iteration; the fixed depth is evaluated."""
  config.eval.extrapolation_depth = 3
  config.eval.halting.update(eps_grid=(1e-3, 0.5), tau_grid=(0.3, 3.0))
  from loopjax import task as task_lib

  task, model, _ = restore.from_checkpoint(config, whole)
  family = task_lib.for_config(config)
  ev = family.evaluator(config, task, model.graphdef)
  flat, results = ev.run_all(model.params)
  assert 3 in ev.depths and "eval/test_k5/acc@3" in flat
  _, per_example = ev.per_depth(model.params)
  _, correct_RN, kl_RN, entropy_RN = per_example["test_k5"]
  h = results["test_k5"]["halt"]
  iters_N = depth.halt_at(kl_RN, entropy_RN, h["eps"], h["tau"], 2, 6)
  assert correct_RN.shape[0] == 6  # to eval.halting.r_max
  assert flat["eval/test_k5/acc@halt"] == pytest.approx(
    correct_RN[iters_N - 1, np.arange(len(iters_N))].mean()
  )
  assert flat["eval/test_k5/iters@halt"] == pytest.approx(iters_N.mean())
  assert h["tuned_on"] == []  # the tiny config holds no validation chains
