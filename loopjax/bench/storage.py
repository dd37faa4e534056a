"""What checkpoints cost the train step on a disk and on a bucket, and what a
run's logs upload.

Three runs of one config, each in a fresh workdir, `train.num_steps` steps:
no checkpoint but the last step's, one every `checkpoint.every` steps to the
local disk, and the same to `gs://` (a GCS emulator on loopback, or the
endpoint STORAGE_EMULATOR_HOST names). Each row: the median and the slowest
of the run's logged `train/steps_per_s` (one per `log_every` window, the
first left out: it holds the compile), and the loop's wall seconds. Saves are
asynchronous, so the rows should differ by noise only.

Upload bytes, from the bucket run's own records and events: what loopjax
wrote (each object once: chunks), against what a writer that appends would
have uploaded to a bucket, where each flush rewrites the whole object (the
writer before chunks flushed `metrics.jsonl` after every line and its event
file every 30 s). The second is computed from the same records under that
rule, not measured through a FUSE mount.
"""

import contextlib
import copy
import os
import statistics
import struct
import tempfile
from pathlib import Path

from loopjax import metrics, storage, train

TB_FLUSH_S = 30.0  # the appending writer's event-file flush interval


def bench(config) -> dict:
  rows = []
  with tempfile.TemporaryDirectory(prefix="storage_") as tmp, _bucket() as bucket:
    for name, where, every in (
      ("no checkpoints", Path(tmp) / "none", config.train.num_steps),
      ("disk", Path(tmp) / "disk", config.checkpoint.every),
      ("bucket (emulator)", f"{bucket}/run", config.checkpoint.every),
    ):
      c = copy.deepcopy(config)
      c.checkpoint.every = every
      train.train_and_evaluate(c, where)
      rows.append(_row(name, every, c, metrics.read(storage.path(where))))
      print(
        f"{name:20} every {every:6} steps: {rows[-1]['median_steps_per_s']:8.1f} "
        f"steps/s median, {rows[-1]['slowest_steps_per_s']:8.1f} slowest window"
      )
    uploads = _uploads(storage.path(f"{bucket}/run"))
  print(
    f"logs uploaded over {config.train.num_steps} steps: {uploads['chunks_bytes']:,} "
    f"bytes as chunks, {uploads['appending_bytes']:,} by an appending writer "
    f"({uploads['appending_bytes'] / uploads['chunks_bytes']:.0f}x)"
  )
  return {"size": config.get("variant"), "rows": rows, "uploads": uploads}


@contextlib.contextmanager
def _bucket():
  """gs:// of a new bucket on an emulator started here (its environment set
  for this process: orbax's tensorstore reads it)."""
  from loopjax.bench import emulator

  server, before = emulator.Emulator(), dict(os.environ)
  emulator.activate(server.env)
  try:
    yield f"gs://{server.bucket()}"
  finally:
    server.stop()
    os.environ.clear()
    os.environ.update(before)


def _row(name: str, every: int, config, records: list[dict]) -> dict:
  rates = [r["train/steps_per_s"] for r in records if "train/steps_per_s" in r][1:]
  walls = metrics.wall_times(records)
  return {
    "storage": name,
    "checkpoint_every": every,
    "steps": config.train.num_steps,
    "median_steps_per_s": statistics.median(rates),
    "slowest_steps_per_s": min(rates),
    "wall_s": max(walls.values()),
  }


def _uploads(run) -> dict:
  """Bytes of the run's records and events as written, and as an appending
  writer's flushes would have rewritten them."""
  files = sorted((run / "metrics").iterdir()) + sorted((run / "tb").iterdir())
  written = sum(len(f.read_bytes()) for f in files)
  lines = [
    x for f in files if f.suffix == ".jsonl" for x in f.read_text().splitlines(True)
  ]
  size = appending = 0
  for line in lines:  # flushed after every line: the whole file each time
    size += len(line.encode())
    appending += size
  size, flushed = 0, None
  for f in files:
    if f.suffix != ".jsonl":
      for event, frame in _frames(f.read_bytes()):
        if not event.HasField("summary"):
          continue  # each chunk's header: an appending file has one
        size += len(frame)
        flushed = event.wall_time if flushed is None else flushed
        if event.wall_time - flushed >= TB_FLUSH_S:
          appending, flushed = appending + size, event.wall_time
  appending += size  # the close
  return {"chunks_bytes": written, "appending_bytes": appending}


def _frames(data: bytes):
  """(Event, its TFRecord frame) of each record of an event file."""
  from tensorboardX.proto.event_pb2 import Event

  while data:
    (n,) = struct.unpack("<Q", data[:8])
    yield Event.FromString(data[12 : 12 + n]), data[: 16 + n]
    data = data[16 + n :]
