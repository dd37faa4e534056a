"""Fault injection: damaged checkpoints, divergence, full disks, kills mid-write.

Each test breaks a run the way real machines do and checks that nothing saved is
lost and the run resumes from the newest good checkpoint.
"""

import contextlib
import json
import random
import re
import shutil
import subprocess
import time

import jax
import numpy as np
import pytest
from conftest import (
  CPU_ENV,
  cli,
  in_process,
  losses,
  main_in_process,
  run,
  steps_on_disk,
)

from loopjax import checkpoint, metrics, train
from loopjax.errors import ConfigError
from loopjax.kg import source as kg_source
from loopjax.state import build_model, init_state, make_optimizer
from loopjax.workdir import Workdir


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """One uninterrupted tiny run to step 120, a checkpoint every 20 steps."""
  from experiments import sysgen

  root = tmp_path_factory.mktemp("straight")
  c = sysgen.get_config("tiny")
  c.data.data_dir = str(root / "data")
  c.train.num_steps = 120
  c.checkpoint.keep = 10
  train.train_and_evaluate(c, root / "run")
  return c, root / "run"


def _run_to(config, workdir, step):
  config = config.copy_and_resolve_references()
  config.train.num_steps = step
  return train.train_and_evaluate(config, workdir)


def _keep_records_to(workdir, step):
  """Drops the copied run's later records, so what follows is the new run's."""
  kept = [r for r in metrics.read(workdir) if r["step"] <= step]
  shutil.rmtree(workdir / "metrics")
  (workdir / "metrics").mkdir()
  chunk = workdir / "metrics" / "0000000000001.jsonl"
  chunk.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _flip(path):
  b = bytearray(path.read_bytes())
  for i in range(len(b) // 2, len(b) // 2 + 8):
    b[i] ^= 0xFF
  path.write_bytes(bytes(b))


def _flip_until_it_decodes(config, workdir, step):
  """Silent bit rot: the data files are compressed, so a flip can also break the
  decoder (a read error, tested by truncation) or land in bytes no array reads;
  move the flip over the data files until the step restores with wrong values,
  which only the checksums catch."""
  files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")]
  for path in sorted(
    (p for p in files if p.is_file()), key=lambda p: -p.stat().st_size
  ):
    clean = path.read_bytes()
    for offset in np.linspace(len(clean) // 4, len(clean) - 9, 12).astype(int):
      b = bytearray(clean)
      for i in range(offset, offset + 8):
        b[i] ^= 0xFF
      path.write_bytes(bytes(b))
      try:
        _restore(config, workdir, step)
      except checkpoint.CorruptCheckpoint:
        return
      except Exception:  # noqa: BLE001 - the decoder noticed: try another spot
        continue
    path.write_bytes(clean)
  raise AssertionError(f"step {step}: no flip decoded to wrong values")


def _largest_file(directory):
  return max(
    (p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
  )


@pytest.mark.parametrize(
  "damage",
  [
    _flip,  # silent bit rot: only the checksums catch it
    lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),  # truncated
    lambda p: p.unlink(),  # deleted
  ],
  ids=["flipped", "truncated", "deleted"],
)
def test_damaged_newest_checkpoint_is_set_aside(straight, tmp_path, capsys, damage):
  config, done = straight
  workdir = tmp_path / "run"
  shutil.copytree(done, workdir)
  # Back to step 80 (as if the run had stopped there), then damage step 80.
  for s in (100, 120):
    shutil.rmtree(workdir / "checkpoints" / str(s))
  _keep_records_to(workdir, 80)
  if damage is _flip:
    _flip_until_it_decodes(config, workdir, 80)
  else:
    damage(_largest_file(workdir / "checkpoints/80/state"))
  capsys.readouterr()
  _run_to(config, workdir, 120)
  out = capsys.readouterr().out
  assert re.search(
    r"checkpoint 80 is damaged \(.+\); set aside in checkpoints_damaged.json", out
  ), out
  if damage is _flip:  # the bytes still decode: only the checksums catch it
    assert "checksum mismatch" in out, out
  assert "TensorStore details" not in out and "<bound method" not in out, out
  assert "resumed from" in out and "at step 60" in out
  # Kept until the run trained to step 80 again; the record says why it went.
  record = json.loads((workdir / checkpoint.DAMAGED).read_text())
  assert record["damaged"] == {} and list(record["replaced"]) == ["80"]
  assert steps_on_disk(workdir) == [20, 40, 60, 80, 100, 120]
  # Steps 61-120 were trained again from step 60 and logged a second time; the
  # later records must equal the uninterrupted run's.
  assert losses(workdir) == losses(done)


def test_no_good_checkpoint_refuses_and_moves_nothing(straight, tmp_path):
  config, done = straight
  workdir = tmp_path / "run"
  shutil.copytree(done, workdir)
  for s in steps_on_disk(workdir):  # every data file: arrays are spread over many
    for path in (workdir / "checkpoints" / str(s) / "state").rglob("*"):
      if path.is_file() and path.stat().st_size > 1000:
        _flip(path)
  before = sorted(p.relative_to(workdir) for p in workdir.rglob("*"))
  with pytest.raises(
    ConfigError, match=r"no checkpoint in .* restores \(newest, step 120"
  ):
    _run_to(config, workdir, 140)
  assert sorted(p.relative_to(workdir) for p in workdir.rglob("*")) == before


def test_checksum_detects_one_changed_word():
  tree = {"w": np.arange(1000, dtype=np.float32), "k": jax.random.key(0)}
  sums, finite = checkpoint.digest(tree)
  assert finite
  w = tree["w"].copy()
  w[[3, 4]] = w[[4, 3]]  # a swap keeps a plain sum; the weighted sum changes
  assert checkpoint.digest({**tree, "w": w})[0] != sums
  w = tree["w"].copy()
  w[999] = np.nextafter(w[999], np.float32(np.inf))  # one ulp
  assert checkpoint.digest({**tree, "w": w})[0]["['w']"] != sums["['w']"]
  w[0] = np.nan
  assert not checkpoint.digest({**tree, "w": w})[1]


@pytest.mark.slow  # ~22 s of CLI runs
def test_diverging_run_stops_and_keeps_its_good_checkpoints(tmp_path, straight):
  config, done = straight
  workdir = tmp_path / "run"
  proc = run(
    cli(
      workdir,
      config.data.data_dir,
      "--config.train.lr=1e4",
      "--config.train.grad_clip=0",
      "--config.checkpoint.every=1",
      "--config.checkpoint.keep=100",
    ),
  )
  assert proc.returncode == 1, proc.stderr[-2000:]
  (last,) = [x for x in proc.stderr.splitlines() if "error: step" in x]
  m = re.fullmatch(
    r".*error: step (\d+): "
    r"(train/\S+ is (?:nan|inf|-inf)|the train state holds NaN or inf)"
    r".*the run stopped\. "
    r"Checkpoints are intact, newest: step (\d+) in .*",
    last,
  )
  assert m, last
  bad, newest = int(m[1]), int(m[3])
  assert newest < bad and steps_on_disk(workdir)[-1] == newest
  # Every checkpoint on disk restores, verifies and holds only finite numbers.
  config = config.copy_and_resolve_references()
  config.train.grad_clip = 0.0  # the run's optimizer: no clipping stage
  for step in steps_on_disk(workdir):
    assert checkpoint.digest(_restore(config, workdir, step))[1], step


def test_a_checkpoint_deleted_under_a_reader_is_skipped_quietly(
  straight, tmp_path, capsys, monkeypatch
):
  """A trainer's keep policy deletes checkpoints while an evaluation lists
  and reads them: the listing is read again, a deleted one is passed over
  without a word, and the newest left is the one read."""
  from loopjax import restore

  config, done = straight
  workdir = tmp_path / "run"
  shutil.copytree(done, workdir)
  reader = restore.Reader(config, workdir, kg_source.knowledge_graph(config.data))
  try:
    assert reader.steps()[-1] == 120
    shutil.rmtree(workdir / "checkpoints" / "120")  # orbax's list still has it
    capsys.readouterr()
    assert reader.model()[1] == 100
    assert "damaged" not in capsys.readouterr().out
    calls, all_steps = [], reader.mngr.all_steps

    def racing():  # the list read while the keep policy deletes: twice
      calls.append(1)
      if len(calls) <= 2:
        raise FileNotFoundError("checkpoints/20/_CHECKPOINT_METADATA")
      return all_steps()

    monkeypatch.setattr(reader.mngr, "all_steps", racing)
    assert reader.steps() == [20, 40, 60, 80, 100] and len(calls) == 3
  finally:
    reader.close()


def _restore(config, workdir, step):

  task = kg_source.knowledge_graph(config.data)
  model = build_model(
    config.model, task.vocab.vocab_size, task.splits["train"]["inputs"].shape[1], 0
  )
  tx = make_optimizer(config.train)
  _, state = init_state(model, tx, config.seed)
  mngr = Workdir(workdir).checkpoints(config.checkpoint)
  try:
    restored, s = checkpoint.restore(mngr, checkpoint.abstract(state), step=step)
  finally:
    mngr.close()
  assert s == step
  return restored


def _file_size_limit(kib, cmd):
  """`cmd` where writes past `kib` KiB per file fail with EFBIG, like a full disk."""
  return ["bash", "-c", 'trap "" XFSZ; ulimit -f "$0"; exec "$@"', str(kib), *cmd]


# ~20 s: four runs as processes.
@pytest.mark.slow
def test_a_full_disk_under_the_logs_is_one_line_not_masked_by_clean_up(
  tiny_config, tmp_path
):
  """Every write fails (metrics, TensorBoard, then clean-up's own): the error
  that stopped the run is the one line, with the workdir; no traceback. The
  data set cannot be written either: one line naming data.data_dir; nor the
  run's config.json: one line, before the first step."""
  workdir = tmp_path / "run"
  data_dir = tiny_config.data.data_dir
  proc = run(_file_size_limit(4, cli(workdir, data_dir)))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (
    proc.stderr.strip()
    .splitlines()[-1]
    .startswith(f"error: data.data_dir={data_dir}: cannot write the dataset (")
  ), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  data_only = run(cli(tmp_path / "data_only", data_dir, "--config.train.num_steps=1"))
  assert data_only.returncode == 0, data_only.stderr[-2000:]
  proc = run(_file_size_limit(1, cli(workdir, data_dir)))  # config.json: > 1 KiB
  assert proc.returncode == 1, proc.stderr[-2000:]
  (line,) = proc.stderr.strip().splitlines()  # nothing but the one line
  assert line.startswith(f"error: writing in {workdir}: [Errno 27] File too large")
  assert line.endswith("the run stopped before its first step"), line
  proc = run(
    _file_size_limit(
      16,  # config.json fits (~4 KiB); the logs outgrow it
      cli(
        workdir, tiny_config.data.data_dir, "--config.train.num_steps=400",
        "--config.log_every=1", "--config.checkpoint.every=1000",
      ),
    )
  )  # fmt: skip
  assert proc.returncode == 1, proc.stderr[-2000:]
  (line,) = proc.stderr.strip().splitlines()  # nothing but the one line
  assert line.startswith(f"error: writing in {workdir}: [Errno 27] File too large")


@pytest.mark.slow  # ~18 s: a run on a size-limited disk, then its resume
def test_full_disk_stops_cleanly_and_the_run_resumes(straight, tmp_path):
  config, done = straight
  workdir = tmp_path / "run"
  shutil.copytree(done, workdir)
  for s in (80, 100, 120):
    shutil.rmtree(workdir / "checkpoints" / str(s))
  _keep_records_to(workdir, 60)
  proc = run(  # checkpoint data files are ~130 kB
    _file_size_limit(
      20, cli(workdir, config.data.data_dir, "--config.train.num_steps=120")
    ),
  )
  assert proc.returncode == 1, proc.stderr[-2000:]
  # orbax logs the failed write from each of its threads and asyncio each
  # unawaited write: in the library log the line names, not on the terminal.
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith(f"error: writing in {workdir}: a checkpoint write"), line
  assert "File too large" in line and "newest: step 60" in line, line
  log = re.fullmatch(r".* \(library log: (\S+)\)", line)
  assert log and "orbax" in open(log[1]).read(), line
  assert steps_on_disk(workdir) == [20, 40, 60]
  rerun = run(
    cli(workdir, config.data.data_dir, "--config.train.num_steps=120"),
  )
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert "at step 60" in rerun.stdout
  assert losses(workdir) == losses(done)


def _kill_trials(straight, tmp_path, trials, seed):
  """SIGKILL at random moments while a checkpoint is written every step."""
  config, done = straight
  rng = random.Random(seed)
  workdir = tmp_path / "run"
  args = ["--config.train.num_steps=120", "--config.checkpoint.every=1"]
  for trial in range(trials):
    proc = subprocess.Popen(
      cli(workdir, config.data.data_dir, *args),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      env=CPU_ENV,
    )
    # Wait until training is under way, then kill at a random moment.
    deadline = time.time() + 120
    while not (workdir / "checkpoints").exists() or not steps_on_disk(workdir):
      assert proc.poll() is None and time.time() < deadline, f"trial {trial}"
      time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 1.5))
    proc.kill()
    proc.wait()
    complete = steps_on_disk(workdir)
    resumed = run(
      cli(workdir, config.data.data_dir, *args, "--config.train.num_steps=1"),
    )  # num_steps=1 < saved step: restores (and verifies) the newest, trains nothing
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "damaged" not in resumed.stdout, resumed.stdout
    assert steps_on_disk(workdir) == complete
  final = run(
    cli(workdir, config.data.data_dir, *args),
  )
  assert final.returncode == 0, final.stderr[-2000:]
  assert "damaged" not in final.stdout
  assert losses(workdir) == losses(done)


