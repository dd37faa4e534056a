"""The levers toward held depth extrapolation (issue 54): the params' EMA
(train.param_ema) kept, checkpointed and evaluated beside the raw params; the
last curriculum stage's decayed lr; and `experiments/extrapolation.py`'s
`long_<lever>` variants."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import extrapolation
from loopjax import config as config_lib
from loopjax import ema, evaluate, follow, footprint, restore, sharding, train
from loopjax import task as task_lib
from loopjax.data import kg, pipeline
from loopjax.errors import ConfigError
from loopjax.kg import beyond, curriculum
from loopjax.state import sharded_train_state, train_state
from loopjax.workdir import Workdir


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.fixture
def config(data_dir):
  c = extrapolation.get_config("tiny")
  c.data.data_dir = str(data_dir)
  return c


def _task():
  return kg.chains(
    num_entities=16, num_relations=4, seed=0, max_hops=5, train_per_hop=50,
    test_per_hop=8,
  )  # fmt: skip


def _batch(task):
  split = kg.train_split(task, 4)
  return next(pipeline.train_iterator(split, 32, 0, task.vocab.pad_id))


def test_ema_is_the_average_of_the_params_it_saw(config):
  """After N steps the EMA is the hand-computed average of the recorded
  params, decay min(d, (1 + t) / (10 + t)); it differs from them."""
  config.train.param_ema = 0.2
  task = _task()
  graphdef, state, tx = train_state(config, task)
  step, batch = train.make_train_step(config, graphdef, tx), _batch(task)
  want = jax.device_get(state["params"])
  for t in range(4):  # the decay: 0.1, 2 / 11, then d = 0.2 from t = 2
    state, _ = step(state, batch)
    w = min(0.2, (1 + t) / (10 + t))
    want = jax.tree.map(
      lambda e, p, w=w: w * e + (1 - w) * p, want, jax.device_get(state["params"])
    )
  for got, w in zip(*(jax.tree.leaves(x) for x in (state["ema"], want)), strict=True):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)
  moved = [float(jnp.abs(a - b).max()) for a, b in zip(
    jax.tree.leaves(state["ema"]), jax.tree.leaves(state["params"]), strict=True
  )]  # fmt: skip
  assert max(moved) > 1e-4


@pytest.mark.parametrize(  # at once (steps 0): slow tier
  "steps", [8, pytest.param(0, marks=pytest.mark.slow)]
)
def test_the_last_stage_lr_follows_its_cosine(config, steps):
  """In the last stage the updates are scaled by a cosine from 1 to
  last_stage_lr over last_stage_steps from the stage's first step, then flat
  (steps 0: at once); the other stages are not."""
  config.train.curriculum.update(last_stage_lr=0.25, last_stage_steps=steps)
  task = _task()
  graphdef, state, tx = train_state(config, task)
  assert ("stage_start" in state) == bool(steps)
  step, batch = train.make_train_step(config, graphdef, tx), _batch(task)
  for _ in range(config.train.warmup_steps + 1):  # past warmup: a constant lr
    state, _ = step(state, batch)
  entered = curriculum.enter(jax.tree.map(jnp.copy, state), 4, tx, config)
  if steps:
    assert int(entered["stage_start"]) == int(state["step"])

  def delta(stage, since=0):
    s = curriculum.enter(jax.tree.map(jnp.copy, state), stage, tx, config)
    if steps:
      s["stage_start"] = s["step"] - since
    new, out = step(s, batch)
    d = jax.tree.map(lambda a, b: b - a, state["params"], new["params"])
    return d, float(out["train/last_stage_scale"])

  base, scale = delta(3)  # not the last stage (data.train_hops 4)
  assert scale == 1.0
  cosine = lambda t: 0.25 + 0.75 * 0.5 * (1 + np.cos(np.pi * min(t / 8, 1)))  # noqa: E731
  for since in (0, 4, 8, 12) if steps else (0, 12):
    want = cosine(since) if steps else 0.25
    d, scale = delta(4, since)
    assert scale == pytest.approx(want, rel=1e-6)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(d), strict=True):
      np.testing.assert_allclose(b, want * a, rtol=2e-4, atol=1e-7)


def test_the_footprint_counts_the_ema(config):
  family = task_lib.for_config(config)
  task = family.without_examples(config)
  mesh = sharding.make_mesh(config.mesh)
  without = footprint.lower_bound(config, family, task, mesh)
  config.train.param_ema = 0.999
  terms = footprint.lower_bound(config, family, task, mesh)
  assert terms[footprint.EMA] == terms[footprint.STATE] / 4
  assert terms.keys() - without.keys() == {footprint.EMA}


# One tiny run with the EMA on (~40 s of fixture on a shared core): evaluated,
# restored, forked; the slow tier, as test_extrapolation's `whole` run.
@pytest.fixture(scope="module")
def with_ema(data_dir, tmp_path_factory):
  c = extrapolation.get_config("tiny")
  c.data.data_dir = str(data_dir)
  c.train.update(num_steps=20, param_ema=0.9)
  workdir = tmp_path_factory.mktemp("ema")
  last = train.train_and_evaluate(c, workdir)
  return c, workdir, last


@pytest.mark.slow
def test_a_run_with_ema_evaluates_both_and_restores_the_average(with_ema, capsys):
  config, workdir, last = with_ema
  assert {"eval/test_k5/acc", "ema/test_k5/acc", "ema/test_k5/acc@halt"} <= set(last)
  assert "ema/halting/eps" in last
  assert all(k.startswith(("eval/", "ema/", "train/", "steps")) for k in last), last
  task = task_lib.for_config(config).load(config)
  reader = restore.Reader(config, workdir, task, ema=True)
  models, step = reader.models()
  reader.close()
  assert step == 20 and set(models) == {"params", "ema"}
  raw, avg = (jax.tree.leaves(models[k].params) for k in ("params", "ema"))
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(raw, avg, strict=True)) > 0
  ev = task_lib.for_config(config).evaluator(config, task, models["ema"].graphdef)
  assert ev.run(models["ema"].params) == pytest.approx(
    {k.replace("ema/", "eval/", 1): v for k, v in last.items() if ema.is_metric(k)}
  )
  plain = restore.Reader(config, workdir, task)  # the params alone, as before
  assert set(plain.models()[0]) == {"params"}
  plain.close()

  report = evaluate.evaluate_checkpoint(config, workdir)
  assert set(report["ema"]) == set(report["splits"])
  assert report["ema"]["test_k5"]["acc"][4] == pytest.approx(last["ema/test_k5/acc"])
  assert "EMA of the params (train.param_ema): accuracy at step 20" in (
    capsys.readouterr().out
  )


@pytest.mark.slow
def test_the_follower_and_the_depth_report_show_the_ema(with_ema, tmp_path):
  config, workdir, last = with_ema
  task = task_lib.for_config(config).load(config)
  reader = restore.Reader(config, workdir, task, ema=True)
  job = follow._Job(Workdir(workdir), config, task, reader, False)
  job.evaluate(20)
  job.close()
  record = job.records[-1]
  assert record["ema/test_k5/acc"] == pytest.approx(last["ema/test_k5/acc"])
  saved = json.loads((workdir / "eval" / "step_20.json").read_text())
  assert "ema" in saved
  paths = beyond.write(workdir, {})
  assert {p.name for p in paths} >= {"depths_ema.md", "depths_ema.json"}
  text = (workdir / "plots" / "depths_ema.md").read_text()
  assert text.startswith("The EMA of the params (train.param_ema).")


@pytest.mark.slow
def test_resuming_without_the_ema_is_refused_and_a_fork_adds_it(with_ema, tmp_path):
  """A run with the EMA resumes with it; one trained without it does not
  resume with it (one line naming the field); a fork may add it (begun at
  the fork's params) or drop it, and add the last stage's decay (counted
  from the fork)."""
  config, workdir, _ = with_ema
  plain = config_lib.base()
  plain.update(json.loads(config_lib.to_json(config)))
  plain.train.param_ema = 0.0
  (tmp_path / "plain").mkdir()
  (tmp_path / "plain" / "config.json").write_text(config_lib.to_json(plain))
  with pytest.raises(ConfigError, match=r"train.param_ema=0.0 \(workdir\) vs 0.9"):
    Workdir(tmp_path / "plain").check(config)

  shutil.copytree(workdir, tmp_path / "resumed")  # its own run resumes with it
  longer = config.copy_and_resolve_references()
  longer.train.num_steps = 30
  last = train.train_and_evaluate(longer, tmp_path / "resumed")
  assert last["ema/test_k5/acc"] >= 0 and "train/last_stage_scale" not in last

  fork = extrapolation.get_config("tiny")
  fork.data.data_dir = config.data.data_dir
  fork.train.update(num_steps=30)
  fork.train.curriculum.update(last_stage_lr=0.5, last_stage_steps=10)
  fork.checkpoint.fork_from = f"{workdir}:20"
  last = train.train_and_evaluate(fork, tmp_path / "fork")
  assert "eval/test_k5/acc" in last and not any(map(ema.is_metric, last))
  assert last["train/last_stage_scale"] == 1.0  # stage 3 until the eval at 30
  meta = tmp_path / "fork" / "checkpoints" / "30" / "meta" / "metadata"
  saved = {k.split("]")[0] + "]" for k in json.loads(meta.read_text())["checksums"]}
  assert "['stage_start']" in saved and "['ema']" not in saved


LEVERS = [f"long_{n}" for n in extrapolation.LEVERS] + ["long_ema+decay"]


@pytest.mark.parametrize("variant", LEVERS)
def test_each_lever_variant_validates_and_builds(variant):
  """Each lever on top of `long` validates, differs from it in its own fields
  only, and its train state (abstract: nothing computed) builds."""
  c = extrapolation.get_config(variant)
  config_lib.validate(c)
  long = extrapolation.get_config("long")
  levers = variant.removeprefix("long_").split("+")
  fields = {f for n in levers for f in extrapolation.LEVERS[n]}
  for f in fields:
    head, _, leaf = f.rpartition(".")
    node_c, node_l = c, long
    for k in head.split("."):
      node_c, node_l = node_c[k], node_l[k]
    assert (
      node_c[leaf]
      == extrapolation.LEVERS[next(n for n in levers if f in extrapolation.LEVERS[n])][
        f
      ]
    )
  family = task_lib.for_config(c)
  task = family.without_examples(c)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  state = sharded_train_state(c, task, mesh, abstract=True)[1]
  assert ("ema" in state) == ("ema" in levers)
  assert ("stage_start" in state) == ("decay" in levers)
  if "ema" in state:
    assert jax.tree.structure(state["ema"]) == jax.tree.structure(state["params"])


def test_lever_fields_are_checked():
  c = extrapolation.get_config("long_nope")
  c.model.random_positions = 64
  with pytest.raises(ConfigError, match=r"^model.random_positions: .*'none' has no"):
    config_lib.validate(c)
  for field, value, message in (
    ("param_ema", 1.0, r"^train.param_ema: must be in \[0, 1\)"),
    ("curriculum.last_stage_lr", 0.0, r"^train.curriculum.last_stage_lr: must be"),
    ("curriculum.last_stage_steps", -1, r"^train.curriculum.last_stage_steps: must"),
  ):
    c = extrapolation.get_config("long")
    head, _, leaf = f"train.{field}".rpartition(".")
    node = c
    for k in head.split("."):
      node = node[k]
    node[leaf] = value
    with pytest.raises(ConfigError, match=message):
      config_lib.validate(c)
  c = extrapolation.get_config("cpu")
  c.train.curriculum.update(enabled=False, last_stage_steps=100)
  with pytest.raises(ConfigError, match=r"need train.curriculum.enabled"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match=r"got 'wide'"):
    extrapolation.get_config("long_wide")
  assert len(extrapolation.sweep("levers")) == 3 * (1 + len(extrapolation.LEVERS))
