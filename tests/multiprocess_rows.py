"""Run as several processes by tests/test_multiprocess.py (launch/local.py
appends the coordinator flags; then --out=FILE): a mesh whose devices alternate
between the processes, so each process holds several separate spans of every
batch, fed as training feeds them (`process_rows`, `shuffled_batches`,
`global_batch`). Process 0 saves, per step, each row's example and the process
that fed it, read back from the global arrays."""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from loopjax import sharding
from loopjax.data import pipeline

RULES = (("batch", ("data", "fsdp")),)
B, STEPS, EXAMPLES = 16, 6, 96


def main(argv) -> None:
  flags = dict(a.removeprefix("--").split("=", 1) for a in argv[1:])
  sharding.initialize(
    coordinator=flags["coordinator_address"],
    num_processes=int(flags["num_processes"]),
    process_id=int(flags["process_id"]),
  )
  own: dict[int, list] = {}
  for d in jax.devices():
    own.setdefault(d.process_index, []).append(d)
  alternating = [d for column in zip(*own.values(), strict=True) for d in column]
  mesh = sharding.make_mesh({"data": -1, "fsdp": 2, "tensor": 1}, alternating)
  rows = sharding.process_rows(mesh, RULES, B)
  put = sharding.batch_sharding(mesh, RULES)
  me = jax.process_index()
  gather = lambda idx: {"example": idx, "process": np.full_like(idx, me)}  # noqa: E731
  it = pipeline.shuffled_batches(np.arange(EXAMPLES), B, 0, gather, rows)
  seen = []
  for _ in range(STEPS):
    batch = sharding.global_batch(next(it), put, B)
    whole = multihost_utils.process_allgather(batch, tiled=True)
    seen.append(np.stack([whole["example"], whole["process"]]))
  if me == 0:
    owner = {
      r: d.process_index
      for d, index in put.devices_indices_map((B,)).items()
      for r in range(*index[0].indices(B)[:2])
    }
    np.savez(flags["out"], seen=np.stack(seen), owner=[owner[r] for r in range(B)])


if __name__ == "__main__":
  main(sys.argv)
