"""Libraries' restatements of an error go to a file, not the terminal
(loopjax/liblog.py): orbax's records and Python's ignored "Event loop is
closed" are what `--follow` beside a fast trainer and a full disk printed by
the hundred (issue 53). Run in a subprocess: `divert` sets process-wide hooks."""

import subprocess
import sys

from conftest import CPU_ENV

SCRIPT = """
import gc, logging, sys
from loopjax import liblog

logging.basicConfig()  # the handlers exist first, as app.run's do
liblog.divert()
logging.getLogger("orbax.checkpoint").error("orbax says boom")
logging.getLogger("someone.else").error("keep me on the terminal")

class Loop:
  def __del__(self):
    raise RuntimeError("Event loop is closed")

Loop()
gc.collect()

class Other:
  def __del__(self):
    raise ValueError("not a library's")

Other()
gc.collect()
print(liblog.written())
mark = liblog.writes()  # a second command in this process (tests run in-process)
print(liblog.written(mark))
logging.getLogger("orbax.checkpoint").error("orbax says boom again")
print(liblog.written(mark))
"""


def test_library_noise_goes_to_the_log_and_the_rest_to_the_terminal(tmp_path):
  env = CPU_ENV | {"LOOPJAX_LOG_DIR": str(tmp_path)}
  out = subprocess.run(
    [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60
  )
  assert out.returncode == 0, out.stderr
  assert "orbax says boom" not in out.stderr
  assert "Event loop is closed" not in out.stderr
  assert "keep me on the terminal" in out.stderr
  assert "not a library's" in out.stderr  # other ignored exceptions: as before
  log = tmp_path / "loopjax"
  (written,) = log.iterdir()
  # The log named for what came; a later command that added nothing does
  # not name it (an earlier command's records are not its own).
  assert out.stdout.split() == [str(written), "None", str(written)]
  text = written.read_text()
  assert "orbax says boom" in text and "Event loop is closed" in text
