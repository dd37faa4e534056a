"""Metric sinks: `metrics.jsonl` (one JSON object per line) and TensorBoard."""

import json
from pathlib import Path

import jax
import numpy as np


class Writer:
  """Writes scalars from process 0 only; other processes drop them."""

  def __init__(self, workdir: Path):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      from tensorboardX import SummaryWriter  # heavy import, process 0 only

      self._jsonl = open(workdir / "metrics.jsonl", "a")
      self._tb = SummaryWriter(str(workdir / "tb"))

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(np.asarray(v)) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    self._jsonl.flush()
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def read_jsonl(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
