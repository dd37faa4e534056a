"""`--mode=eval --follow`: an evaluation job beside a live training run."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
from conftest import CPU_ENV, cli, steps_on_disk

from loopjax import data, evaluate, follow, metrics, train
from loopjax.workdir import Workdir

STEPS = [
  "--config.train.num_steps=200",
  "--config.checkpoint.every=20",
  "--config.checkpoint.keep=100",
  "--config.eval_every=0",  # no in-loop evaluation: the follower's job
]


def _follower(workdir):
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "loopjax.main",
      "--mode=eval",
      "--follow",
      f"--workdir={workdir}",
      "--poll_s=0.2",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=CPU_ENV,
  )


def _evaluated(workdir) -> list[int]:
  log = workdir / "eval" / "metrics.jsonl"
  return [r["step"] for r in metrics.read_jsonl(log)] if log.exists() else []


def test_follower_evaluates_each_checkpoint_once_across_a_restart(
  tiny_config, tmp_path
):
  workdir, data_dir = tmp_path / "run", tmp_path / "data"
  first = _follower(workdir)  # before the trainer has written anything
  trainer = subprocess.Popen(
    cli(workdir, data_dir, *STEPS),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=CPU_ENV,
  )
  deadline = time.monotonic() + 120
  while len(_evaluated(workdir)) < 2 and time.monotonic() < deadline:
    assert first.poll() is None, first.communicate()[0][-3000:]
    time.sleep(0.05)
  first.send_signal(signal.SIGKILL)
  out_first = first.communicate()[0]
  at_kill = _evaluated(workdir)
  assert "waiting for" in out_first  # it started before config.json existed
  second = _follower(workdir)
  out_train = trainer.communicate(timeout=180)[0]
  out_second = second.communicate(timeout=180)[0]
  assert trainer.returncode == 0, out_train[-3000:]
  assert second.returncode == 0, out_second[-3000:]
  assert "the run has finished (step 200)" in out_second
  steps = steps_on_disk(workdir)
  assert steps == list(range(20, 201, 20))
  assert 2 <= len(at_kill) < len(steps)  # killed midway
  assert sorted(_evaluated(workdir)) == steps  # each exactly once
  assert f"{len(at_kill)} checkpoints already evaluated" in out_second
  assert not any("eval/" in r for r in metrics.read_jsonl(workdir / "metrics.jsonl"))

  # The follower's numbers are an evaluation of that checkpoint.
  tiny_config.data.data_dir = str(data_dir)
  task, model, _ = evaluate.restore_model(tiny_config, workdir, step=200)
  want = evaluate.Evaluator(model.graphdef, tiny_config, task).run(model.params)
  got = next(
    r for r in metrics.read_jsonl(workdir / "eval/metrics.jsonl") if r["step"] == 200
  )
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
  report = json.loads((workdir / "eval/step_200.json").read_text())
  assert (
    report["splits"]["test_inferred_id"]["acc"]["2"]
    == want["eval/test_inferred_id/acc"]
  )
  assert any((workdir / "tb" / "eval").iterdir())


def test_a_checkpoint_deleted_before_its_turn_is_skipped(tiny_config, tmp_path, capsys):
  tiny_config.train.num_steps = 40
  tiny_config.checkpoint.update(every=20, keep=5)
  tiny_config.eval_every = 0
  workdir = tmp_path / "run"
  train.train_and_evaluate(tiny_config, workdir)
  wd = Workdir(workdir)
  task = data.load(tiny_config.data)
  reader = evaluate.Reader(tiny_config, workdir, task)
  evaluator = evaluate.Evaluator(reader.graphdef, tiny_config, task)
  writer = metrics.Writer(workdir / "eval/metrics.jsonl", workdir / "tb/eval")
  import shutil

  shutil.rmtree(workdir / "checkpoints" / "20")  # the trainer's keep policy, say
  args = (wd, tiny_config, task, reader, evaluator, writer)
  assert not follow._evaluate(*args, 20, False)
  assert "checkpoint 20 was deleted before it was evaluated; skipped" in (
    capsys.readouterr().out
  )
  assert follow._evaluate(*args, 40, False)
  writer.close()
  reader.close()
  assert _evaluated(workdir) == [40]
