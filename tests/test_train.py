"""Training end to end on the tiny config: learning, resume, preemption, workdirs."""

import json
import logging
import random
import signal
import subprocess
import sys
import time

import jax
import pytest
from conftest import CPU_ENV, cli, losses, run, start, steps_on_disk

from loopjax import config as config_lib
from loopjax import evaluate, footprint, loss, metrics, task, train
from loopjax.errors import ConfigError
from loopjax.kg import source as kg_source
from loopjax.kg.evaluate import Evaluator
from loopjax.kg.task import Composition

SPLITS = (
  "id_atomic",
  "ood_atomic",
  "train_inferred",
  "test_inferred_id",
  "test_inferred_ood",
)


def evals(workdir):
  return {
    r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
    for r in metrics.read(workdir)
    if "eval/id_atomic/acc" in r
  }


def test_tiny_run_learns_and_writes_outputs(tiny_config, tmp_path):
  tiny_config.train.num_steps = 120
  last = train.train_and_evaluate(tiny_config, tmp_path / "run")
  loss = losses(tmp_path / "run")
  assert loss[120] < 0.8 * loss[10], loss
  assert {f"eval/{s}/acc" for s in SPLITS} <= set(last)
  assert 0 <= last["eval/test_inferred_ood/atomic_known"] <= 1
  assert last["eval/id_atomic/acc"] > 0.2  # chance: 1/24 entities
  assert steps_on_disk(tmp_path / "run") == [80, 100, 120]  # keep=3
  assert any((tmp_path / "run/tb").iterdir())
  saved = json.loads((tmp_path / "run/config.json").read_text())
  assert saved["model"]["num_loops"] == tiny_config.model.num_loops


def test_resume_equals_uninterrupted(tiny_config, tmp_path):
  train.train_and_evaluate(tiny_config, tmp_path / "straight")
  tiny_config.train.num_steps = 30
  train.train_and_evaluate(tiny_config, tmp_path / "resumed")
  tiny_config.train.num_steps = 60
  last = train.train_and_evaluate(tiny_config, tmp_path / "resumed")
  straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
  assert straight == resumed  # bit for bit, every logged step
  evals = [
    r
    for r in metrics.read(tmp_path / "straight")
    if r["step"] == 60 and "eval/test_inferred_id/acc" in r
  ]
  assert evals[0]["eval/test_inferred_id/acc"] == last["eval/test_inferred_id/acc"]


@pytest.mark.slow  # ~11 s; a fork in the default tier: test_bucket (bucket to disk)
def test_a_fork_trains_on_from_its_sources_checkpoint(tiny_config, tmp_path):
  tiny_config.train.num_steps = 40
  train.train_and_evaluate(tiny_config, tmp_path / "source")  # saves 20, 40
  source = losses(tmp_path / "source")
  before = {p: p.stat().st_mtime_ns for p in (tmp_path / "source").rglob("*")}
  tiny_config.checkpoint.fork_from = f"{tmp_path / 'source'}:20"
  train.train_and_evaluate(tiny_config, tmp_path / "same")
  assert losses(tmp_path / "same") == {s: v for s, v in source.items() if s > 20}
  tiny_config.train.update(lr=tiny_config.train.lr / 2, schedule="cosine")
  train.train_and_evaluate(tiny_config, tmp_path / "slower")
  slower = losses(tmp_path / "slower")
  assert min(slower) > 20 and slower[30] != source[30]
  tiny_config.model.d_model = 64
  with pytest.raises(ConfigError, match=r"train.\* only; .* model.d_model=32"):
    train.train_and_evaluate(tiny_config, tmp_path / "other")
  assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "source").rglob("*")}


class Toy(Composition):
  """A family written outside loopjax: composition's data under another name."""

  name = "toy"

  def load(self, config):
    d = config.data.copy_and_resolve_references()
    d.task = "composition"
    return kg_source.knowledge_graph(d)


