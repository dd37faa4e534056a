"""Repository hygiene: lint, and CI running exactly the README's test command."""

import re
import subprocess
import sys
from pathlib import Path

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
  code = (
    "import os; a = dict(os.environ); import loopjax.train, loopjax.config, "
    "loopjax.main, experiments.sysgen; assert a == dict(os.environ)"
  )
  r = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
  )
  assert r.returncode == 0, r.stderr


def test_ruff_clean():
  r = subprocess.run(
    [sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True
  )
  assert r.returncode == 0, r.stdout
