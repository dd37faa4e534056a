"""Metric sinks (a JSONL file, one object per line, and TensorBoard) and the
training run's progress display."""

import json
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from loopjax import sharding


class Writer:
  """Writes scalars from process 0 only; other processes drop them.

  Every record carries `time` (Unix seconds); `start(step)` marks where a
  process began (or resumed) training, so wall time to a step can be summed
  over the segments of a resumed run (`wall_times`), and `end(step, reason)`
  where it stopped. A line cut short by a kill is removed before appending.
  `tb_section`: TensorBoard tags `<section>/...` in place of `eval/...` (an
  evaluation job's own tags), each point flushed at once.
  """

  def __init__(self, jsonl: Path, tb_dir: Path, tb_section: str | None = None):
    self.enabled = sharding.writes()
    self.tb_section = tb_section
    if self.enabled:
      jsonl.parent.mkdir(parents=True, exist_ok=True)
      _drop_partial_line(jsonl)
      self._jsonl = open(jsonl, "a")
      # Its own event file (names hold only the second and the host): the
      # trainer's and an evaluation job's may start in the same second.
      suffix = "" if tb_section is None else f".{tb_section}"
      self._tb = _EventFile(tb_dir, suffix, flush_s=0 if tb_section else 30)

  def start(self, step: int) -> None:
    if self.enabled:
      self._line({"step": step, "time": time.time(), "event": "start"})

  def end(self, step: int, reason: str) -> None:
    """`reason`: finished, preempted or stopped (an error)."""
    if self.enabled:
      self._line({"step": step, "time": time.time(), "event": "end", "reason": reason})

  def write(self, step: int, scalars: dict) -> None:
    """TensorBoard first, then the JSONL line: a record in the JSONL file means
    the step was written everywhere."""
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
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    """Closes both sinks whatever either does (a full disk fails both); raises
    the first error."""
    if not self.enabled:
      return
    errors = []
    for close in (self._jsonl.close, self._tb.close):
      try:
        close()  # a file whose flush fails is closed all the same
      except OSError as e:
        errors.append(e)
    if errors:
      raise errors[0]


class _EventFile:
  """A TensorBoard event file (TFRecord-framed `Event` protos), written in the
  caller's thread. tensorboardX's SummaryWriter writes from a thread of its
  own: on a full disk that thread dies and the next `add_scalar` waits on its
  queue for ever; here the error reaches the training loop like any other.
  `flush_s`: seconds between flushes (0: every write, for an evaluation job's
  points)."""

  def __init__(self, tb_dir: Path, suffix: str, flush_s: float):
    from tensorboardX.proto import event_pb2, summary_pb2  # heavy: process 0

    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    tb_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}{suffix}"
    self._file, self._flush_s, self._flushed = open(tb_dir / name, "ab"), flush_s, now
    self._append(self._event(wall_time=now, file_version="brain.Event:2"))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
    now = time.time()
    self._append(
      self._event(wall_time=now, step=step, summary=self._summary(value=values))
    )
    if now - self._flushed >= self._flush_s:
      self._file.flush()
      self._flushed = now

  def _append(self, event) -> None:
    from tensorboardX.record_writer import masked_crc32c

    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    self._file.write(
      header
      + struct.pack("<I", masked_crc32c(header))
      + data
      + struct.pack("<I", masked_crc32c(data))
    )

  def close(self) -> None:
    self._file.close()


def _drop_partial_line(path: Path) -> None:
  """Truncates a last line without its newline (a writer killed mid-line)."""
  if not path.exists() or path.stat().st_size == 0:
    return
  size = path.stat().st_size
  with open(path, "rb+") as f:
    f.seek(max(0, size - 2**16))  # records are far shorter than this
    tail = f.read()
    if not tail.endswith(b"\n"):
      f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)


def read_jsonl(path) -> list[dict]:
  """The records of a JSONL file; a last line cut short (a writer killed
  mid-line) is left out."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
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