@pytest.mark.slow  # the default suite's time; .ci/run runs the slow tier
def test_sigkill_during_async_writes_resumes_from_complete_checkpoint(
  straight, tmp_path
):
  _kill_trials(straight, tmp_path, trials=20, seed=1)
  _kill_trials(straight, tmp_path, trials=20, seed=1)


@pytest.mark.parametrize(
  "flag,message",
  [
    ("--workdir={f}/run", "--workdir={f}/run: cannot write there"),
    (
      "--config.data.data_dir={f}/data",
      "data.data_dir: cannot prepare the dataset in '{f}/data'",
    ),
    (
      "--config.data.source=grokked_json:{f}/missing",
      "{f}/missing/vocab.json: cannot read (Not a directory)",
    ),
  ],
  ids=["workdir", "data_dir", "json_source"],
)
def test_unusable_paths_fail_in_one_line(tmp_path, flag, message):
  blocker = tmp_path / "a_file"  # a path under a regular file: not creatable,
  blocker.write_text("")  # even for root (CI containers often run as root)
  # The flag comes last: it wins over cli's own --workdir / data_dir.
  proc = in_process(cli(tmp_path / "run", tmp_path / "data", flag.format(f=blocker)))
  lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
  assert proc.returncode == 2 and lines, proc.stderr[-2000:]
  assert lines[0].startswith("error: " + message.format(f=blocker)), lines
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()  # nothing created


