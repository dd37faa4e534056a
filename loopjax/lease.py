"""One writer per run directory: `flock` on a disk, a lease on a bucket.

On a disk each process locks a file (`exclusive`); the OS drops the lock
however the process ends. On a bucket `flock` cannot reach, so process 0
holds a lease: one JSON object (`<workdir>/lease.json` for the trainer,
`eval/lease.json` for an evaluation job) that it creates only if absent
(generation precondition 0), renews every `stale_s / 4` seconds by rewriting
it only if its generation is still the one it wrote, and deletes when it
ends. Before every save the holder checks it (`Exclusive.fence`): a holder
that finds the object rewritten by another (or gone) has lost the lease and
stops. A newcomer that finds a lease waits: if its holder renews it, the
newcomer is refused; once it goes `stale_s` seconds without renewal (the
holder was killed outright, its host preempted), the newcomer takes it over,
again by a generation precondition, so of two newcomers only one wins. A
lease whose holder ran on this machine (same boot, same pid namespace) under
a pid that is gone is taken over at once. Staleness compares the holder's
clock with the newcomer's: hosts of one cloud keep NTP time, well inside
`stale_s`; the holder counts its own lease as lost a quarter of `stale_s`
early, from before its last renewal was sent.
"""

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid

import jax
import numpy as np
from jax.experimental import multihost_utils

from loopjax import storage
from loopjax.errors import ConfigError, Stopped, first_line

RECENT_S = 5.0  # a check this soon after a renewal reads instead of writing


class LeaseLost(Stopped):
  """Another process holds the lease now: this one must not write."""


class Exclusive:
  """The single-writer rule of one workdir role, held for a `with` block."""

  def __init__(self, path, role: str, stale_s: float):
    self.path, self.role, self.stale_s = path, role, stale_s
    self.lease = None

  @contextlib.contextmanager
  def held(self):
    who = f"--workdir={self.path}: another process"
    train = self.role == "train"  # else the evaluation job: it writes in eval/
    doing = "is training there" if train else "is following it"
    if not storage.is_bucket(self.path):
      if train:
        lock = self.path / f".train-{jax.process_index()}.lock"
      else:
        lock = self.path / "eval" / ".follow.lock"
        lock.parent.mkdir(exist_ok=True)
      with _locked(lock, who, doing):
        yield self
      return
    where = self.path / ("lease.json" if train else "eval/lease.json")
    lease, error = Lease(where, who, doing, self.stale_s), None
    try:
      if jax.process_index() == 0:
        try:
          lease.acquire()
          self.lease = lease
        except ConfigError as e:
          error = e
        except Exception as e:  # noqa: BLE001 - the bucket's errors, one line
          error = ConfigError(f"{where}: cannot take the lease ({first_line(e)})")
      if not _all_agree(error is None):  # every process stops together
        raise error or ConfigError(
          f"--workdir={self.path}: process 0 could not take the lease (its "
          "log says why)"
        )
      yield self
    finally:
      if self.lease is not None:
        self.lease.release()

  def fence(self) -> None:
    """Before a write that must be this job's alone (a save, an evaluation's
    record): raises LeaseLost on every process if the lease was taken over.
    A disk's lock cannot be."""
    if not storage.is_bucket(self.path):
      return
    lost = None
    if self.lease is not None:
      try:
        self.lease.check()
      except LeaseLost as e:
        lost = e
    if not _all_agree(lost is None):
      raise lost or LeaseLost(f"process 0 lost the lease on {self.path}")

  def lost(self) -> bool:
    """Whether this job knows it lost the lease (no request: for the log
    writer, which writes between fences)."""
    return self.lease is not None and self.lease.lost is not None


