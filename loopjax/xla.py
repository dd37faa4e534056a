"""XLA:CPU defaults chosen by measurement (docs/performance.md).

YNNPACK fusions off: XLA's own dot emitters train these small models ~15-25%
faster. The flags only affect CPU compilation, and a flag already in XLA_FLAGS
wins. XLA reads them when JAX starts its backend, so they are applied by the
entry points (`loopjax.main`, `loopjax.bench`, `loopjax.aot`) before any JAX
computation, never on import; in a notebook call `loopjax.xla.apply_defaults()`
first. LOOPJAX_XLA_DEFAULTS=0 leaves XLA_FLAGS alone.

On a host with no accelerator device, JAX_PLATFORMS (unless set) is `cpu`:
JAX would otherwise start the CUDA plugin or libtpu that the `targets` extra
installs for compiling (`loopjax.aot`, which needs neither started) and print
their failures at every start.
"""

import glob
import os
import sys
import warnings

CPU_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}
# NVIDIA, AMD, TPU (v4 / v5e: accel; v5p / v6e: vfio groups)
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")


def has_accelerator() -> bool:
  return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def apply_defaults() -> None:
  """Adds the CPU defaults to XLA_FLAGS; warns if JAX's backend already started
  (then they would not take effect in this process)."""
  if os.environ.get("LOOPJAX_XLA_DEFAULTS") == "0":
    return
  if "JAX_PLATFORMS" not in os.environ and not has_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # it read the environment on import
      import jax

      jax.config.update("jax_platforms", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  extra = [f"{k}={v}" for k, v in CPU_FLAGS.items() if k not in flags]
  if not extra:
    return
  if "jax" in sys.modules:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
      warnings.warn(
        "loopjax.xla.apply_defaults: JAX's backend has already started, so the "
        "XLA:CPU defaults do not apply in this process; call it before the "
        "first JAX computation",
        stacklevel=2,
      )
      return
  os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
