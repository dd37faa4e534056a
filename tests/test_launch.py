"""Launchers' dry runs (SLURM, TPU pods, sweeps to either) and the AOT check."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import CPU_ENV, in_process, run

from launch import slurm, sweep, tpu
from loopjax import compiled

MAIN_ARGS = ["--config=experiments/sysgen.py:paper", "--workdir=/shared/run"]


@pytest.mark.parametrize(
  "per,tasks,gpus_per_task,ids",
  [("gpu", 8, 1, "0"), ("node", 1, 8, "0,1,2,3,4,5,6,7")],
)
def test_slurm_script_per_gpu_or_per_node(capsys, per, tasks, gpus_per_task, ids):
  argv = ["--nodes=2", "--gpus_per_node=8", f"--per={per}", "--dry-run", "--"]
  assert slurm.main([*argv, *MAIN_ARGS]) == 0
  out = capsys.readouterr().out
  assert "#SBATCH --nodes=2" in out
  assert f"#SBATCH --ntasks-per-node={tasks}" in out
  assert f"#SBATCH --gpus-per-task={gpus_per_task}" in out
  assert f"export JAX_LOCAL_DEVICE_IDS={ids}\n" in out  # not GPU SLURM_LOCALID
  assert "python -m loopjax.main --distributed " + " ".join(MAIN_ARGS) in out
  assert out.rstrip().endswith("sbatch slurm_logs/loopjax.sbatch")
  assert not re.search(r"\{[a-z_]+\}", out)  # every field filled


def test_slurm_and_tpu_start_an_evaluation_job_with_follow(capsys):
  assert slurm.main(["--follow", "--dry-run", "--", *MAIN_ARGS]) == 0
  script = capsys.readouterr().out
  follow = script.index("srun --overlap --nodes=1 --ntasks=1 --gpus=0")
  train = script.index("python -m loopjax.main --distributed")
  assert follow < train and script.index("\nwait") > train
  assert "--mode=eval --follow " + " ".join(MAIN_ARGS) + " &" in script
  assert (
    tpu.main(["--name=lj", "--zone=z", "--follow", "--dry-run", "--", *MAIN_ARGS]) == 0
  )
  lines = capsys.readouterr().out.splitlines()
  assert "--worker=0" in lines[-2]
  assert "--mode=eval --follow " + " ".join(MAIN_ARGS) in lines[-2]
  assert "JAX_PLATFORMS=cpu" in lines[-2] and "--worker=all" in lines[-1]


def test_slurm_writes_and_submits(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr(
    slurm.subprocess,
    "run",
    lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0),
  )
  assert slurm.main([f"--log_dir={tmp_path}", "--", *MAIN_ARGS]) == 0
  script = tmp_path / "loopjax.sbatch"
  assert ran == [["sbatch", str(script)]] and "srun" in script.read_text()


def test_tpu_dry_run_prints_every_command(capsys):
  argv = ["--name=lj", "--zone=us-west4-a", "--dry-run", "--", *MAIN_ARGS]
  assert tpu.main(argv) == 0
  lines = capsys.readouterr().out.splitlines()
  verbs = [
    line.split()[4] if line.startswith("gcloud") else line.split()[0]
    for line in lines
    if not line.startswith("#")
  ]
  assert verbs == ["describe", "create", "git", "scp", "ssh", "ssh"]
  assert all("--zone=us-west4-a" in x for x in lines if x.startswith("gcloud"))
  assert lines[-1].endswith(
    "--worker=all '--command=cd loopjax && python3 -m loopjax.main --distributed "
    + " ".join(MAIN_ARGS)
    + "'"
  )


@pytest.mark.parametrize("exists", [True, False])
def test_tpu_creates_the_slice_only_when_missing(monkeypatch, exists):
  ran = []

  def fake_run(cmd, **kw):
    ran.append(cmd[4] if cmd[0] == "gcloud" else cmd[0])
    rc = 0 if cmd[4:5] != ["describe"] or exists else 1
    return subprocess.CompletedProcess(cmd, rc, stdout="READY\n")

  monkeypatch.setattr(tpu.subprocess, "run", fake_run)
  assert tpu.main(["--name=lj", "--zone=z", "--", *MAIN_ARGS]) == 0
  want = ["describe", "git", "scp", "ssh", "ssh"]
  assert ran == (want if exists else want[:1] + ["create"] + want[1:])


def test_remote_runs_need_an_absolute_workdir(capsys):
  for main in (slurm.main, lambda a: tpu.main(["--name=lj", "--zone=z", *a])):
    with pytest.raises(SystemExit, match="--workdir: must be gs://BUCKET/PATH or an"):
      main(["--dry-run", "--", "--config=x.py", "--workdir=runs/x"])
    assert main(["--dry-run", "--", "--config=x.py", "--workdir=gs://b/x"]) == 0


def test_sweep_submits_one_slurm_job_per_point(tmp_path, capsys):
  argv = [
    "--config=experiments/sysgen.py",
    f"--root={tmp_path}",
    "--target=slurm",
    "--launcher_args=--nodes=2",
    "--dry-run",
  ]
  assert sweep.main(argv) == 0
  out = capsys.readouterr().out
  for r in (1, 2, 4):
    assert f"#SBATCH --job-name=num_loops={r}" in out
    assert f"--workdir={tmp_path}/num_loops={r} --config.model.num_loops={r}" in out


def test_sweep_on_tpu_installs_once(tmp_path, capsys):
  argv = ["--config=experiments/sysgen.py", f"--root={tmp_path}", "--target=tpu"]
  argv += ["--launcher_args=--name=lj --zone=z", "--dry-run"]
  assert sweep.main(argv) == 0
  out = capsys.readouterr().out
  assert out.count("tar xf") == 1 and out.count("loopjax.main") == 3


def _aot(*flags, config="experiments/sysgen.py:tiny", run=run):
  """`python -m loopjax.aot` in a process of its own, or given `run=in_process`
  in this one (a refusal before anything compiles: no process start to pay)."""
  return run([sys.executable, "-m", "loopjax.aot", f"--config={config}", *flags])


def test_aot_compiles_for_a_target_mesh_and_reports_memory(tmp_path):
  report = tmp_path / "aot.json"
  out = _aot(
    "--devices=8", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", f"--json={report}"
  )
  assert out.returncode == 0, out.stderr[-2000:]
  # The embedding's lookup reads the whole table, so its backward scatter
  # reshards nothing by full rematerialization (issue 27).
  assert "rematerialization" not in out.stderr + out.stdout
  assert "mesh data 2 x fsdp 2 x tensor 2 on cpu:8 (XLA:CPU)" in out.stdout
  # each pass's line as its compile ends, then the report
  order = ("compiled train step (", "compiled evaluation, ", "compiled the train step")
  assert sorted(order, key=out.stdout.find) == list(order), out.stdout
  for k in ("arguments", "temporaries", "outputs", "peak"):
    assert re.search(rf"{k} +\d+\.\d+ GiB", out.stdout), out.stdout
  assert "['core'][0]['mlp']['w1']" in out.stdout and "('fsdp', 'tensor')" in out.stdout
  # FSDP gathers the parameters and reduces the gradients across devices.
  coll = json.loads(report.read_text())["collectives"]
  assert coll["all-reduce"]["count"] > 0 and coll["all-reduce"]["bytes"] > 0
  assert re.search(r"collectives per step: .*all-reduce \d+", out.stdout)


def test_aot_prints_each_pass_as_its_compile_ends(monkeypatch):
  """`on_pass` hears of each pass before the next one compiles; `only`
  compiles just the passes it names (no train step: none of its fields)."""
  import jax

  from experiments import lm
  from loopjax import passes

  events, compile_ = [], passes._compile

  def compile_logged(lowered, what, *args):
    events.append(("compile", what))
    return compile_(lowered, what, *args)

  monkeypatch.setattr(passes, "_compile", compile_logged)
  report = passes.check(
    lm.get_config("tiny"),
    jax.devices()[:1],
    only=["sampling", "eval"],
    on_pass=lambda name, mem: events.append(("line", name)),
  )
  names = ["evaluation, 16 rows"]
  names += ["sampling, prefill of 16 tokens", "sampling, one token (cache of 32)"]
  assert events == [
    x for name in names for x in (("compile", f"the {name} pass"), ("line", name))
  ]
  assert list(report["passes"]) == names
  assert not {"memory", "compile_s", "collectives"} & set(report)


def test_aot_refuses_an_unknown_pass_before_compiling(monkeypatch):
  import jax

  from experiments import sysgen
  from loopjax import passes
  from loopjax.errors import ConfigError

  monkeypatch.setattr(passes, "_compile", lambda *a: pytest.fail("compiled"))
  with pytest.raises(ConfigError) as e:
    passes.check(sysgen.get_config("tiny"), jax.devices()[:1], only=["eval", "nope"])
  assert str(e.value) == (
    "--passes: must be among this run's passes (train, eval); got 'nope'"
  )


@pytest.mark.slow  # ~9 s; in-process: the streamed lines and the refusal
def test_aot_compiles_only_the_passes_named(tmp_path):
  report = tmp_path / "aot.json"
  out = _aot("--devices=1", "--passes=eval", f"--json={report}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert list(json.loads(report.read_text())["passes"]) == ["evaluation, 256 rows"]
  assert "memory" not in json.loads(report.read_text())  # no train step
  lines = out.stdout.splitlines()
  assert re.fullmatch(
    r"compiled evaluation, 256 rows \(\d+\.\d s\): arguments \d\.\d{3} GiB, "
    r"temporaries .*, peak \d\.\d{3} GiB per device",
    lines[0],
  ), lines
  assert lines[1].startswith("compiled for mesh data 1 x fsdp 1 x tensor 1 on cpu:1")
  out = _aot("--devices=1", "--passes=eval,sampling")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
    "error: --passes: must be among this run's passes (train, eval); got 'sampling'"
  ]
  assert out.stdout == ""


@pytest.mark.parametrize(
  "target",
  ["gpu:h100", "gpu:v100:1x1x8", "gpu:h200:1x0x8", "tpu:v9:4x4", "tpu:v5e:4x4:0"],
)
def test_aot_refuses_an_unknown_target_in_one_line(target):
  out = _aot(f"--target={target}", run=in_process)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
    "error: --target: must be tpu:GEN:AxB[xC][:SLICES] (GEN: v4, v5e, v5p, v6e) "
    "or gpu:MODEL:SLICESxHOSTSxGPUS (MODEL: h100, h200, a100_80, b200); got "
    f"{target!r}"
  ]


@pytest.mark.slow
def test_aot_compiles_for_a_tpu_slice_with_its_kernels():
  """libtpu's compile-only v5e chips (the `tpu` extra; skipped without it):
  the LM step compiles with the accelerator attention, memory against 16 GiB."""
  pytest.importorskip("libtpu")
  flags = ("--target=tpu:v5e:2x2", "--config.mesh.devices=0", "--config.mesh.data=2")
  out = _aot(*flags, "--config.mesh.fsdp=2", config="experiments/lm.py:tiny")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh data 2 x fsdp 2 x tensor 1 on tpu:v5e:2x2 (compiled for it)" in (
    out.stdout
  )
  assert re.search(r"capacity +16\.000 GiB: fits, headroom", out.stdout)
  assert "MFU at most" in out.stdout
  # libtpu refuses a program too big for a chip: one line naming the fields
  # (with splash attention and per-iteration remat, 512 x 8192 tokens still fit)
  big = ("--config.data.seq_len=8192", "--config.train.batch_size=1024")
  out = _aot(*flags, "--config.mesh.fsdp=2", *big, config="experiments/lm.py:tiny")
  assert out.returncode == 2
  assert re.fullmatch(
    r"error: train\.batch_size, data\.seq_len, mesh, model\.remat: the train step "
    r"does not fit tpu:v5e:2x2: Ran out of memory on HBM.*",
    out.stderr.strip(),
  ), out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("width", [4096, 8192, 65536])
def test_aot_refuses_a_model_a_tpu_slice_cannot_hold_before_lowering(width):
  """libtpu aborted the process (SIGABRT, nothing printed) compiling a step
  whose gradient it could not allocate on the host (d_model 65536), and
  named the batch for one it could not fit (8192): each is refused before
  anything is lowered, in one line naming the model's size. At 4096 the
  even-split bound passes; the state replicated over mesh.data does not."""
  pytest.importorskip("libtpu")
  out = _aot(
    "--target=tpu:v5e:2x2", f"--config.model.d_model={width}",
    "--config.model.num_heads=64", config="experiments/lm.py:gpu",
  )  # fmt: skip
  assert out.returncode == 2, out.stderr[-2000:]
  (line,) = out.stderr.strip().splitlines()
  assert line.startswith("error: model.d_model, model.num_prelude, model.num_layers")
  assert "mesh.fsdp, mesh.tensor: " in line and "tpu:v5e:2x2 device" in line, line
  assert "compiled" not in out.stdout  # nothing was lowered


def test_aot_refuses_a_gradient_this_host_cannot_hold_while_compiling():
  """A device with room for the state (a target's chip) but a gradient's
  shard past this host's memory: the target's compiler would build host
  literals that size (libtpu aborts when it cannot)."""
  import jax
  import numpy as np

  from experiments import lm
  from loopjax import passes, targets
  from loopjax import task as task_lib
  from loopjax.errors import ConfigError

  config = lm.get_config("tiny")
  task = task_lib.for_config(config).without_examples(config)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  n = host // 4 + 1  # float32s: one more than the host holds
  params = {"w": jax.ShapeDtypeStruct((n,), np.float32, sharding=whole)}
  abstract = {"params": params, "mu": params, "nu": params}
  big = targets.Target("tpu:big", [], 8 * n * 4, 1.0, 1.0)  # room for the state
  with pytest.raises(ConfigError, match=r"this host's .* GiB: shard it more"):
    passes._train_state_fits(config, task, abstract, True, big, mesh)
  small = big._replace(bytes_per_device=4 * n * 4 - 1)  # the state and gradient
  with pytest.raises(ConfigError, match=r"the model alone does not fit a tpu:big"):
    passes._train_state_fits(config, task, abstract, True, small, mesh)
  passes._train_state_fits(config, task, abstract, False, small, mesh)  # eval: fits


@pytest.mark.slow
def test_aot_compiles_for_a_gpu_node():
  """XLA's CUDA compiler with the H200's target config (the `cuda12` extra;
  skipped without it): 8 compile-only H200s, memory against their 141 GB."""
  pytest.importorskip("jax_cuda12_plugin")
  flags = ("--target=gpu:h200:1x1x8", "--config.mesh.devices=0", "--config.mesh.fsdp=2")
  out = _aot(*flags, config="experiments/lm.py:tiny")  # no rematerialization
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh data 4 x fsdp 2 x tensor 1 on gpu:h200:1x1x8" in out.stdout
  assert re.search(r"capacity +141\.000 GiB: fits", out.stdout)


def test_aot_refuses_a_rematerialization_on_a_target_only():
  lines = [f"W0 spmd_partitioner.cc:656] [SPMD] {compiled.REMAT}. ..."]
  why = compiled.refusal(lines, on_target=True, allowed=False)
  assert why.startswith("XLA rematerialized 1 tensor(s) whole to reshard them")
  assert compiled.refusal(lines, on_target=True, allowed=True) is None
  assert compiled.refusal(lines, on_target=False, allowed=False) is None  # CPU
  assert compiled.refusal([], on_target=True, allowed=False) is None


def test_xla_warnings_are_captured_and_passed_on(capfd):
  with compiled.logged() as lines:  # XLA's C++ writes to file descriptor 2
    os.write(
      2, b"W0 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. ...\n"
    )
  assert [x for x in lines if compiled.REMAT in x]
  assert compiled.REMAT in capfd.readouterr().err


# ~17 s (test_aot_compiles_for_a_target_mesh_and_reports_memory: the same path).
@pytest.mark.slow
def test_aot_compiles_a_language_model_step():
  out = _aot("--devices=8", "--config.mesh.fsdp=2", config="experiments/lm.py:tiny")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh data 4 x fsdp 2 x tensor 1 on cpu:8 (XLA:CPU)" in out.stdout
  assert re.search(r"temporaries +\d+\.\d+ GiB", out.stdout), out.stdout
  assert "['embed']" in out.stdout
  # every pass a run uses: evaluation to R, the streamed analysis, sampling
  for name in (
    "evaluation, 16 rows",
    "analysis, 4 iterations, 8 x 32 tokens",
    "sampling, prefill of 16 tokens",
    "sampling, one token (cache of 32)",
  ):
    assert re.search(
      rf"  {re.escape(name)}: (\d+\.\d+ GiB, ){{3}}\d+\.\d+ GiB", out.stdout
    )


def test_aot_refuses_rules_that_split_a_tensor_twice_over_one_mesh_axis():
  rules = "(('batch','data'),('vocab','fsdp'),('embed','tensor'),('mlp','tensor'))"
  flags = ("--devices=8", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
  out = _aot(
    *flags, f"--config.sharding.rules={rules}", config="experiments/lm.py:tiny",
    run=in_process,
  )  # fmt: skip
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
    "error: sharding.rules: embed, mlp would split one tensor over mesh axis "
    "tensor twice; map the names a tensor has together to different mesh axes"
  ]


@pytest.mark.slow  # ~20 s: the default suite stays under 6 minutes
def test_aot_compiles_a_retrofit_from_the_models_config_json_alone(tmp_path):
  """model.init_from's shapes come from its config.json (no tokenizer, no
  tensors: experiments/hf_shapes); the 3-layer Llama split 1,1,1."""
  hf = json.loads(
    (pathlib.Path(__file__).parent / "fixtures/hf/llama_gqa/config.json").read_text()
  )
  hf["vocab_size"] = 320  # a byte-level tokenizer's, at least
  (tmp_path / "config.json").write_text(json.dumps(hf))
  out = _aot(
    "--devices=2",
    "--config.mesh.data=1",
    "--config.mesh.fsdp=2",
    f"--config.model.init_from=hf:{tmp_path}",
    config="experiments/lm.py:retrofit_tiny",
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh data 1 x fsdp 2 x tensor 1 on cpu:2" in out.stdout
  assert "['adapter']" in out.stdout  # the concat injection's, beside the Llama's


def test_aot_refuses_a_model_larger_than_the_host_before_building_it():
  """At d_model 65,536 the state alone (10 TB) exceeds this host's memory:
  footprint's lower bound refuses it before a block is built or a pass
  lowered, naming the model's fields (libtpu used to abort on such sizes)."""
  out = _aot(
    "--devices=8", "--config.model.d_model=65536", "--config.model.num_layers=8",
    run=in_process,
  )  # fmt: skip
  assert out.returncode == 2, out.stderr[-2000:]
  assert re.fullmatch(
    r"error: model\.d_model, model\.num_layers, model\.mlp_ratio, mesh\.fsdp, "
    r"mesh\.tensor: a step needs at least [\d,.]+ GiB per device \(params, Adam "
    r"moments, gradient: [\d,.]+ GiB\) and this host's memory / 8 devices has "
    r"[\d.]+ GiB",
    out.stderr.strip().splitlines()[-1],
  ), out.stderr[-2000:]


