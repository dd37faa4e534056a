"""What a compiled program says about itself: memory per device, the
collectives in its HLO, and the warnings XLA logged while compiling it."""

import contextlib
import os
import re
import sys
import tempfile

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
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


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
  bytes: the size of each one's result, per device (async pairs once)."""
  out = {}
  for line in hlo_text.splitlines():
    if (m := _OP.search(line)) is None or "-done(" in line:
      continue
    size = sum(
      _BYTES[dtype] * _prod(dims) for dtype, dims in _SHAPE.findall(m.group(1))
    )
    entry = out.setdefault(m.group(2), {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += size
  return out


def _prod(dims: str) -> int:
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n


@contextlib.contextmanager
def logged(echo: bool = True):
  """Captures what XLA's C++ code writes to stderr inside the block (a list
  of lines, filled on exit) and writes it on, so nothing is hidden (`echo`
  False: the caller handles what it says)."""
  lines: list[str] = []
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile("w+") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield lines
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      text = f.read()
      if echo:
        sys.stderr.write(text)
      lines += text.splitlines()


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
