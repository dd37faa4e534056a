"""Language-model runs: train, evaluate by recurrence, sample, resume, refuse."""

import json

import pytest
from conftest import cli, losses, run

from loopjax import metrics, report, train
from loopjax.errors import ConfigError
from loopjax.lm import task as lm_task


def test_an_lm_run_trains_evaluates_per_iteration_and_resumes_bit_exact(
  lm_config, tmp_path
):
  # Stopped at 10 by a shorter num_steps: the cosine schedule would change
  # with it, so a constant one (a preempted run keeps its num_steps).
  lm_config.train.update(num_steps=20, schedule="constant")
  train.train_and_evaluate(lm_config, tmp_path / "straight")
  lm_config.train.num_steps = 10
  train.train_and_evaluate(lm_config, tmp_path / "resumed")
  lm_config.train.num_steps = 20
  last = train.train_and_evaluate(lm_config, tmp_path / "resumed")
  straight = losses(tmp_path / "straight")
  assert straight == losses(tmp_path / "resumed")  # bit for bit
  assert straight[20] < straight[5]
  # Validation after every iteration count 1..4 (R = 2 trained, eval.depths 4).
  assert {f"eval/validation/loss@{d}" for d in (1, 3, 4)} <= set(last)
  assert last["eval/validation/loss"] < last["eval/validation/unigram_loss"] + 1.0
  records = metrics.read(tmp_path / "straight")
  assert [r["step"] for r in records if "eval/validation/loss" in r] == [10, 20]
  assert (tmp_path / "straight/tokenizer.json").exists()
  saved = json.loads((tmp_path / "straight/dataset.json").read_text())
  assert saved["vocab_size"] == 300 and set(saved["sizes"]) == {"train", "validation"}
  paths = report.report(tmp_path / "straight")
  assert paths[0].name == "lm.png" and paths[0].stat().length > 10_000
  table = (tmp_path / "straight/results.md").read_text()
  assert "validation/loss" in table and "validation/unigram_loss" in table


def test_a_changed_corpus_is_refused_by_its_workdir(lm_config, tmp_path):
  lm_config.train.num_steps = 10
  train.train_and_evaluate(lm_config, tmp_path / "run")
  before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
  (tmp_path / "corpus" / "doc001.py").write_text("y = 2\n" * 80)
  lm_config.train.num_steps = 20
  with pytest.raises(ConfigError, match="was trained on other data"):
    train.train_and_evaluate(lm_config, tmp_path / "run")
  assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}


def test_a_step_that_cannot_fit_is_refused_before_anything_compiles(
  lm_config, tmp_path
):
  """2^27 windows of 32 tokens: the blocked attention's scores (their
  weights' and both cotangents, 2 heads, 32 x 32 per row) alone are 3 TiB,
  more than any machine this runs on; refused in one line, nothing written.
  So are 2^31 iterations of the state, and a huge model's state."""
  lm_config.train.batch_size = 2**27
  with pytest.raises(ConfigError) as e:
    train.train_and_evaluate(lm_config, tmp_path / "run")
  assert str(e.value).startswith(
    "train.batch_size, data.seq_len: a step needs at least 4096.0 GiB per device "
    "(attention scores of every block (3 x B, N, ~T^2 / 2): 3072.0 GiB; batch "
    "134217728, 32 tokens) and "
  ), str(e.value)
  assert not (tmp_path / "run").exists()
  lm_config.train.batch_size = 8
  lm_config.model.num_loops = 2**31  # (B 8, T 32, D 32) float32 each: 64 TiB
  with pytest.raises(ConfigError) as e:
    train.train_and_evaluate(lm_config, tmp_path / "run")
  assert str(e.value).startswith(
    "model.num_loops (or train.depth.max), train.batch_size, data.seq_len: a "
    "step needs at least 65536.0 GiB per device (each iteration's state (R "
    "2147483648, B, T, D): 65536.0 GiB;"
  ), str(e.value)
  lm_config.model.num_loops = 2
  assert not (tmp_path / "run").exists()
  lm_config.eval.batch_size = 2**27  # the in-loop evaluation's batch: 1 TiB
  with pytest.raises(ConfigError) as e:
    train.train_and_evaluate(lm_config, tmp_path / "run")
  assert str(e.value).startswith(
    "eval.batch_size, data.seq_len: an evaluation needs at least 1024.0 GiB "
  ), str(e.value)
  lm_config.eval.batch_size = 8
  assert not (tmp_path / "run").exists()
  lm_config.train.batch_size = 8
  lm_config.model.d_model = 2**17  # 2 TB of state: the model's fields are named
  with pytest.raises(ConfigError) as e:
    train.train_and_evaluate(lm_config, tmp_path / "run")
  assert str(e.value).startswith(
    "model (d_model, num_layers, mlp_ratio), mesh.fsdp, mesh.tensor: a step needs "
  ), str(e.value)


