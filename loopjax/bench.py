"""Benchmarks (not timed tests): python -m loopjax.bench data --config=...

`data`: wall time of generating a config's dataset in memory (no TFDS write),
on one core when pinned with `taskset -c 0`. Prints a table and writes JSON.
"""

import json
import os
import platform
import time

from absl import app, flags
from ml_collections import config_flags

from loopjax.data import kg, tfds_kg

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (best is reported).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def bench_data(data_cfg, repeats: int) -> dict:
  params = {k: data_cfg[k] for k in tfds_kg.PARAMS}
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    task = kg.composition(**params)
    kg.fingerprint(task)
    times.append(time.perf_counter() - t)
  return {
    "benchmark": "data",
    "params": params,
    "examples": {k: len(v["target"]) for k, v in task.splits.items()},
    "best_s": min(times),
    "times_s": times,
    "cpu": platform.processor() or platform.machine(),
    "cores_allowed": len(os.sched_getaffinity(0)),
  }


def main(argv):
  if argv[1:] != ["data"]:
    raise app.UsageError(f"expected a benchmark name (data); got {argv[1:]}")
  result = bench_data(_CONFIG.value.data, _REPEATS.value)
  print(f"{'benchmark':<10}{'examples':>12}{'best (s)':>10}{'cores':>7}")
  n = sum(result["examples"].values())
  print(f"{'data':<10}{n:>12,}{result['best_s']:>10.3f}{result['cores_allowed']:>7}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
