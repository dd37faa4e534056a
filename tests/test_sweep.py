"""The local sweep launcher: names, commands, and a real two-run sweep."""

import json
from pathlib import Path

import pytest

from launch import sweep

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_lists_one_command_per_sweep_point(tmp_path, capsys):
  assert (
    sweep.main(["--config=experiments/sysgen.py", f"--root={tmp_path}", "--dry-run"])
    == 0
  )
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3
  for r, line in zip((1, 2, 4), lines, strict=True):
    assert f"--workdir={tmp_path}/num_loops={r}" in line
    assert line.endswith(f"--config.model.num_loops={r}")


def test_analyze_follows_each_run(tmp_path, capsys):
  args = ["--config=experiments/ablations.py", f"--root={tmp_path}", "--dry-run"]
  assert sweep.main([*args, "--analyze"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 7  # ablations.py imports sysgen.py: found from launch/
  train, analyze = lines[1].split(" && ")
  assert train.endswith("--config.model.injection=add")
  assert analyze == f"{train} --mode=analyze"


def test_pinned_runs_chain_their_commands(tmp_path, monkeypatch):
  """--analyze's second command runs after the first, on the same core."""
  import sys

  def cmd(name):
    out = str(tmp_path / name)
    code = f"import os; open({out!r}, 'w').write(str(os.sched_getaffinity(0)))"
    return [sys.executable, "-c", code]

  jobs = [(f"run{i}", [cmd(f"train{i}"), cmd(f"analyze{i}")]) for i in range(2)]
  monkeypatch.setattr(sweep, "commands", lambda *_: jobs)
  assert sweep.main(["--config=x", f"--root={tmp_path}", "--parallel=2"]) == 0
  for i in range(2):
    train, analyze = ((tmp_path / f"{s}{i}").read_text() for s in ("train", "analyze"))
    assert train == analyze and len(eval(train)) == 1


def test_parallel_runs_share_an_accelerator_and_one_run_has_it_all(
  tmp_path, monkeypatch
):
  """N parallel runs each get 1/N of its memory (a fraction set outside wins);
  a run alone is left JAX's default."""
  import sys

  code = "import os; print(os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))"
  jobs = [(f"run{i}", [[sys.executable, "-c", code]]) for i in range(2)]
  monkeypatch.setattr(sweep, "commands", lambda *_: jobs)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  for parallel, want in ((2, "0.450"), (1, "None")):
    assert (
      sweep.main(["--config=x", f"--root={tmp_path}", f"--parallel={parallel}"]) == 0
    )
    for i in range(2):
      assert (tmp_path / f"run{i}.log").read_text().splitlines()[-1] == want
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
  assert sweep.main(["--config=x", f"--root={tmp_path}", "--parallel=2"]) == 0
  assert (tmp_path / "run0.log").read_text().splitlines()[-1] == "0.2"


def test_the_seeds_sweep_is_three_model_seeds_and_a_second_graph(tmp_path, capsys):
  config = "--config=experiments/extrapolation.py:long_ema"
  args = [config, f"--root={tmp_path}", "--dry-run", "--sweep=seeds"]
  assert sweep.main(args) == 0
  points = [line.split(f"--workdir={tmp_path}/")[1].split()[0]
            for line in capsys.readouterr().out.splitlines()]  # fmt: skip
  assert points == [
    "seed=0",
    "seed=1",
    "seed=2",
    "seed=0,data.seed=1",
  ]  # `seed` and `data.seed`: full names where last names would collide


def test_named_sweep_and_unknown_name(tmp_path, capsys):
  args = ["--config=experiments/sysgen.py", f"--root={tmp_path}", "--dry-run"]
  assert sweep.main([*args, "--sweep=seeds"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.rsplit(" ", 1)[1] for line in lines] == [
    f"--config.data.seed={s}" for s in (1, 2, 3)
  ]
  try:
    sweep.main([*args, "--sweep=nope"])
  except SystemExit as e:
    assert "--sweep: " in str(e.code) and "loops" in str(e.code)
  else:
    raise AssertionError("an unknown sweep name must exit")


# ~17 s: two runs as processes (the scheduling tests stay in the default suite).
@pytest.mark.slow
def test_parallel_sweep_trains_every_point(tiny_config, tmp_path, monkeypatch):
  monkeypatch.setattr(
    sweep,
    "load_sweep",
    lambda *_: [{"model.num_loops": 1}, {"model.num_loops": 2}],
  )
  rc = sweep.main(
    [
      "--config=experiments/sysgen.py:tiny",
      f"--root={tmp_path}",
      "--parallel=2",
      f"--config.data.data_dir={tmp_path / 'data'}",
      "--config.train.num_steps=20",
    ]
  )
  assert rc == 0
  for r in (1, 2):
    assert (tmp_path / f"num_loops={r}" / "checkpoints" / "20").exists()


def test_pinned_command_runs_on_one_core():
  import subprocess
  import sys

  cmd = sweep._pinned(
    [sys.executable, "-c", "import os; print(os.sched_getaffinity(0))"], 0
  )
  assert subprocess.run(cmd, capture_output=True, text=True).stdout.strip() == "{0}"


def test_a_point_without_overrides_gets_its_own_workdir(tmp_path):
  assert sweep.run_name({}) == "default"
  assert sweep.run_name({"train.depth.dist": "fixed", "model.num_loops": 4}) == (
    "dist=fixed,num_loops=4"
  )


def test_the_next_run_takes_the_first_core_to_free(tmp_path, monkeypatch):
  """A slow first run must not hold back the third: it starts when the second
  ends, on the second's core."""
  import os
  import sys

  def job(name, seconds):
    code = (
      "import json, os, sys, time; t = time.time(); time.sleep(float(sys.argv[1]));"
      "json.dump({'start': t, 'end': time.time(), 'cores': sorted("
      "os.sched_getaffinity(0))}, open(sys.argv[2], 'w'))"
    )
    return name, [[sys.executable, "-c", code, str(seconds), str(tmp_path / name)]]

  jobs = [job("slow", 4), job("fast", 0.1), job("third", 0.1)]
  monkeypatch.setattr(sweep, "commands", lambda *_: jobs)
  assert sweep.main(["--config=x", f"--root={tmp_path}", "--parallel=2"]) == 0
  out = {n: json.loads((tmp_path / n).read_text()) for n, _ in jobs}
  cores = sorted(os.sched_getaffinity(0))
  assert out["slow"]["cores"] == [cores[0]] and out["fast"]["cores"] == [
    cores[1 % len(cores)]
  ]
  assert out["third"]["cores"] == out["fast"]["cores"]
  assert out["third"]["start"] < out["slow"]["end"]


def test_until_stops_a_run_at_its_phase_and_skips_a_run_that_has_it(
  tmp_path, monkeypatch, capsys
):
  """--until=ood: a run whose phases.json records ood is sent SIGTERM (here
  a stand-in that would sleep 60 s writes it after 0.5 s and exits 0 on the
  signal, as a trainer does); a rerun skips it."""
  import sys
  import time

  code = (
    "import json, os, signal, sys, time; w = sys.argv[1]; os.makedirs(w, exist_ok=True)"
    "\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(0.5)"
    "\njson.dump({'ood': 12}, open(os.path.join(w, 'phases.json'), 'w'))"
    "\ntime.sleep(60)"
  )
  jobs = [("run", [[sys.executable, "-c", code, str(tmp_path / "run")]])]
  monkeypatch.setattr(sweep, "commands", lambda *_: jobs)
  start = time.time()
  assert sweep.main(["--config=x", f"--root={tmp_path}", "--until=ood"]) == 0
  assert time.time() - start < 30
  assert sweep.main(["--config=x", f"--root={tmp_path}", "--until=ood"]) == 0
  assert "skipped run (ood reached)" in capsys.readouterr().out
  assert not sweep.reached(tmp_path / "run", "id")