class Lease:
  """The lease object of one workdir role on a bucket (see the module)."""

  def __init__(self, where, who: str, doing: str, stale_s: float):
    self.where, self.who, self.doing, self.stale_s = where, who, doing, stale_s
    bucket, name = storage.key(where)
    self._blob = storage.client().bucket(bucket).blob(name)
    self._id, self._generation, self.lost = uuid.uuid4().hex, None, None
    self._renewed = 0.0  # monotonic time the last renewal was sent
    self._lock, self._stop = threading.Lock(), threading.Event()
    self._thread = None

  def _write(self, if_generation_match: int) -> None:
    sent = time.monotonic()
    body = {
      "holder": self._id,
      "host": socket.gethostname(),
      "machine": _machine(),
      "pid": os.getpid(),
      "renewed": time.time(),
      "stale_s": self.stale_s,
    }
    self._blob.upload_from_string(
      json.dumps(body),
      content_type="application/json",
      if_generation_match=if_generation_match,
      timeout=10,
      retry=None,
    )
    self._generation, self._renewed = self._blob.generation, sent

  def _read(self) -> tuple[dict, int] | None:
    """(the lease's body, its generation), or None if there is none."""
    blob = self._blob.bucket.get_blob(self._blob.name, timeout=10, retry=None)
    if blob is None:
      return None
    try:
      held = json.loads(blob.download_as_bytes(timeout=10, retry=None))
      held["renewed"], held["stale_s"] = float(held["renewed"]), float(held["stale_s"])
      return held, blob.generation
    except (ValueError, KeyError, TypeError):  # not a lease: someone's file
      raise ConfigError(f"{self.where}: not a loopjax lease; move it away") from None

  def acquire(self) -> None:
    """Takes the lease, waiting while its holder may be dead but is not yet
    stale; raises ConfigError naming a holder that renews it."""
    from google.api_core import exceptions as gexc

    seen = None
    while True:
      try:
        self._write(if_generation_match=0)
        break
      except gexc.PreconditionFailed:
        pass
      if (found := self._read()) is None:  # released between the two requests
        continue
      held, generation = found
      age, holder = time.time() - held["renewed"], f"{held['host']}, pid {held['pid']}"
      if seen is not None and generation != seen:
        raise ConfigError(
          f"{self.who} ({holder}) {self.doing}: it renewed its lease "
          f"{self.where} {age:.0f} s ago; wait for it to end or use a new --workdir"
        )
      if age >= held["stale_s"] or _abandoned(held):
        try:
          self._write(if_generation_match=generation)
        except gexc.PreconditionFailed:
          raise ConfigError(
            f"{self.who} took over the lease {self.where} just now; use a new "
            "--workdir or wait for it to end"
          ) from None
        print(f"took over the lease {self.where} from {holder} ({age:.0f} s old)")
        break
      if seen is None:
        print(
          f"waiting for the lease {self.where} ({holder}, renewed {age:.0f} s "
          f"ago): taken over after {held['stale_s']:.0f} s without renewal",
          flush=True,
        )
      seen = generation
      time.sleep(min(1.0, held["stale_s"] / 8))
    self._thread = threading.Thread(target=self._renewing, daemon=True)
    self._thread.start()

  def _renewing(self) -> None:
    while not self._stop.wait(self.stale_s / 4):
      try:
        self.check(renew=True)
      except LeaseLost:
        return
      except Exception:  # noqa: BLE001 - the network: try again, until stale
        pass

  def check(self, renew: bool = False) -> None:
    """Raises LeaseLost if another holds the lease, or if it has gone too
    long without a renewal (a newcomer may hold it by now). Renews it, or,
    right after a renewal, reads it (GCS takes one write a second per object)."""
    from google.api_core import exceptions as gexc

    with self._lock:
      if self.lost is None:
        try:
          if renew or time.monotonic() - self._renewed > RECENT_S:
            self._renew()
          else:  # the object's metadata, not this generation's (gone if taken)
            now = self._blob.bucket.get_blob(self._blob.name, timeout=10, retry=None)
            if now is None:
              self.lost = "another process deleted it"
            elif now.generation != self._generation:
              self.lost = "another process took it over"
        except gexc.NotFound:
          self.lost = "another process deleted it"
        except Exception as e:  # noqa: BLE001
          if time.monotonic() - self._renewed > 0.75 * self.stale_s:
            self.lost = f"not renewed for {0.75 * self.stale_s:.0f} s ({first_line(e)})"
      if self.lost is not None:
        raise LeaseLost(f"lost the lease {self.where} ({self.lost})")

  def _renew(self) -> None:
    """A renewal whose reply was lost committed all the same: the lease's
    own holder id says whose it is."""
    from google.api_core import exceptions as gexc

    try:
      self._write(if_generation_match=self._generation)
    except gexc.PreconditionFailed:
      found = self._read()
      if found is None:
        self.lost = "another process deleted it"
      elif found[0].get("holder") == self._id:
        self._generation = found[1]
      else:
        self.lost = "another process took it over"

  def release(self) -> None:
    """Ends renewal and deletes the lease if it is still this process's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self.lost is None and self._generation is not None:
      try:
        self._blob.delete(if_generation_match=self._generation, timeout=10, retry=None)
      except Exception:  # noqa: BLE001 - taken over or unreachable: it goes stale
        pass


def _machine() -> str:
  """This boot of this machine and this pid namespace: where a pid means
  one process (containers sharing a hostname have their own pids)."""
  try:
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
  except OSError:
    return ""


def _abandoned(held: dict) -> bool:
  """The holder ran in this machine's pid namespace, and its process is gone."""
  if not _machine() or held.get("machine") != _machine():
    return False
  if held["pid"] == os.getpid():
    return False  # this very process holds it
  try:
    os.kill(int(held["pid"]), 0)
  except ProcessLookupError:
    return True
  except (PermissionError, ValueError, OverflowError):  # alive (another user's)
    return False
  return False


def _all_agree(ok: bool) -> bool:
  """Process 0's `ok`, on every process."""
  if jax.process_count() == 1:
    return ok
  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


@contextlib.contextmanager
def _locked(path, who: str, doing: str):
  with open(path, "a+") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      raise ConfigError(
        f"{who} (pid {f.read().strip() or '?'}) {doing}; wait for it to end or "
        "use a new --workdir"
      ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    yield
