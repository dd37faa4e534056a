"""The accelerator check: what a CPU cannot measure, in one run of ~10 minutes.

  python -m loopjax.bench accelerator --out=DIR [--smoke]
  launch/accelerator_check.sh DIR      # installs what JAX needs first

Each part is its own process under a hard timeout, so a hung compile or an
out-of-memory costs that part alone, and DIR/accelerator.json is rewritten
after every part: a later failure never loses an earlier result. This process
never starts a JAX backend (a GPU backend would take the device's memory from
the parts). `--smoke` runs the same parts at tiny shapes with short timeouts;
the test suite runs it on the CPU.

Parts: `devices` (what JAX sees, each device's memory); `step_paper` and
`step_paper_large_batch` (the KG train step of experiments/bench.py:paper, LTG's
model in bf16: ms/step, tokens/s, FLOP/s, MFU against the device's measured
bf16 matmul peak, compile time, peak memory); `train_sysgen_paper` (LTG's
systematicity setting trained for a fixed wall time with its checkpoints and
evaluations: steps/s end to end, input pipeline included, and the projected
time to its step count); `lm_step` (the train step of experiments/lm.py:gpu,
a ~130M-parameter looped LM in bf16: tokens/s, MFU); `attention` (one
layer of it by each fused kernel against XLA's attention: ms, memory;
bench/attention.py); `huginn_forward`
(Huginn-0125's shape with random bf16 weights placed on the device: the
forward at R 32 and MECH's analysis pass to 64 recurrences over 4 prompts of
256 tokens: compile time, seconds per prompt, memory).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from loopjax import metrics

_TAIL = 3000  # characters of a part's output kept in the JSON


@dataclass(frozen=True)
class Part:
  name: str
  timeout_s: float
  argv: Callable[[pathlib.Path], list[str]]  # given the part's JSON path
  needs: str | None = None  # a repository path that must exist, else skipped
  train_s: float | None = None  # run for this long, then SIGTERM (a preemption)
  summarize: Callable[[], dict] | None = None


def _bench(name: str, config: str, *overrides: str) -> Callable:
  def argv(out: pathlib.Path) -> list[str]:
    return [
      sys.executable,
      "-m",
      "loopjax.bench",
      name,
      *([f"--config={config}"] if config else []),
      *overrides,
      f"--out={out}",
    ]

  return argv


def _train(config: str, workdir: pathlib.Path, *overrides: str) -> Callable:
  def argv(out: pathlib.Path) -> list[str]:
    del out  # the summary reads the workdir's records
    return [
      sys.executable,
      "-m",
      "loopjax.main",
      f"--config={config}",
      f"--workdir={workdir}",
      *overrides,
    ]

  return argv


def training_summary(workdir: pathlib.Path, num_steps: int) -> dict:
  """Steps/s from the trainer's own records, and the projection to num_steps."""
  log = metrics.Log(workdir)
  if not log.exists():
    return {"error": f"{workdir}: no metrics (training never started)"}
  records = log.read()
  start = next(r for r in records if r.get("event") == "start")
  timed = [r for r in records if "time" in r and "event" not in r]
  if not timed:
    return {"error": f"{workdir}: no step was logged"}
  end = next((r for r in records if r.get("event") == "end"), None)
  last = end or timed[-1]  # the end record: the step a preemption saved
  logged = [r for r in timed if "train/steps_per_s" in r]
  # Steady state: after the first logged step, which carries the compile.
  steady = (
    (logged[-1]["step"] - logged[0]["step"]) / (logged[-1]["time"] - logged[0]["time"])
    if len(logged) > 1
    else None
  )
  end_to_end = last["step"] / (last["time"] - start["time"])
  return {
    "steps": last["step"],
    "wall_s": last["time"] - start["time"],
    "steps_per_s_end_to_end": end_to_end,
    "steps_per_s_steady": steady,
    "evals": sum(any(k.startswith("eval/") for k in r) for r in records),
    "checkpoints": sorted(
      int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()
    ),
    "end": end and end["reason"],
    "num_steps": num_steps,
    "projected_hours_to_num_steps": num_steps / end_to_end / 3600,
  }


