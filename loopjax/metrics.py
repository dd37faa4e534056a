"""Metric sinks (JSONL records and TensorBoard events) and the training run's
progress display.

Both are written as chunks, each one whole object never appended to
(`metrics/<ms>.jsonl`, `tb/events.out.tfevents.<ms>.<host>`): on a bucket an
append rewrites the whole object, so upload volume would grow with the square
of the run's length; chunks keep it linear, and a reader never sees half a
record. Readers concatenate the chunks in name (time) order (`Log`).
"""

import contextlib
import json
import os
import socket
import struct
import sys
import time

import numpy as np
from etils import epath
from tqdm import tqdm

from loopjax import sharding, storage

LEGACY = "metrics.jsonl"  # runs from before chunks: read first, never written


class Writer:
  """Writes scalars from process 0 only; other processes drop them.

  `where`: the run's folder (the workdir, or `eval/` for an evaluation job);
  records go to `where/metrics/`, TensorBoard events to `tb_dir`. Every
  record carries `time` (Unix seconds); `start(step)` marks where a process
  began (or resumed) training, so wall time to a step can be summed over the
  segments of a resumed run (`wall_times`), and `end(step, reason)` where it
  stopped. What is written goes out as a chunk every `flush_s` seconds, at
  `flush()` (the trainer's, before each checkpoint: what a resume skips was
  logged) and at `end`/`close`. `tb_section`: TensorBoard tags
  `<section>/...` in place of `eval/...` (an evaluation job's own tags).
  `lost()`: whether the job lost its lease (lease.py): then nothing more is
  written.
  """

  def __init__(
    self,
    where,
    tb_dir,
    tb_section: str | None = None,
    flush_s: float = 30.0,
    lost=lambda: False,
  ):
    self.enabled = sharding.writes()
    self.tb_section, self.flush_s, self._lost = tb_section, flush_s, lost
    if self.enabled:
      self._folder = epath.Path(where) / "metrics"
      self._folder.mkdir(parents=True, exist_ok=True)
      self._lines: list[str] = []
      self._flushed, self._last_name = time.time(), 0
      # Its own event files (names hold the host and the section): the
      # trainer's and an evaluation job's may start in the same millisecond.
      suffix = "" if tb_section is None else f".{tb_section}"
      self._tb = _Events(epath.Path(tb_dir), suffix, self._name)

  def _name(self) -> str:
    """A chunk's name: milliseconds, strictly increasing within the writer,
    then the host and process (another writer, in the same millisecond)."""
    self._last_name = max(self._last_name + 1, int(time.time() * 1000))
    return f"{self._last_name:013d}.{socket.gethostname()}.{os.getpid()}"

  def start(self, step: int) -> None:
    """Written at once: a reader sees the run began (and compiles)."""
    if self.enabled:
      self._line({"step": step, "time": time.time(), "event": "start"})
      self.flush()

  def end(self, step: int, reason: str) -> None:
    """`reason`: finished, preempted or stopped (an error)."""
    if self.enabled:
      self._line({"step": step, "time": time.time(), "event": "end", "reason": reason})
      self.flush()

  def write(self, step: int, scalars: dict) -> None:
    """TensorBoard first, then the JSONL record: a record in the JSONL chunks
    means the step was written everywhere."""
    if not self.enabled:
      return
    scalars = {k: float(np.asarray(v)) for k, v in scalars.items()}
    section = self.tb_section
    self._tb.write(
      step,
      {
        f"{section}/{k.removeprefix('eval/')}" if section else k: v
        for k, v in scalars.items()
      },
    )
    self._line({"step": step, "time": time.time(), **scalars})

  def _line(self, record: dict) -> None:
    self._lines.append(json.dumps(record) + "\n")
    if time.time() - self._flushed >= self.flush_s:
      self.flush()

  def flush(self) -> None:
    """Writes what is buffered as one chunk each (events, then records)."""
    if not self.enabled:
      return
    if self._lost():
      return self.drop()
    self._flushed = time.time()
    self._tb.flush()
    if self._lines:
      name = f"{self._name()}.jsonl"
      storage.write_whole(self._folder / name, "".join(self._lines))
      self._lines = []

  def drop(self) -> None:
    """Forgets what is buffered (a writer that lost its lease writes nothing)."""
    if self.enabled:
      self._lines, self._tb.events = [], []

  def close(self) -> None:
    """Flushes; raises its error (a full disk)."""
    self.flush()


class _Events:
  """TensorBoard events (TFRecord-framed `Event` protos), each flush one new
  event file written whole, in the caller's thread (tensorboardX's writer
  thread died on a full disk, and the next point waited for it for ever)."""

  def __init__(self, tb_dir: epath.Path, suffix: str, name):
    from tensorboardX.proto import event_pb2, summary_pb2  # heavy: process 0

    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    self._dir, self._suffix, self._next_name = tb_dir, suffix, name
    self._dir.mkdir(parents=True, exist_ok=True)
    self.events: list[bytes] = []

  def write(self, step: int, scalars: dict[str, float]) -> None:
    values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
    event = self._event(
      wall_time=time.time(), step=step, summary=self._summary(value=values)
    )
    self.events.append(_record(event.SerializeToString()))

  def flush(self) -> None:
    if not self.events:
      return
    head = self._event(wall_time=time.time(), file_version="brain.Event:2")
    name = f"events.out.tfevents.{self._next_name()}"
    data = b"".join([_record(head.SerializeToString()), *self.events])
    storage.write_whole(self._dir / f"{name}{self._suffix}", data)
    self.events = []


