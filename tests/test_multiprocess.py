"""Two loopjax processes on localhost, joined by jax.distributed (gloo on CPU)."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
  CPU_ENV,
  cli,
  losses,
  offline_env,
  run,
  steps_on_disk,
  write_corpus,
  write_tasks,
)

from launch import local
from loopjax import metrics

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def test_dry_run_gives_each_process_its_id(capsys):
  assert local.main(["--num_processes=3", "--dry-run", "--", "prog", "--x=1"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3
  port = lines[0].split("localhost:")[1].split()[0]
  for i, line in enumerate(lines):
    assert line.startswith("prog --x=1 --coordinator_address=localhost:")
    assert line.endswith(f"localhost:{port} --num_processes=3 --process_id={i}")


def _main(workdir, data_dir, steps, *flags, **config):
  """The tiny run on all of each process's devices (tiny itself uses one)."""
  return cli(
    workdir,
    data_dir,
    f"--config.train.num_steps={steps}",
    "--config.mesh.devices=0",
    *flags,
    **config,
  )


def _launch(workdir, data_dir, steps, *flags, devices=1, launcher=(), **config):
  return _on_two(
    _main(workdir, data_dir, steps, "--heartbeat_timeout=20", *flags, **config),
    devices,
    launcher,
  )


def _on_two(cmd, devices=4, launcher=(), timeout=300, env=CPU_ENV):
  """`cmd` as 2 processes of `devices` CPU devices each (launch/local.py)."""
  local = [
    sys.executable,
    "launch/local.py",
    "--num_processes=2",
    f"--devices_per_process={devices}",
    *launcher,
    "--",
  ]
  return subprocess.run(
    local + cmd, capture_output=True, text=True, env=env, timeout=timeout
  )


@pytest.mark.slow  # ~30 s: the default suite stays under 6 minutes on 2 cores
def test_two_processes_train_to_a_checkpoint_and_resume(tmp_path):
  """2 processes (data parallel over their devices): a run to step 20 and its
  resumption to 40, with an evaluation job beside it; process 0 alone writes
  the logs."""
  workdir, data_dir = tmp_path / "run", tmp_path / "data"
  first = _launch(workdir, data_dir, 20)
  assert first.returncode == 0, first.stdout[-3000:]
  assert steps_on_disk(workdir) == [20]
  second = _launch(workdir, data_dir, 40, launcher=["--follow"])
  assert second.returncode == 0, second.stdout[-3000:]
  for i in (0, 1):
    assert f"[{i}] resumed from" in second.stdout
  assert steps_on_disk(workdir) == [20, 40]
  assert "[eval] follow: the run has finished (step 40); done" in second.stdout
  evaluated = [r["step"] for r in metrics.read(workdir / "eval")]
  assert sorted(evaluated) == [20, 40]
  logged = [r["step"] for r in metrics.read(workdir) if "train/loss" in r]
  assert logged == sorted(set(logged)) and logged[-1] == 40  # one writer


