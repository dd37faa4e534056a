"""`--mode=eval --follow`: an evaluation job beside a live training run."""

import json
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import CPU_ENV, cli, start, steps_on_disk

from loopjax import follow, metrics, restore, train
from loopjax.errors import ConfigError
from loopjax.kg import source as kg_source
from loopjax.kg.evaluate import Evaluator
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
  return [r["step"] for r in metrics.read(workdir / "eval")]


# ~29 s: two followers and a trainer as processes (the tests below keep the
# follower in the default suite).
@pytest.mark.slow
def test_follower_evaluates_each_checkpoint_once_across_a_restart(
  tiny_config, tmp_path
):
  workdir, data_dir = tmp_path / "run", tmp_path / "data"
  first = _follower(workdir)  # before the trainer has written anything
  # Its first line, before the trainer starts (else the two race for config.json).
  head = first.stdout.readline()
  assert "waiting for" in head, head  # it started before config.json existed
  trainer = start(cli(workdir, data_dir, *STEPS))
  deadline = time.monotonic() + 120
  while len(_evaluated(workdir)) < 2 and time.monotonic() < deadline:
    assert first.poll() is None, first.communicate()[0][-3000:]
    time.sleep(0.05)
  first.send_signal(signal.SIGKILL)
  first.communicate()  # reaped
  at_kill = _evaluated(workdir)
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
  assert not any("eval/" in r for r in metrics.read(workdir))

  # The follower's numbers are an evaluation of that checkpoint.
  tiny_config.data.data_dir = str(data_dir)
  task, model, _ = restore.from_checkpoint(tiny_config, workdir, step=200)
  want = Evaluator(model.graphdef, tiny_config, task).run(model.params)
  got = next(r for r in metrics.read(workdir / "eval") if r["step"] == 200)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
  report = json.loads((workdir / "eval/step_200.json").read_text())
  assert (
    report["splits"]["test_inferred_id"]["acc"]["2"]
    == want["eval/test_inferred_id/acc"]
  )
  points = [  # each evaluation's TensorBoard point once, across both followers
    e.step
    for f in (workdir / "tb" / "eval_job").glob("events.*.eval_job")
    for e in _events(f)[1:]
  ]
  assert sorted(points) == steps


_SAID = re.compile(
  r"follow: (evaluated step (\d+)|checkpoint (\d+) (was deleted before it was "
  r"evaluated|does not restore \([^\n]*\)); skipped|waiting for \S+|the run "
  r"has finished \(step \d+\); done)"
)


# ~2 min on a busy core: a trainer saving every step, keeping two, and its
# follower, whose reads and analyses race the keep policy's deletes. Whether
# the race happens depends on the machine's speed (on a 2-core VM at 1-4
# steps/s it did not, in three tries): this test holds the terminal to one
# line per checkpoint whatever happens; the skip itself is forced in
# test_a_checkpoint_deleted_before_its_turn_is_skipped.
@pytest.mark.slow
def test_a_follower_beside_a_fast_trainer_says_one_line_per_skipped_checkpoint(
  tmp_path,
):
  workdir, data_dir = tmp_path / "run", tmp_path / "data"
  steps = [
    "--config.train.num_steps=100", "--config.checkpoint.every=1",
    "--config.checkpoint.keep=2", "--config.eval_every=0",
    "--config.log_every=1000",
  ]  # fmt: skip
  trainer = start(cli(workdir, data_dir, *steps))
  follower = subprocess.run(
    [
      sys.executable, "-m", "loopjax.main", "--mode=eval", "--follow",
      f"--workdir={workdir}", "--poll_s=0.05",
      "--analyze",  # slower than the trainer on any machine: some are deleted
    ],
    capture_output=True, text=True, env=CPU_ENV, timeout=900,
  )  # fmt: skip
  out_train = trainer.communicate(timeout=300)[0]
  assert trainer.returncode == 0, out_train[-3000:]
  assert follower.returncode == 0, follower.stderr[-3000:]
  # The terminal: the follower's own lines, one per checkpoint it looked at.
  assert "Traceback" not in follower.stderr, follower.stderr[-3000:]
  assert not [x for x in follower.stderr.splitlines() if "tfds" not in x.lower()], (
    follower.stderr[-3000:]
  )
  lines = [x for x in follower.stdout.splitlines() if x.startswith("follow:")]
  said = [m for x in lines if (m := _SAID.fullmatch(x))]
  assert len(said) == len(lines), [x for x in lines if not _SAID.fullmatch(x)]
  evaluated = [int(m[2]) for m in said if m[2]]
  skipped = [int(m[3]) for m in said if m[3]]
  assert len(set(skipped)) == len(skipped) and not set(skipped) & set(evaluated)
  assert 100 in evaluated and sorted(_evaluated(workdir)) == sorted(evaluated)


@pytest.fixture
def finished(tiny_config, tmp_path):
  """A 40-step run with checkpoints at 20 and 40 and no in-loop evaluation."""
  tiny_config.train.num_steps = 40
  tiny_config.checkpoint.update(every=20, keep=5)
  tiny_config.eval_every = 0
  train.train_and_evaluate(tiny_config, tmp_path / "run")
  return tiny_config, tmp_path / "run"


