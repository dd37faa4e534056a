"""Repository hygiene: lint, and CI running exactly the README's test command."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loopjax import xla

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
  return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_has_two_commands_and_ci_runs_the_test_one():
  train_cmd, test_cmd = quickstart_commands()
  assert "loopjax.main --config=experiments/sysgen.py " in train_cmd
  assert test_cmd.endswith("python -m pytest")
  assert test_cmd in (ROOT / ".ci/run").read_text().splitlines()


def test_importing_loopjax_leaves_the_environment_alone():
  """loopjax adds nothing to os.environ on import (the XLA defaults are the entry
  points' to apply). `import jax` itself sets TF_CPP_MIN_LOG_LEVEL and
  TPU_SKIP_MDS_QUERY (jax 0.10), so the snapshot is taken after it."""
  code = (
    "import os, jax, flax, orbax.checkpoint, tensorflow_datasets, tensorboardX; "
    "a = dict(os.environ); "
    "import loopjax.train, loopjax.config, loopjax.main, loopjax.follow, "
    "loopjax.analyze, experiments.sysgen; "
    "b = dict(os.environ); assert a == b, set(a.items()) ^ set(b.items())"
  )
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("XLA_FLAGS", "LOOPJAX_XLA_DEFAULTS")
  }
  r = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
  )
  assert r.returncode == 0, r.stderr[-2000:]


def test_an_entry_point_on_a_host_without_accelerators_starts_quietly():
  """No JAX_PLATFORMS given, no accelerator device: the entry points' defaults
  start JAX on the CPU alone, so the CUDA plugin and libtpu that the `targets`
  extra installs (the slow tier has them) print nothing."""
  if xla.has_accelerator():
    pytest.skip("this host has an accelerator")
  code = (
    "import jax; from loopjax import xla; xla.apply_defaults(); "
    "print(jax.devices()[0].platform)"
  )
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  r = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
  )
  assert (r.returncode, r.stdout, r.stderr) == (0, "cpu\n", ""), r.stderr[-2000:]


def _minor_faults(keep: bool, mib: int, thread: bool) -> int:
  """Page faults of allocating, touching and freeing a `mib` MiB buffer 8
  times (XLA:CPU's step buffers as glibc sees them), in a fresh process, on
  its main thread or another (XLA runs a step on its worker threads)."""
  code = (
    "import resource, threading, numpy as np; from loopjax import xla\n"
    f"{'xla.keep_freed_memory()' if keep else ''}\n"
    "def work(out):\n"
    f"  a = np.ones({mib} << 17); del a\n"  # the first one faults in either case
    "  f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    f"  for _ in range(8): a = np.ones({mib} << 17); del a\n"
    "  out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)\n"
    "out = []\n"
    + (
      "t = threading.Thread(target=work, args=(out,)); t.start(); t.join()\n"
      if thread
      else "work(out)\n"
    )
    + "print(out[0])"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  return int(r.stdout)


@pytest.mark.parametrize("mib,thread", [(64, False), (256, True)])
def test_keep_freed_memory_stops_the_page_faults_of_every_step(mib, thread):
  """glibc alone returns a freed block above its mmap threshold (at most 32
  MiB) to the OS and faults it in again on the next allocation (at least one
  fault per 2 MiB huge page, 4 KiB pages without them); a thread's own arena
  cannot hold a block over 64 MiB at all. Kept in the one heap, it is reused."""
  if sys.platform != "linux":
    pytest.skip("glibc's mallopt")
  default, kept = _minor_faults(False, mib, thread), _minor_faults(True, mib, thread)
  assert default >= 8 * mib // 2, default
  assert kept <= default / 20, (kept, default)


def test_ruff_clean():
  r = subprocess.run(
    [sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True
  )
  assert r.returncode == 0, r.stdout
