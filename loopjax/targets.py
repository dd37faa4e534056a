"""Compile targets reached from a CPU host: a TPU slice's chips from libtpu
(`jax.experimental.topologies`), as compile-only devices.

  tpu:v5e:4x4      one v5e slice of 4 x 4 chips (4 hosts)
  tpu:v5p:2x2x4:2  two v5p slices

A target's devices carry their host's process index, so a mesh over them is
the one `jax.make_mesh` builds on the pod (`sharding.row_groups` then says
which rows each host feeds). The chips' figures are the vendors' published
ones; memory per device is the chip's divided among the devices libtpu shows
for it (v4 and v5p show each of a chip's two TensorCores).
"""

import math
import os
import re
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


def parse(spec: str) -> tuple[str, tuple[int, ...], int]:
  """`tpu:GEN:AxB[xC][:SLICES]` -> (generation, topology dims, slices)."""
  m = re.fullmatch(r"tpu:(\w+):(\d+(?:x\d+)+)(?::(\d+))?", spec)
  if not m or m[1] not in TPUS or (m[3] is not None and int(m[3]) < 1):
    raise ConfigError(
      f"--target: must be tpu:GEN:AxB[xC][:SLICES] with GEN one of "
      f"{', '.join(TPUS)} (e.g. tpu:v5e:4x4); got {spec!r}"
    )
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
    raise ConfigError(
      f"--target={spec}: libtpu cannot describe it ({_reason(e)}); "
      "pip install -e '.[tpu]' installs libtpu"
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


def _reason(e: Exception) -> str:
  lines = [x for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
  return lines[0][:200]