def _record(data: bytes) -> bytes:
  from tensorboardX.record_writer import masked_crc32c

  header = struct.pack("<Q", len(data))
  return (
    header
    + struct.pack("<I", masked_crc32c(header))
    + data
    + struct.pack("<I", masked_crc32c(data))
  )


class Log:
  """The records of a run's folder (the workdir or `eval/`): `metrics.jsonl`
  of runs from before chunks, then the chunks in order. Chunks never change
  once written, so a reader polling a live run (the evaluation job) reads
  each once."""

  def __init__(self, where):
    self.where = epath.Path(where)
    self._chunks: dict[str, list[dict]] = {}
    self._legacy: list[dict] | None = None  # never written since chunks

  def exists(self) -> bool:
    return (self.where / LEGACY).exists() or (self.where / "metrics").is_dir()

  def read(self) -> list[dict]:
    if self._legacy is None:
      legacy = self.where / LEGACY
      self._legacy = _read_lines(legacy.read_text()) if legacy.exists() else []
    folder = self.where / "metrics"
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    for name in names:
      if name.endswith(".jsonl") and name not in self._chunks:
        self._chunks[name] = _read_lines((folder / name).read_text())
    return self._legacy + [r for n in sorted(self._chunks) for r in self._chunks[n]]


_LOGS: dict[str, Log] | None = None  # within `cached()`: one Log per folder


def read(where) -> list[dict]:
  """The records of the run folder `where` (see `Log`); within `cached()`,
  each chunk is downloaded once however often it is read."""
  if _LOGS is None:
    return Log(where).read()
  return _LOGS.setdefault(str(where), Log(where)).read()


@contextlib.contextmanager
def cached():
  """For a reader that reads the same runs many times (a report)."""
  global _LOGS
  _LOGS = {}
  try:
    yield
  finally:
    _LOGS = None


def _read_lines(text: str) -> list[dict]:
  """JSONL records; a last line cut short (a writer of the legacy file killed
  mid-line) is left out."""
  lines = [line for line in text.splitlines(keepends=True) if line.strip()]
  if lines and not lines[-1].endswith("\n"):
    lines.pop()
  return [json.loads(line) for line in lines]


def wall_times(records: list[dict]) -> dict[int, float]:
  """{step: training wall seconds to reach it}, summed over resumed segments.

  A segment runs from a `start` record (process start, before compilation) to
  the next; steps logged twice after a resume keep their latest time.
  """
  out, done, seg_start, last = {}, 0.0, None, 0.0
  for r in records:
    if "time" not in r or r.get("event") == "end":
      continue
    if r.get("event") == "start":
      if seg_start is not None:
        done += last - seg_start
      seg_start = last = r["time"]
      continue
    if seg_start is not None:
      last = r["time"]
      out[r["step"]] = done + last - seg_start
  return out


class Progress:
  """A training run's progress on stderr, from process 0: a tqdm bar on a
  terminal; elsewhere (SLURM, TPU VMs, nohup) a plain line every `every_s`
  seconds, so a log file grows by lines, not by carriage-return updates."""

  def __init__(self, total: int, initial: int, every_s: float = 30.0, stream=None):
    self.total, self.every_s = total, every_s
    self.stream = sys.stderr if stream is None else stream
    self.enabled = sharding.writes()
    self.bar = None
    if self.enabled and self.stream.isatty():
      self.bar = tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=self.stream,
      )
    now = time.perf_counter()
    self._rate_at, self._line_at = (now, initial), (now, initial)

  def rate(self, step: int) -> dict:
    """Steps per second since the previous call: the logged `train/steps_per_s`."""
    now, (t, s) = time.perf_counter(), self._rate_at
    self._rate_at = (now, step)
    return {"train/steps_per_s": (step - s) / (now - t)}

  def update(self, step: int, last: dict) -> None:
    """After each step; `last`: the newest metrics."""
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix(_postfix(last), refresh=False)
      return
    now, (t, s) = time.perf_counter(), self._line_at
    if self.enabled and (now - t >= self.every_s or step == self.total):
      self._line_at = (now, step)
      shown = " ".join(f"{k}={v}" for k, v in _postfix(last).items())
      print(
        f"train: step {step}/{self.total} ({100 * step / self.total:.0f}%), "
        f"{(step - s) / (now - t):.1f} steps/s, {shown}",
        file=self.stream,
        flush=True,
      )

  def write(self, message: str) -> None:
    """A line on stdout (events: a phase reached), above the bar if there is one."""
    if self.bar is not None:
      self.bar.write(message)
    elif self.enabled:
      print(message, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def _postfix(last: dict) -> dict:
  short = {"loss": last.get("train/loss")}
  for k, v in last.items():
    if k == "eval/validation/loss":  # a language model: its validation loss
      short["val_loss"] = v
    elif k.startswith("eval/") and k.endswith("/acc") and "validation" not in k:
      short[k[5:-4]] = v
  return {k: f"{v:.3f}" for k, v in short.items() if v is not None}