def test_a_new_family_is_its_class_and_one_registry_line(
  tiny_config, tmp_path, monkeypatch
):
  line = task.FAMILIES["composition"]._replace(family="test_train:Toy")
  monkeypatch.setitem(task.FAMILIES, "toy", line)
  tiny_config.data.task = "toy"
  tiny_config.train.num_steps = tiny_config.eval_every = 20
  config_lib.validate(tiny_config)
  last = train.train_and_evaluate(tiny_config, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["data"]["task"] == "toy"
  assert 0 <= last["eval/test_inferred_ood/acc"] <= 1


def test_the_step_compiles_once_and_its_memory_is_checked_before_it_runs(
  tiny_config, tmp_path, monkeypatch, caplog
):
  tiny_config.train.num_steps = 20
  with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
    train.train_and_evaluate(tiny_config, tmp_path / "fits")
  compiles = [r for r in caplog.messages if r.startswith("Compiling jit(train_step)")]
  assert len(compiles) == 1, compiles  # the checked executable is the one run
  # compiled here, or loaded from the cache another test filled: logged once
  (start,) = [
    r for r in metrics.read(tmp_path / "fits") if "compile/train_step_peak_gib" in r
  ]
  assert start["step"] == 0 and 0 < start["compile/train_step_peak_gib"] < 1
  monkeypatch.setattr(footprint, "lower_bound", lambda *a: {})  # passes pre-flight
  monkeypatch.setattr(footprint, "capacity", lambda mesh: (2**20, "a 1 MiB device"))
  says = r"^train.batch_size, data.seq_len, mesh, model.remat: the compiled train step "
  with pytest.raises(ConfigError, match=says + r"needs .* and a 1 MiB device is"):
    train.train_and_evaluate(tiny_config, tmp_path / "big")
  assert not any("train/loss" in r for r in metrics.read(tmp_path / "big"))
  assert steps_on_disk(tmp_path / "big") == []


@pytest.mark.slow  # ~10 s: three runs
def test_compile_metrics_are_logged_once_per_compile_not_at_each_resume(
  tiny_config, tmp_path
):
  """A resume that loads the step from the persistent cache logs the load's
  time alone; one that compiles it (the cache off) logs the compile."""
  tiny_config.train.num_steps = 10
  train.train_and_evaluate(tiny_config, tmp_path)  # compiled, or another's: once
  tiny_config.train.num_steps = 20
  train.train_and_evaluate(tiny_config, tmp_path)  # the cache holds it now
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    tiny_config.train.num_steps = 30
    train.train_and_evaluate(tiny_config, tmp_path)  # compiles again
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
  records = metrics.read(tmp_path)
  peaks = [r["step"] for r in records if "compile/train_step_peak_gib" in r]
  compiles = [r["step"] for r in records if "compile/train_step_s" in r]
  loads = [r["step"] for r in records if "cache/train_step_load_s" in r]
  assert peaks == [0, 20] and compiles[-1:] == [20], (peaks, compiles)
  assert 10 in loads and 20 not in loads, loads


def test_conflicting_workdir_is_refused_and_untouched(tiny_config, tmp_path):
  train.train_and_evaluate(tiny_config, tmp_path)
  before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
  tiny_config.model.d_model = 64
  with pytest.raises(ConfigError, match=r"model.d_model=32 \(workdir\) vs 64 \(new\)"):
    train.train_and_evaluate(tiny_config, tmp_path)
  assert before == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}