def test_a_checkpoint_deleted_before_its_turn_is_skipped(finished, capsys):
  config, workdir = finished
  task = kg_source.knowledge_graph(config.data)
  job = follow._Job(
    Workdir(workdir), config, task, restore.Reader(config, workdir, task), False
  )
  shutil.rmtree(workdir / "checkpoints" / "20")  # the trainer's keep policy, say
  job.evaluate(20)
  assert "checkpoint 20 was deleted before it was evaluated; skipped" in (
    capsys.readouterr().out
  )
  job.evaluate(40)
  job.close()
  assert _evaluated(workdir) == [40] and job.done == {20, 40}
  phases = json.loads((workdir / "eval" / "phases.json").read_text())
  assert set(phases) == {"memorize", "id", "ood"}  # detected from its evaluations


def test_a_trainer_that_stopped_early_ends_the_follower(finished):
  config, workdir = finished
  config.train.num_steps = 100  # what the trainer was asked for
  end = {"step": 40, "time": time.time() + 60, "event": "end", "reason": "stopped"}
  chunk = workdir / "metrics" / "9999999999999.jsonl"  # its end record, after ours
  chunk.write_text(json.dumps(end) + "\n")
  with pytest.raises(follow.TrainerStopped, match="stopped at step 40 \\(stopped\\)"):
    follow.follow(workdir, config, poll_s=0.01)
  assert _evaluated(workdir) == [20, 40]  # everything it saved, first


def test_one_follower_per_workdir(finished):
  config, workdir = finished
  with Workdir(workdir).exclusive("follow"):
    with pytest.raises(ConfigError, match="another process .* is following it"):
      follow.follow(workdir, config, poll_s=0.01)


def test_a_legacy_log_cut_short_by_a_kill_is_read_without_its_last_line(tmp_path):
  """Runs from before chunks appended to metrics.jsonl; they resume into
  chunks and are read as one history."""
  (tmp_path / "metrics.jsonl").write_text('{"step": 20, "a": 1.0}\n{"step": 40, "a"')
  writer = metrics.Writer(tmp_path, tmp_path / "tb")
  writer.write(40, {"a": 2.0})
  writer.close()
  assert [(r["step"], r["a"]) for r in metrics.read(tmp_path)] == [(20, 1.0), (40, 2.0)]


def _events(path):
  """The Event protos of a TFRecord file, each record's two checksums checked."""
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.record_writer import masked_crc32c

  data, events = path.read_bytes(), []
  while data:
    (n,) = struct.unpack("<Q", data[:8])
    assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])
    body, data = data[12 : 12 + n], data[12 + n :]
    assert struct.unpack("<I", data[:4])[0] == masked_crc32c(body)
    events.append(Event.FromString(body))
    data = data[4:]
  return events


@pytest.mark.parametrize("section", [None, "eval_job"])
def test_tensorboard_points_are_whole_records_with_their_tags(tmp_path, section):
  writer = metrics.Writer(tmp_path, tmp_path / "tb", tb_section=section)
  writer.write(20, {"loss": 2.5, "eval/acc": 0.25})
  writer.write(40, {"loss": 1.5, "eval/acc": 0.75})
  assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir())
  writer.close()  # one event file, written whole
  (path,) = (tmp_path / "tb").iterdir()
  assert path.name.startswith("events.out.tfevents.")  # what TensorBoard reads
  assert f".{socket.gethostname()}." in path.name
  assert path.name.endswith(f".{section}") == bool(section)
  header, *points = _events(path)
  assert header.file_version == "brain.Event:2"
  loss, acc = (f"{section}/loss", f"{section}/acc") if section else ("loss", "eval/acc")
  assert [
    (e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in points
  ] == [
    (20, {loss: 2.5, acc: 0.25}),
    (40, {loss: 1.5, acc: 0.75}),
  ]


def test_a_full_disk_under_the_logs_raises_in_the_callers_thread(tmp_path):
  """tensorboardX's SummaryWriter wrote from a thread of its own, which died on
  this while the next points waited for it for ever. Here a chunk too large
  for the file size limit fails in the caller, with its errno, at once."""
  script = (
    "import sys; from pathlib import Path; from loopjax import metrics\n"
    "w = metrics.Writer(Path(sys.argv[1]) / 'run', Path(sys.argv[1]))\n"
    "try:\n"
    "  for step in range(1000): w.write(step, {'a': 1.0, 'b': 2.0 * step})\n"
    "  w.close()\n"
    "except OSError as e: print(e.errno)\n"
  )
  limited = f'trap "" XFSZ; ulimit -f 4; exec {sys.executable} -c "$0" "$1"'
  proc = subprocess.run(
    ["bash", "-c", limited, script, str(tmp_path / "tb")],
    capture_output=True, text=True, env=CPU_ENV, timeout=60,
  )  # fmt: skip
  assert proc.stdout.strip() == "27", proc.stderr[-2000:]  # EFBIG, no hang
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
