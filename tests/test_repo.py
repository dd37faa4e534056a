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


def _minor_faults(keep: bool) -> int:
  """Page faults of allocating, touching and freeing a 64 MiB buffer 8 times
  (XLA:CPU's step buffers as glibc sees them), in a fresh process."""
  code = (
    "import resource, numpy as np; from loopjax import xla; "
    f"{'xla.keep_freed_memory(); ' if keep else ''}"
    "a = np.ones(8 << 20); del a; "  # the first one faults in either case
    "f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "for _ in range(8): a = np.ones(8 << 20); del a\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  return int(r.stdout)


def test_keep_freed_memory_stops_the_page_faults_of_every_step():
  """glibc alone returns a freed 64 MiB block to the OS and faults it in again
  on the next allocation (at least one fault per 2 MiB huge page, 4 KiB pages
  without them); kept in the heap, it is reused."""
  if sys.platform != "linux":
    pytest.skip("glibc's mallopt")
  default, kept = _minor_faults(False), _minor_faults(True)
  assert default >= 8 * 32, default
  assert kept <= default / 20, (kept, default)


def test_ruff_clean():
  r = subprocess.run(
    [sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True
  )
  assert r.returncode == 0, r.stdout