@contextlib.contextmanager
def _immutable(path):
  """`path` made read-only for root too (ext4's immutable attribute: no entry
  added or removed); skips where the file system or the tool has none."""
  if shutil.which("chattr") is None:
    pytest.skip("no chattr")
  made = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
  if made.returncode:
    pytest.skip(f"chattr +i: {made.stderr.decode().strip()}")
  try:
    yield
  finally:
    subprocess.run(["chattr", "-i", str(path)], check=True)


# What each mode writes under the workdir: eval/step_N.json, analysis/, and
# plots/ with results.md beside them.
_WRITES = {"eval": "eval", "analyze": "analysis", "report": "plots"}


@pytest.mark.parametrize("how", ["read_only", "a_file_in_the_way"])
@pytest.mark.parametrize("mode", list(_WRITES))
def test_a_workdir_that_cannot_be_written_is_one_line_before_the_work(
  straight, tmp_path, mode, how
):
  """--mode=eval, analyze and report into a workdir they cannot write: one
  line naming it, exit 2, before a checkpoint is read or a figure drawn. Read
  only: the workdir made immutable (root writes anywhere else); a file in the
  way: where the mode's folder goes, a file (so it cannot be made)."""
  _, done = straight
  workdir = tmp_path / "run"
  shutil.copytree(done, workdir, ignore=shutil.ignore_patterns(*_WRITES.values()))
  folder = workdir / _WRITES[mode]
  if how == "a_file_in_the_way":
    folder.write_text("")
    context, says = contextlib.nullcontext(), f"in {folder} (a file is in the way)"
  else:
    context = _immutable(workdir)
    says = "there" if mode == "report" else f"in {folder}"
    says += " (Operation not permitted)"
  start = time.monotonic()
  with context:
    code, lines = main_in_process(f"--mode={mode}", f"--workdir={workdir}")
  assert (code, lines) == (2, [f"error: --workdir={workdir}: cannot write {says}"])
  assert time.monotonic() - start < 15  # nothing restored or analyzed first


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_cut_short_config_json_is_named_in_one_line(tmp_path, mode):
  """config.json cut short (a full disk, a hand edit): one line naming it,
  exit 2, for a run given its config and for one read from the workdir."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text('{"data": {"task": "compos')
  cmd = cli(workdir, tmp_path / "data", f"--mode={mode}")
  if mode == "eval":  # the workdir's config.json is the config
    cmd = [x for x in cmd if not x.startswith("--config")]
  proc = in_process(cmd)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
    f"error: {workdir / 'config.json'}: not valid JSON (Unterminated string "
    "starting at, line 1); restore it or move the workdir away"
  )
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
  "error",
  [
    # tensorstore: the cause only as a code at the end of a message too long to keep
    ValueError("x" * 500 + " [os_error_code='27'] " + "y" * 500),
    OSError(27, "File too large"),
  ],
)
def test_a_failed_write_names_the_os_error_once(error):
  with pytest.raises(checkpoint.WriteError) as raised:
    with checkpoint._writing():
      raise error
  assert str(raised.value).count("File too large") == 1, raised.value


def _chained(outer: Exception, cause: Exception) -> Exception:
  outer.__cause__ = cause
  return outer


def test_a_storage_that_did_not_answer_is_told_from_a_damaged_step():
  """A busy bucket stops the run with nothing set aside; a damaged step is
  set aside. A truncated step's byte count (45034) once read as HTTP 503."""

  class HttpError(Exception):  # gcsfs's: the status as `code`
    code = 503

  truncated = _chained(
    Exception("Encountered error while reading array index: (slice(0, 32, 1),)."),
    ValueError(
      'OUT_OF_RANGE: Error reading "params.w/0.0" in OCDBT database: Requested '
      "byte range [37113, 48523) is not valid for value of size 45034"
    ),
  )
  assert not checkpoint._unreachable(truncated)
  assert not checkpoint._unreachable(ValueError("checksum mismatch at 503 leaves"))
  for busy in (
    _chained(Exception("reading array index"), ValueError("UNAVAILABLE: code 503")),
    _chained(Exception("reading"), HttpError("Service Unavailable")),
    ValueError("DEADLINE_EXCEEDED: GET gs://b/run/checkpoints/80"),
  ):
    assert checkpoint._unreachable(busy), busy
