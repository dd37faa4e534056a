"""Runs that live in a bucket (`--workdir=gs://BUCKET/run`), against a real
GCS emulator on loopback (loopjax/bench/emulator.py): training, a kill mid-save and
its resumption, the commit marker, the lease, and every mode reading the run.
"""

import contextlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU_ENV, cli, losses, main_in_process, steps_on_disk

from loopjax import metrics, storage, train
from loopjax.lease import Lease, LeaseLost
from loopjax.workdir import Workdir

STEPS = 60  # the tiny run's length
TINY = f"{Path(__file__).parents[1]}/experiments/sysgen.py:tiny"  # from any cwd


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One uninterrupted tiny run on a local disk, a checkpoint every 20 steps:
  what a bucket run must reproduce."""
  from experiments import sysgen

  root = tmp_path_factory.mktemp("straight")
  c = sysgen.get_config("tiny")
  c.data.data_dir = str(root / "data")
  c.train.num_steps = STEPS
  train.train_and_evaluate(c, root / "run")
  return c, root / "run"


def _run(cmd, gcs, cwd=None, timeout=300):
  return subprocess.run(
    cmd, capture_output=True, text=True, env=CPU_ENV | gcs.env, cwd=cwd,
    timeout=timeout,
  )  # fmt: skip


def _start(cmd, gcs, cwd=None):
  return subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    env=CPU_ENV | gcs.env, cwd=cwd,
  )  # fmt: skip


def _error_line(proc) -> str:
  lines = [x for x in proc.stderr.splitlines() if x.strip()]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def trained(straight, gcs, tmp_path_factory):
  """The tiny run trained on a bucket as the command line runs it (in this
  process), from an empty folder (so a local `gs:` folder would show)."""
  config, _ = straight
  here = tmp_path_factory.mktemp("cwd")
  workdir = f"gs://{gcs.bucket()}/run"
  with contextlib.chdir(here):
    code, err = main_in_process(*cli(workdir, config.data.data_dir, config=TINY)[3:])
  assert code == 0, err[-20:]
  return workdir, here


def test_a_run_trains_on_a_bucket_as_on_a_disk(straight, trained, gcs):
  _, done = straight
  workdir, here = trained
  assert list(here.iterdir()) == []  # no local "gs:" folder, nothing else
  assert losses(storage.path(workdir)) == losses(done)
  assert steps_on_disk(workdir) == steps_on_disk(done) == [20, 40, 60]
  bucket, prefix = storage.key(workdir)
  names = gcs.objects(bucket, prefix)
  for name in ("config.json", "dataset.json", "phases.json"):
    assert f"{prefix}/{name}" in names
  for step in (20, 40, 60):  # committed by orbax's marker, not a rename
    assert f"{prefix}/checkpoints/{step}/commit_success.txt" in names
  chunks = [n for n in names if n.startswith(f"{prefix}/metrics/")]
  events = [n for n in names if n.startswith(f"{prefix}/tb/events.out.tfevents.")]
  assert chunks and events
  assert f"{prefix}/lease.json" not in names  # released at the end


def test_every_mode_reads_the_bucket_run(straight, trained, gcs, tmp_path):
  """eval, report and analyze as the command line runs them (in this
  process), and a fork of the bucket run's checkpoint onto a disk."""
  from loopjax import evaluate

  config, done = straight
  workdir, here = trained
  run = storage.path(workdir)
  for mode in ("eval", "report"):
    code, err = main_in_process(f"--mode={mode}", f"--workdir={workdir}")
    assert code == 0, err[-20:]
  code, err = main_in_process(
    "--mode=analyze", f"--workdir={workdir}", f"--config={TINY}",
    f"--config.data.data_dir={config.data.data_dir}",
    "--config.analyze.names=('logit_lens', 'attention')",
  )  # fmt: skip
  assert code == 0, err[-20:]
  evaluate.evaluate_checkpoint(config, done, None)  # the disk run's, to compare
  got = json.loads((run / "eval" / "step_60.json").read_text())
  assert got == json.loads((done / "eval" / "step_60.json").read_text())
  assert (run / "plots" / "accuracy.png").exists()
  assert "| run |" in (run / "results.md").read_text()
  for name in ("logit_lens.json", "logit_lens.png", "attention.md"):
    assert (run / "analysis" / name).exists(), name
  fork = tmp_path / "fork"
  code, err = main_in_process(
    f"--config={TINY}", f"--workdir={fork}",
    f"--config.data.data_dir={config.data.data_dir}",
    f"--config.checkpoint.fork_from={workdir}:40",
  )  # fmt: skip
  assert code == 0, err[-20:]
  assert losses(fork) == {s: v for s, v in losses(done).items() if s > 40}
  assert list(here.iterdir()) == [] and not Path("gs:").exists()  # this cwd