def test_a_second_trainer_in_the_same_workdir_is_refused(tiny_config, tmp_path):
  """A process holding the workdir's lock (as a running trainer does) keeps a
  second one out before it writes anything."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
      "fcntl.flock(f, fcntl.LOCK_EX); f.write('4242'); f.flush(); "
      "print('held', flush=True); time.sleep(60)",
      str(workdir / ".train-0.lock"),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=r"another process \(pid 4242\) is train"):
      train.train_and_evaluate(tiny_config, workdir)
    assert sorted(p.name for p in workdir.iterdir()) == [".train-0.lock"]
  finally:
    holder.kill()
    holder.wait()


def test_eval_mode_reads_checkpoint_at_several_depths(tiny_config, tmp_path):
  last = train.train_and_evaluate(tiny_config, tmp_path)
  tiny_config.eval.depths = (1, 2, 4)
  report = evaluate.evaluate_checkpoint(tiny_config, tmp_path)
  assert report["step"] == 60
  assert set(report["splits"]) == set(SPLITS)
  acc = report["splits"]["id_atomic"]["acc"]
  assert set(acc) == {1, 2, 4}
  assert acc[2] == last["eval/id_atomic/acc"]  # R = 2 is the training depth
  assert (tmp_path / "eval/step_60.json").exists()
  with pytest.raises(ConfigError, match=r"--step=59: no checkpoint at that step .*60"):
    evaluate.evaluate_checkpoint(tiny_config, tmp_path, 59)


STEPS = ("--config.train.num_steps=200",)


def _wait_for_step(workdir, step, proc, timeout=120):
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, proc.communicate()
    if any(r["step"] >= step for r in metrics.read(workdir)):
      return
    time.sleep(0.05)
  raise TimeoutError(f"no step {step} in {workdir}")


@pytest.mark.parametrize(
  "sig",  # ~12 s each (SIGKILL at random moments: test_faults); both slow
  [pytest.param(s, marks=pytest.mark.slow) for s in (signal.SIGTERM, signal.SIGKILL)],
)
def test_killed_run_resumes(tiny_config, tmp_path, sig):
  """SIGTERM saves and exits 0; SIGKILL loses at most the steps since a save.

  Either way rerunning the command finishes with the uninterrupted run's losses
  and evaluations. The kill comes at a random step (seeded, so reproducible).
  """
  workdir, data_dir = tmp_path / "run", tiny_config.data.data_dir
  proc = start(cli(workdir, data_dir, *STEPS))
  _wait_for_step(workdir, random.Random(int(sig)).randrange(20, 150), proc)
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=120)
  if sig == signal.SIGTERM:
    assert proc.returncode == 0 and "rerun the same command to resume" in out, out
  rerun = run(cli(workdir, data_dir, *STEPS))
  assert rerun.returncode == 0, rerun.stderr
  assert "resumed from" in rerun.stdout
  tiny_config.train.num_steps = 200
  train.train_and_evaluate(tiny_config, tmp_path / "straight")
  resumed, straight = losses(workdir), losses(tmp_path / "straight")
  assert straight == resumed  # SIGKILL: steps after the last save are logged twice
  assert evals(workdir) == evals(tmp_path / "straight")


@pytest.mark.slow  # ~20 s
def test_sigterm_during_the_first_compile_ends_the_run_at_once(tiny_config, tmp_path):
  """Nothing is saved before the first step, whose call compiles for minutes
  here (64 unrolled iterations): SIGTERM then ends the process at once."""
  workdir, data_dir = tmp_path / "run", tiny_config.data.data_dir
  slow = ("--config.model.num_loops=64", "--config.model.scan_unroll=64")
  proc = start(cli(workdir, data_dir, *slow))
  deadline = time.monotonic() + 120
  while not any("event" in r for r in metrics.read(workdir)):  # the loop begins:
    assert time.monotonic() < deadline and proc.poll() is None  # then it compiles
    time.sleep(0.1)
  time.sleep(2)
  proc.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  assert proc.wait(timeout=60) == -signal.SIGTERM
  assert time.monotonic() - sent < 10
  assert not (workdir / "checkpoints").exists() or steps_on_disk(workdir) == []


def test_conditional_ood_accuracy_counts_only_queries_with_known_hops(tiny_config):
  import numpy as np

  task = kg_source.knowledge_graph(tiny_config.data)
  ev = Evaluator.__new__(Evaluator)
  ev.R, ev.pad = 1, task.vocab.pad_id
  ev.probes = {
    "test_inferred_ood": {k: v[:4] for k, v in task.splits["test_inferred_ood"].items()}
  }
  # query correct: T F T T; hop 1 known: T T F T; hop 2 known: T T T F
  answers = iter([[1, 1, 0, 1], [1, 1, 1, 0]])
  ev.per_example = lambda params, split: (None, np.array([next(answers)], bool))
  out = ev.conditional_ood(None, np.array([1, 0, 1, 1], bool))
  assert out == {
    "eval/test_inferred_ood/atomic_known": 0.5,
    "eval/test_inferred_ood/acc_given_atomic": 0.5,
  }


def test_phases_are_recorded_and_their_checkpoints_kept(tiny_config, tmp_path):
  from loopjax.kg import grokking

  tiny_config.phases.update(memorize=0.3, id=0.0, ood=1.01)  # ood: never
  tiny_config.checkpoint.update(every=20, keep=1)
  train.train_and_evaluate(tiny_config, tmp_path)
  phases = json.loads((tmp_path / "phases.json").read_text())
  records = metrics.read(tmp_path)
  assert phases == grokking.detect(records, tiny_config.phases)
  assert phases["id"] == 20 and phases["ood"] is None  # written, never reached
  kept = set(steps_on_disk(tmp_path))
  reached = {s for s in phases.values() if s is not None}
  assert kept == {60} | reached  # keep=1, plus every phase's step


def test_supervised_iterations():
  import jax.numpy as jnp

  hops = jnp.array([1, 2])  # an atomic fact, a 2-hop query; R = 3
  T, F = True, False
  assert loss.supervised("last", 3, hops).tolist() == [[F, F], [F, F], [T, T]]
  assert loss.supervised("atomic_every", 3, hops).tolist() == [
    [T, F],
    [T, F],
    [T, T],
  ]
  assert loss.supervised("from_hops", 3, hops).tolist() == [[T, F], [T, T], [T, T]]
  # A sampled depth of 2 in a scan to 4: nothing after it, its last is 2.
  depth = jnp.int32(2)
  assert loss.supervised("last", 4, hops, depth).tolist() == [
    [F, F],
    [T, T],
    [F, F],
    [F, F],
  ]
  assert loss.supervised("from_hops", 4, hops, depth).tolist() == [
    [T, F],
    [T, T],
    [F, F],
    [F, F],
  ]


@pytest.mark.parametrize("mode", ["last", "atomic_every"])
def test_train_step_loss_is_mean_over_supervised_iterations(tiny_config, mode):
  import jax
  import numpy as np
  import optax
  from flax import nnx

  from loopjax.data import pipeline
  from loopjax.state import build_model, init_state, make_optimizer

  tiny_config.train.supervise = mode
  task = kg_source.knowledge_graph(tiny_config.data)
  model = build_model(tiny_config.model, task.vocab.vocab_size, 3, 0)
  tx = make_optimizer(tiny_config.train)
  graphdef, state = init_state(model, tx, 0)
  batch = next(pipeline.train_iterator(task.splits["train"], 64, 0, task.vocab.pad_id))
  _, logits_RBV = nnx.merge(graphdef, state["params"])(
    batch["inputs"], batch["answer_pos"], per_iteration=True
  )
  xent_RB = np.asarray(
    optax.softmax_cross_entropy_with_integer_labels(logits_RBV, batch["target"][None])
  )
  on_RB = np.zeros_like(xent_RB, bool)
  on_RB[-1] = True  # R = 2: the last iteration always counts
  if mode == "atomic_every":
    on_RB[:, batch["answer_pos"] == 1] = True
    assert 0 < (batch["answer_pos"] == 1).sum() < 64  # both kinds in the batch
  step = train.make_train_step(tiny_config, graphdef, tx)
  _, out = step(jax.tree.map(lambda x: x.copy(), state), batch)
  np.testing.assert_allclose(out["train/loss"], xent_RB[on_RB].mean(), rtol=1e-5)


# ~10 s: a run, then --mode=eval on its edited config.
@pytest.mark.slow
def test_eval_mode_reads_an_older_runs_config(tiny_config, tmp_path):
  """A config.json written before fields were added still evaluates (no --config)."""
  train.train_and_evaluate(tiny_config, tmp_path)
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["train"]["depth"], saved["train"]["supervise"]  # fields added later
  (tmp_path / "config.json").write_text(json.dumps(saved))
  proc = run(
    [sys.executable, "-m", "loopjax.main", "--mode=eval", f"--workdir={tmp_path}"]
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads((tmp_path / "eval/step_60.json").read_text())["step"] == 60


def test_progress_off_a_terminal_is_plain_lines_at_an_interval():
  import io

  for every_s, want in ((0.0, 5), (3600.0, 1)):  # 1: only the last step's line
    out = io.StringIO()  # not a terminal, like a SLURM or nohup log
    progress = metrics.Progress(total=5, initial=0, every_s=every_s, stream=out)
    for step in range(1, 6):
      progress.update(step, {"train/loss": 1.0 / step, "eval/test_k2/acc": 0.5})
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == want and "\r" not in out.getvalue()
    assert lines[-1].startswith("train: step 5/5 (100%), ")
    assert lines[-1].endswith("loss=0.200 test_k2=0.500")


@pytest.mark.slow  # two runs as processes, ~20 s
def test_a_restarted_run_takes_its_train_step_from_the_compile_cache(
  tiny_config, tmp_path
):
  """compile_cache (default: a user cache dir) holds XLA's programs across
  restarts: the resumed run compiles no train step."""
  env = {k: v for k, v in CPU_ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env |= {"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
  logs = []
  for steps in (20, 40):
    cmd = cli(
      tmp_path / "run", tiny_config.data.data_dir,
      f"--config.compile_cache={tmp_path / 'xla'}", f"--config.train.num_steps={steps}",
    )  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    logs.append(r.stderr)
  assert "CACHE MISS for 'jit_train_step'" in logs[0]
  assert "cache hit for 'jit_train_step'" in logs[1]
  assert "CACHE MISS for 'jit_train_step'" not in logs[1]
