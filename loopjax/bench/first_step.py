"""Time to first step: a fresh start against restarts with and without the
compilation cache (`compile_cache`), each a `python -m loopjax.main` process.

The data are prepared before the clock starts (a fresh start's dataset
generation or tokenizer training is not what a restart saves); then, in one
throwaway workdir and an empty cache directory:
  fresh:          no checkpoint, an empty cache: the step compiles;
  restart:        resumes from step 1, the cache as the fresh start left it;
  restart, no cache: resumes from step 2 with `compile_cache=off`.
Each row: seconds from launching the process to its first step's metrics
(imports, data, restore, compile, one step) and the train step's compile time
the run logged (`compile/train_step_s`; a cache hit is a load).
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopjax import metrics
from loopjax import task as task_lib

ROWS = (("fresh", ""), ("restart", ""), ("restart, no cache", "off"))


def bench(config, config_args: list[str]) -> dict:
  """The three starts of `config`, given on the command line as
  `config_args` (--config=FILE[:variant] and its --config.FIELD=VALUE)."""
  task_lib.for_config(config).load(config)  # prepared where the runs read it
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  out = []
  with tempfile.TemporaryDirectory(prefix="first_step_") as tmp:
    workdir, cache = Path(tmp) / "run", Path(tmp) / "xla"
    for steps, (name, cache_arg) in enumerate(ROWS, start=1):
      cmd = [
        sys.executable, "-m", "loopjax.main", *config_args, f"--workdir={workdir}",
        f"--config.train.num_steps={steps}", "--config.log_every=1",
        "--config.eval_every=0", f"--config.compile_cache={cache_arg or cache}",
      ]  # fmt: skip
      launched = time.time()
      subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
      records = metrics.read(workdir)
      first = next(r for r in records if r["step"] == steps and "train/loss" in r)
      keys = ("compile/train_step_s", "cache/train_step_load_s")  # a load logs its own
      got = [r[k] for r in records if r["step"] == steps - 1 for k in keys if k in r]
      out.append(
        {
          "start": name,
          "to_first_step_s": first["time"] - launched,
          "compile_s": got[-1],
        }
      )
      print(
        f"{name:20}{out[-1]['to_first_step_s']:10.1f} s to step 1, "
        f"train step compiled or loaded in {out[-1]['compile_s']:.1f} s"
      )
  return {"size": config.get("variant"), "rows": out}