@pytest.mark.slow  # ~20 s, two processes; bucket reads: test_every_mode_reads_...
def test_an_evaluation_job_follows_a_trainer_on_a_bucket(straight, gcs, bucket):
  config, _ = straight
  workdir = f"{bucket}/run"
  follower = _start(
    [sys.executable, "-m", "loopjax.main", "--mode=eval", "--follow",
     f"--workdir={workdir}", "--poll_s=0.2"],
    gcs,
  )  # fmt: skip
  trainer = _run(
    cli(workdir, config.data.data_dir, "--config.train.num_steps=100",
        "--config.eval_every=0", "--config.checkpoint.keep=10"),
    gcs,
  )  # fmt: skip
  assert trainer.returncode == 0, trainer.stderr[-3000:]
  out, _ = follower.communicate(timeout=180)
  assert follower.returncode == 0, out[-3000:]
  assert "the run has finished (step 100); done" in out
  assert "Traceback" not in out and "Event loop is closed" not in out, out[-3000:]
  evaluated = [r["step"] for r in metrics.read(storage.path(workdir) / "eval")]
  assert sorted(evaluated) == [20, 40, 60, 80, 100]


@pytest.mark.parametrize(
  "trials", [1, pytest.param(8, marks=pytest.mark.slow)], ids=["once", "often"]
)
def test_a_kill_mid_save_resumes_to_the_same_metrics(straight, gcs, bucket, trials):
  """SIGKILL at random moments while a checkpoint is saved every step: the
  resumed run never uses an uncommitted step and ends where the
  uninterrupted run does, record for record."""
  config, done = straight
  workdir, rng = f"{bucket}/run", random.Random(trials)
  args = ["--config.checkpoint.every=1", "--config.checkpoint.keep=2"]
  for trial in range(trials):
    proc = _start(cli(workdir, config.data.data_dir, *args), gcs)
    deadline = time.time() + 120
    while not _listed(workdir):
      assert proc.poll() is None and time.time() < deadline, f"trial {trial}"
      time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))
    proc.kill()
    proc.wait()
  rest = ["--config.checkpoint.every=20", "--config.checkpoint.keep=2"]
  code, err = main_in_process(*cli(workdir, config.data.data_dir, *rest)[3:])
  assert code == 0, err[-20:]
  assert losses(storage.path(workdir)) == losses(done)
  assert steps_on_disk(workdir)[-1] == 60


def _listed(workdir) -> bool:
  try:
    return bool(steps_on_disk(workdir))
  except FileNotFoundError:
    return False


def test_an_evaluation_reads_the_params_alone_from_a_bucket(straight, trained):
  """Every mode's restore (`restore.from_checkpoint`) reads from gs:// the
  params' arrays and bytes, none of AdamW's moments (twice the params'):
  counted as tests/test_restore.py counts them on a disk."""
  import jax
  from test_restore import nbytes, reading

  from loopjax import restore

  config, _ = straight
  workdir, _ = trained
  (_, model, step), keys, read = reading(
    lambda: restore.from_checkpoint(config, workdir)
  )
  assert step == STEPS
  assert 0 < keys <= 2 * len(jax.tree.leaves(model.params))
  assert 0 < read < 2 * nbytes(model.params)


def test_a_step_without_its_commit_marker_is_not_restored(trained, gcs, tmp_path):
  """A step whose marker never landed (a save cut short) is not a checkpoint."""
  workdir, _ = trained
  bucket, prefix = storage.key(workdir)
  copy = f"gs://{gcs.bucket()}/run"
  client, (copy_bucket, copy_prefix) = storage.client(), storage.key(copy)
  for name in gcs.objects(bucket, prefix):
    if "/checkpoints/60/commit_success.txt" in name or "lease" in name:
      continue
    blob = client.bucket(bucket).blob(name)
    client.bucket(bucket).copy_blob(
      blob, client.bucket(copy_bucket), copy_prefix + name[len(prefix) :]
    )
  assert steps_on_disk(copy) == [20, 40]
  config = Workdir(copy).saved_config()
  proc = _run(cli(copy, config.data.data_dir, "--config.train.num_steps=1"), gcs)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "at step 40" in proc.stdout


def test_the_lease_refuses_a_second_trainer(straight, gcs, bucket):
  """The newcomer waits while the holder might be dead, and is refused once
  it sees the holder renew."""
  config, _ = straight
  workdir = f"{bucket}/run"
  held = Workdir(workdir)
  with held.exclusive("train", stale_s=4):  # renewed every second
    proc = _run(cli(workdir, config.data.data_dir), gcs, timeout=120)
  assert proc.returncode == 2
  line = _error_line(proc)
  assert "another process" in line and "is training there" in line, line
  assert "it renewed its lease" in line, line
  assert "waiting for the lease" in proc.stdout


