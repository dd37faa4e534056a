"""Libraries' own reports of what loopjax reports in one line, kept off the
terminal and in a file.

A full disk under a checkpoint makes orbax log the failed write from each of
its threads, with tracebacks, and asyncio each future nobody awaited; an
evaluation racing a trainer's keep policy gets orbax's warning per missing
file and, when an event loop is collected after it closed, Python's "Exception
ignored ... Event loop is closed". loopjax says what happened in one line (the
`error:` line, `follow: checkpoint N ... skipped`); these records restate it
in hundreds. They go to `path()` (a local file: the workdir may be the full
disk, or a bucket), named at the end of the `error:` line (`cli.ended`).
Everything else (JAX's, TFDS's, loopjax's own) reaches the terminal as before.
"""

import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Loggers, or source folders of records logged through absl's logger.
_LIBRARIES = ("orbax", "tensorstore", "asyncio")
_lock = threading.Lock()
_state = {"path": None, "writes": 0}


def path() -> Path:
  """This process's library log (created when a record first comes)."""
  if _state["path"] is None:
    folder = Path(os.environ.get("LOOPJAX_LOG_DIR") or tempfile.gettempdir())
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    _state["path"] = folder / "loopjax" / name
  return _state["path"]


def writes() -> int:
  """How many records went to the log so far (a mark for `written`)."""
  return _state["writes"]


def written(since: int = 0) -> Path | None:
  """The library log if anything went there after mark `since`, else None:
  a command names the log only for what its own work put there."""
  return path() if _state["writes"] > since else None


def _write(text: str) -> None:
  """Appends to the log; a log that cannot be written (its disk full too)
  drops the text rather than putting it back on the terminal."""
  with _lock:
    try:
      path().parent.mkdir(parents=True, exist_ok=True)
      with open(path(), "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")
      _state["writes"] += 1
    except OSError:
      pass


def _ours(names) -> bool:
  """Whether any of `names` (a logger, source files) is a library's."""
  sep = os.sep
  return any(
    n.split(".")[0] in _LIBRARIES or any(f"{sep}{lib}{sep}" in n for lib in _LIBRARIES)
    for n in names
  )


def _files(tb) -> list[str]:
  return [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]


class _Divert(logging.Filter):
  """On a terminal handler: a library's record goes to the log instead."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not _ours([record.name, record.pathname]):
      return True
    text = logging.Formatter(
      "%(levelname).1s %(asctime)s %(filename)s:%(lineno)d] %(message)s"
    ).format(record)
    _write(text)
    return False


_FILTER = _Divert()


def divert() -> None:
  """From now on, in this process: libraries' log records, their threads'
  uncaught exceptions and the exceptions Python can only ignore (an object
  collected after its event loop closed) go to `path()`. Idempotent."""
  from absl import logging as absl_logging

  absl_handler = absl_logging.get_absl_handler()
  for h in [*logging.root.handlers, logging.lastResort, absl_handler]:
    if h is not None and _FILTER not in h.filters:
      h.addFilter(_FILTER)
  if getattr(sys.unraisablehook, "_loopjax", False):
    return
  sys.unraisablehook = _unraisable(sys.unraisablehook)
  threading.excepthook = _in_thread(threading.excepthook)


def _unraisable(previous):
  def hook(u):
    closed = isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(
      u.exc_value
    )
    if closed or _ours(_files(u.exc_traceback)):
      lines = traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)
      _write(f"Exception ignored in {u.object!r}\n" + "".join(lines))
    else:
      previous(u)

  hook._loopjax = True
  return hook


def _in_thread(previous):
  def hook(args):
    if _ours(_files(args.exc_traceback)):
      lines = traceback.format_exception(
        args.exc_type, args.exc_value, args.exc_traceback
      )
      name = getattr(args.thread, "name", "?")
      _write(f"Exception in thread {name}\n" + "".join(lines))
    else:
      previous(args)

  return hook