def parts(smoke: bool, scratch: pathlib.Path) -> list[Part]:
  bench, sysgen = "experiments/bench.py", "experiments/sysgen.py"
  size, train_config = (
    ("default", f"{sysgen}:tiny") if smoke else ("paper", f"{sysgen}:paper")
  )
  tiny = (
    "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.train.batch_size=16",
    "--config.bench.warmup=1",
    "--config.bench.steps=2",
    "--config.bench.repeats=1",
  )
  step_overrides = tiny if smoke else ()
  large_batch = "--config.train.batch_size=" + ("64" if smoke else "1024")
  workdir = scratch / "train_sysgen"
  # Paper's own cadence is an eval every 5000 steps; a checkpoint and an eval
  # every 2500 make both happen within the part's minutes.
  train_overrides = (
    f"--config.data.data_dir={scratch / 'data'}",
    *(
      ("--config.train.num_steps=1000000",)
      if smoke
      else ("--config.eval_every=2500", "--config.checkpoint.every=2500")
    ),
  )
  num_steps = 1_000_000
  t = (lambda s, gpu: s) if smoke else (lambda s, gpu: gpu)
  return [
    Part("devices", t(60, 120), _bench("devices", "")),
    Part("step_paper", t(120, 150), _bench("step", f"{bench}:{size}", *step_overrides)),
    Part(
      "step_paper_large_batch",
      t(120, 150),
      _bench("step", f"{bench}:{size}", *step_overrides, large_batch),
    ),
    # Skipping the iterations past a sampled depth (a conditional each) against
    # masking them: on a GPU a conditional may cost a sync, and the tiny model
    # (launch-bound) is where that shows. Its ~20 programs take a CPU ~2 min
    # to compile (the smoke ran out at 120 s on one core of an EPYC VM).
    Part("depth", t(300, 150), _bench("depth", f"{bench}:default", *step_overrides)),
    Part(
      "train_sysgen_paper",
      t(60, 420),
      _train(train_config, workdir, *train_overrides),
      train_s=t(25, 300),
      summarize=lambda: training_summary(workdir, num_steps),
    ),
    Part(
      "lm_step",
      t(60, 120),
      _bench("step", "experiments/lm.py:" + ("tiny" if smoke else "gpu")),
      needs="experiments/lm.py",
    ),
    Part(
      "attention",
      t(60, 180),
      _bench("attention", "experiments/lm.py:" + ("tiny" if smoke else "gpu")),
    ),
    Part(
      "huginn_forward",
      t(60, 180),
      _bench(
        "pretrained",
        "experiments/pretrained.py:huginn_random",
        *(
          (
            "--config.model.hf_dir=tests/fixtures/hf/huginn",
            "--config.analyze.max_depth=4",
            "--config.data.seq_len=16",
          )
          if smoke
          else ()
        ),
      ),
      needs="experiments/pretrained.py",
    ),
  ]


def _run(part: Part, out: pathlib.Path, root: pathlib.Path) -> dict:
  if part.needs and not (root / part.needs).exists():
    return {"status": "skipped", "why": f"{part.needs} is not in this version"}
  argv = part.argv(out)
  t = time.perf_counter()
  with tempfile.TemporaryFile("w+") as log:
    proc = subprocess.Popen(
      argv, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    status = "ok"
    try:
      proc.wait(timeout=part.train_s or part.timeout_s)
    except subprocess.TimeoutExpired:
      if part.train_s:  # the planned stop: SIGTERM is a preemption (a checkpoint)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
          proc.wait(timeout=part.timeout_s - part.train_s)
        except subprocess.TimeoutExpired:
          pass
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timeout"
    log.seek(0)
    tail = log.read()[-_TAIL:]
  result = {
    "status": "failed" if status == "ok" and proc.returncode else status,
    "returncode": proc.returncode,
    "seconds": time.perf_counter() - t,
    "argv": argv[1:],
    "output_tail": tail,
  }
  if out.exists():
    result["result"] = json.loads(out.read_text())
  if part.summarize:
    result["result"] = part.summarize()
  return result


def run(out_dir: str, smoke: bool = False, only: tuple[str, ...] = ()) -> dict:
  """Runs every part (or `only` those), rewriting OUT/accelerator.json after each."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  root = pathlib.Path(__file__).resolve().parents[2]
  report = {
    "smoke": smoke,
    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "parts": {},
  }
  with tempfile.TemporaryDirectory(prefix="loopjax_accel_") as scratch:
    for part in parts(smoke, pathlib.Path(scratch)):
      if only and part.name not in only:
        continue
      print(f"accelerator check: {part.name} ...", flush=True)
      r = _run(part, pathlib.Path(scratch) / f"{part.name}.json", root)
      report["parts"][part.name] = r
      (out / "accelerator.json").write_text(json.dumps(report, indent=2))
      print(
        f"accelerator check: {part.name}: {r['status']} ({r.get('seconds', 0):.0f} s)"
      )
  return report
