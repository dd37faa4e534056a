"""Language-model runs: train, evaluate by recurrence, sample, resume, refuse."""

import json

import pytest
from conftest import cli, losses, run

from loopjax import metrics, train
from loopjax.errors import ConfigError


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
  records = metrics.read_jsonl(tmp_path / "straight/metrics.jsonl")
  assert [r["step"] for r in records if "eval/validation/loss" in r] == [10, 20]
  assert (tmp_path / "straight/tokenizer.json").exists()
  saved = json.loads((tmp_path / "straight/dataset.json").read_text())
  assert saved["vocab_size"] == 300 and set(saved["sizes"]) == {"train", "validation"}


def test_a_changed_corpus_is_refused_by_its_workdir(lm_config, tmp_path):
  lm_config.train.num_steps = 10
  train.train_and_evaluate(lm_config, tmp_path / "run")
  before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
  (tmp_path / "corpus" / "doc001.py").write_text("y = 2\n" * 80)
  lm_config.train.num_steps = 20
  with pytest.raises(ConfigError, match="was trained on other data"):
    train.train_and_evaluate(lm_config, tmp_path / "run")
  assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}


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
    base[:3]
    + [f"--workdir={wd}", "--mode=sample", "--prompt=def ", "--max_new_tokens=16"]
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("def ") and len(out.stdout) > 8
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
