"""Ahead-of-time check of a config on a target mesh, from this machine's CPU.

  python -m loopjax.aot --config=experiments/lm.py:gpu --target=tpu:v5e:4x4 \
      --config.mesh.data=4 --config.mesh.fsdp=4
  python -m loopjax.aot --config=experiments/sysgen.py:paper --devices=64 \
      --config.mesh.data=8 --config.mesh.fsdp=4 --config.mesh.tensor=2

`--target=tpu:GEN:AxB[:SLICES]` compiles for a TPU slice's chips with libtpu
(the `tpu` extra; loopjax/targets.py), with the kernels the slice would run;
without it, for `--devices` forced CPU devices (XLA:CPU's kernels and memory
accounting, a guide for an accelerator's). The mesh is built from the config,
and every program the run compiles (loopjax/passes.py: the train step,
evaluation, a language model's analysis pass and sampling) is lowered and
compiled from abstract shapes (nothing is initialized, no data are
generated: the vocabulary and sequence length come from the config;
`model.init_from`'s from its config.json). Mesh, rule and shape errors show
here instead of on pod time. Each pass's line (memory per device, compile
time) prints as its compile ends, then the report, per device: memory
(arguments = its shard of the state and batch, temporaries, outputs, peak)
against the chip's, compile time, the
collectives in the compiled HLO, XLA's warnings (on a target an involuntary
rematerialization fails the check unless --allow_remat), and on a target the
step time the chips' peak FLOP/s and HBM bandwidth bound it to.

A pretrained model (`model.hf_dir`, of which only config.json is read:
experiments/hf_shapes holds the published models' shapes) instead compiles
its analysis pass and forward (`passes.check_pretrained`):

  python -m loopjax.aot --config=experiments/pretrained.py:huginn --devices=1 \
      --config.model.hf_dir=experiments/hf_shapes/huginn-0125 --config.mesh.data=1

`--passes=analysis,sampling` compiles only the passes named (train, eval,
analysis, sampling; a pretrained model's analysis, forward), e.g. to
recheck one pass of a config whose every pass takes minutes on a target.
"""

import os
import sys

from absl import flags

from loopjax import cli
from loopjax.errors import ConfigError, Stopped

flags.DEFINE_integer("devices", 8, "CPU devices to force (without --target).")
flags.DEFINE_string(
  "target",
  "",
  "tpu:GEN:AxB[:SLICES] (a TPU slice, e.g. tpu:v5e:4x4) or "
  "gpu:MODEL:SxHxG (slices x hosts x GPUs, e.g. gpu:h200:1x2x8).",
)
flags.DEFINE_bool(
  "allow_remat",
  False,
  "--target: pass a compile in which XLA rematerializes a tensor whole (on "
  "forced CPU devices it is reported only).",
)
flags.DEFINE_list(
  "passes",
  [],
  "Compile only these passes (default: all): train, eval, analysis, sampling "
  "(those of them the run has); a pretrained model's analysis, forward.",
)
flags.DEFINE_string("json", "", "Also write the report to this file.")
FLAGS = flags.FLAGS  # --config: cli's, loaded as every entry point loads it


def _gib(n: int) -> str:
  return f"{n / 2**30:.3f} GiB"


def _fit(peak: int, cap: int) -> str:
  """Whether a peak fits a target's capacity per device, and by how much."""
  return f"{'fits' if peak <= cap else 'DOES NOT FIT'}, headroom {_gib(cap - peak)}"


def _pass_lines(passes: dict, cap) -> list[str]:
  """Each pass's memory per device (arguments, temporaries, outputs, peak),
  compile time and, on a target, whether it fits."""
  return [
    f"  {name}: "
    + ", ".join(_gib(mem[k]) for k in list(mem)[:4])
    + f"; {mem['compile_s']:.1f} s"
    + ("" if cap is None else f"; {_fit(mem['peak'], cap)}")
    for name, mem in passes.items()
  ]


def _printer(cap):
  """`on_pass` for `passes.check`: a pass's line as soon as it is compiled
  (flushed: on a TPU target from a small host the passes take minutes)."""

  def on_pass(name: str, mem: dict):
    sizes = ", ".join(f"{k} {_gib(mem[k])}" for k in list(mem)[:4])
    line = f"compiled {name} ({mem['compile_s']:.1f} s): {sizes} per device"
    if cap is not None:
      line += f"; {_fit(mem['peak'], cap)}"
    print(line, flush=True)

  return on_pass


def _overflow(report: dict, devices: int) -> str | None:
  """The line for the pass whose peak memory per device exceeds what a
  device has (a target's; XLA:CPU devices share this host's memory), naming
  the fields that drive it; None if every pass fits."""
  cap, where = report.get("capacity"), report["target"]
  if cap is None:
    cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
    where = f"this host's memory / {devices} CPU devices"
  peaks = {name: mem["peak"] for name, mem in report["passes"].items()}
  if "memory" in report:
    peaks["train step"] = report["memory"]["peak"]
  name = max(peaks, key=peaks.get)
  if peaks[name] <= cap:
    return None
  from loopjax import footprint

  fields = (
    footprint.compiled_fields(report["memory"])
    if name == "train step"
    else "eval.batch_size, analyze.batch_size, analyze.max_depth, data.seq_len, mesh"
  )
  return (
    f"{fields}: the {name} does not fit {where}: its peak is {_gib(peaks[name])} "
    f"per device, the device has {_gib(cap)}"
  )