def test_a_stale_lease_is_taken_over_and_its_old_holder_stops(gcs, bucket):
  where = storage.path(f"{bucket}/run/lease.json")
  old = Lease(where, "another process", "is training there", stale_s=1)
  old.acquire()
  old._stop.set()  # its host froze: no more renewals
  new = Lease(where, "another process", "is training there", stale_s=1)
  start = time.monotonic()
  new.acquire()  # waits until the lease is a second old, then takes it
  assert time.monotonic() - start >= 0.5
  with pytest.raises(LeaseLost, match="another process took it over"):
    old.check()  # what the old holder does before its next save
  new.check()
  new.release()
  assert not where.exists()


def test_a_renewal_whose_reply_was_lost_is_still_the_holders(gcs, bucket):
  """GCS committed the rewrite but the reply never came: the next renewal's
  precondition fails, and the lease's holder id says it is still ours."""
  where = storage.path(f"{bucket}/run/lease.json")
  lease = Lease(where, "another process", "is training there", stale_s=60)
  lease.acquire()
  kept = lease._generation
  lease._write(if_generation_match=kept)  # committed ...
  lease._generation = kept  # ... its reply lost
  lease.check(renew=True)
  lease.check(renew=True)
  lease.release()


def test_only_one_of_two_racing_newcomers_gets_the_lease(gcs, bucket):
  """The emulator enforces ifGenerationMatch on the storage client's uploads:
  the precondition, not timing, decides."""
  where = storage.path(f"{bucket}/run/lease.json")
  a = Lease(where, "another process", "is training there", stale_s=60)
  b = Lease(where, "another process", "is training there", stale_s=60)
  a._write(if_generation_match=0)
  from google.api_core import exceptions as gexc

  with pytest.raises(gexc.PreconditionFailed):
    b._write(if_generation_match=0)
  a._generation -= 1  # as if another had rewritten it since a's last write
  with pytest.raises(gexc.PreconditionFailed):
    a._write(if_generation_match=a._generation)


@pytest.mark.slow  # ~12 s, a process; LeaseLost: test_a_stale_lease_is_taken_over_...
def test_a_trainer_that_lost_its_lease_stops_saving_nothing(straight, gcs, bucket):
  config, _ = straight
  workdir = f"{bucket}/run"
  proc = _start(
    cli(workdir, config.data.data_dir, "--config.train.num_steps=100000"), gcs
  )
  deadline = time.time() + 120
  while not _listed(workdir):
    assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
    time.sleep(0.05)
  lease = storage.path(workdir) / "lease.json"
  body = json.loads(lease.read_text()) | {"holder": "another", "pid": 1}
  lease.write_text(json.dumps(body))  # another trainer took it over
  before = max(steps_on_disk(workdir))
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 1, out[-3000:]
  (line,) = [x for x in out.splitlines() if x.startswith("error:")]
  assert "lost the lease" in line and "stopped without saving more" in line, line
  assert max(steps_on_disk(workdir)) <= before + 20  # at most the save under way
  assert "Traceback" not in out


@pytest.mark.parametrize(
  "where,fork", [("no_bucket", False), ("no_answer", False), ("s3", False),
                 ("no_bucket", True), ("no_answer", True)],
)  # fmt: skip
def test_a_bucket_that_cannot_be_reached_is_one_line_in_seconds(
  where, fork, gcs, tmp_path
):
  """As a workdir, or as the run a fork starts from (checked before its data
  is built: gcsfs would retry for a minute, then print a traceback)."""
  env = CPU_ENV | gcs.env
  url = "gs://no-such-bucket-here/run"
  if where == "no_answer":
    env = env | {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}
  if where == "s3":
    url = "s3://bucket/run"
  workdir, extra, field = url, [], "--workdir"
  if fork:
    field = "checkpoint.fork_from"
    workdir, extra = tmp_path / "run", [f"--config.checkpoint.fork_from={url}:40"]
  start = time.time()
  proc = subprocess.run(
    cli(workdir, tmp_path / "data", *extra, config=TINY), capture_output=True,
    text=True, env=env, cwd=tmp_path, timeout=120,
  )  # fmt: skip
  assert proc.returncode == 2, proc.stderr[-3000:]
  line = _error_line(proc)
  assert line.startswith(f"error: {field}={url}: "), line
  assert {
    "no_bucket": "no such bucket",
    "no_answer": "no answer from",
    "s3": "s3:// cannot hold a run",
  }[where] in line, line
  assert time.time() - start < 60  # a retry loop: minutes; a loaded 2-core VM: ~30 s
  assert list(tmp_path.iterdir()) == []  # nothing written anywhere