@pytest.mark.slow  # five CLI processes, ~30 s
def test_eval_and_sample_from_the_command_line(lm_config, tmp_path):
  wd, data_dir = tmp_path / "run", lm_config.data.data_dir
  args = [
    f"--config.data.source={lm_config.data.source}",
    "--config.data.valid_fraction=0.2",
  ]
  base = cli(wd, data_dir, *args)
  base[3] = "--config=experiments/lm.py:tiny"
  assert run(base).returncode == 0
  ev = run([*base, "--mode=eval"])
  assert ev.returncode == 0, ev.stderr
  assert "validation at step 20 by number of iterations R" in ev.stdout
  assert "R=4" in ev.stdout.splitlines()[-5]
  report = json.loads((wd / "eval/step_20.json").read_text())
  assert report["depths"] == [1, 2, 3, 4]
  out = run(
    [*base[:2], "loopjax.sample", f"--workdir={wd}", "--prompt=def "]
    + ["--max_new_tokens=16"]
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("def ") and len(out.stdout) > 8
  analyze = run(base[:3] + [f"--workdir={wd}", "--mode=analyze"])
  assert analyze.returncode == 0, analyze.stderr
  for name in ("fixed_points", "stages", "attention"):
    assert (wd / "analysis" / f"{name}.png").exists()
  assert "stages: sink rate up to" in analyze.stdout
  bad = run(
    [
      *base[:4],
      f"--workdir={tmp_path / 'new'}",
      *base[5:],
      "--config.data.source=text:/no/such/*.txt",
    ]
  )
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1] == (
    "error: data.source: text:/no/such/*.txt matches no file"
  )


@pytest.mark.slow  # ~10 s; the KG sharding tests stay in the default suite
def test_a_sharded_lm_step_matches_one_device(lm_config):
  """The LM step on a (2, 2, 2) mesh of 8 CPUs, with grouped-query heads and
  SwiGLU, equals the same step on one device."""
  import jax
  import numpy as np

  from loopjax import sharding
  from loopjax.data import lm as lm_data
  from loopjax.state import sharded_train_state, train_state
  from loopjax.train import make_train_step

  lm_config.model.update(num_heads=4, num_kv_heads=2, mlp_type="swiglu")
  task = lm_task.text(lm_config.data)
  batches = [next(lm_data.train_iterator(task, 8, s)) for s in range(2)]
  graphdef, state, tx = train_state(lm_config, task)
  step = make_train_step(lm_config, graphdef, tx)
  want = []
  for b in batches:
    state, m = step(state, b)
    want.append(jax.device_get(m))
  c = lm_config.copy_and_resolve_references()
  c.mesh.update(data=2, fsdp=2, tensor=2, devices=0)
  mesh = sharding.make_mesh(c.mesh)
  graphdef, state, tx, shardings = sharded_train_state(c, task, mesh)
  step = make_train_step(c, graphdef, tx, mesh, shardings)
  put = sharding.batch_sharding(mesh, c.sharding.rules)
  for b, w in zip(batches, want, strict=True):
    state, m = step(state, sharding.global_batch(b, put, 8))
    for k, v in w.items():
      np.testing.assert_allclose(m[k], v, rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_sampled_depth_truncated_backprop_and_remat_train_an_lm(lm_config, tmp_path):
  lm_config.train.update(num_steps=10, backprop_depth=1)
  lm_config.train.depth.update(dist="poisson", mean=2.0, min=1, max=3)
  lm_config.model.remat = "full"
  last = train.train_and_evaluate(lm_config, tmp_path / "run")
  records = metrics.read(tmp_path / "run")
  assert {r["train/depth"] for r in records if "train/depth" in r} <= {1.0, 2.0, 3.0}
  assert last["train/loss"] < 6.0 and last["eval/validation/loss"] < 6.0


def test_an_evaluation_job_follows_an_lm_run(lm_config, tmp_path):
  """Trained with eval_every=0, the follower evaluates each checkpoint."""
  from loopjax import follow

  lm_config.update(eval_every=0)
  train.train_and_evaluate(lm_config, tmp_path / "run")
  follow.follow(tmp_path / "run", lm_config, poll_s=0.1)
  records = metrics.read(tmp_path / "run/eval")
  assert [r["step"] for r in records] == [10, 20]
  assert all("eval/validation/loss@4" in r for r in records)
  assert json.loads((tmp_path / "run/eval/step_20.json").read_text())["depths"] == [
    1,
    2,
    3,
    4,
  ]