def _pretrained_table(report: dict, name: str, config) -> list[str]:
  """A pretrained model's (the directory `name`) passes as lines."""
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  B, T = report["batch"]
  out = [
    f"{name}: {report['params'] / 1e9:.2f}B params in "
    f"{config.model.dtype}, batch {B} x {T} tokens, mesh {mesh} on "
    f"{report['target']}",
    "memory per device (arguments, temporaries, outputs, peak); compile time:",
  ]
  out += _pass_lines(report["passes"], report["capacity"])
  if n := len(report["rematerialized"]):
    out.append(f"XLA rematerialized {n} tensor(s) whole to reshard them (stderr)")
  return out


def _train_lines(report: dict, mesh: str, where: str) -> list[str]:
  """The train step's memory, collectives and, on a target, step time bound."""
  mem, cap = report["memory"], report.get("capacity")
  out = [
    f"compiled the train step for mesh {mesh} on {where} in "
    f"{report['compile_s']:.1f} s",
    "memory per device:",
  ]
  out += [f"  {k:<12} {_gib(mem[k])}" for k in mem]
  if cap is not None:
    out.append(f"  {'capacity':<12} {_gib(cap)}: {_fit(mem['peak'], cap)}")
  coll = report["collectives"]
  out.append(
    "collectives per step: "
    + (
      ", ".join(
        f"{k} {v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in coll.items()
      )
      or "none"
    )
  )
  if cap is not None:
    b = report["step_s_bound"]
    line = (
      f"step time bound: compute {b['compute_s'] * 1e3:.2f} ms (model FLOPs at peak)"
    )
    if report["mfu_bound"] is None:
      line += "; bytes accessed: not reported by this compiler"
    else:
      line += (
        f", HBM {b['hbm_s'] * 1e3:.2f} ms (XLA's bytes; a rolled scan's body "
        f"counted once): MFU at most {report['mfu_bound']:.0%}"
      )
    out.append(line)
  return out


def _table(report: dict) -> list[str]:
  """The report as lines: the train step's (if compiled), the other passes',
  the largest parameters."""
  mesh = " x ".join(f"{k} {v}" for k, v in report["mesh"].items())
  cap = report.get("capacity")
  where = f"{report['target']} ({'XLA:CPU' if cap is None else 'compiled for it'})"
  if "memory" in report:
    out = _train_lines(report, mesh, where)
    out.append(
      "other passes, memory per device (arguments, temporaries, outputs, peak):"
    )
  else:  # --passes without the train step
    out = [
      f"compiled for mesh {mesh} on {where}, memory per device (arguments, "
      "temporaries, outputs, peak):"
    ]
  out += _pass_lines(report["passes"], cap)
  if n := len(report["rematerialized"]):
    out.append(f"XLA rematerialized {n} tensor(s) whole to reshard them (stderr)")
  out.append("largest parameters: shape -> spec")
  out += [f"  {name:<36} {shape} -> {spec}" for name, shape, spec in report["largest"]]
  return out


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}")
  import json

  import jax

  from loopjax import compiled, passes, restore, targets
  from loopjax import config as config_lib
  from loopjax.pretrained import init_from

  config = FLAGS.config
  if config is None:
    raise ConfigError("--config is required")
  if config.model.init_from:  # its shapes; the compile reads no tensor
    config = init_from.resolve(config, tokenizer=False)
    config.model.update(init_from="", hf_split="")
  config_lib.validate(config)
  target = targets.make(FLAGS.target) if FLAGS.target else None
  devices = target.devices if target else jax.devices()
  check = passes.check_pretrained if restore.pretrained(config) else passes.check
  on_pass = _printer(target.bytes_per_device if target else None)
  # A cached executable skips the compile and with it XLA's warnings and time;
  # the cache is back on after (main may run in a process that goes on).
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    report = check(config, devices, target, FLAGS.passes, on_pass)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(report, f, indent=2, default=str)
  if restore.pretrained(config):
    print("\n".join(_pretrained_table(report, restore.name(config), config)))
  else:
    print("\n".join(_table(report)))
  if (why := _overflow(report, len(devices))) is not None:
    raise ConfigError(why)
  on_target, remat = target is not None, report["rematerialized"]
  if (why := compiled.refusal(remat, on_target, FLAGS.allow_remat)) is not None:
    raise Stopped(why)


def _compiles_here(argv) -> None:
  """This host's CPU as JAX's platform, whatever it has, with `--devices`
  forced CPU devices: set before JAX starts its backend, which reads them."""
  import jax

  n = next((a.split("=", 1)[1] for a in argv if a.startswith("--devices=")), "8")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
  )
  if any(a.startswith("--target=gpu:") for a in argv):
    # Compiled without a GPU, XLA cannot autotune, and the Triton tiling it
    # then assumes fails on some GEMMs ("Couldn't find output tile sizes",
    # the paper extrapolation config's evaluation): cuBLAS ones compile.
    os.environ["XLA_FLAGS"] += " --xla_gpu_enable_triton_gemm=false"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])  # read on import


if __name__ == "__main__":
  _compiles_here(sys.argv)
  cli.run(main)
