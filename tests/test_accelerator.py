"""The accelerator check: parts isolated in processes, results kept through failures."""

import json
import pathlib
import subprocess
import sys

import pytest

from loopjax.bench import accelerator

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _part(name, code, **kw):
  return accelerator.Part(name, argv=lambda out: [sys.executable, "-c", code], **kw)


def test_a_failing_or_hung_part_is_recorded_and_costs_only_itself(tmp_path):
  failed = accelerator._run(
    _part("f", "import sys; sys.exit(3)", timeout_s=30), tmp_path / "f.json", ROOT
  )
  assert failed["status"] == "failed" and failed["returncode"] == 3
  hung = accelerator._run(
    _part("h", "import time; time.sleep(60)", timeout_s=1), tmp_path / "h.json", ROOT
  )
  assert hung["status"] == "timeout" and hung["seconds"] < 30
  missing = accelerator._run(
    _part("m", "", timeout_s=1, needs="no/such/file.py"), tmp_path / "m.json", ROOT
  )
  assert missing["status"] == "skipped" and "no/such/file.py" in missing["why"]


def test_a_training_part_is_stopped_by_sigterm_as_a_preemption(tmp_path):
  """train_s elapses, SIGTERM, and the process gets the rest of timeout_s to exit."""
  code = (
    "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)"
  )
  r = accelerator._run(
    _part("t", code, timeout_s=20, train_s=1), tmp_path / "t.json", ROOT
  )
  assert r["status"] == "ok" and r["returncode"] == 0 and r["seconds"] < 15


@pytest.mark.slow
def test_smoke_runs_every_part_on_the_cpu(tmp_path):
  """launch/accelerator_check.sh --smoke: the script a GPU machine runs, tiny."""
  # JAX_PLATFORMS=cpu: a CI machine with jax-cuda12 or libtpu installed
  # would probe for their devices in every part's process. The script's own
  # bound is its parts' timeouts, each recorded when it runs out.
  env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
  bound_s = sum(p.timeout_s for p in accelerator.parts(True, tmp_path)) + 60
  subprocess.run(
    [ROOT / "launch/accelerator_check.sh", tmp_path, "--smoke"],
    env=env,
    check=True,
    timeout=bound_s,
  )
  parts = json.loads((tmp_path / "accelerator.json").read_text())["parts"]
  assert {k: v["status"] for k, v in parts.items()} == {
    "devices": "ok",
    "step_paper": "ok",
    "step_paper_large_batch": "ok",
    "depth": "ok",
    "train_sysgen_paper": "ok",
    "lm_step": "ok",
    "attention": "ok",
    "huginn_forward": "ok",
  }
  small, large = (parts[k]["result"] for k in ("step_paper", "step_paper_large_batch"))
  for r in (small, large):
    assert (
      r["jax"]["mfu"] > 0 and r["jax"]["compile_s"] > 0 and r["jax"]["peak_bytes"] > 0
    )
  assert (
    large["jax"]["tokens_per_s"] > 0
    and large["jax"]["flops"] == 4 * small["jax"]["flops"]
  )
  depth = {r["regime"]: r for r in parts["depth"]["result"]["rows"]}
  assert all(
    depth[f"sampled ({h}): Poisson(4) in [2, 8]"]["step_s"] > 0
    for h in ("skip", "mask")
  )
  assert parts["lm_step"]["result"]["jax"]["tokens_per_s"] > 0  # experiments/lm.py
  kernels = {(r["kernel"], r["batch"]) for r in parts["attention"]["result"]["rows"]}
  assert ("blocked", "packed") in kernels and ("xla", "one document") in kernels
  huginn = parts["huginn_forward"]["result"]  # the tiny Huginn in smoke mode
  assert huginn["analysis_r4"]["seconds_per_prompt"] > 0 and huginn["params"] > 0
  train = parts["train_sysgen_paper"]["result"]
  # Stopped by its time limit as a preemption would be: a checkpoint at the step.
  assert train["end"] == "preempted" and train["steps"] > 0
  assert train["checkpoints"][-1] == train["steps"]
  assert train["projected_hours_to_num_steps"] > 0
