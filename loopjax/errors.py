"""Errors a user can act on, and how a command line reports them: one line."""

import sys


class ConfigError(ValueError):
  """Bad input (a config value, a path, a data file); the message is one line.
  A command line ends on it with that line and exit 2 (`cli.run`)."""


class Stopped(RuntimeError):
  """Work that cannot go on though neither the input nor the code is at fault
  (a run diverged or lost its disk or its lease, a target's compiler failed);
  the message is one line that says what was kept. A command line ends on it
  with that line and exit 1 (`cli.run`)."""


def first_line(e: Exception, limit: int = 400) -> str:
  """An exception as one line for the user (library errors can run to pages)."""
  lines = str(e).strip().splitlines()
  if not lines:
    return type(e).__name__
  line = lines[0]  # long ones (tensorstore's) put the cause at the end: keep both
  return (
    line if len(line) <= limit else f"{line[: limit // 2]} ... {line[-limit // 2 :]}"
  )


def exit_with(message: str, code: int = 2):
  """Ends a command-line run: one line on stderr; exit code 2 for bad input."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)