@pytest.mark.slow  # ~12 s of compile
def test_aot_on_cpu_devices_refuses_a_compiled_step_larger_than_the_host():
  """XLA:CPU compiles any size: a batch whose lower bound fits this host's
  memory / 8 (a third of it) but whose compiled peak (~20x the bound) does
  not exits 2 after the compile, naming the batch's fields."""
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  # sysgen tiny at batch 2^26 bounds at 7.7 GiB per device on 8 devices
  batch = 2 ** round(26 + math.log2(host / 8 / 3 / (7.7 * 2**30)))
  out = _aot("--devices=8", f"--config.train.batch_size={batch}")
  assert out.returncode == 2, out.stderr[-2000:]
  assert re.fullmatch(
    r"error: train\.batch_size, data\.seq_len, mesh, model\.remat: the train step "
    r"does not fit this host's memory / 8 CPU devices: its peak is [\d.]+ GiB per "
    r"device, the device has [\d.]+ GiB",
    out.stderr.strip().splitlines()[-1],
  ), out.stderr[-2000:]


def test_aot_names_a_mesh_that_does_not_fit():
  out = _aot("--devices=8", "--config.mesh.data=3", run=in_process)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
    "error: mesh: data x fsdp x tensor must equal the 8 devices; got data=3, "
    "fsdp=1, tensor=1"
  ]


@pytest.mark.parametrize(
  "argv",
  [
    ["launch/local.py", "--num_processes=abc", "--", "echo"],
    ["launch/slurm.py", "--nodes=x", "--", "echo"],
    ["launch/tpu.py", "--", "echo"],
    ["launch/sweep.py", "--parallel=2"],
  ],
  ids=["local", "slurm", "tpu", "sweep"],
)
def test_a_launchers_bad_argument_is_one_line(argv):
  r = subprocess.run(
    [sys.executable, *argv], capture_output=True, text=True, env=CPU_ENV, timeout=60
  )
  assert r.returncode == 2 and r.stdout == "", r
  assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr


def test_local_processes_keep_the_users_xla_flags_beside_their_device_count():
  """Two CPU processes compile what one process does: the flags the user (or
  the tests) set stay, the device count is the launcher's. (It once replaced
  them all: the 2-process analysis differed from one process's numbers.)"""
  from launch import local

  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"}
  env = local.cpu_env(environ, 4)
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
  assert env["JAX_PLATFORMS"] == "cpu" and local.cpu_env({}, 2)["XLA_FLAGS"] == (
    "--xla_force_host_platform_device_count=2"
  )
