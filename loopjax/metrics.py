"""Metric sinks: `metrics.jsonl` (one JSON object per line) and TensorBoard."""

import json
import time
from pathlib import Path

import jax
import numpy as np


class Writer:
  """Writes scalars from process 0 only; other processes drop them.

  Every record carries `time` (Unix seconds); `start(step)` marks where a
  process began (or resumed) training, so wall time to a step can be summed
  over the segments of a resumed run (`wall_times`).
  """

  def __init__(self, workdir: Path):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from tensorboardX import SummaryWriter  # heavy import, process 0 only

      self._jsonl = open(workdir / "metrics.jsonl", "a")
      self._tb = SummaryWriter(str(workdir / "tb"))

  def start(self, step: int) -> None:
    if self.enabled:
      self._line({"step": step, "time": time.time(), "event": "start"})

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(np.asarray(v)) for k, v in scalars.items()}
    self._line({"step": step, "time": time.time(), **scalars})
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, step)

  def _line(self, record: dict) -> None:
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def read_jsonl(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def wall_times(records: list[dict]) -> dict[int, float]:
  """{step: training wall seconds to reach it}, summed over resumed segments.

  A segment runs from a `start` record (process start, before compilation) to
  the next; steps logged twice after a resume keep their latest time.
  """
  out, done, seg_start, last = {}, 0.0, None, 0.0
  for r in records:
    if "time" not in r:
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
