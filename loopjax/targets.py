"""Compile targets reached from a CPU host, as compile-only devices
(`jax.experimental.topologies`): a TPU slice's chips from libtpu, or a GPU
node's from XLA's CUDA compiler given the GPU's target config.

  tpu:v5e:4x4      one v5e slice of 4 x 4 chips (4 hosts)
  tpu:v5p:2x2x4:2  two v5p slices
  gpu:h200:1x2x8   H200s: 1 slice x 2 hosts x 8 GPUs per host

A target's devices carry their host's process index, so a mesh over them is
the one `jax.make_mesh` builds on the pod (`sharding.row_groups` then says
which rows each host feeds). The chips' figures are the vendors' published
ones (a GPU's memory and bandwidth from its target config, gpu_targets/);
memory per device is the chip's divided among the devices libtpu shows for it
(v4 and v5p show each of a chip's two TensorCores).
"""

import importlib.util
import math
import os
import pathlib
import re
import sys
from typing import NamedTuple

from loopjax.errors import ConfigError

GIB = 2**30


class Chip(NamedTuple):
  """A TPU generation: HBM per chip, peak bf16 FLOP/s and HBM bytes/s per chip,
  chips per host, and its accelerator-type name (libtpu's TPU_ACCELERATOR_TYPE:
  the chip count, or for v4 and v5p the TensorCore count)."""

  hbm_bytes: int
  peak_flops: float
  hbm_bytes_per_s: float
  chips_per_host: int
  accelerator: str  # format: {n}: chips, {cores}: TensorCores


TPUS = {
  "v4": Chip(32 * GIB, 275e12, 1.2e12, 4, "v4-{cores}"),
  "v5e": Chip(16 * GIB, 197e12, 8.19e11, 4, "v5litepod-{n}"),
  "v5p": Chip(95 * GIB, 459e12, 2.765e12, 4, "v5p-{cores}"),
  "v6e": Chip(32 * GIB, 918e12, 1.64e12, 4, "v6e-{n}"),
}


class Target(NamedTuple):
  """Compile-only devices and what each can hold and do."""

  name: str
  devices: list
  bytes_per_device: int
  peak_flops_per_device: float
  hbm_bytes_per_s_per_device: float


# GPU -> peak dense bf16 FLOP/s (NVIDIA's data sheets); its target config is
# gpu_targets/<name>.txtpb (XLA's, with its source).
GPUS = {"h100": 989e12, "h200": 989e12, "a100_80": 312e12, "b200": 2250e12}
SPECS = pathlib.Path(__file__).parent / "gpu_targets"


def make(spec: str) -> Target:
  """The target `spec` names: a TPU slice or a GPU node."""
  return gpu(spec) if spec.startswith("gpu:") else tpu(spec)


def gpu(spec: str) -> Target:
  """`gpu:MODEL:SxHxG`: S slices x H hosts x G GPUs of MODEL (jax[cuda12])."""
  m = re.fullmatch(r"gpu:(\w+):(\d+)x(\d+)x(\d+)", spec)
  if not m or m[1] not in GPUS or min(map(int, m.groups()[1:])) < 1:
    raise _unknown(spec)
  text = (SPECS / f"{m[1]}.txtpb").read_text()
  from jax.experimental import topologies

  from loopjax import compiled

  dropped = []
  for _ in range(text.count("\n")):  # drop the fields this jaxlib predates
    try:
      with compiled.logged(echo=False) as log:
        topology = topologies.get_topology_desc(
          topology_name=m[1],
          platform="cuda",
          target_config=text,
          topology="x".join(m.groups()[1:]),
        )
      break
    except Exception as e:  # no CUDA plugin, or a config it cannot parse
      unknown = re.search(r'has no field named "(\w+)"', "\n".join(log))
      if unknown is None:
        raise ConfigError(
          f"--target={spec}: XLA's CUDA compiler cannot describe it "
          f"({_reason(e)}); pip install -e '.[cuda12]' installs it"
        ) from None
      text = _without(text, unknown[1])
      dropped.append(unknown[1])
  if dropped:
    print(
      f"{m[1]}.txtpb: left out {', '.join(dropped)} (newer than this jaxlib)",
      file=sys.stderr,
    )
  field = lambda name: float(re.search(rf"\b{name}: (\d+)", text)[1])  # noqa: E731
  return Target(
    spec,
    list(topology.devices),
    int(field("device_memory_size")),
    GPUS[m[1]],
    field("memory_bandwidth"),
  )


def parse(spec: str) -> tuple[str, tuple[int, ...], int]:
  """`tpu:GEN:AxB[xC][:SLICES]` -> (generation, topology dims, slices)."""
  m = re.fullmatch(r"tpu:(\w+):(\d+(?:x\d+)+)(?::(\d+))?", spec)
  if not m or m[1] not in TPUS or (m[3] is not None and int(m[3]) < 1):
    raise _unknown(spec)
  return m[1], tuple(int(x) for x in m[2].split("x")), int(m[3] or 1)


def libtpu_env(gen: str, dims: tuple[int, ...]) -> dict:
  """libtpu's variables for a slice it is not running on: without them it
  waits on metadata look-ups that cannot succeed off a TPU VM (a compile of
  151 s instead of 35 s)."""
  chip, n = TPUS[gen], math.prod(dims)
  hosts = max(n // chip.chips_per_host, 1)
  return {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": chip.accelerator.format(n=n, cores=2 * n),
    "TPU_WORKER_HOSTNAMES": ",".join(["localhost"] * hosts),
    "TPU_WORKER_ID": "0",
    # compile-only: several checks at once need no lock on TPUs there are not
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  }


def tpu(spec: str) -> Target:
  """The devices of `spec`'s slices (libtpu: the `tpu` extra)."""
  gen, dims, slices = parse(spec)
  os.environ.update(libtpu_env(gen, dims))
  from jax.experimental import topologies

  name = f"{gen}:{'x'.join(map(str, dims))}"
  try:
    topology = topologies.get_topology_desc(
      topology_name=name, platform="tpu", num_slices=slices
    )
  except Exception as e:  # no libtpu, or a topology it does not know
    have = importlib.util.find_spec("libtpu") is not None
    raise ConfigError(
      f"--target={spec}: libtpu cannot describe it ({_reason(e)})"
      + ("" if have else "; pip install -e '.[tpu]' installs libtpu")
    ) from None
  chip, chips = TPUS[gen], math.prod(dims) * slices
  share = chips / len(topology.devices)  # of a chip, per device
  return Target(
    spec,
    list(topology.devices),
    int(chip.hbm_bytes * share),
    chip.peak_flops * share,
    chip.hbm_bytes_per_s * share,
  )


def _without(text: str, field: str) -> str:
  """A text proto without `field` (a `field: value` line or a `field { }`
  block), which a jaxlib older than the target config does not know."""
  lines, out, depth = text.splitlines(keepends=True), [], 0
  for line in lines:
    if depth:
      depth += line.count("{") - line.count("}")
    elif re.match(rf"\s*{field}\s*:", line):
      continue
    elif re.match(rf"\s*{field}\s*{{", line):
      depth = line.count("{") - line.count("}")
    else:
      out.append(line)
  return "".join(out)


def _unknown(spec: str) -> ConfigError:
  return ConfigError(
    f"--target: must be tpu:GEN:AxB[xC][:SLICES] (GEN: {', '.join(TPUS)}) or "
    f"gpu:MODEL:SLICESxHOSTSxGPUS (MODEL: {', '.join(GPUS)}); got {spec!r}"
  )


def _reason(e: Exception) -> str:
  lines = [x for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
  return lines[0][:200]