@pytest.mark.slow
def test_processes_holding_the_same_rows_feed_the_same_examples(tmp_path):
  """Tensor parallel across 2 processes (1 device each): both hold every row of
  the batch, so both must feed the whole batch: the same losses as one
  process with 2 devices on the same mesh."""
  mesh = ["--config.mesh.data=1", "--config.mesh.tensor=-1"]
  data_dir = tmp_path / "data"
  two = _launch(tmp_path / "two", data_dir, 10, *mesh, devices=1)
  assert two.returncode == 0, two.stdout[-3000:]
  env = CPU_ENV | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  one = subprocess.run(
    _main(tmp_path / "one", data_dir, 10, *mesh),
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert one.returncode == 0, one.stderr[-3000:]
  want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
  assert list(got) == list(want) == [10]
  assert abs(got[10] - want[10]) < 1e-5 * abs(want[10])


@pytest.mark.slow
def test_a_dead_peer_ends_the_others_with_a_clear_error(tmp_path):
  """Process 1 is killed mid-training; process 0 ends in bounded time with an
  error naming the cause (loopjax's one line if it was in a collective with the
  dead peer, else JAX's heartbeat error), instead of hanging."""
  cmd = _main(tmp_path / "run", tmp_path / "data", 10**6, "--heartbeat_timeout=10")
  logs = [tmp_path / f"{i}.log" for i in range(2)]
  procs = [
    subprocess.Popen(c, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=CPU_ENV)
    for c, log in zip(local.commands(cmd, 2, local.free_port()), logs, strict=True)
  ]
  try:
    deadline = time.monotonic() + 240
    while not losses(tmp_path / "run"):  # a first chunk of records
      assert time.monotonic() < deadline and procs[0].poll() is None
      time.sleep(1)
    procs[1].kill()
    killed = time.monotonic()
    code = procs[0].wait(timeout=60)
    assert time.monotonic() - killed < 30  # heartbeat timeout 10 s
  finally:
    for p in procs:
      p.kill()
  log = logs[0].read_text()
  if code == 1:  # in a collective with the dead peer: loopjax's line
    (line,) = [x for x in log.splitlines() if x.startswith("error:")]
    assert "a peer process has probably died" in line and "rerun" in line
  else:  # elsewhere: JAX's coordination service ends it (SIGABRT)
    assert code == -signal.SIGABRT
    assert "JAX distributed service detected fatal errors" in log


@pytest.mark.slow
def test_sigterm_to_one_process_stops_all_after_the_same_step(tmp_path):
  """JAX's preemption sync: a SIGTERM to process 1 only; both save the same
  step and exit 0, and the run resumes from it."""
  cmd = _main(tmp_path / "run", tmp_path / "data", 10**6)
  logs = [tmp_path / f"{i}.log" for i in range(2)]
  procs = [
    subprocess.Popen(c, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=CPU_ENV)
    for c, log in zip(local.commands(cmd, 2, local.free_port()), logs, strict=True)
  ]
  try:
    deadline = time.monotonic() + 240
    while not losses(tmp_path / "run"):  # a first chunk of records
      assert time.monotonic() < deadline and procs[0].poll() is None
      time.sleep(1)
    procs[1].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
  finally:
    for p in procs:
      p.kill()
  saved = [re.search(r"saved step (\d+)", log.read_text()).group(1) for log in logs]
  assert saved[0] == saved[1] and steps_on_disk(tmp_path / "run")[-1] == int(saved[0])
  assert all("SIGTERM (all processes)" in log.read_text() for log in logs)


@pytest.mark.slow
def test_processes_feed_their_rows_of_a_mesh_that_is_not_host_major(tmp_path):
  """2 processes x 4 CPU devices, the mesh's devices alternating between them:
  each process holds 4 separate spans of every batch. Every global batch has
  each row fed by the process whose device holds it, 16 different examples,
  and an epoch of 96 examples passes without one twice."""
  out = tmp_path / "rows.npz"
  # local.py appends the coordinator flags after --out
  run = _on_two([sys.executable, "tests/multiprocess_rows.py", f"--out={out}"])
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  got = np.load(out)
  seen, owner = got["seen"], got["owner"]  # (steps, 2, B), (B,)
  assert list(owner) != sorted(owner)  # not one block per process
  for examples, fed_by in seen:
    assert (fed_by == owner).all()
    assert len(set(examples)) == 16
  assert len(set(seen[:, 0].ravel())) == 96  # 6 steps x 16: the whole epoch


# A halting rule's answers are decisions: a KL or entropy within float32
# rounding of its threshold falls either side when the reduction order moves
# (CI saw one of 47 examples exit one iteration later). Its accuracy and mean
# iterations may differ by about one example's; everything else to `tol`.
DECIDED = 0.05


def _same_report(got, want, at="", tol=1e-6) -> None:
  """Equal JSON; floats to `tol` (the order of a sum may differ), a halting
  rule's acc and iterations to DECIDED."""
  if isinstance(want, dict):
    assert got.keys() == want.keys(), at
    for k in want:
      _same_report(got[k], want[k], f"{at}.{k}", tol)
  elif isinstance(want, list):
    assert len(got) == len(want), at
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
      _same_report(g, w, f"{at}[{i}]", tol)
  elif (
    isinstance(want, float) and ".halting[" in at and at.endswith(("acc", "iterations"))
  ):
    assert abs(got - want) <= DECIDED, (at, got, want)
  elif isinstance(want, float):
    assert abs(got - want) <= tol * max(1.0, abs(want)), (at, got, want)
  else:
    assert got == want, (at, got, want)


@pytest.mark.slow
def test_eval_on_two_processes_reports_what_one_process_does(tmp_path):
  """A checkpoint trained in one process, evaluated by 2 processes x 4 devices
  (params split over fsdp and tensor, batches over data and fsdp): the same
  eval/step_N.json as one process on one device, written by process 0 alone."""
  workdir, data_dir = tmp_path / "run", tmp_path / "data"
  trained = run(cli(workdir, data_dir, "--config.train.num_steps=10"))
  assert trained.returncode == 0, trained.stderr[-3000:]
  one = run(cli(workdir, data_dir, "--mode=eval"))
  assert one.returncode == 0, one.stderr[-3000:]
  report = workdir / "eval" / "step_10.json"
  want = json.loads(report.read_text())
  report.unlink()
  mesh = ["--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
  two = _launch(workdir, data_dir, 10, "--mode=eval", *mesh, devices=4)
  assert two.returncode == 0, two.stdout[-3000:]
  _same_report(json.loads(report.read_text()), want)
  assert f"[0] wrote {report}" in two.stdout and "[1] wrote" not in two.stdout
  assert sorted(p.name for p in report.parent.iterdir()) == ["step_10.json"]
  # The run trained with tiny's mesh.devices=1; the job, on 2 processes, is
  # launched as it was trained, no mesh flag: a mesh is where a job runs.
  report.unlink()
  plain = _on_two(cli(workdir, data_dir, "--mode=eval", "--heartbeat_timeout=20"))
  assert plain.returncode == 0, plain.stdout[-3000:]
  _same_report(json.loads(report.read_text()), want)


def _same_table(got: str, want: str) -> None:
  """Equal markdown but for the numbers in scientific notation (distances
  between iterates, some ~1e-6: a few float32 ulps of the states, which the
  reduction order moves): within 1e-6 as in the .json, or one in the last
  digit shown; and a halting rule's "acc / iterations" cells: to DECIDED and
  the digit shown."""
  tiny, decided = r"(-?\d\.\de[-+]\d+)", r"(\d\.\d{3} / \d+\.\d)"
  got_parts, want_parts = re.split(tiny, got), re.split(tiny, want)
  for g, w in zip(got_parts[1::2], want_parts[1::2], strict=True):
    digit = 10.0 ** (int(w.split("e")[1]) - 1)
    assert abs(float(g) - float(w)) <= max(1e-6, 1.01 * digit), (g, w)
  got_parts = re.split(decided, "".join(got_parts[::2]))
  want_parts = re.split(decided, "".join(want_parts[::2]))
  assert got_parts[::2] == want_parts[::2]
  for g, w in zip(got_parts[1::2], want_parts[1::2], strict=True):
    for a, b, digit in zip(g.split(" / "), w.split(" / "), (1e-3, 0.1), strict=True):
      assert abs(float(a) - float(b)) <= DECIDED + digit, (g, w)


def _analyses_by_one_and_two(tmp_path, *flags, mesh=(2, 2), **config):
  """(2 processes' analysis/, one's): --mode=analyze of a run trained to step
  10 in one process, there (one device) and on 2 processes x 4 devices
  (params split over `mesh`: fsdp and tensor); process 0 alone writes."""
  workdir, data_dir = tmp_path / "run", tmp_path / "data"
  trained = run(cli(workdir, data_dir, "--config.train.num_steps=10", *flags, **config))
  assert trained.returncode == 0, trained.stderr[-3000:]
  one = run(cli(workdir, data_dir, "--mode=analyze", *flags, **config))
  assert one.returncode == 0, one.stderr[-3000:]
  (workdir / "analysis").rename(tmp_path / "one")
  mesh = [f"--config.mesh.fsdp={mesh[0]}", f"--config.mesh.tensor={mesh[1]}"]
  two = _launch(
    workdir, data_dir, 10, "--mode=analyze", *mesh, *flags, devices=4, **config
  )
  assert two.returncode == 0, two.stdout[-3000:]
  assert "[0] wrote" in two.stdout and "[1] wrote" not in two.stdout
  got, want = workdir / "analysis", tmp_path / "one"
  assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
  return got, want


def _same_analyses(got, want, per_device=(None, None), tol=1e-6) -> None:
  """The same .json numbers (to `tol`) and .md tables; `per_device`: (a key
  of the main split's results, a word of the .md lines showing it) left out:
  compiled memory is per device, so per mesh."""
  key, word = per_device
  for path in want.glob("*.json"):
    reports = [json.loads(p.read_text()) for p in (got / path.name, path)]
    for r in reports if key else ():
      r[path.stem][r["main_split"]].pop(key, None)
    _same_report(*reports, tol=tol)
  for path in want.glob("*.md"):
    tables = [
      "".join(x for x in p.read_text().splitlines(True) if not (word and word in x))
      for p in (got / path.name, path)
    ]
    _same_table(*tables)


@pytest.mark.slow  # ~5 min on 2 busy cores
def test_analyze_on_two_processes_writes_what_one_process_does(tmp_path):
  """A knowledge-graph run's analyses: every file, the same numbers (json)
  and tables (md) as one process."""
  _same_analyses(*_analyses_by_one_and_two(tmp_path))


@pytest.mark.slow
def test_lm_analyze_on_two_processes_writes_what_one_process_does(tmp_path):
  """A language model's analyses (fixed points, stages, attention) likewise,
  but for the compiled pass's memory (stages: per device). Params over fsdp
  only: with tensor 2 the streamed pass (depth_scan) never ends on CPU (gloo),
  process 0's device threads waiting in stages' eigvalsh (docs/scaling_out.md)."""
  corpus = write_corpus(tmp_path / "corpus")
  got, want = _analyses_by_one_and_two(
    tmp_path,
    f"--config.data.source=text:{corpus}/*.py",
    "--config.data.valid_fraction=0.2",
    mesh=(2, 1),
    config="experiments/lm.py:tiny",
  )
  _same_analyses(got, want, per_device=("memory", "MiB"))


def _lm_run(tmp_path) -> list[str]:
  """The tiny language model trained to step 10 in one process; the flags
  that name it."""
  corpus = write_corpus(tmp_path / "corpus")
  flags = [
    "--config=experiments/lm.py:tiny",
    f"--workdir={tmp_path / 'run'}",
    f"--config.data.data_dir={tmp_path / 'data'}",
    f"--config.data.source=text:{corpus}/*.py",
    "--config.data.valid_fraction=0.2",
  ]
  trained = run(
    [sys.executable, "-m", "loopjax.main", *flags, "--config.train.num_steps=10"]
  )
  assert trained.returncode == 0, trained.stderr[-3000:]
  return flags


def _said(stdout: str, process: int) -> list[str]:
  """A process's own lines in launch/local.py's output (not gloo's)."""
  mine = [x for x in stdout.splitlines() if x.startswith(f"[{process}] ")]
  return [x[len(f"[{process}] ") :] for x in mine if "[Gloo]" not in x]


MESH = ["--config.mesh.devices=0", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]


@pytest.mark.slow
def test_sample_on_two_processes_prints_what_one_process_does(tmp_path):
  """python -m loopjax.sample of a run's checkpoint, sampled (temperature
  0.8): on 2 processes x 4 devices (params over fsdp and tensor, the batch
  padded to and split over data and fsdp) the text one process on one
  device samples, printed by process 0 alone."""
  flags = _lm_run(tmp_path) + [
    "--prompt=def ", "--max_new_tokens=16", "--temperature=0.8", "--seed=3",
  ]  # fmt: skip
  one = run([sys.executable, "-m", "loopjax.sample", *flags])
  assert one.returncode == 0, one.stderr[-3000:]
  sample = [sys.executable, "-m", "loopjax.sample", *flags, *MESH]
  two = _on_two(sample + ["--heartbeat_timeout=20"])
  assert two.returncode == 0, two.stdout[-3000:]
  assert len(one.stdout.strip()) > len("def ")
  # the text is each process's last output; gloo's lines may be cut in two
  want = one.stdout.splitlines()
  assert _said(two.stdout, 0)[-len(want) :] == want
  assert want[0] not in _said(two.stdout, 1)


@pytest.mark.slow
def test_lm_eval_on_two_processes_writes_what_one_process_does(tmp_path):
  """python -m loopjax.lm_eval of the tiny Ouro checkpoint on local YAML
  tasks (multiple choice, generation, rolling perplexity) at R 2 and 4: the
  same lm_eval/ files as one process, written by process 0 alone. A word
  perplexity exponentiates a sum of log-likelihoods, so float32 sums in
  another order move it by up to ~1e-6 of itself: compared to 1e-5 (and
  table.md but for its numbers)."""
  tasks = write_tasks(tmp_path / "tasks")
  env = CPU_ENV | offline_env(tmp_path)
  flags = [
    "--config=experiments/pretrained.py:ouro",
    f"--config.model.hf_dir={FIXTURES / 'ouro'}",
    "--config.model.dtype=float32",
    "--tasks=toy_mc,toy_gen,toy_ppl",
    f"--include_path={tasks}",
    "--num_loops=2,4",
    "--batch_size=2",
  ]
  lm_eval = [sys.executable, "-m", "loopjax.lm_eval", *flags]
  one = subprocess.run(
    [*lm_eval, f"--workdir={tmp_path / 'one'}", "--config.mesh.devices=1"],
    capture_output=True, text=True, env=env, timeout=300,
  )  # fmt: skip
  assert one.returncode == 0, one.stderr[-3000:]
  two = _on_two(
    [*lm_eval, f"--workdir={tmp_path / 'two'}", *MESH, "--heartbeat_timeout=20"],
    timeout=600,
    env=env,
  )
  assert two.returncode == 0, two.stdout[-3000:]
  got, want = tmp_path / "two" / "lm_eval", tmp_path / "one" / "lm_eval"
  assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
  for R in (2, 4):
    reports = [json.loads((d / f"r{R}.json").read_text()) for d in (got, want)]
    assert reports[1]["toy_ppl"]["word_perplexity,none"] > 1
    _same_report(*reports, tol=1e-5)
    records = [(d / f"requests_r{R}.jsonl").read_text() for d in (got, want)]
    assert records[0] == records[1]
  tables = [
    [x.split(" | ")[:2] for x in (d / "table.md").read_text().splitlines()]
    for d in (got, want)
  ]
  assert tables[0] == tables[1] and len(tables[0]) == 2 + 4  # 4 metrics
  assert "| toy_ppl |" in "\n".join(_said(two.stdout, 0))
  assert "| toy_ppl |" not in "\n".join(_said(two.stdout, 1))


@pytest.mark.slow
def test_pretrained_analyze_on_two_processes_writes_what_one_process_does(tmp_path):
  """--mode=analyze of the tiny Huginn checkpoint (model.hf_dir) on its 8
  prompts, a batch of 8 (its random initial state is drawn per batch): every
  file, the same numbers and tables as one process on one device but for
  the compiled pass's memory, written by process 0 alone. Params over fsdp
  only (see the LM analysis above)."""
  flags = [
    sys.executable, "-m", "loopjax.main", "--mode=analyze",
    "--config=experiments/pretrained.py:huginn",
    f"--config.model.hf_dir={FIXTURES / 'huginn'}",
    "--config.model.dtype=float32",
    "--config.analyze.max_depth=6",
    "--config.analyze.batch_size=8",
    "--config.analyze.halting.r_max=6",
    "--config.analyze.halting.criteria=('kl_reverse','argmax')",
    "--config.analyze.halting.eps=(0.01,)",
    "--config.analyze.halting.patience=(2,)",
  ]  # fmt: skip
  one = run([*flags, f"--workdir={tmp_path / 'one'}", "--config.mesh.devices=1"])
  assert one.returncode == 0, one.stderr[-3000:]
  mesh = ["--config.mesh.devices=0", "--config.mesh.fsdp=2"]
  two = _on_two(
    [*flags, f"--workdir={tmp_path / 'two'}", *mesh, "--heartbeat_timeout=20"],
    timeout=600,
  )
  assert two.returncode == 0, two.stdout[-3000:]
  assert "[0] wrote" in two.stdout and "[1] wrote" not in two.stdout
  got, want = tmp_path / "two" / "analysis", tmp_path / "one" / "analysis"
  assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
  assert (want / "halting.json").exists()
  # six iterations from a random state: float32 sums in another order move
  # a few statistics by up to ~2e-6 (stages' sink mass)
  _same_analyses(got, want, per_device=("memory", "MiB"), tol=1e-5)
