"""What a compiled program says about itself: memory per device, the
collectives in its HLO, and the warnings XLA logged while compiling it."""

import contextlib
import os
import re
import sys
import tempfile
import threading

# XLA logs these while partitioning: a tensor replicated whole to be resharded.
REMAT = "Involuntary full rematerialization"
COLLECTIVES = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# An async start's result is (operands, output[, contexts]), its output the
# second element: all-gather-start's and collective-permute-start's own
# tuples, and XLA's async wrapper (reduce-scatter-start, all-to-all-start).
# all-reduce-start's result is its output alone.
_OUTPUT_SECOND = ("all-gather", "collective-permute", "reduce-scatter", "all-to-all")


def compile_or_load(lowered) -> tuple[object, bool]:
  """(executable, loaded): `lowered` compiled, or loaded from JAX's persistent
  compilation cache (`loaded`: this thread heard the cache's hit event; a
  load is not a compile, and its time is a read's)."""
  from jax import monitoring

  me, hits = threading.get_ident(), []

  def heard(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits" and threading.get_ident() == me:
      hits.append(event)

  monitoring.register_event_listener(heard)
  try:
    executable = lowered.compile()
  finally:
    monitoring.unregister_event_listener(heard)
  return executable, bool(hits)


def memory(compiled) -> dict:
  """Bytes per device: arguments, temporaries, outputs, and the peak the
  program needs (arguments + temporaries + outputs - donated aliases)."""
  m = compiled.memory_analysis()
  out = {
    "arguments": m.argument_size_in_bytes,
    "temporaries": m.temp_size_in_bytes,
    "outputs": m.output_size_in_bytes,
  }
  return out | {"peak": sum(out.values()) - m.alias_size_in_bytes}


def collectives(hlo_text: str) -> dict:
  """{kind: {"count", "bytes"}} of the collectives in an HLO module's text;
  bytes: the size of each one's output, per device (async pairs once: a
  start, not its done; of a start's result tuple, the output, not the
  operand it also holds)."""
  out = {}
  for line in hlo_text.splitlines():
    if (m := _OP.search(line)) is None or "-done(" in line:
      continue
    result, kind, start = m.groups()
    if start and kind in _OUTPUT_SECOND:
      result = _elements(result)[1]
    size = sum(_BYTES[dtype] * _prod(dims) for dtype, dims in _SHAPE.findall(result))
    entry = out.setdefault(kind, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size
  return out


def _elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape's text, "(a, b, ...)" (layouts
  such as {1,0:T(8,128)} nest commas and parentheses)."""
  out, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    depth += (ch in "([{") - (ch in ")]}")
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      out.append(shape[start:i].strip())
      start = i + 1
  return out


def _prod(dims: str) -> int:
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n


_LOGGED = threading.RLock()


@contextlib.contextmanager
def logged(echo: bool = True):
  """What is written to stderr's file descriptor inside the block (XLA's C++
  logging), as a list of lines (complete on exit), passed on to stderr as
  it comes (`echo` False: kept back, the caller handles what it says).

  XLA's warnings (an involuntary rematerialization, a field the CUDA
  compiler does not know) reach no Python API: its C++ logging writes to
  descriptor 2. So the block points that descriptor at a file, which a
  thread follows and forwards to the real stderr as it grows: nothing is
  held back until the block ends (a compile can take minutes, and a crash
  inside it would lose the lot) and, echoed, the terminal sees what it
  would have. A file, not a pipe: a write never waits for the thread (which
  needs the GIL, and native code may hold it while it logs). One block at a
  time per process (a lock: the descriptor is the process's)."""
  with _LOGGED, tempfile.TemporaryFile() as f:
    sys.stderr.flush()
    saved = os.dup(2)
    done = threading.Event()

    def forward():
      at = 0
      while True:
        last = done.is_set()
        while data := os.pread(f.fileno(), 1 << 16, at):
          at += len(data)
          while echo and data:  # a write may take part of it
            data = data[os.write(saved, data) :]
        if last:
          return
        done.wait(0.05)

    thread = threading.Thread(target=forward, name="compiled.logged", daemon=True)
    os.dup2(f.fileno(), 2)
    thread.start()
    lines: list[str] = []
    try:
      yield lines
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      done.set()
      thread.join()
      os.close(saved)
      text = os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0)
      lines += text.decode(errors="replace").splitlines()


def refusal(rematerialized: list, on_target: bool, allowed: bool) -> str | None:
  """Why a target's compile fails its check: XLA replicated tensors whole to
  reshard them (`rematerialized`: its warnings), which a pod would pay in
  every step. On forced CPU devices they are reported only."""
  if rematerialized and on_target and not allowed:
    return (
      f"XLA rematerialized {len(rematerialized)} tensor(s) whole to reshard "
      "them (its warnings above); change the mesh or sharding rules, or pass "
      "--allow_remat"
    )
  return None
