"""XLA:CPU defaults chosen by measurement (docs/performance.md).

YNNPACK fusions off: XLA's own dot emitters train these small models ~15-25%
faster. The flags only affect CPU compilation, and a flag already in XLA_FLAGS
wins. XLA reads them when JAX starts its backend, so they are applied by the
entry points (`loopjax.main`, `loopjax.bench`, `loopjax.aot`) before any JAX
computation, never on import; in a notebook call `loopjax.xla.apply_defaults()`
first. LOOPJAX_XLA_DEFAULTS=0 leaves XLA_FLAGS alone.

glibc's allocator is told to keep freed memory (`keep_freed_memory`): by
default it returns every block over its mmap threshold to the OS, and the next
step's buffers fault their pages in again, zeroed by the kernel; a d 64 looped
model spent ~40% of its time in the kernel doing that and trains ~1.7x faster
without it, a d 128 one (temporaries of 0.17-0.26 GiB, allocated by XLA's
worker threads) 1.5-2.3x (docs/performance.md).

On a host with no accelerator device, JAX_PLATFORMS (unless set) is `cpu`:
JAX would otherwise start the CUDA plugin or libtpu that the `targets` extra
installs for compiling (`loopjax.aot`, which needs neither started) and print
their failures at every start.
"""

import ctypes
import glob
import os
import sys
import warnings

CPU_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}
# NVIDIA, AMD, TPU (v4 / v5e: accel; v5p / v6e: vfio groups)
ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")


def has_accelerator() -> bool:
  return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def keep_freed_memory() -> None:
  """Blocks up to 1 GiB come from (and go back to) the heap, which is trimmed
  only past 1 GiB free: the steady state of a training loop reuses its pages.
  One arena for every thread: a thread's own arena is a heap of at most 64
  MiB, so a larger block allocated by one of XLA's worker threads (a step's
  temporaries) would be mmapped and unmapped every step whatever the
  threshold. Call before threads start. A no-op without glibc."""
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return
  m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # malloc.h
  libc.mallopt(m_mmap_threshold, 1 << 30)  # not 32 MiB: XLA's buffers exceed it
  libc.mallopt(m_trim_threshold, 1 << 30)
  libc.mallopt(m_arena_max, 1)


def apply_defaults() -> None:
  """Adds the CPU defaults to XLA_FLAGS (warns if JAX's backend already
  started: then they would not take effect in this process) and keeps freed
  memory in the heap."""
  if os.environ.get("LOOPJAX_XLA_DEFAULTS") == "0":
    return
  keep_freed_memory()
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