def test_without_the_gcs_extra_a_bucket_is_one_line(tmp_path):
  script = (
    "import sys; sys.modules['gcsfs'] = None\n"
    "from loopjax import storage\n"
    "try: storage.path('gs://b/run')\n"
    "except Exception as e: print(e)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=CPU_ENV
  ).stdout
  assert "pip install 'loopjax[gcs]'" in out, out


def test_metrics_chunks_are_whole_objects_never_appended(gcs, bucket):
  where = storage.path(f"{bucket}/run")
  writer = metrics.Writer(where, where / "tb", flush_s=3600)
  writer.start(0)
  for step in range(1, 4):
    writer.write(step, {"loss": float(step)})
    writer.flush()
  writer.end(3, "finished")
  names = sorted(p.name for p in (where / "metrics").iterdir())
  assert len(names) == 5 and names == sorted(names)  # start, 3 flushes, end
  read = metrics.read(where)
  assert [r.get("loss") for r in read] == [None, 1.0, 2.0, 3.0, None]
  assert [r.get("event") for r in (read[0], read[-1])] == ["start", "end"]
  assert len(list((where / "tb").iterdir())) == 3  # one event file per flush


@pytest.mark.slow  # ~60 s: two processes, twice
def test_two_processes_share_one_bucket_workdir(straight, gcs, bucket):
  """2 processes x 2 CPU devices, one gs:// workdir: they write one
  checkpoint together, process 0 alone the records and the lease; the run
  resumes on both."""
  config, _ = straight
  workdir = f"{bucket}/run"

  def launch(steps):
    cmd = [
      sys.executable, "launch/local.py", "--num_processes=2",
      "--devices_per_process=2", "--",
      *cli(workdir, config.data.data_dir, f"--config.train.num_steps={steps}",
           "--config.mesh.devices=0", "--heartbeat_timeout=20"),
    ]  # fmt: skip
    return _run(cmd, gcs)

  first = launch(40)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  assert steps_on_disk(workdir) == [20, 40]
  second = launch(60)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  for i in (0, 1):
    assert f"[{i}] resumed from {workdir}/checkpoints at step 40" in second.stdout
  records = metrics.read(storage.path(workdir))
  logged = [r["step"] for r in records if "train/loss" in r]
  assert logged == sorted(set(logged)) and logged[-1] == 60  # one writer
  assert [r["event"] for r in records if "event" in r] == ["start", "end"] * 2
  bucket_name, prefix = storage.key(workdir)
  assert f"{prefix}/lease.json" not in gcs.objects(bucket_name, prefix)


def test_a_data_dir_on_a_bucket_is_one_line(tmp_path):
  """Data sets are built on each host's disk; a URL there would have become a
  local folder named "gs:"."""
  code, err = main_in_process(
    f"--config={TINY}", f"--workdir={tmp_path / 'run'}",
    "--config.data.data_dir=gs://b/data",
  )  # fmt: skip
  assert code == 2 and err[-1].startswith("error: data.data_dir: must be a local"), err
  assert list(tmp_path.iterdir()) == []


@pytest.fixture
def lm_on_a_bucket(lm_config, bucket):
  """A language model trained on gs:// (4 steps, one checkpoint)."""
  workdir = storage.path(f"{bucket}/lm")
  lm_config.train.num_steps = lm_config.checkpoint.every = 4
  lm_config.eval_every = 0
  train.train_and_evaluate(lm_config, workdir)
  return workdir


def test_sample_reads_a_language_model_run_on_a_bucket(lm_on_a_bucket, tmp_path):
  here = tmp_path / "cwd"
  here.mkdir()
  with contextlib.chdir(here):
    code, err = main_in_process(
      f"--workdir={lm_on_a_bucket}", "--prompt=def ", "--max_new_tokens=4",
      "--temperature=0", entry="sample",
    )  # fmt: skip
  assert code == 0, err[-20:]
  assert list(here.iterdir()) == []


@pytest.mark.slow  # ~40 s: the harness's start
def test_lm_eval_reads_and_writes_a_language_model_run_on_a_bucket(
  lm_on_a_bucket, gcs, tmp_path
):
  from conftest import offline_env, write_tasks

  tasks = write_tasks(tmp_path / "tasks")
  scored = subprocess.run(
    [sys.executable, "-m", "loopjax.lm_eval", f"--workdir={lm_on_a_bucket}",
     "--tasks=toy_mc", f"--include_path={tasks}"],
    capture_output=True, text=True, timeout=300, cwd=tmp_path,
    env=CPU_ENV | gcs.env | offline_env(tmp_path / "hf"),
  )  # fmt: skip
  assert scored.returncode == 0, scored.stderr[-3000:]
  table = (lm_on_a_bucket / "lm_eval" / "table.md").read_text()
  assert "| toy_mc | acc,none |" in table
  assert not (tmp_path / "gs:").exists()
