"""One writer per run directory on a bucket, where `flock` cannot reach.

A lease is one JSON object (`<workdir>/lease.json` for the trainer,
`eval/lease.json` for an evaluation job) that its holder creates only if
absent (generation precondition 0), renews every `stale_s / 4` seconds by
rewriting it only if its generation is still the one it wrote, and deletes
when it ends. Before every save the holder renews it at once (`check`): a
holder that finds the object rewritten by another (or gone) has lost the
lease and stops, saving nothing. A new holder may take a lease over once it
has gone `stale_s` seconds without renewal (its writer was killed outright
or its host preempted), again by a generation precondition, so of two
newcomers only one wins. Staleness compares the holder's clock with the
newcomer's: hosts of one cloud keep NTP time, well inside `stale_s`. A lease
whose holder ran on this host under a pid that is no longer alive (a killed
run restarted where it ran) is abandoned, and taken over at once.
"""

import json
import os
import socket
import threading
import time
import uuid

from loopjax import storage
from loopjax.errors import ConfigError


class LeaseLost(RuntimeError):
  """Another process holds the lease now: this one must not write."""


class Lease:
  def __init__(self, where, who: str, doing: str, stale_s: float):
    self.where, self.who, self.doing, self.stale_s = where, who, doing, stale_s
    bucket, name = storage.key(where)
    self._blob = storage.client().bucket(bucket).blob(name)
    self._id, self._generation, self._lost = uuid.uuid4().hex, None, None
    self._renewed = 0.0
    self._lock, self._stop = threading.Lock(), threading.Event()
    self._thread = None

  def _body(self) -> str:
    return json.dumps(
      {
        "holder": self._id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "renewed": time.time(),
        "stale_s": self.stale_s,
      }
    )

  def _write(self, if_generation_match: int) -> None:
    self._blob.upload_from_string(
      self._body(),
      content_type="application/json",
      if_generation_match=if_generation_match,
      timeout=10,
      retry=None,
    )
    self._generation, self._renewed = self._blob.generation, time.monotonic()

  def acquire(self) -> None:
    """Takes the lease, or raises ConfigError naming its holder."""
    from google.api_core import exceptions as gexc

    try:
      self._write(if_generation_match=0)
    except gexc.PreconditionFailed:
      self._take_over()
    self._thread = threading.Thread(target=self._renewing, daemon=True)
    self._thread.start()

  def _take_over(self) -> None:
    from google.api_core import exceptions as gexc

    blob = self._blob.bucket.get_blob(self._blob.name, timeout=10, retry=None)
    if blob is None:  # released between the two requests
      return self._write(if_generation_match=0)
    try:
      held = json.loads(blob.download_as_bytes(timeout=10, retry=None))
      age, stale_s = time.time() - held["renewed"], float(held["stale_s"])
      holder = f"{held['host']}, pid {held['pid']}"
    except (ValueError, KeyError, TypeError):  # not a lease: the caller's file
      raise ConfigError(f"{self.where}: not a loopjax lease; move it away") from None
    if age < stale_s and not _abandoned(held):
      raise ConfigError(
        f"{self.who} ({holder}) {self.doing}: its lease {self.where} was renewed "
        f"{age:.0f} s ago (taken over after {stale_s:.0f} s without renewal); "
        "wait for it to end or use a new --workdir"
      )
    try:
      self._write(if_generation_match=blob.generation)
    except gexc.PreconditionFailed:
      raise ConfigError(
        f"{self.who} took over the stale lease {self.where} just now; use a "
        "new --workdir or wait for it to end"
      ) from None
    print(f"took over the lease {self.where} from {holder} (renewed {age:.0f} s ago)")

  def _renewing(self) -> None:
    while not self._stop.wait(self.stale_s / 4):
      try:
        self.check()
      except LeaseLost:
        return
      except Exception:  # noqa: BLE001 - the network: try again, until stale
        pass

  def check(self) -> None:
    """Renews the lease now; LeaseLost if another holds it (or it went
    `stale_s` without a renewal, when a newcomer may have taken it)."""
    from google.api_core import exceptions as gexc

    with self._lock:
      if self._lost is None:
        try:
          self._write(if_generation_match=self._generation)
        except (gexc.PreconditionFailed, gexc.NotFound):
          self._lost = "another process took it over"
        except Exception as e:  # noqa: BLE001
          if time.monotonic() - self._renewed > self.stale_s:
            self._lost = f"not renewed for {self.stale_s:.0f} s ({type(e).__name__})"
      if self._lost is not None:
        raise LeaseLost(
          f"lost the lease {self.where} ({self._lost}); stopped without saving"
        )

  def release(self) -> None:
    """Ends renewal and deletes the lease if it is still this process's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self._lost is None and self._generation is not None:
      try:
        self._blob.delete(if_generation_match=self._generation, timeout=10, retry=None)
      except Exception:  # noqa: BLE001 - taken over or unreachable: it goes stale
        pass


def _abandoned(held: dict) -> bool:
  """The holder ran on this host and its process is gone."""
  if held["host"] != socket.gethostname() or held["pid"] == os.getpid():
    return False
  try:
    os.kill(int(held["pid"]), 0)
  except ProcessLookupError:
    return True
  except (PermissionError, ValueError, OverflowError):  # alive (another user's)
    return False
  return False
